// #/p/<project>/diff?a=<state>&b=<state> — what changed from state A to state B,
// side by side: files (from the API's unified diffs), characters and world
// settings (both documents, line by line). A state is head, draft, a version
// id, or turn:<id>:start|end.
import {badge, h, replace, short} from "./dom.js";
import {enc, get, newestPages} from "./api.js";
import {LIMITS} from "./project.js";
import {attempt, errorBox} from "./ui.js";

const CONTEXT = 3; // unchanged lines kept around a change in the JSON documents
const MAX_FILES = 2000; // changed files shown; the route is paged, the page stops asking after these

// the diff's pages (files in path order) up to MAX_FILES files; next_cursor set when more are left
async function diffPages(url, signal) {
  const diff = await get(`${url}&limit=200`, {signal});
  while (diff.next_cursor && diff.files.length < MAX_FILES && !signal.aborted) {
    const more = await get(`${url}&limit=200&cursor=${enc(diff.next_cursor)}`, {signal});
    diff.files.push(...more.files);
    diff.next_cursor = more.next_cursor;
  }
  return diff;
}

export async function diffPage(main, ctx, projectId, params) {
  const base = `/v1/projects/${enc(projectId)}`;
  const project = await get(base, {signal: ctx.signal});
  if (ctx.signal.aborted) return;
  const {items: versions} = await newestPages(`${base}/versions`,
    {signal: ctx.signal, keep: LIMITS.versions, limit: LIMITS.page});
  if (ctx.signal.aborted) return;
  let head = versions.find((v) => v.id === project.current_version_id);
  if (!head && project.current_version_id) { // older than the versions listed
    head = await get(`${base}/versions/${enc(project.current_version_id)}`, {signal: ctx.signal});
    if (ctx.signal.aborted) return;
    versions.unshift(head);
  }
  const a = params.get("a") || (head && head.parent_version_id) || "head";
  const b = params.get("b") || "head";
  document.title = `Diff — ${project.name} — draftstore admin`;
  const observer = Boolean(ctx.who && (ctx.who.role === "observer" || ctx.who.role === "approver")); // published only

  const label = (ref) => {
    if (ref === "head") return head ? `head (v${head.number})` : "head";
    if (ref === "draft") return "draft";
    const v = versions.find((x) => x.id === ref || `version:${x.id}` === ref);
    if (v) return `v${v.number}${v.summary ? ` — ${v.summary}` : ""}`;
    const t = /^turn:([^:]+):(start|end)$/.exec(ref);
    if (t) return `turn ${short(t[1])} ${t[2]}`;
    return ref;
  };
  const picker = (id, value) => {
    // an observer may compare published versions only: no draft to pick
    const refs = [...(observer ? ["head"] : ["head", "draft"]), ...[...versions].reverse().map((v) => v.id)];
    if (!refs.includes(value)) refs.push(value);
    return h("select", {id, name: id}, refs.map((ref) => h("option", {value: ref, selected: ref === value}, label(ref))));
  };
  const pickA = picker("state-a", a);
  const pickB = picker("state-b", b);
  const go = () => { location.hash = `#/p/${enc(projectId)}/diff?a=${enc(pickA.value)}&b=${enc(pickB.value)}`; };
  const swap = () => { location.hash = `#/p/${enc(projectId)}/diff?a=${enc(pickB.value)}&b=${enc(pickA.value)}`; };

  const result = h("div", {id: "diff-result"}, h("p.muted", "Loading…"));
  replace(main,
    h("div.crumbs", h("a", {href: "#/"}, "Projects"), " / ",
      h("a", {href: `#/p/${enc(projectId)}`}, project.name), " / ", h("span", "diff")),
    h("h1", "Diff"),
    h("form.card.pickers", {onsubmit: (ev) => { ev.preventDefault(); go(); }},
      h("label", "from (A) ", pickA), h("button.secondary.small", {type: "button", onclick: swap, title: "swap"}, "⇄"),
      h("label", "to (B) ", pickB), h("button", {type: "submit", id: "compare-go"}, "Compare")),
    result);

  const [diff, err] = await attempt(
    diffPages(`${base}/diff?a=${enc(a)}&b=${enc(b)}`, ctx.signal), result, `Diff ${label(a)} → ${label(b)}`);
  if (err || ctx.signal.aborted) return;

  const docs = diff.characters.length || diff.world_settings.length
    ? await Promise.all([a, b].map((ref) => get(`${base}/view?at=${enc(ref)}`, {signal: ctx.signal}).catch((e) => e)))
    : null;
  if (ctx.signal.aborted) return;

  const counts = {};
  for (const f of diff.files) counts[f.status] = (counts[f.status] || 0) + 1;
  replace(result,
    h("p.summary", {id: "diff-summary"},
      h("strong", label(a)), " → ", h("strong", label(b)), ": ",
      diff.files.length ? `${diff.files.length}${diff.next_cursor ? "+" : ""} file${diff.files.length === 1 ? "" : "s"} changed` : "no file changed",
      diff.next_cursor ? ` (the first ${diff.files.length} shown)` : "",
      Object.keys(counts).length ? ` (${Object.entries(counts).map(([k, n]) => `${n} ${k}`).join(", ")})` : "",
      `; characters: ${diff.characters.length ? `${diff.characters.length} change${diff.characters.length === 1 ? "" : "s"}` : "unchanged"}`,
      `; world settings: ${diff.world_settings.length ? `${diff.world_settings.length} change${diff.world_settings.length === 1 ? "" : "s"}` : "unchanged"}.`),
    h("section.card", {id: "diff-files"}, h("h2", "Files"),
      diff.files.length ? diff.files.map(fileBlock) : h("p.muted", "No file changed.")),
    docBlock("Characters", "diff-characters", "characters", diff.characters, docs),
    docBlock("World settings", "diff-world", "world_settings", diff.world_settings, docs));
}

