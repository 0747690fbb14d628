"""The MCP server, driven by the MCP SDK's own client.

- over stdio: ``python -m draftstore.cli mcp --project P [--turn T]`` spawned on an
  embedded store (``DRAFTSTORE_HOME``): every tool, its writes in the draft, every
  call in the turn's history, truncation markers, typed errors that change nothing,
  and the running turn chosen at the time of each call when no turn is named;
- over HTTP: the service (both stacks) at ``/mcp/projects/{P}[/turns/{T}]`` with a
  bearer token; observers, other projects' tokens and other projects' turns refused;
  in open mode, only loopback Host and Origin;
- in process (``build_server`` over an embedded store): a cancelled or disconnected call
  is recorded as it ended, never left ``started``; errors and results too big for the
  history still close the call; bounded errors, searches and lines; unexpected
  exceptions are ``internal`` tool errors.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from mcp import ClientSession, MCPError, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

from draftstore import Settings, Store
from draftstore.mcpserver import TOOL_NAMES, AgentTools
from draftstore.mcpserver.server import build_server
from draftstore.settings import Limits
from service_fixtures import Service

BIG = "".join(f"line {i}\n" for i in range(1, 1501))  # over view_file's 1000-line bound
FILES = {"main.py": "print(1)\n", "src/util.py": "X = 1\n", "big.txt": BIG,
         "docs/notes.md": "TODO one\nTODO two\nTODO three\n"}


# -- clients -----------------------------------------------------------------------------
@asynccontextmanager
async def stdio_session(home: Path, *args: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=sys.executable, args=["-m", "draftstore.cli", "mcp", *args],
                                   env={"DRAFTSTORE_HOME": str(home)}, cwd=str(home))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


@asynccontextmanager
async def http_session(url: str, token: str) -> AsyncIterator[ClientSession]:
    async with httpx2.AsyncClient(headers={"authorization": f"Bearer {token}"}, timeout=60) as client, \
            streamable_http_client(url, http_client=client) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        yield session


def ok(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content
    return result.structured_content


def code(result: Any) -> str:
    assert result.is_error, result.structured_content
    error = result.structured_content["error"]
    assert result.content[0].text.startswith(f"[{error['code']}] ")
    return error["code"]


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in leaves(e)]
    return [exc]


def calls_of(store: Store, turn_id: str) -> list[tuple[str, str, str | None]]:
    """(tool, status, error code) of each recorded call, in order."""
    return [(c.tool_name, c.status, (c.error or {}).get("code")) for c in store.get_turn(turn_id).tool_calls]


async def every_tool(s: ClientSession) -> list[tuple[str, str, str | None]]:
    """Call each tool once (and a few refusals); check each answer; return the calls expected
    in the history."""
    assert {t.name for t in (await s.list_tools()).tools} == TOOL_NAMES
    # the agent's tools: none decides a tool call (an approval is a person's, through an approver or admin token)
    assert not [n for n in TOOL_NAMES if any(w in n for w in ("approv", "decide", "deny"))]

    view = ok(await s.call_tool("view_file", {"path": "main.py"}))
    assert view["content"] == "print(1)\n" and view["truncated"] is False and view["total_lines"] == 1
    big = ok(await s.call_tool("view_file", {"path": "big.txt"}))
    assert big["truncated"] is True and big["end_line"] == 1000 and big["next_start_line"] == 1001
    assert big["content"].startswith("line 1\n") and big["content"].endswith("line 1000\n")
    rest = ok(await s.call_tool("view_file", {"path": "big.txt", "start_line": 1001}))
    assert rest["truncated"] is False and rest["end_line"] == 1500 and rest["next_start_line"] is None
    some = ok(await s.call_tool("view_file", {"path": "big.txt", "start_line": 10, "end_line": 11}))
    assert some["content"] == "line 10\nline 11\n" and some["truncated"] is False
    listing = ok(await s.call_tool("list_dir", {}))
    assert [(e["name"], e["kind"]) for e in listing["entries"]] == [
        ("big.txt", "file"), ("docs", "dir"), ("main.py", "file"), ("src", "dir")]
    found = ok(await s.call_tool("find_files", {"glob": "**/*.py", "max_results": 1}))
    assert found["paths"] == ["main.py"] and found["truncated"] is True
    hits = ok(await s.call_tool("search_code", {"pattern": "TODO", "max_results": 2, "context": 1}))
    assert [(m["path"], m["line_number"]) for m in hits["matches"]] == [("docs/notes.md", 1), ("docs/notes.md", 2)]
    assert hits["truncated"] is True and hits["matches"][1]["before"] == ["TODO one"]

    ok(await s.call_tool("write_file", {"path": "src/new.py", "content": "Y = 2\n"}))
    ok(await s.call_tool("write_file", {"path": "run.sh", "content": base64.b64encode(b"#!/bin/sh\n").decode(),
                                        "encoding": "base64", "executable": True}))
    batch = ok(await s.call_tool("apply_changes", {"changes": {"a.py": "A = 1\n", "main.py": None}}))
    assert batch == {"written": 1, "deleted": 1}
    ok(await s.call_tool("move_file", {"src": "src/new.py", "dst": "src/moved.py"}))
    ok(await s.call_tool("delete_file", {"path": "src/util.py"}))
    chars = ok(await s.call_tool("patch_characters", {"patch": [{"op": "add", "path": "/dragon", "value": {"hp": 99}}]}))
    assert chars["characters"] == {"hero": {"hp": 10}, "dragon": {"hp": 99}}
    world = ok(await s.call_tool("patch_world_settings", {"patch": {"era": "iron"}}))
    assert world["world_settings"] == {"era": "iron"}

    # refusals: each a typed error, each changing nothing
    assert code(await s.call_tool("view_file", {"path": "nope.py"})) == "path.not_found"
    assert code(await s.call_tool("write_file", {"path": "../escape.py", "content": "x"})) == "path.denied"
    assert code(await s.call_tool("apply_changes", {"changes": {"fine.py": "x", "/abs.py": "y"}})) == "path.denied"
    assert code(await s.call_tool("patch_characters", {"patch": [{"op": "remove", "path": "/nobody"}]})) \
        == "patch.invalid"
    assert code(await s.call_tool("search_code", {"pattern": "(?<=x)y", "regex": True})) == "pattern.invalid"
    assert code(await s.call_tool("view_file", {"path": 3})) == "input.invalid"  # the SDK's argument check
    assert code(await s.call_tool("find_files", {"max_results": 100_000})) == "input.invalid"
    assert code(await s.call_tool("write_file", {"path": "b.bin", "content": "not base64!",
                                                 "encoding": "base64"})) == "input.invalid"
    unknown = await s.call_tool("rm_rf", {})
    assert code(unknown) == "input.invalid"  # not a tool: not recorded
    return ([("view_file", "completed", None)] * 4 + [
        ("list_dir", "completed", None), ("find_files", "completed", None), ("search_code", "completed", None),
        ("write_file", "completed", None), ("write_file", "completed", None), ("apply_changes", "completed", None),
        ("move_file", "completed", None), ("delete_file", "completed", None),
        ("patch_characters", "completed", None), ("patch_world_settings", "completed", None),
        ("view_file", "failed", "path.not_found"), ("write_file", "failed", "path.denied"),
        ("apply_changes", "failed", "path.denied"), ("patch_characters", "failed", "patch.invalid"),
        ("search_code", "failed", "pattern.invalid"), ("view_file", "failed", "input.invalid"),
        ("find_files", "failed", "input.invalid"), ("write_file", "failed", "input.invalid"),
    ])


def check_draft(store: Store, project_id: str) -> None:
    view = store.view(project_id)
    assert view.kind == "draft"
    assert view.list_files() == ["a.py", "big.txt", "docs/notes.md", "run.sh", "src/moved.py"]
    assert view.read_file("src/moved.py") == b"Y = 2\n" and view.stat("run.sh").executable
    assert view.characters == {"hero": {"hp": 10}, "dragon": {"hp": 99}}
    assert view.world_settings == {"era": "iron"}


def new_project(store: Store, name: str = "game") -> str:
    return store.create_project(name, files=FILES, characters={"hero": {"hp": 10}},
                                world_settings={"era": "bronze"}).id


# -- stdio -------------------------------------------------------------------------------
@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "store"
    home.mkdir()
    return home


def test_stdio_every_tool_writes_the_draft_and_lands_in_the_turns_history(home: Path) -> None:
    with Store.open(settings=Settings(home=home)) as store:
        project_id = new_project(store)
        turn_id = store.start_turn(project_id, "add a dragon").id

    async def run() -> list[tuple[str, str, str | None]]:
        async with stdio_session(home, "--project", project_id, "--turn", turn_id) as s:
            return await every_tool(s)

    expected = anyio.run(run)
    with Store.open(settings=Settings(home=home)) as store:
        check_draft(store, project_id)
        assert calls_of(store, turn_id) == expected
        first = store.get_turn(turn_id).tool_calls[0]
        assert first.args == {"path": "main.py"} and first.result["content"] == "print(1)\n"


def test_stdio_without_a_turn_follows_the_running_turn_at_each_call(home: Path) -> None:
    with Store.open(settings=Settings(home=home)) as store:
        project_id = new_project(store)

        async def run() -> None:
            async with stdio_session(home, "--project", project_id) as s:
                # no turn: reads are served (unrecorded), writes refused with a stable code
                assert ok(await s.call_tool("view_file", {"path": "main.py"}))["state"] == "version"
                assert code(await s.call_tool("write_file", {"path": "x.py", "content": "x"})) == "turn.not_running"
                first = store.start_turn(project_id, "go")
                ok(await s.call_tool("write_file", {"path": "x.py", "content": "x"}))
                assert ok(await s.call_tool("view_file", {"path": "x.py"}))["content"] == "x"
                store.complete_turn(first.id, "done")
                assert code(await s.call_tool("delete_file", {"path": "x.py"})) == "turn.not_running"
                ok(await s.call_tool("find_files", {}))
                second = store.continue_turn(project_id, "more")
                ok(await s.call_tool("delete_file", {"path": "x.py"}))
                assert calls_of(store, first.id) == [("write_file", "completed", None), ("view_file", "completed", None)]
                assert calls_of(store, second.id) == [("delete_file", "completed", None)]

        anyio.run(run)
        assert "x.py" not in store.view(project_id).list_files()


def test_stdio_refuses_an_unknown_project_or_a_turn_of_another_project(home: Path) -> None:
    import subprocess

    with Store.open(settings=Settings(home=home)) as store:
        a, b = new_project(store, "a"), new_project(store, "b")
        turn_b = store.start_turn(b, "go").id
    env = {"DRAFTSTORE_HOME": str(home), "PATH": "/usr/bin:/bin"}
    for args in (["--project", "0" * 32], ["--project", a, "--turn", turn_b]):
        run = subprocess.run([sys.executable, "-m", "draftstore.mcpserver", *args], capture_output=True,
                             text=True, env=env, cwd=home, timeout=60, stdin=subprocess.DEVNULL)
        assert run.returncode == 2 and run.stdout == ""
        assert "not_found]" in run.stderr


# -- HTTP --------------------------------------------------------------------------------
@pytest.fixture
def service(shared_service_per_test: Service) -> Service:
    """One service per flavour for this module's tests (``shared_service``): each test makes its
    own projects and tokens and looks only at those."""
    return shared_service_per_test


def test_http_every_tool_through_the_service_with_an_agent_token(service: Service) -> None:
    store = service.store
    project_id = new_project(store)
    turn_id = store.start_turn(project_id, "add a dragon").id
    agent = service.token("agent", project_id=project_id)
    base = f"{service.url}/mcp/projects/{project_id}"

    async def run() -> list[tuple[str, str, str | None]]:
        async with http_session(f"{base}/turns/{turn_id}", agent) as s:
            expected = await every_tool(s)
        async with http_session(base, service.admin or "") as s:  # no turn named: the running one
            ok(await s.call_tool("list_dir", {"path": "src"}))
        return expected + [("list_dir", "completed", None)]

    expected = anyio.run(run)
    check_draft(store, project_id)
    assert calls_of(store, turn_id) == expected


def test_http_refuses_observers_other_projects_and_their_turns(service: Service) -> None:
    store = service.store
    mine, other = new_project(store, "mine"), new_project(store, "other")
    turn_id = store.start_turn(mine, "go").id
    other_turn = store.start_turn(other, "go").id
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                  "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                             "clientInfo": {"name": "tests", "version": "1"}}}
    headers = {"accept": "application/json, text/event-stream"}
    url = f"/mcp/projects/{mine}"
    cases = [
        (service.token("observer"), url, 403, "auth.forbidden"),
        (service.token("observer", project_id=mine), url, 403, "auth.forbidden"),
        (service.token("approver", project_id=mine), url, 403, "auth.forbidden"),  # decides calls, never makes one
        (service.token("observer", project_id=other), url, 404, "project.not_found"),  # 404 before 403
        (service.token("agent", project_id=other), url, 404, "project.not_found"),
        (service.token("agent", project_id=other), f"{url}/turns/{turn_id}", 404, "project.not_found"),
        (service.admin, f"{url}/turns/{other_turn}", 404, "turn.not_found"),
        (service.admin, f"/mcp/projects/{'0' * 32}", 404, "project.not_found"),
        (service.admin, "/mcp/somewhere", 404, "route.not_found"),
        (None, url, 401, "auth.required"),
        ("dst_not_a_token", url, 401, "auth.invalid"),
    ]
    for secret, path, status, want in cases:
        r = service.client(token=secret).post(path, json=initialize, headers=headers)
        assert (r.status_code, r.json()["code"]) == (status, want), (path, r.text)
    allowed = service.client(token=service.token("agent", project_id=mine)).post(url, json=initialize,
                                                                                   headers=headers)
    assert allowed.status_code == 200 and allowed.json()["result"]["serverInfo"]["name"] == "draftstore"

    async def observer_with_the_sdk() -> None:
        async with http_session(f"{service.url}{url}/turns/{turn_id}", service.token("observer")) as s:
            await s.call_tool("write_file", {"path": "x.py", "content": "x"})

    with pytest.raises(BaseException) as refused:  # the SDK client cannot even initialize
        anyio.run(observer_with_the_sdk)
    assert any(isinstance(e, MCPError) for e in leaves(refused.value)), refused.value
    assert store.get_turn(turn_id).tool_calls == () and "x.py" not in store.view(mine).list_files()
    assert httpx.get(f"{service.url}/openapi.json").json()["paths"].keys() >= {"/v1/projects"}


def test_the_mcp_endpoint_answers_errors_without_loading_the_http_service() -> None:
    # one error table below both front doors: the MCP endpoint reaches it without
    # pulling in the HTTP service (FastAPI routes, auth, admin pages) it sits beside
    import subprocess

    probe = ("import sys, draftstore.mcpserver, draftstore.mcpserver.http, draftstore.mcpserver.server\n"
             "print(sorted(m for m in sys.modules if m.startswith('draftstore.service')))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


def test_a_refused_request_reads_the_same_through_the_mcp_endpoint_and_the_http_api(service: Service) -> None:
    project_id = new_project(service.store)
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                  "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                             "clientInfo": {"name": "tests", "version": "1"}}}
    for secret in (None, "dst_not_a_token"):
        client = service.client(token=secret)
        mcp = client.post(f"/mcp/projects/{project_id}", json=initialize,
                          headers={"accept": "application/json, text/event-stream"})
        api = client.get(f"/v1/projects/{project_id}")
        assert mcp.status_code == api.status_code == 401
        assert mcp.json() == api.json(), (mcp.text, api.text)
        assert mcp.headers["www-authenticate"] == api.headers["www-authenticate"] == "Bearer"


def test_http_open_mode_serves_loopback_hosts_and_origins_only(service_factory: Any) -> None:
    svc = service_factory(with_admin=False)  # no token exists: open loopback mode, every client an admin
    project_id = new_project(svc.store)
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                  "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                             "clientInfo": {"name": "tests", "version": "1"}}}
    accept = {"accept": "application/json, text/event-stream"}
    port = svc.url.rsplit(":", 1)[1]
    client = svc.client(token=None)
    url = f"/mcp/projects/{project_id}"
    for headers in ({"host": f"rebound.example:{port}"}, {"host": "rebound.example"},
                    {"origin": "http://rebound.example"}, {"origin": "null"},
                    {"host": f"localhost:{port}", "origin": f"http://rebound.example:{port}"}):
        r = client.post(url, json=initialize, headers={**accept, **headers})
        assert (r.status_code, r.json()["code"]) == (403, "auth.forbidden"), (headers, r.text)
        assert "loopback" in r.json()["message"]
    for headers in ({}, {"host": f"localhost:{port}"}, {"host": "localhost"}, {"host": f"[::1]:{port}"},
                    {"origin": f"http://localhost:{port}"}, {"origin": "http://127.0.0.1:5173"}):
        r = client.post(url, json=initialize, headers={**accept, **headers})
        assert r.status_code == 200 and r.json()["result"]["serverInfo"]["name"] == "draftstore", (headers, r.text)


# -- in process ----------------------------------------------------------------------------
class InProcess:
    """``build_server`` over an embedded store, a project and a running turn."""

    def __init__(self, home: Path, limits: Limits | None = None) -> None:
        self.store = Store.open(settings=Settings(home=home, **({"limits": limits} if limits else {})))
        self.project_id = new_project(self.store)
        self.turn_id = self.store.start_turn(self.project_id, "go").id
        self.agent = AgentTools(self.store, self.project_id, self.turn_id)
        self.server = build_server(lambda _context: self.agent)

    def call(self, name: str, args: dict[str, Any]) -> Any:
        return anyio.run(self.server.call_tool, name, args)

    def calls(self) -> list[tuple[str, str, str | None]]:
        return calls_of(self.store, self.turn_id)

    def stall(self, method: str, seconds: float = 0.3) -> threading.Event:
        """Make ``store.<method>`` stall; the event is set when a call enters it."""
        entered = threading.Event()
        original = getattr(self.store, method)

        def stalled(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            time.sleep(seconds)
            return original(*args, **kwargs)

        setattr(self.store, method, stalled)
        return entered

    def cancel_inside(self, entered: threading.Event, name: str, args: dict[str, Any]) -> None:
        """Call a tool and cancel the call once ``entered`` is set."""

        async def run() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.server.call_tool, name, args)
                assert await anyio.to_thread.run_sync(entered.wait, 10)
                tg.cancel_scope.cancel()

        anyio.run(run)


@pytest.fixture
def inproc(home: Path) -> Iterator[InProcess]:
    world = InProcess(home)
    yield world
    world.store.close()


def test_a_call_cancelled_while_it_writes_is_recorded_completed_as_the_draft_says(inproc: InProcess) -> None:
    inproc.cancel_inside(inproc.stall("write_file"), "write_file", {"path": "b.py", "content": "hi"})
    assert inproc.store.view(inproc.project_id).read_file("b.py") == b"hi"
    assert inproc.calls() == [("write_file", "completed", None)]
    inproc.store.complete_turn(inproc.turn_id, "done")
    assert inproc.calls() == [("write_file", "completed", None)]  # closed for good


def test_a_call_cancelled_before_its_body_ran_is_recorded_failed_cancelled(inproc: InProcess) -> None:
    inproc.cancel_inside(inproc.stall("tool_started"), "write_file", {"path": "b.py", "content": "hi"})
    assert "b.py" not in inproc.store.view(inproc.project_id).list_files()
    assert inproc.calls() == [("write_file", "failed", "cancelled")]


def test_a_call_cancelled_while_it_fails_is_recorded_with_its_error(inproc: InProcess) -> None:
    inproc.cancel_inside(inproc.stall("view"), "view_file", {"path": "nope.py"})
    assert inproc.calls() == [("view_file", "failed", "path.not_found")]


SLOW_SERVER = """
import sys, time
from draftstore.store import Store
write = Store.write_file
def slow(self, *a, **k):
    time.sleep(1.0)
    return write(self, *a, **k)
