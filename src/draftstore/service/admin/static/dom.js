// DOM helpers. Every piece of stored text becomes a text node (textContent):
// nothing here ever parses a string as markup.

/** h("tag.class1.class2", {attr: value, onclick: fn, dataset: {...}}, ...children) */
export function h(spec, attrs, ...children) {
  const [tag, ...classes] = spec.split(".");
  const el = document.createElement(tag || "div");
  if (classes.length) el.className = classes.join(" ");
  if (attrs !== null && attrs !== undefined && (typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs))) {
    children.unshift(attrs);
    attrs = null;
  }
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key === "class") el.className = [el.className, value].filter(Boolean).join(" ");
    else if (key === "text") el.textContent = String(value);
    else if (key in el && typeof value !== "string") el[key] = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

export function replace(el, ...children) {
  return append(clear(el), children);
}

export function short(id) {
  return id ? String(id).slice(0, 8) : "—";
}

export function when(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  return d.toLocaleString(undefined, {year: "numeric", month: "short", day: "2-digit",
                                      hour: "2-digit", minute: "2-digit", second: "2-digit"});
}

export function duration(startIso, endIso) {
  if (!startIso) return "";
  const start = new Date(startIso).getTime();
  const end = endIso ? new Date(endIso).getTime() : Date.now();
  const ms = Math.max(0, end - start);
  if (ms < 1000) return `${ms} ms`;
  if (ms < 60_000) return `${(ms / 1000).toFixed(ms < 10_000 ? 2 : 1)} s`;
  const m = Math.floor(ms / 60_000), s = Math.round((ms % 60_000) / 1000);
  if (m < 60) return `${m} min ${s} s`;
  return `${Math.floor(m / 60)} h ${m % 60} min`;
}

/** A JSON value as readable text: strings as they are, anything else pretty-printed. */
export function jsonText(value, limit = 20_000) {
  let text = typeof value === "string" ? value : JSON.stringify(value, null, 2);
  if (text === undefined) text = String(value);
  return text.length > limit ? text.slice(0, limit) + `\n… (${text.length - limit} more characters)` : text;
}

/** One line of a JSON value, for table cells. */
export function preview(value, limit = 120) {
  if (value === null || value === undefined) return "";
  const text = typeof value === "string" ? value : JSON.stringify(value);
  const line = (text ?? String(value)).replace(/\s+/g, " ");
  return line.length > limit ? line.slice(0, limit - 1) + "…" : line;
}

/** The text of a chat message: a string, or {content: [{type: "text", text}]}, else JSON. */
export function messageText(msg) {
  if (msg === null || msg === undefined) return "";
  if (typeof msg === "string") return msg;
  if (typeof msg === "object" && !Array.isArray(msg)) {
    const content = msg.content;
    if (typeof content === "string") return content;
    if (Array.isArray(content)) {
      const parts = content.map((p) => (p && typeof p === "object" && typeof p.text === "string" ? p.text : null));
      if (parts.every((p) => p !== null)) return parts.join("\n");
    }
  }
  return jsonText(msg);
}

export function badge(text, kind) {
  return h("span.badge", {class: `b-${String(kind || text).replace(/[^a-z_]/gi, "")}`}, String(text));
}

export function section(title, ...children) {
  return h("section.card", h("h2", title), ...children);
}

export function table(headers, rows, opts = {}) {
  return h("table", {class: opts.class || ""},
    h("thead", h("tr", headers.map((x) => h("th", x)))),
    h("tbody", rows));
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
