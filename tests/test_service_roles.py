"""Who may do what: every route × every kind of caller, as one table of data.

``ROUTES`` names each route of the app (method, path template as in
/openapi.json), the roles it admits, a request that succeeds on a fresh
``World`` and the status that success is. The table is checked against
every caller: admin, agent, observer, approver (tokens of every project), no token,
a token that never existed and a revoked admin token. A route missing from
the table fails ``test_the_table_covers_every_route_of_the_app``: a new route
needs a role decision.

Then: a token scoped to one project never reaches another's resources (404,
not 403, so ids do not leak); tokens are shown once and stored hashed; a
revoked token is refused within the auth cache's few seconds; only an admin
of every project manages tokens; an observer never learns of a draft;
``/v1/whoami`` names each caller's role and scope.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from draftstore import Store
from draftstore.db.tables import TOKENS
from draftstore.service.app import create_app
from draftstore.service.auth import AUTH_CACHE_S
from service_fixtures import Service
from services import token as random_token

ADMIN = frozenset({"admin"})
AGENT = frozenset({"admin", "agent"})
ANY = frozenset({"admin", "agent", "observer", "approver"})
TURN_READERS = frozenset({"admin", "agent", "approver"})  # what an approver reads to decide
DECIDERS = frozenset({"admin", "approver"})  # a person's decision: never an agent's
PUBLIC = frozenset({"admin", "agent", "observer", "approver", "none", "bad", "revoked"})
CALLERS = ["admin", "agent", "observer", "approver", "none", "bad", "revoked"]
UNKNOWN_TOKEN = f"dst_{'0' * 32}_{'A' * 43}"  # well formed, never issued


@pytest.fixture
def service(shared_service_per_test: Service) -> Service:
    """One service per flavour for this module's tests (``shared_service``): each test makes its
    own projects and tokens and looks only at those."""
    return shared_service_per_test


@dataclass(frozen=True)
class World:
    """A project with two versions and a running turn (or, ``paused``, a completed
    one) on its draft; the turn has tool call 1 started and, with ``approval``,
    tool call 2 awaiting approval; an external snapshot of head and a sandbox session
    open on the draft. Plus a spare token to revoke."""

    project_id: str
    turn_id: str
    v1: str
    v2: str
    token_id: str
    session_id: str = ""

    def fill(self, template: Any) -> Any:
        """``template`` (a URL, or a JSON body: its strings) with this world's ids."""
        if isinstance(template, str):
            return template.format(project_id=self.project_id, turn_id=self.turn_id, v1=self.v1, v2=self.v2,
                                   token_id=self.token_id, session_id=self.session_id)
        if isinstance(template, dict):
            return {k: self.fill(v) for k, v in template.items()}
        if isinstance(template, list):
            return [self.fill(v) for v in template]
        return template


def build_world(store: Store, *, paused: bool = False, approval: bool = False) -> World:
    p = store.create_project(f"roles-{random_token(3)}", files={"main.py": "print(1)\n", "src/util.py": "X = 1\n"},
                             characters={"hero": {"hp": 10}}, world_settings={"era": "bronze"})
    first = store.start_turn(p.id, "grow")
    store.write_file(first.id, "src/util.py", "X = 2\n")
    store.complete_turn(first.id, "grown")
    v2 = store.publish(p.id, "v2")
    turn = store.start_turn(p.id, "more")
    store.tool_started(turn.id, "view_file", {"path": "main.py"})
    if approval:
        store.tool_started(turn.id, "rm", {"path": "main.py"}, needs_approval=True)
    if paused:
        store.complete_turn(turn.id, "done")
    spare, _ = store.tokens.create("observer", name="spare")
    store.record_snapshot(p.id, "head", "provider-snap-1")
    session = store.open_sandbox(p.id, "local", "sbx-1", turn_id=turn.id)
    return World(p.id, turn.id, p.current_version_id or "", v2.id, spare.id, session.id)


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # the template in /openapi.json
    allowed: frozenset[str]
    ok: int  # what an allowed caller gets on a fresh World
    url: str = ""  # the request (World placeholders, query); default: ``path``
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    paused: bool = False  # needs the turn completed (a draft that may be published)
    approval: bool = False  # needs tool call 2 awaiting approval
    why: str = ""

    @property
    def mutates(self) -> bool:
        return self.method != "GET"

    @property
    def label(self) -> str:
        return f"{self.method} {self.url or self.path}"

    def send(self, c: httpx.Client, world: World) -> httpx.Response:
        url = world.fill(self.url or self.path)
        kwargs: dict[str, Any] = {"headers": self.headers}
        if self.content is not None:
            kwargs["content"] = self.content
        elif self.json is not None:
            kwargs["json"] = world.fill(self.json)
        return c.request(self.method, url, **kwargs)