function fileBlock(f) {
  const head = h("div.file-head",
    badge(f.status), " ",
    f.old_path ? [h("code", f.old_path), " → "] : null, h("code.path", f.path),
    h("span.muted.sizes", sizes(f)),
    f.old_executable != null && f.new_executable != null && f.old_executable !== f.new_executable
      ? h("span.badge", f.new_executable ? "+x" : "-x") : null);
  let body;
  if (f.status === "renamed" && f.old_digest === f.new_digest) body = h("p.muted", "Renamed, content unchanged.");
  else if (f.binary) body = h("p.muted", `Binary file (${short(f.old_digest)} → ${short(f.new_digest)}).`);
  else if (f.unified == null) body = h("p.muted", "No text diff (file over 1 MiB, or text diffs not asked for).");
  else if (f.unified === "") body = h("p.muted", "Same text.");
  else body = sideBySide(unifiedRows(f.unified));
  return h("div.file", {dataset: {path: f.path, status: f.status}}, head, body);
}

function sizes(f) {
  const s = (n) => (n == null ? "" : `${n} B`);
  if (f.old_size == null) return ` ${s(f.new_size)}`;
  if (f.new_size == null) return ` ${s(f.old_size)}`;
  return ` ${s(f.old_size)} → ${s(f.new_size)}`;
}

function docBlock(title, id, key, ops, docs) {
  if (!ops.length) return h("section.card", {id}, h("h2", title), h("p.muted", "Unchanged."));
  let body;
  if (!docs) body = null;
  else if (docs.some((d) => d instanceof Error)) body = errorBox(docs.find((d) => d instanceof Error), title);
  else body = sideBySide(lineRows(pretty(docs[0][key]), pretty(docs[1][key])));
  return h("section.card", {id}, h("h2", title), body,
    h("details.ops", h("summary", `${ops.length} JSON Patch operation${ops.length === 1 ? "" : "s"}`),
      h("table.ops", h("tbody", ops.map((op) => h("tr",
        h("td", badge(op.op)), h("td", h("code", op.path)),
        h("td", h("code", "value" in op ? JSON.stringify(op.value) : op.from ? `from ${op.from}` : ""))))))));
}

function pretty(value) {
  return value === undefined ? [] : (JSON.stringify(value, null, 2) ?? "null").split("\n");
}

