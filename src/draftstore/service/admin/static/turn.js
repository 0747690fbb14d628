// #/t/<turn> — a turn's timeline: the user message, every tool call in order
// (status, duration, args/result previews, approvals), streamed assistant text,
// and the outcome. Follows the turn's SSE stream: each tool event re-reads only
// the page of tool calls it touched, so a long turn stays cheap to watch.
import {badge, duration, h, jsonText, messageText, preview, replace, short, when} from "./dom.js";
import {enc, follow, get, post} from "./api.js";
import {actorOf, busy, confirmAction, errorBox} from "./ui.js";

const PAGE = 200;
const STREAM_LABEL = {
  connecting: "connecting…", live: "live", reconnecting: "reconnecting…", ended: "stream ended", denied: "stream refused",
};

export async function turnPage(main, ctx, turnId) {
  const base = `/v1/turns/${enc(turnId)}`;
  const role = ctx.who ? ctx.who.role : "admin"; // unknown: offer everything, the API decides
  // deciding a call is a person's act, through an admin or approver token: never the agent's
  const mayDecide = role === "admin" || role === "approver";
  const readsDrafts = role === "admin" || role === "agent"; // a turn's boundary states are draft states
  let turn = await get(`${base}?tool_calls_limit=1`, {signal: ctx.signal});
  if (ctx.signal.aborted) return;
  const project = await get(`/v1/projects/${enc(turn.project_id)}`, {signal: ctx.signal}).catch((err) => {
    if (err && err.name === "AbortError") throw err;
    return null; // only the crumb's name is missing
  });
  if (ctx.signal.aborted) return;
  document.title = `Turn #${turn.number} — draftstore admin`;

  const streamState = h("span.stream", {id: "stream-state", dataset: {state: "connecting"}}, "connecting…");
  const streamError = h("div", {id: "stream-error"});
  const header = h("div", {id: "turn-header"});
  const userItem = h("li.item.user", {id: "user-message"});
  const calls = h("ol.calls", {id: "tool-calls"});
  const live = h("li.item.assistant.live", {id: "live-text", hidden: true});
  const liveText = document.createTextNode(""); // streamed text: each delta is appended, never rebuilt
  live.append(h("div.who", "assistant (streaming)"), h("pre.message", liveText));
  const outcome = h("li.item", {id: "outcome", hidden: true});
  const actionStatus = h("div", {id: "action-status"});
  const rows = new Map(); // seq -> <li>
  const cursors = [null]; // cursors[i] reads page i of the tool calls

  replace(main,
    h("div.crumbs", h("a", {href: "#/"}, "Projects"), " / ",
      h("a", {href: `#/p/${enc(turn.project_id)}`}, project ? project.name : short(turn.project_id)), " / ",
      h("span", `turn #${turn.number}`)),
    header, streamError, actionStatus,
    h("ol.timeline", {id: "timeline"}, userItem, h("li.item.calls-item", calls), live, outcome));

  function renderHeader() {
    replace(header,
      h("h1", `Turn #${turn.number} `, h("span", {id: "turn-status"}, badge(turn.status)), " ", streamState),
      h("dl.meta.wide",
        h("dt", "turn"), h("dd", h("code", turn.id)),
        h("dt", "actor"), h("dd", turn.actor || "—"),
        h("dt", "started"), h("dd", when(turn.started_at)),
        h("dt", "ended"), h("dd", turn.ended_at ? when(turn.ended_at) : "—",
          turn.end_reason ? ` (${turn.end_reason})` : ""),
        h("dt", "took"), h("dd", {dataset: turn.ended_at ? {} : {start: turn.started_at}}, duration(turn.started_at, turn.ended_at)),
        h("dt", "base"), h("dd", turn.base_version_id ? h("code", {title: turn.base_version_id}, short(turn.base_version_id)) : "—"),
        turn.continues_turn_id ? [h("dt", "continues"), h("dd", h("a", {href: `#/t/${enc(turn.continues_turn_id)}`}, short(turn.continues_turn_id)))] : null),
      h("div.toolbar", turn.end_root && readsDrafts
        ? h("a.button.secondary", {href: `#/p/${enc(turn.project_id)}/diff?a=${enc(`turn:${turn.id}:start`)}&b=${enc(`turn:${turn.id}:end`)}`, id: "turn-diff"}, "What this turn changed")
        : null));
    replace(userItem, h("div.who", "user"), h("pre.message", messageText(turn.user_message)));
    const endings = [];
    if (turn.assistant_message != null) endings.push(h("div.who", "assistant"), h("pre.message", {id: "assistant-message"}, messageText(turn.assistant_message)));
    if (turn.partial_response != null && turn.assistant_message == null) endings.push(h("div.who", "partial response"), h("pre.message", messageText(turn.partial_response)));
    if (turn.error != null) endings.push(h("div.who.bad", "error"), h("pre.message", jsonText(turn.error)));
    outcome.hidden = endings.length === 0;
    replace(outcome, endings);
    if (turn.status !== "running") live.hidden = true;
  }

  function payload(label, value, digest, previewText) {
    if (value === null || value === undefined) {
      if (!digest) return null;
      return h("details", h("summary", `${label} (stored apart, ${short(digest)}…)`), h("pre", previewText || ""));
    }
    return h("details", {dataset: {part: label}}, h("summary", h("span.label", label), " ", h("span.pv", preview(value))),
      h("pre", jsonText(value)));
  }

  function approvalOf(call) {
    const a = call.approval;
    if (call.status === "awaiting_approval") {
      if (!mayDecide) {
        return h("div.approval.waiting", "awaiting approval ",
          h("span.muted", {class: "decided-by-a-person"}, "(an admin or an approver decides)"));
      }
      return h("div.approval.waiting", "awaiting approval ",
        h("button.small", {class: "approve", onclick: (ev) => decide(ev, call, true)}, "Approve"), " ",
        h("button.small.danger", {class: "deny", onclick: (ev) => decide(ev, call, false)}, "Deny"));
    }
    if (!a || typeof a !== "object") return null;
    return h("div.approval", {class: a.approved ? "ok" : "bad"}, a.approved ? "approved" : "denied",
      a.by ? ` by ${a.by}` : "", a.at ? ` at ${when(a.at)}` : "",
      a.reason != null ? h("span", " — ", preview(a.reason, 200)) : null);
  }

  // calls their turn's end found unfinished: said in words, so they never read as still running
  const UNFINISHED = {interrupted: "never finished: the turn ended first",
                      expired: "no decision came before the turn ended"};

  function callRow(call) {
    const open = new Set();
    const old = rows.get(call.seq);
    if (old) old.querySelectorAll("details[open]").forEach((d) => open.add(d.dataset.part || d.firstChild.textContent));
    const row = h("li.call", {dataset: {seq: String(call.seq), status: call.status}},
      h("div.call-head",
        h("span.seq", `#${call.seq}`), " ", h("strong.tool", call.tool_name), " ", badge(call.status), " ",
        h("span.took", {dataset: call.ended_at || call.status === "awaiting_approval" ? {} : {start: call.started_at}},
          duration(call.started_at, call.ended_at)),
        h("span.muted.at", when(call.started_at))),
      approvalOf(call),
      payload("args", call.args, call.args_digest, call.args_preview),
      payload("result", call.result, call.result_digest, call.result_preview),
      UNFINISHED[call.status] ? h("div.muted.unfinished", UNFINISHED[call.status]) : null,
      call.error != null ? h("details.err", {dataset: {part: "error"}, open: true},
        h("summary", h("span.label", "error"), " ", h("span.pv", preview(call.error))), h("pre", jsonText(call.error))) : null);
    row.querySelectorAll("details").forEach((d) => {
      if (open.has(d.dataset.part || d.firstChild.textContent)) d.open = true;
    });
    return row;
  }

  function place(call) {
    const row = callRow(call);
    const old = rows.get(call.seq);
    rows.set(call.seq, row);
    if (old) return old.replaceWith(row);
    // keep seq order even if a later page arrived first
    let next = null;
    for (const [seq, el] of rows) if (seq > call.seq && el.isConnected && (!next || seq < Number(next.dataset.seq))) next = el;
    calls.insertBefore(row, next);
  }

  async function loadCalls(fromPage) {
    let page = Math.min(fromPage, cursors.length - 1);
    for (;;) {
      const cursor = cursors[page];
      const data = await get(`${base}/tool-calls?limit=${PAGE}${cursor ? `&cursor=${enc(cursor)}` : ""}`, {signal: ctx.signal});
      data.items.forEach(place);
      if (!data.next_cursor) break;
      cursors[page + 1] = data.next_cursor;
      page += 1;
    }
    const empty = calls.querySelector(".none");
    if (rows.size && empty) empty.remove();
    if (!rows.size && !empty) calls.append(h("li.none.muted", "No tool calls yet."));
  }

  async function decide(ev, call, approved) {
    const values = await confirmAction({
      title: `${approved ? "Approve" : "Deny"} #${call.seq} ${call.tool_name}?`,
      text: approved ? "The call goes ahead." : "The call is refused (not a failure of the turn).",
      okLabel: approved ? "Approve" : "Deny", danger: !approved,
      fields: [{name: "reason", label: "Reason (optional)"}],
    });
    if (!values || ctx.signal.aborted) return;
    await busy(ev.target, async () => {
      try {
        await post(`${base}/tool-calls/${call.seq}/approval`,
          {approved, reason: values.reason || null, actor: actorOf(ctx.who)});
        replace(actionStatus);
      } catch (err) {
        replace(actionStatus, errorBox(err, "Approval failed"));
      }
      schedule(call.seq);
    });
  }

  // -- live updates: coalesce bursts of events into one read ------------------------------
  let pendingSeq = null;
  let pendingTurn = false;
  let timer = null;
  let running = Promise.resolve();

  function schedule(seq, whole = false) {
    if (seq != null) pendingSeq = pendingSeq == null ? seq : Math.min(pendingSeq, seq);
    pendingTurn = pendingTurn || whole;
    clearTimeout(timer);
    timer = setTimeout(() => { running = running.then(flush); }, 60);
  }

  async function flush() {
    const seq = pendingSeq;
    const whole = pendingTurn;
    pendingSeq = null;
    pendingTurn = false;
    try {
      if (whole) {
        turn = await get(`${base}?tool_calls_limit=1`, {signal: ctx.signal});
        renderHeader();
        cursors.length = 1; // an ended turn's history is compacted: read it again from the start
        await loadCalls(0);
      } else if (seq != null) {
        await loadCalls(Math.floor((seq - 1) / PAGE));
      }
    } catch (err) {
      if (err && err.name === "AbortError") return;
      replace(streamError, errorBox(err, "Refreshing the timeline"));
    }
  }

  renderHeader();
  await loadCalls(0);
  if (ctx.signal.aborted) return; // left while loading: no stream for a page that is gone

  const stream = follow(`${base}/events`, {
    onState: (state, err) => {
      streamState.dataset.state = state;
      streamState.textContent = STREAM_LABEL[state] || state;
      if (state === "denied" && err) replace(streamError, errorBox(err, "Live updates"));
      else if (state === "live") replace(streamError);
    },
    onEvent: ({type, data}) => {
      if (type === "assistant.delta" && data && typeof data.text === "string") {
        liveText.appendData(data.text);
        live.hidden = turn.status !== "running"; // an ended turn shows its final message instead
      } else if (type === "stream.rebuilt") {
        liveText.data = "";
        live.hidden = true;
        schedule(null, true);
      } else if (type.startsWith("turn.")) {
        schedule(null, true);
      } else if (type.startsWith("tool.") && data && Number.isInteger(data.seq)) {
        schedule(data.seq);
      }
    },
  });

  // running durations tick
  const tick = setInterval(() => {
    main.querySelectorAll("[data-start]").forEach((el) => { el.textContent = duration(el.dataset.start, null); });
  }, 1000);
  ctx.onLeave(() => { stream.close(); clearTimeout(timer); clearInterval(tick); });
}
