"""Fifty agents through HAProxy to three replicas, one killed with SIGKILL mid-load: nothing lost, nothing twice.

The service keeps no state of its own (PostgreSQL, S3 and Redis hold it), so a
deployment grows by replicas behind any load balancer, without stickiness. This
story runs it on the real stack: Debian's haproxy (the configuration of
docs/operations.md) in front of three ``draftstore serve`` processes, 50 agent
threads driving turns through it (start, tool call started and completed, file
write, complete), and a few SSE readers following agents' turns through it too.
Mid-load one replica is killed with SIGKILL and started again on its port.

Agents follow the retry rules of docs/http.md ("Retries"): a connection error,
502, 503 or 504 is retried; a tool-call start carries an ``Idempotency-Key``; a
retried end that meets the state it asked for (``toolcall.already_finished``,
``turn.not_running`` with the status it set, ``turn.already_running`` naming
the turn it started) landed the first time. Afterwards, through the Store:
every acknowledged call and write is there, none twice; every reader's events
for a turn are the turn's buffer exactly (no gap, no duplicate id) however
many times it reconnected with ``Last-Event-ID``. The figures (requests,
retries, errors seen, times to recover) are printed and written to
``replicas-figures.json`` in the test's temp dir.
"""

from __future__ import annotations

import collections
import json
import queue
import random
import threading
import time
from datetime import datetime, timezone
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest

from draftstore import Store
from replicas import Balancer, Replica
from service_fixtures import free_port, stack_env
from test_service_streams import EventSource

pytestmark = [
    pytest.mark.parametrize("stack", [pytest.param("real", marks=pytest.mark.real)], indirect=True),
    pytest.mark.alone,  # 50 agents and a replica's restart on two cores: nothing else beside it
]

AGENTS = 50
MIN_TURNS, MAX_TURNS = 2, 20  # an agent goes on past MIN_TURNS until the restarted replica has served a while
CALLS_PER_TURN = 2
READERS = 4
RETRYABLE = {502, 503, 504}


@dataclass
class Figures:
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    retries: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    error_times: list[float] = field(default_factory=list)
    landed_on_retry: collections.Counter[str] = field(default_factory=collections.Counter)
    retried: collections.Counter[str] = field(default_factory=collections.Counter)  # operation -> retries

    def sent(self) -> None:
        with self.lock:
            self.requests += 1

    def failed(self, what: str, operation: str) -> None:
        with self.lock:
            self.retries += 1
            self.errors[what] += 1
            self.retried[operation] += 1
            self.error_times.append(time.monotonic())


