"""Schemathesis against the running service's own ``/openapi.json``.

One pytest item per stack: ``service`` runs uvicorn in a subprocess on the
embedded and on the real stack (~2,500 requests, 36-40 s each on a quiet 2-core
machine). Every request carries the fixture's admin token. Before generating,
the fixture seeds data so generated requests sometimes hit existing
resources: a project with files, two published versions, an ended turn and a
running turn with tool calls (one open, one done, one awaiting approval), a
second project with no draft, a spare token and real paging cursors. Those
known values (ids, paths, state references, cursors, event ids at the 64-bit
edges) and happy-path request bodies are added to the OpenAPI document as
``examples`` (the examples phase sends them first, round-robin), and hooks
mix them into the generated path parameters, query strings and bodies too. A turn that a generated request ended (complete,
interrupt, fail, cancel, discard) is replaced by a new running turn before
the next request that names the running turn.

Per operation: the schema's examples, the coverage phase (boundary and
invalid values derived from the schema, two unexpected methods) and
``MAX_EXAMPLES`` fuzzed cases (positive and negative), derandomized so every
run sends the same cases: the same coverage on a fast machine and a slow one.
Shrinking is off: a failure reports the request as sent. ``BUDGET_S`` per
stack is a cap for a run gone wrong (a server that answers every request
slowly), three times a quiet run's length: no case is sent after it, and a
warning says how many were not. The event routes are called alternately for
a JSON page and for the SSE stream (read for ``SSE_TIMEOUT_S``).

Checks, per response:

- no 5xx for any input (and no request left without a response);
- every 4xx body is JSON with a string ``code``, a string ``message`` and a
  ``details`` object;
- an event stream is not cut off by the server: a turn's stream ends with
  ``stream.end``, a project's does not end by itself.

Every failing operation is reported once, with the request (method, URL,
query, body), the response and the exception the server logged.

Runs the operations with ``schemathesis.pytest.lazy.get_all_tests`` (what
``schemathesis.pytest.from_fixture(...).parametrize()`` runs per operation):
``from_fixture`` itself fails on pytest 9 in schemathesis 4.32.5 (it sets
``request.node._nodeid``, which pytest 9 no longer has).

``FUZZ_MAX_EXAMPLES``, ``FUZZ_BUDGET_S``, ``FUZZ_RANDOM=1`` (a new seed every
run) and ``FUZZ_VERBOSE=1`` (statuses per operation) are for longer
exploration runs by hand.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
import schemathesis
from schemathesis.core import NotSet
from schemathesis.core.result import Ok
from schemathesis.pytest.lazy import get_all_tests
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from draftstore import Store

# fuzzed cases per operation (on top of the schema's examples and the coverage cases), and the cap on
# a stack's time (every case is sent well within it; see the docstring). A longer, randomized
# exploration by hand:
# FUZZ_MAX_EXAMPLES=150 FUZZ_BUDGET_S=400 FUZZ_RANDOM=1 FUZZ_VERBOSE=1 pytest -s tests/test_service_fuzz.py
MAX_EXAMPLES = int(os.environ.get("FUZZ_MAX_EXAMPLES", "15"))
BUDGET_S = float(os.environ.get("FUZZ_BUDGET_S", "120"))
DERANDOMIZE = not os.environ.get("FUZZ_RANDOM")  # CI sends the same cases every run
SSE_TIMEOUT_S = 0.5  # an event stream of a running turn never ends by itself: read it this long
RUNNING = "RUNNINGTURN"  # placeholder (URL-safe) for "the running turn", replaced at call time

# alone (tests/alone.py): an event route's answer, even a JSON page, must come within SSE_TIMEOUT_S,
# which a machine busy with other tests could miss
pytestmark = pytest.mark.alone


# -- the service's log: drained (a full pipe would block the server), kept for reports ----
class Log:
    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        for raw in iter(stream.readline, b""):
            with self._lock:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def mark(self) -> int:
        with self._lock:
            return len(self.lines)

    def since(self, mark: int, wait: float = 0.3) -> str:
        """The end of what the server logged after ``mark``: the exception, not the whole traceback."""
        time.sleep(wait)  # the traceback is written just after the 500 is sent
        with self._lock:
            lines = self.lines[mark:]
        first = next((ln for ln in lines if "unexpected error" in ln), "")
        # the exception lines: unindented "SomeError: ..." lines of the traceback(s), chained ones too
        exc = [ln[:300] for ln in lines if re.match(r"[A-Za-z_][\w.]*(Error|Exception)\b.*: ", ln)]
        shown = ([first] if first else []) + (list(dict.fromkeys(exc))[-3:] or [ln[:300] for ln in lines[-4:]])
        return "\n".join(f"    | {ln}" for ln in shown)


# -- seeded data ---------------------------------------------------------------------------
@dataclass
class Seed:
    store: Store
    project: str = ""
    other_project: str = ""
    versions: list[str] = field(default_factory=list)
    ended_turn: str = ""
    running_turn: str = ""
    spare_token: str = ""
    cursors: list[str] = field(default_factory=list)
    reseeded: int = 0
    session: str = ""
    seed_errors: list[str] = field(default_factory=list)

    FILES = {
        "main.py": b"print('hello')\n# TODO: dragons\n",
        "src/app.py": b"def run():\n    return 42\n",
        "src/util/strings.py": b"def up(s):\n    return s.upper()\n",
        "docs/readme.md": "# caf\u00e9 \u2603\n".encode(),
        "assets/blob.bin": bytes(range(256)),
    }

    def plant(self) -> "Seed":
        s = self.store
        p = s.create_project("fuzz", files=self.FILES, characters={"hero": {"hp": 10}},
                             world_settings={"era": "iron"}, actor="fuzz")
        self.project = p.id
        assert p.current_version_id is not None
        self.versions.append(p.current_version_id)
        t = s.start_turn(p.id, "first", actor="fuzz")
        s.tool_completed(t.id, s.tool_started(t.id, "view_file", {"path": "main.py"}).seq, {"ok": True})
        s.write_file(t.id, "src/new.py", b"NEW = 1\n")
        s.complete_turn(t.id, "done")
        self.ended_turn = t.id
        self.versions.append(s.publish(p.id, "second", actor="fuzz").id)
        self.running_turn = self._start_running()
        other = s.create_project("fuzz-other", files={"x.txt": b"x"}, actor="fuzz")
        self.other_project = other.id
        assert other.current_version_id is not None
        self.versions.append(other.current_version_id)
        self.spare_token = s.tokens.create("observer", name="fuzz-spare")[0].id
        s.record_snapshot(p.id, "head", "fuzz-provider-snap")
        self.session = s.open_sandbox(p.id, "e2b", "fuzz-sbx", turn_id=t.id).id
        for page in (s.page_projects(None, 1), s.page_versions(p.id, None, 1), s.page_turns(p.id, None, 1),
                     s.page_tool_calls(self.running_turn, None, 1)):
            if page.next_cursor:
                self.cursors.append(page.next_cursor)
        return self

    def _start_running(self) -> str:
        s = self.store
        draft = s.get_project(self.project).active_draft_id
        begin = s.continue_turn if draft is not None else s.start_turn
        t = begin(self.project, {"role": "user", "content": [{"type": "text", "text": "go"}]}, actor="fuzz")
        s.tool_started(t.id, "view_file", {"path": "main.py"})  # seq 1: open
        s.tool_completed(t.id, s.tool_started(t.id, "list_dir", {"dir": "src"}).seq, ["app.py"])  # seq 2: done
        try:  # seq 3: awaiting approval
            s.tool_started(t.id, "delete_file", {"path": "main.py"}, needs_approval=True)
        except Exception as exc:  # noqa: BLE001 - seeding goes on; the fuzzer reports it through HTTP
            why = f"tool_started(needs_approval=True): {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            if why not in self.seed_errors:
                self.seed_errors.append(why)
        s.write_file(t.id, "src/app.py", b"def run():\n    return 43\n")
        return t.id

    def running(self) -> str:
        """The running turn, started afresh if a generated request ended it."""
        s = self.store
        try:
            if s.get_turn(self.running_turn, tool_calls=False).status == "running":
                return self.running_turn
        except Exception:
            pass
        d = s.get_project(self.project).active_draft_id
        if d is not None:
            draft = s.get_draft(self.project)
            if draft.status == "running" and draft.last_turn_id:  # a generated start_turn made one
                self.running_turn = draft.last_turn_id
                return self.running_turn
        self.running_turn = self._start_running()
        self.reseeded += 1
        return self.running_turn

    # what the hooks mix into generated values
    def path_values(self) -> dict[str, list[Any]]:
        return {
            "project_id": [self.project, self.other_project],
            "version_id": self.versions,
            "turn_id": [RUNNING, RUNNING, self.ended_turn],
            "seq": [1, 2, 3],
            "path": list(self.FILES) + ["src", "src/new.py", "nope/missing.py"],
            "token_id": [self.spare_token],
            "session_id": [self.session],
        }

    def query_values(self) -> dict[str, list[Any]]:
        refs = ["draft", "head", f"version:{self.versions[0]}", self.versions[1],
                f"turn:{self.ended_turn}:start", f"turn:{self.ended_turn}:end", f"turn:{RUNNING}:start"]
        return {"at": refs, "a": refs, "b": refs, "cursor": self.cursors or ["x"], "dir": ["", "src", "src/util"],
                "glob": ["**", "**/*.py", "src/*"], "q": ["TODO", "def ", "(?i)run"],
                "state": ["draft", "head", self.versions[0]], "status": ["ready", "closed"],
                # event ids: 64-bit edges (a stream id is at most 2**63 - 1 in SQLite and Redis)
                "after": [2**64, 2**63, 2**63 - 1, 0, 1], "before": [2**64, 2**63, 1, 2]}

    def body_values(self) -> dict[str, list[Any]]:
        message = {"role": "user", "content": [{"type": "text", "text": "add a dragon"}]}
        return {
            "version_id": self.versions, "project_id": [self.project, self.other_project],
            "tool_name": ["view_file", "write_file"], "needs_approval": [True, False], "approved": [True, False],
            "args": [{"path": "main.py"}, None], "result": [{"ok": True}, "x" * 10_000],
            "user_message": ["go on", message], "assistant_message": ["done", message],
            "error": [{"type": "Timeout"}], "partial_response": [{"text": "half"}],
            "name": ["fuzz-made"], "role": ["admin", "agent", "observer"], "summary": ["release"],
            "force": [True, False], "text": ["hello "], "actor": ["fuzzer"],
            "files": [{"a.py": "cHJpbnQoMSk=", "src/b.py": ""}],
            "changes": [{"a.py": "cHJpbnQoMSk=", "main.py": None}, {"src": None}],
            "src": ["main.py", "src/app.py", "src"], "dst": ["moved.py", "src/util/x.py", "main.py"],
            "patch": [[{"op": "add", "path": "/dragon", "value": {"hp": 3}}], {"hero": {"hp": 11}},
                      [{"op": "remove", "path": "/nope"}], [{"op": "test", "path": "/hero/hp", "value": 10}]],
        }


    def body_examples(self) -> dict[str, list[Any]]:
        """Request bodies by schema name: the happy paths, sent first."""
        message = {"role": "user", "content": [{"type": "text", "text": "add a dragon"}]}
        return {
            "CreateProject": [{"name": "fuzz-made", "files": {"a.py": "cHJpbnQoMSk="}, "characters": {"hero": {}}}],
            "StartTurn": [{"user_message": "go on"}, {"user_message": message, "continue": True, "actor": "fuzzer"}],
            "Complete": [{"assistant_message": "done"}, {"assistant_message": message}],
            "Interrupt": [{"partial_response": {"text": "half"}}],
            "Fail": [{"error": {"type": "Timeout"}}],
            "ToolStart": [{"tool_name": "view_file", "args": {"path": "main.py"}},
                          {"tool_name": "delete_file", "args": {"path": "main.py"}, "needs_approval": True}],
            "ToolComplete": [{"result": {"ok": True}}, {"result": "x" * 10_000}],
            "ToolFail": [{"error": {"type": "Timeout"}}],
            "Approval": [{"approved": True}, {"approved": False, "reason": "no", "actor": "fuzzer"}],
            "Changes": [{"changes": {"a.py": "cHJpbnQoMSk=", "main.py": None}}],
            "Move": [{"src": "main.py", "dst": "moved.py"}, {"src": "src", "dst": "lib"}],
            "Patch": [{"patch": [{"op": "add", "path": "/dragon", "value": {"hp": 3}}]},
                      {"patch": {"hero": {"hp": 11}}}],
            "Delta": [{"text": "hello "}],
            "Publish": [{"summary": "release"}, {"summary": "forced", "force": True}],
            "Rollback": [{"version_id": v} for v in self.versions],
            "Revert": [{"to_turn_id": self.ended_turn, "actor": "fuzzer"}],
            "Fork": [{"name": "fork", "version_id": self.versions[1]}, {"name": "fork-head"}],
            "CreateToken": [{"role": "agent", "project_id": self.project}, {"role": "observer"}],
            "Actor": [{"actor": "fuzzer"}],
            "OpenSandbox": [{"provider": "e2b", "external_id": "sbx-fuzz"},
                            {"provider": "docker", "external_id": "c-1", "state": "head", "status": "ready"}],
            "SandboxHeartbeat": [{"status": "ready"}, {}],
        }


def _substitute(value: Any, turn: str) -> Any:
    return value.replace(RUNNING, turn) if isinstance(value, str) and RUNNING in value else value


def _mix(generated: dict[str, Any] | None, known: dict[str, list[Any]]) -> st.SearchStrategy[Any]:
    """Each known key keeps its generated value or takes a known one."""
    if not generated:
        return st.just(generated)
    parts = {k: (st.one_of(st.just(v), st.sampled_from(known[k])) if k in known else st.just(v))
             for k, v in generated.items()}
    return st.fixed_dictionaries(parts)


# -- the schema fixture ------------------------------------------------------------------
@dataclass
class Fuzz:
    seed: Seed
    log: Log
    base_url: str
    deadline: float
    sent: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    per_op: dict[str, Counter[int]] = field(default_factory=dict)
    unsent: int = 0
    event_calls: int = 0
    failures: list[str] = field(default_factory=list)
    failed: set[tuple[str, int]] = field(default_factory=set)


@pytest.fixture
def fuzz(service: Any) -> Iterator[Fuzz]:
    assert service.admin
    log = Log(service.proc.stdout)
    seed = Seed(service.store).plant()
    started = time.monotonic()
    f = Fuzz(seed, log, service.url, started + BUDGET_S)
    yield f
    print(f"\nfuzz: {sum(f.sent.values())} requests over {len(f.sent)} operations in "
          f"{time.monotonic() - started:.1f}s; statuses {dict(sorted(f.statuses.items()))}; "
          f"running turn re-seeded {seed.reseeded} times; {len(f.failures)} failing operations",
          file=sys.stderr)
    if os.environ.get("FUZZ_VERBOSE"):
        for label, c in sorted(f.per_op.items()):
            print(f"  {label}: {dict(sorted(c.items()))}", file=sys.stderr)
    if seed.seed_errors:
        print("  seeding through the library failed: " + "; ".join(seed.seed_errors), file=sys.stderr)
    if f.unsent:  # the cap was reached: fewer cases than every other run sent; say so rather than fail
        warnings.warn(f"the fuzz time cap ({BUDGET_S:.0f}s) was reached: {f.unsent} generated cases were not sent",
                      stacklevel=1)


def _with_examples(raw: dict[str, Any], seed: Seed) -> dict[str, Any]:
    """The service's OpenAPI document with the seeded values as examples: the examples phase then
    sends them (round-robin, deterministically) before any generated case."""
    params = {**seed.path_values(), **seed.query_values()}
    bodies = seed.body_examples()
    for ops in raw["paths"].values():
        for op in ops.values():
            for param in op.get("parameters", ()):
                if param["name"] in params:
                    param["examples"] = {f"seeded{i}": {"value": v} for i, v in enumerate(params[param["name"]])}
            content = op.get("requestBody", {}).get("content", {}).get("application/json")
            ref = (content or {}).get("schema", {}).get("$ref", "")
            name = ref.rpartition("/")[2]
            if not name:  # an optional body: anyOf [ref, null]
                refs = [x.get("$ref", "") for x in (content or {}).get("schema", {}).get("anyOf", ())]
                name = next((r.rpartition("/")[2] for r in refs if r), "")
            if content is not None and name in bodies:
                content["examples"] = {f"seeded{i}": {"value": v} for i, v in enumerate(bodies[name])}
    return raw


@pytest.fixture
def api_schema(service: Any, fuzz: Fuzz) -> Any:
    raw = requests.get(f"{service.url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(_with_examples(raw, fuzz.seed))
    schema.config.update(base_url=service.url, headers={"Authorization": f"Bearer {service.admin}"},
                         request_timeout=30)
    # unexpected-method probes: two per operation rather than seven
    schema.config.phases.coverage.unexpected_methods = {"patch", "trace"}
    schema.config.phases.examples.fill_missing = True  # parameters without a seeded example are generated
    seed = fuzz.seed
    path_values, query_values, body_values = seed.path_values(), seed.query_values(), seed.body_values()

    @schema.hook
    def flatmap_path_parameters(context: Any, path_parameters: dict[str, Any]) -> Any:
        return _mix(path_parameters, path_values)

    @schema.hook
    def flatmap_query(context: Any, query: dict[str, Any]) -> Any:
        return _mix(query, query_values)

    @schema.hook
    def flatmap_body(context: Any, body: Any) -> Any:
        return _mix(body, body_values) if isinstance(body, dict) else st.just(body)

    return schema


def _body(case: Any) -> str:
    body = case.body
    if isinstance(body, (bytes, bytearray)):
        return f"<{len(body)} bytes> {bytes(body[:200])!r}"
    if isinstance(body, NotSet):
        return "(none)"
    try:
        return json.dumps(body, ensure_ascii=True)[:2000]
    except (TypeError, ValueError):
        return repr(body)[:2000]


def _describe(case: Any, response: Any) -> str:
    sent = {k: v for k, v in response.request.headers.items()
            if k.lower() in ("accept", "content-type", "last-event-id")}
    return (f"{case.method} {response.request.url}\n"
            f"  path parameters: {case.path_parameters}\n  query: {case.query}\n"
            f"  headers: {sent}\n  body: {_body(case)}\n"
            f"  -> {response.status_code} {response.content[:1000]!r}")


def _resolve_running(case: Any, fuzz: Fuzz) -> None:
    """Replace the running-turn placeholder with the turn running now."""
    params = case.path_parameters or {}
    query = case.query or {}
    if not any(isinstance(v, str) and RUNNING in v for v in (*params.values(), *query.values())):
        return
    turn = fuzz.seed.running()
    if params:
        case.path_parameters = {k: _substitute(v, turn) for k, v in params.items()}
    if query:
        case.query = {k: _substitute(v, turn) for k, v in query.items()}


def _check(case: Any, fuzz: Fuzz) -> None:
    """Send one generated case and check the response."""
    if time.monotonic() > fuzz.deadline:
        fuzz.unsent += 1
        return
    _resolve_running(case, fuzz)
    events = case.operation.path.endswith("/events")
    headers = None
    if events:  # alternately one JSON page and the SSE stream
        fuzz.event_calls += 1
        if fuzz.event_calls % 2:
            headers = {"Accept": "application/json"}
    mark = fuzz.log.mark()
    try:
        response = case.call(headers=headers, timeout=SSE_TIMEOUT_S if events else 30)
    except requests.RequestException as exc:  # no (complete) response at all
        report = (f"no response: {case.method} {case.formatted_path} query={case.query} body={_body(case)}: "
                  f"{type(exc).__name__}: {exc}\n  server log (end):\n{fuzz.log.since(mark)}")
        fuzz.failures.append(report)
        raise AssertionError(report) from None
    fuzz.sent[case.operation.label] += 1
    fuzz.statuses[response.status_code] += 1
    fuzz.per_op.setdefault(case.operation.label, Counter())[response.status_code] += 1
    problem = None
    streamed = "text/event-stream" in response.headers.get("content-type", [""])[0]
    if streamed and not response.stream_cut_short and b"event: stream.end" not in response.content:
        # the server closed a stream we were still reading: a turn's stream ends with stream.end,
        # a project's never ends by itself
        problem = "event stream closed by the server without stream.end (aborted)"
    elif response.status_code >= 500:
        problem = "server error"
    elif 400 <= response.status_code < 500:
        try:
            err = response.json()
        except ValueError:
            err = None
        if not (isinstance(err, dict) and isinstance(err.get("code"), str) and isinstance(err.get("message"), str)
                and isinstance(err.get("details"), dict)):
            problem = "4xx body is not {code: str, message: str, details: object}"
    if problem is not None:
        key = (case.operation.label, response.status_code)
        if key not in fuzz.failed:  # hypothesis replays a failing case once more: report it once
            report = f"{problem}: {_describe(case, response)}"
            if response.status_code >= 500 or streamed:
                report += "\n  server log (end):\n" + fuzz.log.since(mark)
            fuzz.failed.add(key)
            fuzz.failures.append(report)
        raise AssertionError(problem)


SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=DERANDOMIZE, database=None,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


def test_openapi_fuzz(api_schema: Any, fuzz: Fuzz) -> None:
    """Every operation of /openapi.json: examples, coverage cases and fuzzed cases; no 5xx, well-formed 4xx."""

    def check(case: Any) -> None:
        _check(case, fuzz)

    # what ``schemathesis.pytest.from_fixture(...).parametrize()`` runs per operation, without its
    # pytest node-id bookkeeping (which schemathesis 4.32.5 does through ``Function._nodeid``, gone in pytest 9)
    schema = api_schema.clone(test_function=check)
    operations = 0
    for result in get_all_tests(schema=schema, test_func=check, settings=SETTINGS, given_kwargs=None):
        if not isinstance(result, Ok):
            fuzz.failures.append(f"schema error: {result.err()}")
            continue
        operation, run = result.ok()
        operations += 1
        before = len(fuzz.failures)
        try:
            run()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001
            # _check recorded what it found; hypothesis then raises it (or a group, or Flaky if a
            # replay passed): anything else is an error of its own (generation, hooks, the harness)
            if len(fuzz.failures) == before:
                fuzz.failures.append(f"{operation.label}: {type(exc).__name__}: {str(exc)[:2000]}")
    assert operations >= 40, f"only {operations} operations in /openapi.json"
    if fuzz.failures:
        pytest.fail(f"{len(fuzz.failures)} failing operation(s):\n\n" + "\n\n".join(fuzz.failures), pytrace=False)