Store.write_file = slow
from draftstore.mcpserver.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_stdio_a_client_that_times_out_or_disconnects_mid_call_leaves_the_call_recorded(home: Path) -> None:
    with Store.open(settings=Settings(home=home)) as store:
        project_id = new_project(store)
        turn_id = store.start_turn(project_id, "go").id
    params = StdioServerParameters(command=sys.executable,
                                   args=["-c", SLOW_SERVER, "--project", project_id, "--turn", turn_id],
                                   env={"DRAFTSTORE_HOME": str(home)}, cwd=str(home))

    async def run() -> None:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
            await s.initialize()
            with pytest.raises(MCPError):  # the client gives up: the server is told the call is cancelled
                await s.call_tool("write_file", {"path": "t.py", "content": "t"}, read_timeout_seconds=0.3)
            with anyio.move_on_after(0.3):  # then hangs up mid-call
                await s.call_tool("write_file", {"path": "d.py", "content": "d"})

    anyio.run(run)
    deadline = time.monotonic() + 20
    with Store.open(settings=Settings(home=home)) as store:
        while len(calls_of(store, turn_id)) < 2 or "started" in [c[1] for c in calls_of(store, turn_id)]:
            assert time.monotonic() < deadline, calls_of(store, turn_id)
            time.sleep(0.1)
        files = store.view(project_id).list_files()
        for path, (_, status, error) in zip(("t.py", "d.py"), calls_of(store, turn_id)):
            assert (status, error) in (("completed", None), ("failed", "cancelled")), calls_of(store, turn_id)
            assert (path in files) == (status == "completed"), (path, files, calls_of(store, turn_id))