class Agent:
    """One agent: its own project and HTTP client; records what the service acknowledged."""

    def __init__(self, n: int, lb: str, token: str, project_id: str, figures: Figures, keep_going: threading.Event,
                 turns_out: queue.Queue[str | None] | None) -> None:
        self.n, self.project_id, self.figures = n, project_id, figures
        self.keep_going, self.turns_out = keep_going, turns_out
        self.client = httpx.Client(base_url=lb, headers={"authorization": f"Bearer {token}"}, timeout=60)
        self.turns: list[str] = []
        self.calls: dict[str, list[tuple[str, int]]] = {}  # turn -> [(idempotency key, seq)] acknowledged
        self.files: dict[str, bytes] = {}  # path -> content acknowledged (the last write of the path)
        self.failure: BaseException | None = None
        self.last_attempt_at = datetime.now(timezone.utc)

    def send(self, operation: str, method: str, path: str, **kw: Any) -> tuple[httpx.Response, bool]:
        """The answer, and whether it came to a retry (the first attempt may have landed)."""
        retried = False
        for attempt in range(60):
            self.figures.sent()
            self.last_attempt_at = datetime.now(timezone.utc)
            try:
                r = self.client.request(method, path, **kw)
            except httpx.TransportError as exc:
                self.figures.failed(type(exc).__name__, operation)
            else:
                if r.status_code not in RETRYABLE:
                    return r, retried
                self.figures.failed(f"HTTP {r.status_code}", operation)
            retried = True
            time.sleep(min(1.0, 0.05 * 2 ** min(attempt, 5)) * random.uniform(0.5, 1.0))
        raise AssertionError(f"agent {self.n}: {method} {path} still failing after 60 attempts")

    def landed(self, r: httpx.Response, retried: bool, code: str, what: str, **details: Any) -> bool:
        """A retried request refused with ``code`` (and ``details``): its first attempt landed."""
        if not retried or r.status_code != 409:
            return False
        body = r.json()
        if body["code"] != code or any(body["details"].get(k) != v for k, v in details.items()):
            return False
        with self.figures.lock:
            self.figures.landed_on_retry[what] += 1
        return True

    def start_turn(self, number: int) -> str:
        r, retried = self.send("turn start", "POST", f"/v1/projects/{self.project_id}/turns",
                               json={"user_message": f"agent {self.n} turn {number}"})
        if r.status_code == 201:
            return r.json()["id"]
        if self.landed(r, retried, "turn.already_running", "turn start"):
            # the running turn is the one the lost answer named (this agent alone works on its project)
            running = r.json()["details"].get("turn_id")
            if running is None:
                d, _ = self.send("draft read", "GET", f"/v1/projects/{self.project_id}/draft")
                running = d.json()["last_turn_id"]
            return running
        raise AssertionError(f"agent {self.n}: start turn: {r.status_code} {r.text}")

    def run(self) -> None:
        try:
            number = 0
            while number < MIN_TURNS or (self.keep_going.is_set() and number < MAX_TURNS):
                number += 1
                self.one_turn(number)
        except BaseException as exc:  # the test reports it
            self.failure = exc
        finally:
            if self.turns_out is not None:
                self.turns_out.put(None)

    def one_turn(self, number: int) -> None:
        t = self.start_turn(number)
        self.turns.append(t)
        self.calls[t] = []
        if self.turns_out is not None:
            self.turns_out.put(t)
        for k in range(1, CALLS_PER_TURN + 1):
            key = f"a{self.n}-t{number}-c{k}"
            path = f"agent{self.n}/turn{number}/call{k}.txt"
            r, retried = self.send("call start", "POST", f"/v1/turns/{t}/tool-calls",
                                   headers={"Idempotency-Key": key},
                                   json={"tool_name": "write_file", "args": {"path": path, "key": key}})
            assert r.status_code == 201, (self.n, r.status_code, r.text)
            if retried and datetime.fromisoformat(r.json()["started_at"]) < self.last_attempt_at:
                with self.figures.lock:  # recorded before the attempt that answered: the key found it
                    self.figures.landed_on_retry["call start (answered by its key)"] += 1
            seq = r.json()["seq"]
            self.calls[t].append((key, seq))
            content = f"{key}\n".encode() * 8
            r, _ = self.send("file write", "PUT", f"/v1/turns/{t}/files/{path}", content=content)
            assert r.status_code == 204, (self.n, r.status_code, r.text)
            self.files[path] = content
            r, retried = self.send("call complete", "POST", f"/v1/turns/{t}/tool-calls/{seq}/complete",
                                   json={"result": {"key": key}})
            assert r.status_code == 204 or self.landed(r, retried, "toolcall.already_finished", "call complete",
                                                       status="completed"), (self.n, r.status_code, r.text)
        r, retried = self.send("turn complete", "POST", f"/v1/turns/{t}/complete",
                               json={"assistant_message": f"done {number}"})
        assert r.status_code == 200 or self.landed(r, retried, "turn.not_running", "turn complete",
                                                   status="completed"), (self.n, r.status_code, r.text)


class Reader:
    """Follows one agent's turns through the balancer, reconnecting with ``Last-Event-ID``."""

    def __init__(self, lb: str, token: str, turns: queue.Queue[str | None]) -> None:
        self.lb, self.token, self.turns = lb, token, turns
        self.events: dict[str, list[tuple[str, str, str]]] = {}  # turn -> [(id, type, data)]
        self.reconnects = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            while (t := self.turns.get(timeout=600)) is not None:
                self.follow(t)
        except BaseException as exc:
            self.failure = exc

    def follow(self, turn_id: str) -> None:
        got = self.events.setdefault(turn_id, [])
        last: str | None = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                es = EventSource(self.lb, f"/v1/turns/{turn_id}/events", token=self.token, last_event_id=last,
                                 timeout=30)
            except (OSError, h11.ProtocolError, AssertionError):  # refused, reset, or closed before an answer
                es = None
            except ValueError:  # an error page that is not the service's JSON: the balancer's 502/503/504
                es = None
            if es is not None:
                with es:
                    if es.status == 200:
                        if self._read(es, got):
                            return
                        last = got[-1][0] if got else last
                    elif es.status not in RETRYABLE:
                        raise RuntimeError(f"turn {turn_id}'s stream answered {es.status}: {es.body}")
            self.reconnects += 1
            time.sleep(0.1)
        raise AssertionError(f"turn {turn_id}'s stream never ended")

    @staticmethod
    def _read(es: EventSource, got: list[tuple[str, str, str]]) -> bool:
        """Read until ``stream.end`` (True) or the connection breaks (False)."""
        try:
            while (e := es.next_event(timeout=60)) is not None:
                got.append((e.last_event_id, e.type, e.data))
                if e.type == "stream.end":
                    return True
        except (OSError, h11.ProtocolError):
            pass
        return False


