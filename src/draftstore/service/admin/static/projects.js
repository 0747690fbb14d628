// #/ — every project this token can see, paged.
import {h, replace, short, when} from "./dom.js";
import {enc, get} from "./api.js";
import {attempt} from "./ui.js";

export async function projectsPage(main, ctx) {
  document.title = "Projects — draftstore admin";
  const tbody = h("tbody", {id: "projects-rows"});
  const status = h("div");
  // the API shows an observer (or an approver) no draft
  const observer = Boolean(ctx.who && (ctx.who.role === "observer" || ctx.who.role === "approver"));
  const columns = ["name", "id", "head", ...(observer ? [] : ["draft"]), "forked from", "created"];
  const more = h("button.secondary", {id: "projects-more", hidden: true}, "More");
  let cursor = null;

  let loading = false;
  async function load() {
    if (loading) return; // "More" clicked again before its page came: the same cursor, once
    loading = true;
    more.disabled = true;
    const url = `/v1/projects?limit=100${cursor ? `&cursor=${enc(cursor)}` : ""}`;
    const [page, err] = await attempt(get(url, {signal: ctx.signal}), status, "Projects");
    loading = false;
    more.disabled = false;
    if (err || ctx.signal.aborted) return;
    for (const p of page.items) {
      tbody.append(h("tr", {dataset: {project: p.id}},
        h("td", h("a", {href: `#/p/${enc(p.id)}`, class: "project-link"}, p.name)),
        h("td", h("code", {title: p.id}, short(p.id))),
        h("td", p.current_version_id ? h("code", {title: p.current_version_id}, short(p.current_version_id)) : "—"),
        observer ? null : h("td", p.active_draft_id ? h("span.badge.b-running", "open") : h("span.muted", "none")),
        h("td", p.forked_from_version_id ? h("code", {title: p.forked_from_version_id}, short(p.forked_from_version_id)) : ""),
        h("td", when(p.created_at))));
    }
    cursor = page.next_cursor;
    more.hidden = !cursor;
    if (!tbody.firstChild) tbody.append(h("tr", h("td.muted", {colSpan: columns.length}, "No projects yet.")));
  }

  more.addEventListener("click", load);
  replace(main,
    h("h1", "Projects"),
    h("section.card",
      h("table", {id: "projects"},
        h("thead", h("tr", columns.map((x) => h("th", x)))),
        tbody),
      more, status));
  await load();
}