R = Route
T = "/v1/turns/{turn_id}"
P = "/v1/projects/{project_id}"
V = "/v1/projects/{project_id}/view"
EVENTS_PAGE = {"accept": "application/json"}

ROUTES: list[Route] = [
    R("GET", "/healthz", PUBLIC, 200),
    R("GET", "/readyz", PUBLIC, 200),
    R("GET", "/v1/whoami", ANY, 200, why="a client offers only what the role may do"),
    # projects and their published history
    R("POST", "/v1/projects", ADMIN, 201, json={"name": "new", "files": {"a.txt": "YQ=="}}),
    R("GET", "/v1/projects", ANY, 200),
    R("GET", P, ANY, 200),
    R("GET", f"{P}/draft", AGENT, 200, why="a draft is unpublished work"),
    R("GET", f"{P}/versions", ANY, 200),
    R("GET", f"{P}/versions/{{version_id}}", ANY, 200, url=f"{P}/versions/{{v1}}"),
    R("GET", f"{P}/head-moves", ANY, 200),
    R("GET", f"{P}/diff", ANY, 200, url=f"{P}/diff?a=version:{{v1}}&b=version:{{v2}}"),
    R("GET", f"{P}/diff", ANY, 200, url=f"{P}/diff?a={{v1}}&b=head"),
    R("GET", f"{P}/diff", AGENT, 200, url=f"{P}/diff?a=head&b=draft", why="the draft"),
    R("GET", f"{P}/diff", AGENT, 200, url=f"{P}/diff?a=turn:{{turn_id}}:start&b=draft", why="a turn"),
    R("GET", f"{P}/events", ANY, 200, headers=EVENTS_PAGE, why="committed events only"),
    # admin operations
    R("POST", f"{P}/publish", ADMIN, 201, json={"summary": "v3"}, paused=True),
    R("POST", f"{P}/discard", ADMIN, 200),
    R("POST", f"{P}/rollback", ADMIN, 200, json={"version_id": "{v1}"}),
    R("POST", f"{P}/draft/revert", ADMIN, 200, json={"to_turn_id": "{turn_id}"}, paused=True,
      why="undoes an agent's turns"),
    R("POST", f"{P}/fork", ADMIN, 201, json={"name": "copy"}),
    R("GET", f"{P}/snapshots", AGENT, 200),
    R("POST", f"{P}/snapshots", AGENT, 201, json={"source": "head"}),
    R("GET", f"{P}/snapshots/best", AGENT, 200, url=f"{P}/snapshots/best?state=head"),
    # sandbox sessions: a sandbox runs unpublished work
    R("POST", f"{P}/sandbox-sessions", AGENT, 201, json={"provider": "e2b", "external_id": "sbx-2"}),
    R("GET", f"{P}/sandbox-sessions", AGENT, 200, url=f"{P}/sandbox-sessions?status=starting"),
    R("GET", f"{P}/sandbox-sessions/{{session_id}}", AGENT, 200),
    R("POST", f"{P}/sandbox-sessions/{{session_id}}/heartbeat", AGENT, 200, json={"status": "ready"}),
    R("POST", f"{P}/sandbox-sessions/{{session_id}}/close", AGENT, 200),
    # turns
    R("POST", f"{P}/turns", AGENT, 201, json={"user_message": {"role": "user", "content": "hi"}}, paused=True),
    R("POST", f"{P}/turns", AGENT, 201, json={"user_message": "go on", "continue": True}, paused=True),
    R("GET", f"{P}/turns", TURN_READERS, 200),
    R("GET", T, TURN_READERS, 200),
    R("GET", f"{T}/tool-calls", TURN_READERS, 200),
    R("GET", f"{T}/tool-calls/{{seq}}/payload", TURN_READERS, 200, url=f"{T}/tool-calls/1/payload?part=args"),
    R("GET", f"{T}/resume-context", AGENT, 200, why="rebuilding a model's context reads unpublished work"),
    R("GET", f"{T}/events", TURN_READERS, 200, headers=EVENTS_PAGE, why="a turn's stream"),
    R("POST", f"{T}/complete", AGENT, 200, json={"assistant_message": "done"}),
    R("POST", f"{T}/interrupt", AGENT, 200, json={"partial_response": {"text": "half"}}),
    R("POST", f"{T}/fail", AGENT, 200, json={"error": "boom"}),
    R("POST", f"{T}/cancel", AGENT, 200),
    R("POST", f"{T}/heartbeat", AGENT, 204),
    R("POST", f"{T}/deltas", AGENT, 204, json={"text": "Hel"}),
    # tool calls and approvals
    R("POST", f"{T}/tool-calls", AGENT, 201, json={"tool_name": "search_code", "args": {"q": "x"}}),
    R("POST", f"{T}/tool-calls/{{seq}}/complete", AGENT, 204, url=f"{T}/tool-calls/1/complete", json={"result": 1}),
    R("POST", f"{T}/tool-calls/{{seq}}/fail", AGENT, 204, url=f"{T}/tool-calls/1/fail", json={"error": "x"}),
    R("POST", f"{T}/tool-calls/{{seq}}/approval", DECIDERS, 200, url=f"{T}/tool-calls/2/approval",
      json={"approved": True, "reason": "fine"}, approval=True, why="a person decides, never the agent"),
    # draft writes
    R("PUT", f"{T}/files/{{path}}", AGENT, 204, url=f"{T}/files/src/new.py", content=b"NEW = 1\n"),
    R("DELETE", f"{T}/files/{{path}}", AGENT, 204, url=f"{T}/files/main.py"),
    R("POST", f"{T}/changes", AGENT, 204, json={"changes": {"b.txt": "Yg==", "main.py": None}}),
    R("POST", f"{T}/move", AGENT, 204, json={"src": "main.py", "dst": "app.py"}),
    R("PATCH", f"{T}/characters", AGENT, 200, json={"patch": [{"op": "add", "path": "/dragon", "value": {}}]}),
    R("PATCH", f"{T}/world-settings", AGENT, 200, json={"patch": {"weather": "rain"}}),
    # views: published states for everyone, the draft and turns for agents
    *[r for sub, tail in (("", ""), ("/files/{path}", "/files/main.py"), ("/stat/{path}", "/stat/main.py"),
                          ("/list", "/list"), ("/find", "/find"), ("/search", "/search?q=print"))
      for r in (
          R("GET", f"{V}{sub}", ANY, 200, url=f"{V}{tail}{'&' if '?' in tail else '?'}at=head"),
          R("GET", f"{V}{sub}", ANY, 200, url=f"{V}{tail}{'&' if '?' in tail else '?'}at=version:{{v1}}"),
          R("GET", f"{V}{sub}", AGENT, 200, url=f"{V}{tail}", why="default: the draft"),
          R("GET", f"{V}{sub}", AGENT, 200, url=f"{V}{tail}{'&' if '?' in tail else '?'}at=draft"),
          R("GET", f"{V}{sub}", AGENT, 200, url=f"{V}{tail}{'&' if '?' in tail else '?'}at=turn:{{turn_id}}:start"),
      )],
    # tokens: admins of every project
    R("POST", "/v1/tokens", ADMIN, 201, json={"role": "observer", "name": "made by the table"}),
    R("GET", "/v1/tokens", ADMIN, 200),
    R("DELETE", "/v1/tokens/{token_id}", ADMIN, 204),
]