def test_fifty_agents_through_haproxy_lose_nothing_when_a_replica_is_killed_mid_load(stack, tmp_path: Path):
    store = Store.open(**stack, migrate=True)
    try:
        run_story(store, stack, tmp_path)
    finally:
        store.close()


def run_story(store: Store, stack: dict[str, str], tmp_path: Path) -> None:
    admin = store.tokens.create("admin", name="replicas-admin")[1]
    agent_token = store.tokens.create("agent", name="replicas-agents")[1]
    env = stack_env(stack)
    replicas = [Replica(f"r{i}", free_port(), env, tmp_path / f"r{i}.log") for i in range(3)]
    balancer = Balancer(tmp_path, free_port(), {r.name: r.port for r in replicas})
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_ready()
        balancer.start()
        figures = drive(store, admin, agent_token, replicas, balancer, tmp_path)
    finally:
        balancer.stop()
        for r in replicas:
            r.stop()
    print("\nreplicas figures: " + json.dumps(figures, indent=1))
    (tmp_path / "replicas-figures.json").write_text(json.dumps(figures, indent=1))


def answered(balancer: Balancer, replica: Replica) -> int:
    """HTTP answers the balancer got from ``replica`` so far (any status)."""
    row = balancer.stats()[replica.name]
    return sum(int(row[f"hrsp_{k}"] or 0) for k in ("1xx", "2xx", "3xx", "4xx", "5xx", "other"))