def test_an_error_with_thousands_of_entries_comes_back_and_is_recorded_bounded(inproc: InProcess) -> None:
    result = inproc.call("apply_changes", {"changes": {f"p{i}.py": i for i in range(30_000)}})
    assert code(result) == "input.invalid"
    error = result.structured_content["error"]
    assert len(json.dumps(result.structured_content)) < 16 * 1024
    assert len(error["errors"]) == 20 and error["errors_total"] == 30_000
    assert inproc.calls() == [("apply_changes", "failed", "input.invalid")]
    assert inproc.store.get_turn(inproc.turn_id).tool_calls[0].error["errors_total"] == 30_000
    long = inproc.call("search_code", {"pattern": "(" * 50_000, "regex": True})
    assert code(long) == "pattern.invalid" and len(json.dumps(long.structured_content)) < 16 * 1024


def test_an_error_or_a_result_the_history_refuses_still_closes_the_call(home: Path) -> None:
    world = InProcess(home, Limits(max_message_bytes=600, max_payload_bytes=4096))
    try:
        # the error (20 entries of a few hundred bytes) is over the history's limit for an error
        refused = world.call("apply_changes", {"changes": {f"p{i}.py": i for i in range(100)}})
        assert code(refused) == "input.invalid" and refused.structured_content["error"]["errors_total"] == 100
        # the result (1500 lines, about 10 KiB) is over its limit for a result: the client still gets it
        big = ok(world.call("view_file", {"path": "big.txt"}))
        assert big["end_line"] == 1000
        assert world.calls() == [("apply_changes", "failed", "payload.too_large"),
                                 ("view_file", "failed", "payload.too_large")]
        errors = [c.error for c in world.store.get_turn(world.turn_id).tool_calls]
        assert "input.invalid" in errors[0]["message"] and "result" in errors[1]["message"]
    finally:
        world.store.close()