/** Rows of a unified diff: {hunk} | {l: {n, text} | null, r: {n, text} | null, same}. */
export function unifiedRows(text) {
  const rows = [];
  let ln = 0;
  let rn = 0;
  let dels = [];
  let adds = [];
  const flush = () => {
    for (let i = 0; i < Math.max(dels.length, adds.length); i++) rows.push({l: dels[i] || null, r: adds[i] || null});
    dels = [];
    adds = [];
  };
  for (const line of text.split("\n")) {
    if (line.startsWith("@@")) {
      flush();
      const m = /^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@/.exec(line);
      if (m) { ln = Number(m[1]); rn = Number(m[2]); }
      rows.push({hunk: line});
      continue;
    }
    if (!rows.length) continue; // the ---/+++ header
    const c = line[0];
    if (c === "-") dels.push({n: ln++, text: line.slice(1)});
    else if (c === "+") adds.push({n: rn++, text: line.slice(1)});
    else if (c === " ") { flush(); rows.push({l: {n: ln++, text: line.slice(1)}, r: {n: rn++, text: line.slice(1)}, same: true}); }
  }
  flush();
  return rows;
}

/** Side-by-side rows of two line lists (longest common subsequence), unchanged runs folded. */
export function lineRows(a, b) {
  const n = a.length;
  const m = b.length;
  const ops = []; // [kind, i, j]
  if (n * m > 4_000_000) {
    a.forEach((_, i) => ops.push(["-", i]));
    b.forEach((_, j) => ops.push(["+", null, j]));
  } else {
    const w = m + 1;
    const lcs = new Uint32Array((n + 1) * w);
    for (let i = n - 1; i >= 0; i--) {
      for (let j = m - 1; j >= 0; j--) {
        lcs[i * w + j] = a[i] === b[j] ? lcs[(i + 1) * w + j + 1] + 1 : Math.max(lcs[(i + 1) * w + j], lcs[i * w + j + 1]);
      }
    }
    let i = 0;
    let j = 0;
    while (i < n || j < m) {
      if (i < n && j < m && a[i] === b[j]) ops.push(["=", i++, j++]);
      else if (j < m && (i === n || lcs[i * w + j + 1] >= lcs[(i + 1) * w + j])) ops.push(["+", null, j++]);
      else ops.push(["-", i++]);
    }
  }
  const rows = [];
  let dels = [];
  let adds = [];
  const flush = () => {
    for (let k = 0; k < Math.max(dels.length, adds.length); k++) rows.push({l: dels[k] || null, r: adds[k] || null});
    dels = [];
    adds = [];
  };
  for (const [kind, i, j] of ops) {
    if (kind === "-") dels.push({n: i + 1, text: a[i]});
    else if (kind === "+") adds.push({n: j + 1, text: b[j]});
    else { flush(); rows.push({l: {n: i + 1, text: a[i]}, r: {n: j + 1, text: b[j]}, same: true}); }
  }
  flush();
  // fold long unchanged runs, keeping CONTEXT lines around each change
  const keep = rows.map((r) => !r.same);
  const near = keep.map((_, k) => keep.slice(Math.max(0, k - CONTEXT), k + CONTEXT + 1).some(Boolean));
  const out = [];
  for (let k = 0; k < rows.length; k++) {
    if (near[k]) { out.push(rows[k]); continue; }
    let end = k;
    while (end + 1 < rows.length && !near[end + 1]) end++;
    out.push({hunk: `… ${end - k + 1} unchanged line${end === k ? "" : "s"}`});
    k = end;
  }
  return out;
}

function sideBySide(rows) {
  const cell = (side, kind) => side
    ? [h("td.ln", String(side.n)), h(`td.code.${kind}`, side.text)]
    : [h("td.ln"), h("td.code.empty")];
  return h("table.sbs", h("colgroup", h("col.ln"), h("col"), h("col.ln"), h("col")), h("tbody", rows.map((r) => (r.hunk
    ? h("tr.hunk", h("td", {colSpan: 4}, r.hunk))
    : h("tr", cell(r.l, r.same ? "ctx" : "del"), cell(r.r, r.same ? "ctx" : "add"))))));
}