def expected(route: Route, caller: str) -> tuple[int, str | None]:
    """(status, error code) a caller gets."""
    if caller in route.allowed:
        return route.ok, None
    if caller == "none":
        return 401, "auth.required"
    if caller in ("bad", "revoked"):
        return 401, "auth.invalid"
    return 403, "auth.forbidden"


def outcome(r: httpx.Response) -> tuple[int, str | None]:
    code = None
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        code = r.json().get("code")
    return r.status_code, code


def secrets_of(service: Service, project_id: str | None = None) -> dict[str, str | None]:
    store = service.store
    revoked, secret = store.tokens.create("admin", name="revoked at once")
    store.tokens.revoke(revoked.id)
    return {"admin": service.token("admin", project_id), "agent": service.token("agent", project_id),
            "observer": service.token("observer", project_id),
            "approver": service.token("approver", project_id), "none": None, "bad": UNKNOWN_TOKEN,
            "revoked": secret}


def revoked(store: Store, token_id: str) -> bool:
    with store.engine.connect() as conn:
        return conn.execute(sa.select(TOKENS.c.revoked_at).where(TOKENS.c.id == token_id)).scalar_one() is not None


def every_project(c: httpx.Client) -> list[Any]:
    items, cursor = [], None
    while True:
        page = c.get("/v1/projects", params={"limit": 200, **({"cursor": cursor} if cursor else {})}).json()
        items += page["items"]
        if (cursor := page["next_cursor"]) is None:
            return items


