// The admin page: login, hash routing, and the pages.
//   #/                      projects
//   #/p/<project>           a project: head, draft, versions, head moves, turns, actions
//   #/p/<project>/diff?a=&b= the diff between two states, side by side
//   #/t/<turn>              a turn's timeline, live over its SSE stream
import {h, replace, short} from "./dom.js";
import {ApiError, get, session} from "./api.js";
import {closeDialog, errorBox} from "./ui.js";
import {projectsPage} from "./projects.js";
import {projectPage} from "./project.js";
import {diffPage} from "./diff.js";
import {turnPage} from "./turn.js";

const main = document.getElementById("main");
const whoami = document.getElementById("whoami");

let openMode = false;
let who = null; // GET /v1/whoami: {role, project_id, token_id, open_mode}
let current = null; // {controller, signal, cleanups, onLeave}

/** Leave the current page: abort its requests, run its cleanups (streams, timers), cancel its open question. */
function leave() {
  closeDialog();
  if (!current) return;
  current.controller.abort();
  for (const fn of current.cleanups) {
    try { fn(); } catch { /* the page is going away */ }
  }
  current.cleanups = [];
  current = null;
}

/**
 * A page's context. A page function checks ``ctx.signal.aborted`` after each await and returns
 * once the page was left; ``ctx.onLeave(fn)`` runs ``fn`` when the page is left, or at once if it
 * already was (so a stream opened late is never leaked).
 */
function pageContext() {
  const controller = new AbortController();
  const ctx = {controller, signal: controller.signal, cleanups: [], who};
  ctx.onLeave = (fn) => {
    if (ctx.signal.aborted) {
      try { fn(); } catch { /* already gone */ }
    } else {
      ctx.cleanups.push(fn);
    }
  };
  return ctx;
}

/** The role (and project scope) the API gives this token: the page offers only what that role may do. */
function roleBadges() {
  if (!who) return [];
  return [h("span.badge.b-role", {id: "who-role", dataset: {role: who.role},
    title: "what this token may do; the API enforces it"}, who.role),
  who.project_id
    ? h("span.badge", {id: "who-scope", title: `scoped to project ${who.project_id}`}, "project ", short(who.project_id))
    : h("span.muted", {id: "who-scope"}, "every project")];
}

function renderWho() {
  if (session.token) {
    const t = session.token;
    const shown = t.length > 12 ? `${t.slice(0, 12)}…` : "token";
    replace(whoami, roleBadges(), h("span.muted", "signed in with "), h("code", {id: "who-token"}, shown), " ",
      h("button.secondary.small", {id: "logout", onclick: logout}, "Log out"));
  } else if (openMode) {
    replace(whoami, roleBadges(), h("span.badge.b-open", {id: "open-mode",
      title: "No token exists yet: the service answers loopback clients only, each as an admin."},
    "open mode (loopback, no token configured)"));
  } else {
    replace(whoami);
  }
}

function logout() {
  showLogin(null);
}

/** The login form; a 401 anywhere (token revoked, open mode ended) brings it back with its code. */
function showLogin(err) {
  leave();
  session.token = "";
  openMode = false;
  who = null;
  renderWho();
  document.title = "Log in — draftstore admin";
  const input = h("input", {type: "password", id: "token", name: "token", autocomplete: "off",
    placeholder: "dst_…", required: true, size: 60});
  const status = h("div", {id: "login-status"});
  if (err) status.append(errorBox(err));
  const form = h("form.card.login", {id: "login-form", onsubmit: async (ev) => {
    ev.preventDefault();
    session.token = input.value.trim();
    const button = form.querySelector("button");
    button.disabled = true;
    replace(status, h("span.muted", "Checking…"));
    try {
      who = await get("/v1/whoami");
      renderWho();
      if (!location.hash || location.hash === "#/login") location.hash = "#/";
      else route();
    } catch (e) {
      session.token = "";
      who = null;
      renderWho();
      // a 401 has already redrawn this form with its code; anything else is shown here
      if (e.status !== 401) replace(status, errorBox(e, "Log in failed"));
    } finally {
      button.disabled = false;
    }
  }},
  h("h1", "Log in"),
  h("p.muted", "Paste an API token (admin, agent, observer or approver; ",
    h("code", "draftstore token create --role admin"),
    "). It is kept in this tab's session storage only and sent as a bearer header."),
  h("label", {for: "token"}, "Token"), input,
  h("div.actions", h("button", {type: "submit", id: "login-submit"}, "Log in")),
  status);
  replace(main, form);
  input.focus();
}

function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const [path, query = ""] = raw.split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return {parts, params: new URLSearchParams(query)};
}

async function route() {
  leave();
  if (!session.token && !openMode) return showLogin(null);
  const ctx = pageContext();
  current = ctx;
  replace(main, h("p.muted", "Loading…"));
  try {
    let parsed;
    try {
      parsed = parseHash();
    } catch (err) { // a bad percent escape (#/p/%E0)
      throw new ApiError(0, {code: "route.invalid", message: `cannot read the address ${location.hash} (${err.message})`});
    }
    const {parts, params} = parsed;
    if (parts.length === 0) await projectsPage(main, ctx);
    else if (parts[0] === "p" && parts.length === 2) await projectPage(main, ctx, parts[1]);
    else if (parts[0] === "p" && parts[2] === "diff") await diffPage(main, ctx, parts[1], params);
    else if (parts[0] === "t" && parts.length === 2) await turnPage(main, ctx, parts[1]);
    else if (parts[0] === "login") location.hash = "#/";
    else replace(main, errorBox(new ApiError(404, {code: "route.not_found", message: `no page ${location.hash}`})));
  } catch (err) {
    if ((err && err.name === "AbortError") || ctx.signal.aborted) return;
    if (current === ctx) replace(main, errorBox(err));
  }
}

async function start() {
  window.addEventListener("draftstore:unauthorized", (ev) => showLogin(ev.detail));
  window.addEventListener("hashchange", route);
  // who this tab is: the stored token's role, or (without one) open loopback mode, where
  // the API answers without a token while none exists
  try {
    who = await get("/v1/whoami");
    openMode = who.open_mode === true;
  } catch (err) {
    if (!(err instanceof ApiError) || err.status !== 401) {
      renderWho();
      replace(main, errorBox(err, "The service did not answer"));
    }
    return; // a 401: the unauthorized event showed the login form
  }
  renderWho();
  route();
}

start();
