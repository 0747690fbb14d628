// The /v1 API as the page uses it: a bearer token from sessionStorage (none in
// open loopback mode), error bodies {code, message, details, retryable} as
// ApiError, and a turn's SSE stream read through fetch() so the token travels
// in a header (EventSource cannot send one) and never in a URL.

const TOKEN_KEY = "draftstore.admin.token";

export const session = {
  get token() { return sessionStorage.getItem(TOKEN_KEY) || ""; },
  set token(value) {
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
  },
};

export class ApiError extends Error {
  constructor(status, body) {
    const b = body && typeof body === "object" ? body : {};
    super(typeof b.message === "string" ? b.message : `HTTP ${status}`);
    this.status = status;
    this.code = typeof b.code === "string" ? b.code : (status ? `http.${status}` : "network.error");
    this.details = b.details && typeof b.details === "object" ? b.details : {};
    this.retryable = b.retryable === true;
  }
}

function headers(extra) {
  const out = {...extra};
  if (session.token) out.Authorization = `Bearer ${session.token}`;
  return out;
}

async function errorOf(response) {
  const text = await response.text().catch(() => "");
  let body = null;
  try { body = JSON.parse(text); } catch { body = {message: text.slice(0, 300)}; }
  return new ApiError(response.status, body);
}

/** One API call. Resolves to the decoded JSON body (null for 204); rejects with ApiError. */
export async function api(method, path, body, {signal} = {}) {
  const init = {method, headers: headers({Accept: "application/json"}), cache: "no-store", signal};
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    if (err && err.name === "AbortError") throw err;
    throw new ApiError(0, {code: "network.error", message: `the service did not answer (${err && err.message || err})`});
  }
  if (!response.ok) {
    const err = await errorOf(response);
    if (response.status === 401) window.dispatchEvent(new CustomEvent("draftstore:unauthorized", {detail: err}));
    throw err;
  }
  if (response.status === 204) return null;
  const text = await response.text();
  return text ? JSON.parse(text) : null;
}

export const get = (path, opts) => api("GET", path, undefined, opts);
export const post = (path, body, opts) => api("POST", path, body === undefined ? {} : body, opts);

/**
 * The newest ``keep`` items of a paged list, oldest first: the API pages it
 * newest first (``order=newest``), so only the pages holding them are read.
 * ``more``: older items exist that are not kept.
 */
export async function newestPages(path, {keep = 2000, limit = 200, signal} = {}) {
  const items = [];
  let cursor = null;
  const sep = path.includes("?") ? "&" : "?";
  do {
    const size = Math.min(limit, keep - items.length);
    const url = `${path}${sep}order=newest&limit=${size}` + (cursor ? `&cursor=${encodeURIComponent(cursor)}` : "");
    const page = await get(url, {signal});
    items.push(...page.items);
    cursor = page.next_cursor;
  } while (cursor && items.length < keep);
  return {items: items.reverse(), more: Boolean(cursor)};
}

export const enc = encodeURIComponent;

// -- Server-sent events over fetch() ----------------------------------------------------

/** An SSE parser (the HTML spec's rules): feed it text; it calls onEvent({type, data, id}). */
export class SSEParser {
  constructor(onEvent, onId) {
    this.onEvent = onEvent;
    this.onId = onId || (() => {});
    this.buffer = "";
    this.lastId = ""; // the last event id seen: it persists across events, as in EventSource
    this.reset();
  }

  reset() { this.type = ""; this.data = []; this.id = undefined; }

  push(text) {
    this.buffer += text;
    let start = 0;
    let i = 0;
    for (; i < this.buffer.length; i++) {
      const c = this.buffer[i];
      if (c !== "\n" && c !== "\r") continue;
      if (c === "\r" && i + 1 === this.buffer.length) break; // a "\r\n" may be split across chunks
      const line = this.buffer.slice(start, i);
      if (c === "\r" && this.buffer[i + 1] === "\n") i++;
      start = i + 1;
      this.line(line);
    }
    this.buffer = this.buffer.slice(start);
  }

  line(line) {
    if (line === "") return this.dispatch();
    if (line.startsWith(":")) return; // keep-alive comment
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.data.push(value);
    else if (field === "event") this.type = value;
    else if (field === "id" && !value.includes("\0")) this.id = value;
  }

  dispatch() {
    if (this.id !== undefined) { // an id-only event still moves Last-Event-ID
      this.lastId = this.id;
      this.onId(this.id);
    }
    if (this.data.length) this.onEvent({type: this.type || "message", data: this.data.join("\n"), id: this.lastId});
    this.reset();
  }
}

/**
 * Follow an SSE route: reconnects (with Last-Event-ID) until the server sends
 * ``stream.end`` or ``close()`` is called. ``onEvent({type, data, id})`` with
 * data already JSON-decoded; ``onState(state, error)`` with state one of
 * connecting | live | reconnecting | ended | denied.
 */
export function follow(path, {onEvent, onState = () => {}}) {
  const controller = new AbortController();
  let lastEventId = "";
  let closed = false;
  let delay = 500; // the wait before the next attempt: back to 500 ms once a connection is live
  let quiet = 0; // answers in a row that ended without a single event: they do not reset the wait

  async function once(seen) {
    const hdrs = headers({Accept: "text/event-stream"});
    if (lastEventId) hdrs["Last-Event-ID"] = lastEventId;
    const response = await fetch(path, {headers: hdrs, cache: "no-store", signal: controller.signal});
    if (!response.ok) {
      const err = await errorOf(response);
      if (response.status === 401) window.dispatchEvent(new CustomEvent("draftstore:unauthorized", {detail: err}));
      if (response.status < 500 && response.status !== 408 && response.status !== 429) {
        err.final = true;
      }
      throw err;
    }
    const type = (response.headers.get("content-type") || "").split(";")[0].trim().toLowerCase();
    if (type !== "text/event-stream") { // not an event stream (a proxy's page, say): asking again will not help
      response.body && response.body.cancel().catch(() => {});
      const err = new ApiError(response.status, {code: "stream.not_sse",
        message: `expected an event stream, got ${type || "no content type"}`});
      err.final = true;
      throw err;
    }
    seen.live = true;
    if (!quiet) delay = 500;
    onState("live");
    let ended = false;
    const parser = new SSEParser((e) => {
      seen.event = true;
      let data = e.data;
      try { data = JSON.parse(e.data); } catch { /* keep the text */ }
      if (e.type === "stream.end") ended = true;
      onEvent({type: e.type, data, id: e.id});
    }, (id) => { seen.event = true; lastEventId = id; });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    try {
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        parser.push(value);
        if (ended) break;
      }
    } finally {
      reader.cancel().catch(() => {});
    }
    return ended;
  }

  (async () => {
    while (!closed) {
      onState(lastEventId ? "reconnecting" : "connecting");
      const seen = {live: false, event: false};
      try {
        if (await once(seen)) { onState("ended"); return; }
      } catch (err) {
        if (closed || (err && err.name === "AbortError")) return;
        if (err instanceof ApiError && err.final) { onState("denied", err); return; }
        onState("reconnecting", err);
      }
      if (closed) return;
      if (seen.live) quiet = seen.event ? 0 : quiet + 1;
      await new Promise((resolve) => setTimeout(resolve, delay));
      delay = Math.min(delay * 2, 5000);
    }
  })();

  return {
    close() { closed = true; controller.abort(); },
    get lastEventId() { return lastEventId; },
  };
}