def test_arguments_the_history_refuses_fail_the_call_and_it_is_recorded_failed(home: Path) -> None:
    world = InProcess(home, Limits(max_payload_bytes=4096))
    try:
        before = world.store.view(world.project_id).list_files()
        refused = world.call("write_file", {"path": "huge.txt", "content": "x" * 10_000})  # args over 4 KiB
        assert code(refused) == "payload.too_large"
        assert world.store.view(world.project_id).list_files() == before  # it did not run
        not_json = world.call("view_file", {"path": "main.py", "pad": float("inf")})
        assert code(not_json) == "input.invalid"
        assert world.calls() == [("write_file", "failed", "payload.too_large"),
                                 ("view_file", "failed", "input.invalid")]
        recorded = world.store.get_turn(world.turn_id).tool_calls
        assert [c.args["arguments_not_recorded"]["code"] for c in recorded] == ["payload.too_large", "input.invalid"]
    finally:
        world.store.close()


def test_search_code_is_bounded_in_bytes(inproc: InProcess) -> None:
    line = "\U0001F600" * 501 + "\n"  # 2 KiB of UTF-8 in 501 characters
    ok(inproc.call("write_file", {"path": "e.txt", "content": line * 600}))
    found = ok(inproc.call("search_code", {"pattern": "\U0001F600", "context": 10, "max_results": 500}))
    size = len(json.dumps(found, ensure_ascii=False).encode("utf-8"))
    assert 48 * 1024 < size <= 72 * 1024, size
    assert found["truncated"] is True and found["lines_clipped"] is True and 1 <= len(found["matches"]) < 500
    for m in found["matches"]:
        for text in (m["line"], *m["before"], *m["after"]):
            assert len(text.encode("utf-8")) <= 500 + 3
    assert inproc.calls()[-1] == ("search_code", "completed", None)