def test_the_table_covers_every_route_of_the_app() -> None:
    doc = create_app().openapi()  # the app's own description (no store is opened for this)
    in_app = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    in_table = {(r.method, r.path) for r in ROUTES}
    assert not in_app - in_table, f"routes without a role decision: {sorted(in_app - in_table)}"
    assert not in_table - in_app, f"rows for routes the app does not have: {sorted(in_table - in_app)}"


def test_every_route_admits_exactly_the_roles_it_should(service: Service) -> None:
    store = service.store
    clients = {who: service.client(token=secret) for who, secret in secrets_of(service).items()}
    shared = build_world(store)  # read-only rows, and every refused request
    wrong: list[str] = []
    for route in ROUTES:
        for caller in CALLERS:
            want = expected(route, caller)
            fresh = route.mutates and want[1] is None
            try:
                world = build_world(store, paused=route.paused, approval=route.approval) if fresh else shared
            except Exception as exc:  # the library could not even set the stage
                wrong.append(f"{route.label:75} {caller:9} world setup failed: {type(exc).__name__}: {exc}"[:400])
                continue
            r = route.send(clients[caller], world)
            if outcome(r) != want:
                wrong.append(f"{route.label:75} {caller:9} expected {want}, got {r.status_code} {r.text[:200]}")
    assert not wrong, "\n" + "\n".join(wrong)
    # nothing refused changed the shared world
    assert store.get_turn(shared.turn_id, tool_calls=False).status == "running"
    project = store.get_project(shared.project_id)
    assert project.current_version_id == shared.v2 and project.active_draft_id is not None
    assert [t.status for t in store.get_turn(shared.turn_id).tool_calls] == ["started"]
    assert not revoked(store, shared.token_id)