def drive(store: Store, admin: str, agent_token: str, replicas: list[Replica], balancer: Balancer,
          tmp_path: Path) -> dict[str, Any]:
    lb = balancer.url
    setup = httpx.Client(base_url=lb, headers={"authorization": f"Bearer {admin}"}, timeout=60)
    projects = []
    for n in range(AGENTS):
        r = setup.post("/v1/projects", json={"name": f"agent-{n}", "files": {}})
        assert r.status_code == 201, r.text
        projects.append(r.json()["id"])
    setup.close()

    figures = Figures()
    keep_going = threading.Event()
    keep_going.set()
    followed = {n * (AGENTS // READERS): queue.Queue() for n in range(READERS)}  # agent -> its turns, for a reader
    agents = [Agent(n, lb, agent_token, projects[n], figures, keep_going, followed.get(n)) for n in range(AGENTS)]
    readers = [Reader(lb, admin, q) for q in followed.values()]
    threads = [threading.Thread(target=a.run, name=f"agent-{a.n}") for a in agents]
    threads += [threading.Thread(target=r.run, name="reader") for r in readers]
    t_start = time.monotonic()
    for th in threads:
        th.start()

    # mid-load: kill one replica (SIGKILL), start it again on its port
    victim = replicas[1]
    planned = AGENTS * MIN_TURNS * (2 + 3 * CALLS_PER_TURN)
    while figures.requests < planned // 3:
        time.sleep(0.05)
    requests_at_kill = figures.requests
    answered_before = answered(balancer, victim)
    t_kill = time.monotonic()
    victim.kill9()
    t_down = None
    while t_down is None:  # the balancer takes it out after two failed checks
        if balancer.status()[victim.name].startswith("DOWN"):
            t_down = time.monotonic()
        time.sleep(0.02)
    victim.start()
    t_restarted = time.monotonic()
    victim.wait_ready()
    t_ready = time.monotonic()
    t_up = None
    while t_up is None:
        if balancer.status()[victim.name] == "UP":
            t_up = time.monotonic()
        time.sleep(0.02)
    answered_at_up = answered(balancer, victim)
    # let the restarted replica serve a while, then let the agents finish their turns
    while answered(balancer, victim) < answered_at_up + 100 and time.monotonic() - t_up < 60:
        time.sleep(0.1)
    keep_going.clear()
    for th in threads:
        th.join(timeout=900)
    assert not any(th.is_alive() for th in threads), "agents or readers still running after 15 minutes"
    t_end = time.monotonic()
    failures = [(a.n, a.failure) for a in agents if a.failure] + [("reader", r.failure) for r in readers if r.failure]
    assert not failures, failures
    served_after = answered(balancer, victim) - answered_at_up
    assert served_after > 0, "the restarted replica served nothing: round robin did not take it back"

    # -- every acknowledged call and write is there, none twice -----------------------------------
    turns_total = calls_total = 0
    for a in agents:
        turns = store.list_turns(a.project_id)
        assert sorted(t.id for t in turns) == sorted(a.turns), f"agent {a.n}: a turn started twice or lost"
        assert [t.number for t in turns] == list(range(1, len(a.turns) + 1))
        for t in a.turns:
            turn = store.get_turn(t)
            assert turn.status == "completed", (a.n, t, turn.status)
            recorded = [(c.args["key"], c.seq, c.status, c.result) for c in turn.tool_calls]
            assert recorded == [(key, seq, "completed", {"key": key}) for key, seq in a.calls[t]], (a.n, recorded)
            turns_total += 1
            calls_total += len(recorded)
        view = store.view(a.project_id)
        for path, content in a.files.items():
            assert view.read_file(path) == content, (a.n, path)

    # -- every reader saw each followed turn's buffer exactly ---------------------------------------
    events_seen = 0
    missing_tool_events = 0
    rebuilt_turns = 0
    for reader in readers:
        for t, got in reader.events.items():
            assert got and got[-1][1] == "stream.end", f"turn {t}: the reader never saw its stream end"
            kinds = [kind for _, kind, _ in got]
            if "stream.rebuilt" in kinds:
                # the turn's end never reached the buffer (the killed replica committed it and died before
                # appending it): the stream found the turn ended in the database and sent its history
                # rebuilt from there, then ended
                rebuilt_turns += 1
                after_last_rebuilt = len(kinds) - kinds[::-1].index("stream.rebuilt")
                durable = kinds[after_last_rebuilt:-1]  # the rebuilt history, without stream.end
                calls = store.get_turn(t).tool_calls
                assert durable[0] == "turn.started" and durable[-1] == "turn.completed", (t, kinds)
                assert durable.count("tool.started") == len(calls) == durable.count("tool.completed"), (t, kinds)
                events_seen += len(got)
                continue
            ids = [i for i, _, _ in got[:-1]]  # stream.end has no id of its own (it repeats the last one)
            assert len(ids) == len(set(ids)), f"turn {t}: a duplicate event id: {ids}"
            ns = [int(i.rpartition(":")[2]) for i in ids]
            assert ns == sorted(ns), f"turn {t}: ids out of order: {ids}"
            with EventSource(lb, f"/v1/turns/{t}/events", token=admin, timeout=30) as es:
                assert es.status == 200
                fresh = [(e.last_event_id, e.type, e.data) for e in es.read_to_end(timeout=30)]
            assert got == fresh, f"turn {t}: the reader's events differ from the buffer"
            events_seen += len(got)
            started = {json.loads(d)["seq"] for _, kind, d in got if kind == "tool.started"}
            missing_tool_events += sum(1 for c in store.get_turn(t).tool_calls if c.seq not in started)

    after_kill = [e - t_kill for e in figures.error_times if e >= t_kill]
    return {
        "agents": AGENTS, "replicas": len(replicas), "turns": turns_total, "tool_calls": calls_total,
        "files": sum(len(a.files) for a in agents),
        "requests": figures.requests, "retries": figures.retries, "errors_seen": dict(figures.errors),
        "landed_on_retry": dict(figures.landed_on_retry),
        "requests_at_kill": requests_at_kill, "victim_answers_before_kill": answered_before,
        "victim_answers_after_restart": served_after, "retried_by_operation": dict(figures.retried),
        "seconds": {
            "run": round(t_end - t_start, 2),
            "kill_to_marked_down": round(t_down - t_kill, 2),
            "restart_to_ready": round(t_ready - t_restarted, 2),
            "kill_to_back_up_in_balancer": round(t_up - t_kill, 2),
            "kill_to_last_client_error": round(max(after_kill), 2) if after_kill else None,
        },
        "sse": {"readers": len(readers), "turns_followed": sum(len(r.events) for r in readers),
                "events": events_seen, "reconnects": sum(r.reconnects for r in readers),
                "tool_started_events_missing_from_buffer": missing_tool_events,
                "turns_whose_end_was_rebuilt_from_the_database": rebuilt_turns},
    }