def test_view_file_says_when_a_single_line_is_cut(inproc: InProcess) -> None:
    ok(inproc.call("write_file", {"path": "one.txt", "content": "é" * 100_000 + "\nend\n"}))
    cut = ok(inproc.call("view_file", {"path": "one.txt"}))
    assert cut["line_clipped"] is True and cut["truncated"] is True and cut["end_line"] == 1
    assert cut["next_start_line"] == 2 and len(cut["content"].encode("utf-8")) <= 64 * 1024
    assert ok(inproc.call("view_file", {"path": "one.txt", "start_line": 2}))["line_clipped"] is False
    assert ok(inproc.call("view_file", {"path": "main.py"}))["line_clipped"] is False


def test_unexpected_exceptions_are_internal_tool_errors_and_the_call_is_closed(inproc: InProcess) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    lost = build_server(boom)  # the agent lookup fails
    assert code(anyio.run(lost.call_tool, "view_file", {"path": "main.py"})) == "internal"

    original = inproc.store.tool_started
    inproc.store.tool_started = boom  # the start cannot be recorded: nothing is
    assert code(inproc.call("write_file", {"path": "x.py", "content": "x"})) == "internal"
    inproc.store.tool_started = original
    assert "x.py" not in inproc.store.view(inproc.project_id).list_files() and inproc.calls() == []

    view = inproc.store.view
    inproc.store.view = boom  # the body fails unexpectedly
    assert code(inproc.call("view_file", {"path": "main.py"})) == "internal"
    inproc.store.view = view

    completed = inproc.store.tool_completed
    inproc.store.tool_completed = boom  # the end cannot be recorded: the call is closed as failed
    assert ok(inproc.call("write_file", {"path": "y.py", "content": "y"}))["bytes"] == 1
    inproc.store.tool_completed = completed
    assert inproc.calls() == [("view_file", "failed", "internal"), ("write_file", "failed", "internal")]
    assert inproc.store.view(inproc.project_id).read_file("y.py") == b"y"