def test_a_project_scoped_token_never_reaches_another_project(service: Service) -> None:
    store = service.store
    a, b = build_world(store), build_world(store)
    scoped = {role: service.client(token=service.token(role, a.project_id))
              for role in ("admin", "agent", "observer", "approver")}
    scoped_rows = [r for r in ROUTES if "{project_id}" in r.path or "{turn_id}" in r.path]
    wrong: list[str] = []
    # on project B: not found, exactly as if it did not exist, whatever the role may do
    for route in scoped_rows:
        for role, c in scoped.items():
            r = route.send(c, b)
            missing = (404, "turn.not_found" if route.path.startswith("/v1/turns/") else "project.not_found")
            want = {missing}
            if outcome(r) not in want:
                wrong.append(f"B {route.label:75} {role:9} expected {want}, got {r.status_code} {r.text[:200]}")
    # on its own project: everything the role allows (a fresh project A, and a token, where the route writes)
    for route in scoped_rows:
        try:
            world = build_world(store, paused=route.paused, approval=route.approval) if route.mutates else a
        except Exception as exc:
            wrong.append(f"A {route.label:75} world setup failed: {type(exc).__name__}: {exc}"[:400])
            continue
        c = scoped["admin"] if world is a else service.client(token=service.token("admin", world.project_id))
        r = route.send(c, world)
        # a fork makes a new project, out of a scoped token's reach: only an admin of every project may
        ok = 403 if route.path.endswith("/fork") else route.ok
        if r.status_code != ok:
            wrong.append(f"A {route.label:75} admin     expected {ok}, got {r.status_code} {r.text[:200]}")
    assert not wrong, "\n" + "\n".join(wrong)
    # B's ids through A's own routes
    c = scoped["admin"]
    for method, url, body, code in [
        ("GET", f"/v1/projects/{a.project_id}/versions/{b.v1}", None, "version.not_found"),
        ("GET", f"/v1/projects/{a.project_id}/view?at=version:{b.v2}", None, "version.not_found"),
        ("GET", f"/v1/projects/{a.project_id}/view?at={b.v2}", None, "version.not_found"),
        ("GET", f"/v1/projects/{a.project_id}/view?at=turn:{b.turn_id}:start", None, "turn.not_found"),
        ("GET", f"/v1/projects/{a.project_id}/diff?a=version:{a.v1}&b=version:{b.v2}", None, "version.not_found"),
        ("GET", f"/v1/projects/{a.project_id}/diff?a=turn:{b.turn_id}:start&b=head", None, "turn.not_found"),
        ("POST", f"/v1/projects/{a.project_id}/rollback", {"version_id": b.v1}, "version.not_found"),
        ("POST", f"/v1/projects/{a.project_id}/draft/revert", {"to_turn_id": b.turn_id}, "turn.not_found"),
        ("GET", f"/v1/projects/{a.project_id}/sandbox-sessions/{b.session_id}", None, "sandbox.not_found"),
        ("POST", f"/v1/projects/{a.project_id}/sandbox-sessions/{b.session_id}/heartbeat", None, "sandbox.not_found"),
        ("POST", f"/v1/projects/{a.project_id}/sandbox-sessions/{b.session_id}/close", None, "sandbox.not_found"),
        ("POST", f"/v1/projects/{a.project_id}/sandbox-sessions",
         {"provider": "e2b", "external_id": "x", "turn_id": b.turn_id}, "turn.not_found"),
        ("GET", f"/v1/projects/{a.project_id}/snapshots/best?state={b.v2}", None, "version.not_found"),
    ]:
        r = c.request(method, url, json=body)
        assert outcome(r) == (404, code), f"{method} {url}: {r.status_code} {r.text}"
    # forking A from B's version: not found even for an admin of every project (a scoped one may not fork at all)
    r = service.client().post(f"/v1/projects/{a.project_id}/fork", json={"name": "stolen", "version_id": b.v2})
    assert outcome(r) == (404, "version.not_found"), r.text
    # the list of projects holds A alone
    for role, client in scoped.items():
        page = client.get("/v1/projects").json()
        assert [p["id"] for p in page["items"]] == [a.project_id] and page["next_cursor"] is None, role
    assert store.get_project(b.project_id).current_version_id == b.v2  # B untouched
    assert store.get_turn(b.turn_id, tool_calls=False).status == "running"
    assert store.get_sandbox(b.session_id).status == "starting"


