// #/p/<project> — head, draft status, actions (publish, discard, roll back),
// versions, turns and head moves. Refreshes itself on the project's committed
// events (version.published, head.moved, draft.discarded). What it offers
// follows the token's role (ctx.who): the actions are an admin's, an
// observer gets no draft or turns sections at all, and an approver (who decides
// tool calls) the turns but no draft (the API refuses them anyway).
import {badge, h, messageText, preview, replace, section, short, when, duration} from "./dom.js";
import {enc, follow, get, newestPages, post} from "./api.js";
import {actorOf, attempt, busy, confirmAction, errorBox} from "./ui.js";

/**
 * How many of each list the page shows: the newest ones (read newest first,
 * only the pages that hold them). ``page`` is the page size asked for. A
 * module object, so a test can lower it.
 */
export const LIMITS = {versions: 5000, moves: 2000, turns: 1000, page: 200};

/** "showing the newest N <what>; older ones are not shown", or null when all are shown. */
function olderNote(id, what, list) {
  if (!list.more) return null;
  return h("p.muted.older", {id}, `Showing the newest ${list.items.length} ${what}; older ones are not shown.`);
}

export async function projectPage(main, ctx, projectId) {
  const base = `/v1/projects/${enc(projectId)}`;
  const project = await get(base, {signal: ctx.signal});
  if (ctx.signal.aborted) return;
  const role = ctx.who ? ctx.who.role : "admin"; // unknown: offer everything, the API decides
  const isAdmin = role === "admin";
  const isObserver = role === "observer";
  const noDraft = isObserver || role === "approver"; // reads published versions only, never a draft
  document.title = `${project.name} — draftstore admin`;

  const headCard = h("section.card", {id: "head"});
  const draftCard = h("section.card", {id: "draft"});
  const actionStatus = h("div", {id: "action-status"});
  const versionsBox = h("div", {id: "versions"});
  const turnsBox = h("div", {id: "turns"});
  const movesBox = h("div", {id: "head-moves"});

  replace(main,
    h("div.crumbs", h("a", {href: "#/"}, "Projects"), " / ", h("span", project.name)),
    h("h1", {id: "project-name"}, project.name, " ", h("code.muted", {title: project.id}, short(project.id))),
    h("div.toolbar",
      h("a.button.secondary", {href: `#/p/${enc(projectId)}/diff`, id: "compare"}, "Compare states…")),
    actionStatus,
    isObserver
      ? [headCard, h("p.muted", {id: "observer-note"}, "observers see published versions and their diffs")]
      : noDraft ? headCard : h("div.grid2", headCard, draftCard),
    section("Versions", versionsBox),
    isObserver ? null : section("Turns", turnsBox),
    section("Head moves", movesBox));

  let versions = [];
  let headVersion = null; // head's version, read by id when it is older than the versions shown
  const actor = actorOf(ctx.who);
  const numberOf = (id) => {
    const v = versions.find((x) => x.id === id) || (headVersion && headVersion.id === id ? headVersion : null);
    return v ? `v${v.number}` : short(id);
  };

  // a turn's timeline is not an observer's: its id only, not a link
  const turnRef = (id) => isObserver
    ? h("code", {class: "turn-ref", title: id}, short(id))
    : h("a", {class: "turn-ref", href: `#/t/${enc(id)}`}, short(id));

  function notice(text) {
    replace(actionStatus, h("div.notice", {role: "status"}, text));
  }

  async function act(button, what, call, done) {
    await busy(button, async () => {
      replace(actionStatus, h("span.muted", `${what}…`));
      try {
        const result = await call();
        notice(done(result));
      } catch (err) {
        if (err && err.name === "AbortError") return;
        replace(actionStatus, errorBox(err, `${what} failed`));
      }
      await refresh();
    });
  }

  async function publish(ev) {
    const values = await confirmAction({
      title: `Publish the draft of ${project.name}?`,
      text: "The draft becomes a new immutable version and the project's head.",
      okLabel: "Publish",
      fields: [{name: "summary", label: "Summary", placeholder: "what changed"},
               {name: "force", label: "force (publish even if the draft's base is no longer head)", type: "checkbox"}],
    });
    if (!values || ctx.signal.aborted) return;
    await act(ev.target, "Publish", () => post(`${base}/publish`, {summary: values.summary, force: values.force, actor}),
      (v) => `Published version ${v.number}.`);
  }

  async function discard(ev) {
    const values = await confirmAction({
      title: `Discard the draft of ${project.name}?`,
      text: "Its unpublished work is dropped; a running turn ends rolled back. Versions are not touched.",
      okLabel: "Discard", danger: true,
    });
    if (!values || ctx.signal.aborted) return;
    await act(ev.target, "Discard", () => post(`${base}/discard`, {actor}), () => "The draft was discarded.");
  }

  async function rollback(ev, version) {
    const values = await confirmAction({
      title: `Roll ${project.name} back to v${version.number}?`,
      text: `Head moves from ${numberOf(project.current_version_id)} to v${version.number}. ` +
            "No version is deleted, and the move is recorded.",
      okLabel: `Roll back to v${version.number}`, danger: true,
    });
    if (!values || ctx.signal.aborted) return;
    await act(ev.target, "Roll back", () => post(`${base}/rollback`, {version_id: version.id, actor}),
      () => `Head is now v${version.number}.`);
  }

  function renderHead() {
    const head = headVersion;
    replace(headCard, h("h2", "Head"),
      head
        ? h("div",
          h("div.big", {id: "head-number"}, `v${head.number}`),
          h("div", head.summary ? head.summary : h("span.muted", "(no summary)")),
          h("dl.meta",
            h("dt", "version"), h("dd", h("code", head.id)),
            h("dt", "files"), h("dd", String(head.file_count)),
            h("dt", "published"), h("dd", when(head.created_at), head.created_by ? ` by ${head.created_by}` : "")))
        : h("div.muted", project.current_version_id ? short(project.current_version_id) : "no version"));
  }

  async function renderDraft() {
    let draft = null;
    let error = null;
    try {
      draft = await get(`${base}/draft`, {signal: ctx.signal});
    } catch (err) {
      if (err && err.name === "AbortError") throw err;
      error = err;
    }
    if (error && error.code === "draft.none") {
      replace(draftCard, h("h2", "Draft"), h("div.muted", {id: "draft-status"}, "No open draft."));
      return;
    }
    if (error) {
      replace(draftCard, h("h2", "Draft"), errorBox(error, "Draft"));
      return;
    }
    const stale = draft.base_version_id && draft.base_version_id !== project.current_version_id;
    replace(draftCard, h("h2", "Draft"),
      h("div", {id: "draft-status"}, badge(draft.status), stale ? h("span.badge.b-failed", "base is not head") : null),
      h("dl.meta",
        h("dt", "base"), h("dd", draft.base_version_id ? numberOf(draft.base_version_id) : "—"),
        h("dt", "revision"), h("dd", String(draft.revision)),
        h("dt", "files"), h("dd", String(draft.file_count)),
        h("dt", "last turn"), h("dd", draft.last_turn_id
          ? h("a", {href: `#/t/${enc(draft.last_turn_id)}`}, short(draft.last_turn_id)) : "—"),
        h("dt", "opened"), h("dd", when(draft.created_at))),
      draft.partial_response != null
        ? h("details", h("summary", "partial response"), h("pre", messageText(draft.partial_response))) : null,
      h("div.actions",
        isAdmin ? h("button", {id: "publish", onclick: publish}, "Publish…") : null,
        isAdmin ? h("button.danger", {id: "discard", onclick: discard}, "Discard…") : null,
        h("a.button.secondary", {href: `#/p/${enc(projectId)}/diff?a=head&b=draft`, id: "diff-draft"},
          "Diff draft vs head")));
  }

  function renderVersions(list) {
    const rows = [...versions].reverse().map((v) => {
      const isHead = v.id === project.current_version_id;
      const parent = v.parent_version_id;
      return h("tr", {dataset: {version: v.id, number: String(v.number)}, class: isHead ? "is-head" : ""},
        h("td", h("strong", `v${v.number}`), isHead ? h("span.badge.b-head", "head") : null),
        h("td", v.summary),
        h("td.num", String(v.file_count)),
        h("td", v.created_by || ""),
        h("td", when(v.created_at)),
        h("td", v.created_by_turn_id ? turnRef(v.created_by_turn_id) : ""),
        h("td.row-actions",
          parent ? h("a", {href: `#/p/${enc(projectId)}/diff?a=${enc(parent)}&b=${enc(v.id)}`}, "diff vs parent") : null,
          !isHead ? h("a", {href: `#/p/${enc(projectId)}/diff?a=${enc(v.id)}&b=head`}, "diff vs head") : null,
          !isHead && isAdmin ? h("button.small.danger", {class: "rollback", onclick: (ev) => rollback(ev, v)}, "Roll back here…") : null));
    });
    replace(versionsBox,
      h("table", {id: "versions-table"},
        h("thead", h("tr", ["version", "summary", "files", "by", "published", "turn", ""].map((x) => h("th", x)))),
        h("tbody", rows)),
      olderNote("versions-older", "versions", list));
  }

  async function renderTurns() {
    const [page, err] = await attempt(
      newestPages(`${base}/turns`, {signal: ctx.signal, keep: LIMITS.turns, limit: LIMITS.page}), turnsBox, "Turns");
    if (err || ctx.signal.aborted) return;
    const rows = [...page.items].reverse().map((t) => h("tr", {dataset: {turn: t.id}},
      h("td", h("a", {href: `#/t/${enc(t.id)}`}, `#${t.number}`)),
      h("td", badge(t.status), t.end_reason ? h("span.muted", ` ${t.end_reason}`) : null,
        // undone by a revert of the draft: the record stays, its changes do not
        t.reverted_at ? [" ", h("span", {class: "reverted", title: `reverted ${when(t.reverted_at)}${t.reverted_by ? ` by ${t.reverted_by}` : ""}`}, badge("reverted", "revert"))] : null),
      h("td.msg", preview(messageText(t.user_message), 100)),
      h("td", t.actor || ""),
      h("td", when(t.started_at)),
      h("td.num", duration(t.started_at, t.ended_at))));
    replace(turnsBox, rows.length
      ? h("table", {id: "turns-table"},
        h("thead", h("tr", ["turn", "status", "user message", "actor", "started", "took"].map((x) => h("th", x)))),
        h("tbody", rows))
      : h("p.muted", "No turns yet."), olderNote("turns-older", "turns", page));
  }

  async function renderMoves() {
    const [page, err] = await attempt(
      newestPages(`${base}/head-moves`, {signal: ctx.signal, keep: LIMITS.moves, limit: LIMITS.page}), movesBox, "Head moves");
    if (err || ctx.signal.aborted) return;
    const rows = [...page.items].reverse().map((m) => h("tr", {dataset: {reason: m.reason}},
      h("td", when(m.at)),
      h("td", badge(m.reason)),
      m.reason === "revert" // head stays: the draft went back to the start of the turn
        ? h("td", "draft → start of turn")
        : h("td", m.from_version_id ? numberOf(m.from_version_id) : "—", " → ", m.to_version_id ? numberOf(m.to_version_id) : "—"),
      h("td", m.actor || ""),
      h("td", m.turn_id ? turnRef(m.turn_id) : "")));
    replace(movesBox, h("table", {id: "moves-table"},
      h("thead", h("tr", ["when", "reason", "move", "actor", "turn"].map((x) => h("th", x)))),
      h("tbody", rows)), olderNote("moves-older", "head moves", page));
  }

  let refreshing = null;
  let again = false;
  async function refresh() {
    if (refreshing) { // one more round after this one: it may have read before the change
      again = true;
      return refreshing;
    }
    refreshing = (async () => {
      try {
        Object.assign(project, await get(base, {signal: ctx.signal}));
        const page = await newestPages(`${base}/versions`, {signal: ctx.signal, keep: LIMITS.versions, limit: LIMITS.page});
        const headId = project.current_version_id;
        headVersion = page.items.find((v) => v.id === headId) || null;
        if (!headVersion && headId) { // rolled back to a version older than the ones shown
          headVersion = await get(`${base}/versions/${enc(headId)}`, {signal: ctx.signal});
        }
        if (ctx.signal.aborted) return;
        versions = page.items;
        renderHead();
        renderVersions(page);
        await Promise.all(isObserver ? [renderMoves()]
          : noDraft ? [renderTurns(), renderMoves()] : [renderDraft(), renderTurns(), renderMoves()]);
      } catch (err) {
        if (err && err.name === "AbortError") return;
        replace(actionStatus, errorBox(err));
      } finally {
        refreshing = null;
      }
      if (again && !ctx.signal.aborted) {
        again = false;
        await refresh();
      }
    })();
    return refreshing;
  }

  await refresh();
  if (ctx.signal.aborted) return; // left while loading: no stream for a page that is gone

  let timer = null;
  const stream = follow(`${base}/events`, {
    onEvent: (e) => {
      if (e.type === "stream.end") return;
      clearTimeout(timer);
      timer = setTimeout(refresh, 150);
    },
  });
  ctx.onLeave(() => { stream.close(); clearTimeout(timer); });
}