def test_arguments_of_the_wrong_type_or_unknown_are_refused_not_coerced_or_dropped(inproc: InProcess) -> None:
    # a lax client must not have "5" read as 5, true as 1, or a misspelt argument ignored
    for name, args in (("view_file", {"path": "main.py", "start_line": "2"}),
                       ("view_file", {"path": "main.py", "start_line": True}),
                       ("view_file", {"path": "main.py", "end_line": 2.0}),
                       ("search_code", {"pattern": "print", "regex": "yes"}),
                       ("search_code", {"pattern": "print", "max_results": True}),
                       ("find_files", {"glob": "**", "max_results": "10"}),
                       ("write_file", {"path": "x.sh", "content": "x", "executable": 1}),
                       ("view_file", {"path": "main.py", "start_lines": 2}),
                       ("move_file", {"src": "main.py", "dst": "m.py", "force": True})):
        assert code(inproc.call(name, args)) == "input.invalid", (name, args)
    assert [c[1:] for c in inproc.calls()] == [("failed", "input.invalid")] * 9  # each one recorded
    assert ok(inproc.call("view_file", {"path": "main.py", "start_line": 1}))["start_line"] == 1
    assert not inproc.store.view(inproc.project_id).exists("x.sh")


def test_move_file_does_not_replace_an_existing_file_unless_asked(inproc: InProcess) -> None:
    view = inproc.store.view
    ok(inproc.call("write_file", {"path": "a.py", "content": "A = 1\n"}))
    ok(inproc.call("write_file", {"path": "b.py", "content": "B = 2\n"}))
    assert code(inproc.call("move_file", {"src": "b.py", "dst": "a.py"})) == "path.conflict"
    assert view(inproc.project_id).read_file("a.py") == b"A = 1\n" and view(inproc.project_id).exists("b.py")
    ok(inproc.call("move_file", {"src": "b.py", "dst": "a.py", "overwrite": True}))
    assert view(inproc.project_id).read_file("a.py") == b"B = 2\n" and not view(inproc.project_id).exists("b.py")