def test_a_token_is_shown_once_and_stored_hashed(service: Service) -> None:
    admin = service.client()
    made = admin.post("/v1/tokens", json={"role": "agent", "name": "ci runner"})
    assert made.status_code == 201, made.text
    body = made.json()
    secret = body["token"]
    assert secret.startswith(f"dst_{body['id']}_")
    assert {k: body[k] for k in ("role", "project_id", "name", "revoked_at")} == {
        "role": "agent", "project_id": None, "name": "ci runner", "revoked_at": None}
    assert service.client(token=secret).get("/v1/projects").status_code == 200

    # never again: not in the list, in no field, in no form
    listed, cursor = [], None
    while True:
        r = admin.get("/v1/tokens", params={"limit": 200, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200
        assert secret not in r.text and hashlib.sha256(secret.encode()).hexdigest() not in r.text
        listed += r.json()["items"]
        cursor = r.json()["next_cursor"]
        if cursor is None:
            break
    mine = [t for t in listed if t["id"] == body["id"]]
    assert mine == [{k: v for k, v in body.items() if k != "token"}]
    assert all(set(t) == {"id", "role", "project_id", "name", "created_at", "created_by", "revoked_at"}
               for t in listed)
    # what the database holds is the digest
    with service.store.engine.connect() as conn:
        row = conn.execute(sa.select(TOKENS).where(TOKENS.c.id == body["id"])).one()
    assert row.secret_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in [str(v) for v in row]


def test_a_revoked_token_is_refused_within_seconds(service: Service) -> None:
    admin = service.client()
    made = admin.post("/v1/tokens", json={"role": "agent", "name": "leaked"}).json()
    agent = service.client(token=made["token"])
    assert agent.get("/v1/projects").status_code == 200  # now in the service's auth cache

    assert admin.delete(f"/v1/tokens/{made['id']}").status_code == 204
    revoked_at = time.monotonic()
    deadline = revoked_at + AUTH_CACHE_S + 5
    while (r := agent.get("/v1/projects")).status_code == 200:
        assert time.monotonic() < deadline, "a revoked token still works"
        time.sleep(0.1)
    assert time.monotonic() - revoked_at <= AUTH_CACHE_S + 1.5
    assert outcome(r) == (401, "auth.invalid") and r.headers["www-authenticate"] == "Bearer"
    assert admin.delete(f"/v1/tokens/{made['id']}").status_code == 204  # idempotent
    assert revoked(service.store, made["id"])
    assert outcome(admin.delete(f"/v1/tokens/{'f' * 32}")) == (404, "token.not_found")


def test_only_an_admin_of_every_project_manages_tokens(service: Service) -> None:
    p = service.store.create_project("tokens", files={"a.txt": "a"})
    spare, _ = service.store.tokens.create("observer", project_id=p.id)
    project_admin = service.client(token=service.token("admin", p.id))
    assert project_admin.get(f"/v1/projects/{p.id}").status_code == 200  # an admin, of this project
    for r in (project_admin.post("/v1/tokens", json={"role": "admin"}),
              project_admin.post("/v1/tokens", json={"role": "agent", "project_id": p.id}),
              project_admin.get("/v1/tokens"),
              project_admin.delete(f"/v1/tokens/{spare.id}")):
        assert outcome(r) == (403, "auth.forbidden"), r.text
    assert not revoked(service.store, spare.id)

    admin = service.client()
    scoped = admin.post("/v1/tokens", json={"role": "agent", "project_id": p.id})
    assert scoped.status_code == 201 and scoped.json()["project_id"] == p.id
    assert outcome(admin.post("/v1/tokens", json={"role": "agent", "project_id": "f" * 32})) == (
        404, "project.not_found")
    assert outcome(admin.post("/v1/tokens", json={"role": "superuser"})) == (422, "input.invalid")


def test_an_observer_never_learns_of_a_draft(service: Service) -> None:
    world = build_world(service.store)
    observer = service.client(token=service.token("observer"))
    admin = service.client()
    pid = world.project_id
    assert admin.get(f"/v1/projects/{pid}").json()["active_draft_id"] is not None
    assert admin.get(f"/v1/projects/{pid}").json()["draft"]["id"] is not None
    seen = observer.get(f"/v1/projects/{pid}").json()
    assert seen["active_draft_id"] is None and seen["current_version_id"] == world.v2
    assert seen["draft"] is None and seen["head"]["id"] == world.v2
    assert [p["active_draft_id"] for p in every_project(observer) if p["id"] == pid] == [None]
    # what it may read: published versions, their files and diffs
    assert observer.get(f"/v1/projects/{pid}/view/files/src/util.py", params={"at": "head"}).content == b"X = 2\n"
    assert observer.get(f"/v1/projects/{pid}/view/files/src/util.py",
                        params={"at": f"version:{world.v1}"}).content == b"X = 1\n"
    diff = observer.get(f"/v1/projects/{pid}/diff", params={"a": world.v1, "b": world.v2}).json()
    assert [f["path"] for f in diff["files"]] == ["src/util.py"]
    for r in (observer.get(f"/v1/projects/{pid}/view"), observer.get(f"/v1/projects/{pid}/draft"),
              observer.get(f"/v1/projects/{pid}/turns"), observer.get(f"/v1/turns/{world.turn_id}"),
              observer.get(f"/v1/projects/{pid}/diff", params={"a": "head", "b": "draft"})):
        assert outcome(r) == (403, "auth.forbidden"), r.text


def test_whoami_in_open_mode_is_an_admin_of_every_project_without_a_token(service_factory: Any) -> None:
    svc = service_factory(with_admin=False)  # no token exists: open loopback mode
    r = svc.client(token=None).get("/v1/whoami")
    assert r.status_code == 200, r.text
    assert r.json() == {"role": "admin", "project_id": None, "token_id": None, "open_mode": True}
    # a page on another site reaching the loopback service (DNS rebinding) is refused,
    # on every route, reads and writes alike; nothing is created
    port = svc.url.rsplit(":", 1)[1]
    client = svc.client(token=None)
    for headers in ({"host": f"rebound.example:{port}"}, {"origin": "http://rebound.example"},
                    {"origin": "null"}, {"host": f"localhost:{port}", "origin": f"http://rebound.example:{port}"}):
        for r in (client.get("/v1/projects", headers=headers),
                  client.post("/v1/projects", json={"name": "rebound"}, headers=headers)):
            assert (r.status_code, r.json()["code"]) == (403, "auth.forbidden"), (headers, r.text)
            assert "loopback" in r.json()["message"]
    assert [p.name for p in svc.store.list_projects()] == []
    for headers in ({}, {"host": f"localhost:{port}"}, {"host": f"[::1]:{port}"},
                    {"origin": f"http://127.0.0.1:{port}"}):
        assert client.get("/v1/projects", headers=headers).status_code == 200, headers


def test_whoami_names_the_role_the_scope_and_the_token(service: Service) -> None:
    p = service.store.create_project("whoami")
    for role in ("admin", "agent", "observer", "approver"):
        for project_id in (None, p.id):
            secret = service.token(role, project_id)
            r = service.client(token=secret).get("/v1/whoami")
            assert r.status_code == 200, r.text
            assert r.json() == {"role": role, "project_id": project_id, "token_id": secret.split("_")[1],
                                "open_mode": False}


def test_a_malformed_unknown_or_tampered_token_is_401(service: Service) -> None:
    secret = service.token("admin")
    tampered = secret[:-1] + ("A" if secret[-1] != "A" else "B")  # a real token's id, a wrong secret
    for header in ("Basic YWRtaW46YWRtaW4=", "Bearer", "Bearer dst_", "Token abc", "bearer not-a-token",
                   f"Bearer {UNKNOWN_TOKEN}", f"Bearer {tampered}", f"Bearer {secret}x"):
        r = httpx.get(f"{service.url}/v1/projects", headers={"authorization": header}, timeout=30)
        assert outcome(r) == (401, "auth.invalid"), f"{header!r}: {r.text}"
        assert r.headers["www-authenticate"] == "Bearer" and set(r.json()) == {"code", "message", "details", "retryable"}
    assert service.client(token=secret).get("/v1/projects").status_code == 200


def test_a_project_scoped_admin_cannot_create_or_fork_projects(service: Service) -> None:
    world = build_world(service.store)
    scoped = service.client(token=service.token("admin", world.project_id))
    names = [f"out of reach {world.project_id}", f"copy {world.project_id}"]
    r = scoped.post("/v1/projects", json={"name": names[0]})
    assert (r.status_code, r.json()["code"]) == (403, "auth.forbidden")
    r = scoped.post(f"/v1/projects/{world.project_id}/fork", json={"name": names[1]})
    assert (r.status_code, r.json()["code"]) == (403, "auth.forbidden")
    assert not [p for p in service.store.list_projects() if p.name in names]


def test_a_request_that_names_no_actor_is_recorded_as_its_token(service: Service) -> None:
    # the audit trail says who: the token's name (else token:<id>), unless the body names an actor
    _, named = service.store.tokens.create("admin", name="ops-console")
    agent_secret = service.token("agent")  # no name
    admin, agent = service.client(token=named), service.client(token=agent_secret)
    r = admin.post("/v1/projects", json={"name": "audited", "files": {"a.py": "eA=="}})
    assert r.status_code == 201, r.text
    pid = r.json()["id"]
    v1 = service.store.list_versions(pid)[0]
    assert v1.created_by == "ops-console"
    r = agent.post(f"/v1/projects/{pid}/turns", json={"user_message": "go"})
    assert r.status_code == 201, r.text
    turn_id = r.json()["id"]
    assert r.json()["actor"] == f"token:{agent_secret.split('_')[1]}"
    seq = agent.post(f"/v1/turns/{turn_id}/tool-calls",
                     json={"tool_name": "delete_file", "args": {}, "needs_approval": True}).json()["seq"]
    r = admin.post(f"/v1/turns/{turn_id}/tool-calls/{seq}/approval", json={"approved": False, "reason": "no"})
    assert r.status_code == 200, r.text
    assert r.json()["approval"]["by"] == "ops-console"
    assert agent.post(f"/v1/turns/{turn_id}/complete", json={"assistant_message": "ok"}).status_code == 200
    r = admin.post(f"/v1/projects/{pid}/publish", json={"summary": "v2"})
    assert r.status_code == 201 and r.json()["created_by"] == "ops-console", r.text
    r = admin.post(f"/v1/projects/{pid}/rollback", json={"version_id": v1.id, "actor": "alice"})
    assert r.status_code == 200, r.text
    moves = service.store.head_moves(pid)
    assert [m.actor for m in moves] == ["ops-console", "ops-console", "alice"]  # create, publish, rollback
    agent.post(f"/v1/projects/{pid}/turns", json={"user_message": "again"})
    r = admin.post(f"/v1/projects/{pid}/discard")
    assert r.status_code == 200 and r.json()["closed_by"] == "ops-console", r.text
    r = admin.post(f"/v1/projects/{pid}/fork", json={"name": "audited copy"})
    assert r.status_code == 201, r.text
    assert service.store.list_versions(r.json()["id"])[0].created_by == "ops-console"


def test_an_agent_never_decides_a_tool_call_and_an_approver_decides_without_touching_the_draft(
        service: Service) -> None:
    """An approval is a person's decision: the agent that asked cannot approve its own call; the
    backend relaying a person's click holds an approver token (here scoped to the project): it
    reads the turn, its pending calls and its events, decides, and can write nothing."""
    world = build_world(service.store, approval=True)
    t, pid = world.turn_id, world.project_id
    agent = service.client(token=service.token("agent", pid))
    approver = service.client(token=service.token("approver", pid))
    r = agent.post(f"/v1/turns/{t}/tool-calls/2/approval", json={"approved": True, "reason": "I say so"})
    assert outcome(r) == (403, "auth.forbidden"), r.text
    assert service.store.get_turn(t).tool_calls[1].status == "awaiting_approval"  # the refusal changed nothing

    # what the approver reads to decide
    assert [x["id"] for x in approver.get(f"/v1/projects/{pid}/turns").json()["items"]][-1] == t
    pending = [c for c in approver.get(f"/v1/turns/{t}/tool-calls").json()["items"]
               if c["status"] == "awaiting_approval"]
    assert [(c["seq"], c["tool_name"]) for c in pending] == [(2, "rm")]
    events = approver.get(f"/v1/turns/{t}/events", headers=EVENTS_PAGE).json()["events"]
    assert ("tool.awaiting_approval", 2) in [(e["type"], e["data"].get("seq")) for e in events]
    assert approver.get(f"/v1/projects/{pid}").json()["draft"] is None  # the draft is not its to read
    r = approver.post(f"/v1/turns/{t}/tool-calls/2/approval", json={"approved": True, "reason": "asked Alice"})
    assert r.status_code == 200 and r.json()["status"] == "started", r.text
    assert r.json()["approval"]["approved"] is True

    # and nothing that writes the draft or runs the turn
    before = service.store.get_draft(pid).revision
    for r in (approver.put(f"/v1/turns/{t}/files/evil.py", content=b"x"),
              approver.post(f"/v1/turns/{t}/tool-calls", json={"tool_name": "rm", "args": {}}),
              approver.post(f"/v1/turns/{t}/tool-calls/2/complete", json={"result": 1}),
              approver.post(f"/v1/turns/{t}/cancel"),
              approver.patch(f"/v1/turns/{t}/characters", json={"patch": {"evil": 1}}),
              approver.post(f"/v1/projects/{pid}/turns", json={"user_message": "mine now"}),
              approver.get(f"/v1/projects/{pid}/view"),
              approver.post(f"/v1/projects/{pid}/discard")):
        assert outcome(r) == (403, "auth.forbidden"), r.text
    assert service.store.get_draft(pid).revision == before
    assert service.store.get_turn(t, tool_calls=False).status == "running"