# -- edges: the optional server stream, the wrong directory ------------------------------
def test_http_get_is_405_since_the_server_offers_no_stream_of_its_own(service: Service) -> None:
    project_id = new_project(service.store)
    agent = service.token("agent", project_id)
    with httpx.Client(base_url=service.url, headers={"authorization": f"Bearer {agent}"}, timeout=20) as c:
        for method in ("GET", "DELETE"):
            # streamed: an answer that is an endless event stream fails here instead of hanging the test
            with c.stream(method, f"/mcp/projects/{project_id}", headers={"accept": "text/event-stream"}) as r:
                assert r.status_code == 405 and r.headers["allow"] == "POST", method
                assert json.loads(r.read())["code"] == "method.not_allowed"
        # still authenticated first: no token is 401, whatever the method
        assert httpx.get(f"{service.url}/mcp/projects/{project_id}", timeout=20).status_code == 401


def test_mcp_started_where_no_store_is_refuses_and_leaves_nothing_behind(tmp_path: Path) -> None:
    import os
    import subprocess

    empty = tmp_path / "elsewhere"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTSTORE_")}
    for command in (["-m", "draftstore.cli", "mcp", "--project", "0" * 32],
                    ["-m", "draftstore.mcpserver", "--project", "0" * 32]):
        run = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, cwd=empty,
                             timeout=60, stdin=subprocess.DEVNULL)
        assert run.returncode != 0 and run.stdout == ""
        assert "config.invalid" in run.stderr and "no draftstore database" in run.stderr, run.stderr
        assert list(empty.iterdir()) == []  # no .draftstore/ made in the wrong place


# -- result shapes ------------------------------------------------------------------------
class SchemaChecked:
    """A client session whose every tool result is checked against the tool's declared
    ``outputSchema``, and whose every tool error is checked to carry its code and message in
    the structured content as in the text."""

    def __init__(self, session: ClientSession, schemas: dict[str, dict[str, Any]]) -> None:
        self.session = session
        self.schemas = schemas
        self.checked: set[str] = set()

    async def list_tools(self) -> Any:
        return await self.session.list_tools()

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        import jsonschema

        result = await self.session.call_tool(name, arguments)
        if result.is_error:
            error = result.structured_content["error"]
            assert isinstance(error["code"], str) and isinstance(error["message"], str)
            assert result.content[0].text == f"[{error['code']}] {error['message']}"
        else:
            jsonschema.validate(result.structured_content, self.schemas[name])
            self.checked.add(name)
        return result


def test_http_every_tool_declares_its_result_shape_and_every_result_matches_it(service: Service) -> None:
    store = service.store
    project_id = new_project(store)
    turn_id = store.start_turn(project_id, "add a dragon").id
    agent = service.token("agent", project_id=project_id)

    async def run() -> set[str]:
        async with http_session(f"{service.url}/mcp/projects/{project_id}/turns/{turn_id}", agent) as s:
            schemas = {t.name: t.output_schema for t in (await s.list_tools()).tools}
            for name, schema in schemas.items():  # a shape of its own, not "any object"
                assert schema and schema["type"] == "object" and schema["properties"], name
                assert schema.get("additionalProperties") is False, name
            assert set(schemas["view_file"]["required"]) >= {"path", "content", "truncated", "next_start_line"}
            checked = SchemaChecked(s, schemas)
            await every_tool(checked)  # type: ignore[arg-type]
            return checked.checked

    assert anyio.run(run) == TOOL_NAMES  # a result of every tool was checked against its schema
