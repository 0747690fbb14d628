"""HTTP service load: the agent workload over HTTP against the same operations in-process.

The service runs as a subprocess, exactly as deployed:
``python -m uvicorn draftstore.service.app:create_app --factory --workers N`` with
``DRAFTSTORE_*`` pointing at the bench's own stack (its PostgreSQL database,
its SeaweedFS bucket, its Redis prefix), once with 1 worker and once with 4.

One agent round (``_Round``): ``start_turn`` on the agent's own project, then
20 tool-call pairs (``tool_started`` + ``tool_completed``) with a 1 KiB raw
file write (``PUT /v1/turns/{id}/files/{path}``) after every second pair (10
writes), then ``complete_turn``. Every request is timed on its own.

- **library baseline**: the same round through the bench's measuring ``Store``
  in-process, sequentially (no concurrency).
- **sequential HTTP**: one agent against the 1-worker service, rounds
  interleaved with the library rounds (drift hits both alike), each round
  followed by ``SHORT_TURNS`` turns of a start and a complete alone (so
  the two ~10 ms operations get 5x the samples), twice: with
  a lean client (the standard library's ``http.client`` on one kept-alive
  connection, 0.1-0.25 ms of client CPU per request, about what a client in Go,
  Java or Node costs) and with ``httpx`` (a pure-Python client that costs
  ~0.35-0.55 ms of CPU per request on its own). Overhead = HTTP p50 - library
  p50 per operation. Goal: <= 1 ms with the lean client, since the client is
  the caller's choice and the goal is the service's; httpx's figure is shown
  beside it.
- **load**: ``agents`` concurrent agents (a thread and a lean client
  each, all started together, each on its own project), ``rounds`` rounds
  each, against the 1-worker and the 4-worker service. Goal: p99 <= 5x p50
  per operation.

Rows (``NAME ratio=R ours_ms=X baseline_ms=Y``):

- ``http_<op>``: sequential HTTP p50 / library p50 (information, no goal)
- ``http_<op>_overhead``: (HTTP p50 - library p50) / 1 ms, lean client (goal <= 1)
- ``http_<op>_overhead_httpx``: the same with httpx (information)
- ``http_<op>_load_w1`` / ``_load_w4``: HTTP p50 under load / library p50 (information)
- ``http_<op>_load_w1_p99`` / ``_load_w4_p99``: p99 / p50 under load (goal <= 5)

Two lanes, one after the other in the same run, each with its own library baseline:
the service as deployed (the fast lane in front of FastAPI, ``service/fastlane.py``),
then the same rows prefixed ``fastapi_`` on ``create_app(fast_lane=False)`` (every
route through FastAPI's own request handling): what the fast lane buys.

Only when named (``--only http_ops`` for both lanes, or row names): not part of the default run.
Sizes: 50 agents; quick 1 load round and 8 sequential rounds, full 3 and 40.

``DRAFTSTORE_BENCH_HTTP_PROFILE=1`` (or ``=DIR`` to keep py-spy's collapsed
stacks there) adds untimed passes after the measured sequential one: a turn
of tool-call pairs (the commonest request) through the library, over HTTP
(CPU per request of the service and of the client), and over HTTP again with
``py-spy record --gil`` on the 1-worker service; the GIL time per request by
stage of request handling and the heaviest frames go to stderr.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from .env import REPO, BenchEnv, progress
from .projects import random_source
from .timing import Result

OPS = ("start_turn", "tool_started", "tool_completed", "write_file", "complete_turn")
WORKERS = (1, 4)
OVERHEAD_GOAL_MS = 1.0
P99_GOAL = 5.0
PAIRS = 20  # tool-call pairs per round
WRITE_EVERY = 2  # one write after every second pair: 10 writes per round
SHORT_TURNS = 4  # sequential runs: start + complete turns after each round (5x their samples)
KIB = 1024

ARGS = {"path": "src/agent_0.py", "offset": 0, "limit": 200}
RESULT = {"ok": True, "bytes": 1024, "preview": "def agent_turn(path: str) -> int: ..."}


@dataclass
class HttpSizes:
    agents: int  # concurrent agents under load
    load_rounds: int  # timed rounds per agent under load
    seq_rounds: int  # timed sequential rounds (library and HTTP, interleaved)
    profile_pairs: int  # DRAFTSTORE_BENCH_HTTP_PROFILE: tool-call pairs per profile pass


HTTP_QUICK = HttpSizes(agents=50, load_rounds=1, seq_rounds=8, profile_pairs=300)
HTTP_FULL = HttpSizes(agents=50, load_rounds=3, seq_rounds=40, profile_pairs=1000)


def names() -> tuple[str, ...]:
    out: list[str] = []
    for op in OPS:
        out += [f"http_{op}", f"http_{op}_overhead", f"http_{op}_overhead_httpx"]
        for w in WORKERS:
            out += [f"http_{op}_load_w{w}", f"http_{op}_load_w{w}_p99"]
    return tuple(out)


FASTAPI = "fastapi_"  # prefix of the same rows measured on ``create_app(fast_lane=False)``
NAMES = names() + tuple(FASTAPI + n for n in names())
ALIAS = "http_ops"  # ``--only http_ops`` selects every row above, on both lanes
FACTORIES = {  # the uvicorn factory of each lane
    "": "draftstore.service.app:create_app",
    FASTAPI: "bench.http_ops:fastapi_only_app",
}


def fastapi_only_app() -> Any:
    """The service with every route served by FastAPI alone (no fast lane): the other lane."""
    from draftstore.service.app import create_app

    return create_app(fast_lane=False)


class Info(Result):
    """A row without a goal: information (a ratio to read, not to pass)."""

    @property
    def verdict(self) -> str:
        return "SKIP" if self.skipped is not None else "INFO"


# -- statistics -------------------------------------------------------------------------
def p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def p99(xs: list[float]) -> float:
    """Nearest-rank 99th percentile, in ms."""
    s = sorted(xs)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)] * 1e3


@dataclass
class Samples:
    times: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: Counter[str] = field(default_factory=Counter)
    wall: float = 0.0
    client_cpu: float = 0.0  # the bench process (the agents' clients), during ``wall``
    server_cpu: float = 0.0  # the service (all its worker processes), during ``wall``
    by_worker: str = ""  # under load: agents and tool-call latencies per service worker (``_per_worker``)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, op: str, seconds: float) -> None:
        with self.lock:
            self.times[op].append(seconds)

    def error(self, what: str) -> None:
        with self.lock:
            self.errors[what] += 1

    def requests(self) -> int:
        return sum(len(v) for v in self.times.values())


# -- one agent round, two transports ------------------------------------------------------------
class _Round:
    """start_turn, PAIRS tool-call pairs with a write after every WRITE_EVERY-th, complete_turn."""

    def __init__(self, project_id: str, agent: int) -> None:
        self.project_id, self.agent = project_id, agent
        self.k = 0

    def run(self, ops: "_Ops", out: Samples, pairs: int = PAIRS, short_turns: int = 0) -> None:
        """One round, then ``short_turns`` turns of a start and a complete alone (more samples of
        the two ~10 ms operations, whose medians are otherwise the noisiest)."""
        t = _timer(out)
        turn = t("start_turn", lambda: ops.start_turn(self.project_id, f"agent {self.agent} round {self.k}"))
        if turn is None:
            return
        self.k += 1
        for i in range(pairs):
            seq = t("tool_started", lambda: ops.tool_started(turn, "read_file", ARGS))
            if seq is not None:
                t("tool_completed", lambda: ops.tool_completed(turn, seq, RESULT))
            if i % WRITE_EVERY == WRITE_EVERY - 1:
                path, data = f"src/agent_{(i // WRITE_EVERY) % 10}.py", random_source(KIB)
                t("write_file", lambda: ops.write_file(turn, path, data))
        t("complete_turn", lambda: ops.complete_turn(turn, "done"))
        for _ in range(short_turns):
            turn = t("start_turn", lambda: ops.start_turn(self.project_id, f"agent {self.agent} short {self.k}"))
            if turn is None:
                return
            self.k += 1
            t("complete_turn", lambda: ops.complete_turn(turn, "done"))


class _Failed(Exception):
    pass


def _timer(out: Samples) -> Callable[[str, Callable[[], Any]], Any]:
    def t(op: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            value = fn()
        except _Failed as exc:
            out.error(f"{op}: {exc}")
            return None
        out.add(op, time.perf_counter() - t0)
        return value

    return t


class _Ops:
    def start_turn(self, project_id: str, message: str) -> str: ...
    def tool_started(self, turn: str, name: str, args: Any) -> int: ...
    def tool_completed(self, turn: str, seq: int, result: Any) -> None: ...
    def write_file(self, turn: str, path: str, data: bytes) -> None: ...
    def complete_turn(self, turn: str, message: Any) -> None: ...


class LibraryOps(_Ops):
    def __init__(self, store: Any) -> None:
        self.s = store

    def start_turn(self, project_id: str, message: str) -> str:
        return self.s.start_turn(project_id, message).id

    def tool_started(self, turn: str, name: str, args: Any) -> int:
        return self.s.tool_started(turn, name, args).seq

    def tool_completed(self, turn: str, seq: int, result: Any) -> None:
        self.s.tool_completed(turn, seq, result)

    def write_file(self, turn: str, path: str, data: bytes) -> None:
        self.s.write_file(turn, path, data)

    def complete_turn(self, turn: str, message: Any) -> None:
        self.s.complete_turn(turn, message)


class HttpOps(_Ops):
    """What an agent does over HTTP, whatever the client: JSON bodies, raw PUTs.

    ``_call(method, path, status, body, content_type)`` is the client's part:
    send one request on a kept-alive connection, check the status, return the body.
    """

    client = "?"

    def __init__(self, base_url: str, token: str) -> None:
        self.base_url, self.auth = base_url, f"Bearer {token}"

    def _call(self, method: str, path: str, status: int, body: bytes = b"",
              content_type: str = "application/json") -> bytes:
        raise NotImplementedError

    def _json(self, method: str, path: str, status: int, doc: Any) -> bytes:
        return self._call(method, path, status, json.dumps(doc).encode())

    def healthz(self) -> None:
        self._call("GET", "/healthz", 200)

    def start_turn(self, project_id: str, message: str) -> str:
        return json.loads(self._json("POST", f"/v1/projects/{project_id}/turns", 201, {"user_message": message}))["id"]

    def tool_started(self, turn: str, name: str, args: Any) -> int:
        r = self._json("POST", f"/v1/turns/{turn}/tool-calls", 201, {"tool_name": name, "args": args})
        return json.loads(r)["seq"]

    def tool_completed(self, turn: str, seq: int, result: Any) -> None:
        self._json("POST", f"/v1/turns/{turn}/tool-calls/{seq}/complete", 204, {"result": result})

    def write_file(self, turn: str, path: str, data: bytes) -> None:
        self._call("PUT", f"/v1/turns/{turn}/files/{path}", 204, data, "application/octet-stream")

    def complete_turn(self, turn: str, message: Any) -> None:
        self._json("POST", f"/v1/turns/{turn}/complete", 200, {"assistant_message": message})

    def close(self) -> None:
        pass


class StdlibOps(HttpOps):
    """A lean client: the standard library's ``http.client`` on one kept-alive connection
    (what a service in Go, Java or Node pays per request is closer to this than to httpx)."""

    client = "http.client"

    def __init__(self, base_url: str, token: str) -> None:
        super().__init__(base_url, token)
        u = urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.conn: http.client.HTTPConnection | None = None

    def _call(self, method: str, path: str, status: int, body: bytes = b"",
              content_type: str = "application/json") -> bytes:
        headers = {"authorization": self.auth}
        if method in ("POST", "PUT", "PATCH"):
            headers["content-type"] = content_type
        for attempt in (0, 1):  # a kept-alive connection the server closed is reopened once
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            try:
                self.conn.request(method, path, body=body if method in ("POST", "PUT", "PATCH") else None,
                                  headers=headers)
                r = self.conn.getresponse()
                data = r.read()
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if attempt:
                    raise _Failed(f"{type(exc).__name__}: {exc}") from None
                continue
            if r.status != status:
                raise _Failed(f"{r.status} {data[:120]!r}")
            return data
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class HttpxOps(HttpOps):
    """The same over one keep-alive ``httpx.Client`` (a heavier pure-Python client)."""

    client = "httpx"

    def __init__(self, base_url: str, token: str) -> None:
        super().__init__(base_url, token)
        self.c = httpx.Client(base_url=base_url, headers={"authorization": self.auth}, timeout=60)

    def _call(self, method: str, path: str, status: int, body: bytes = b"",
              content_type: str = "application/json") -> bytes:
        try:
            r = self.c.request(method, path, content=body if body else None,
                               headers={"content-type": content_type} if body else None)
        except httpx.HTTPError as exc:
            raise _Failed(f"{type(exc).__name__}: {exc}") from None
        if r.status_code != status:
            raise _Failed(f"{r.status_code} {r.content[:120]!r}")
        return r.content

    def close(self) -> None:
        self.c.close()


# -- the service subprocess -----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """``uvicorn draftstore.service.app:create_app --factory --workers N`` on the bench's stack."""

    def __init__(self, env: BenchEnv, workers: int, lane: str = "") -> None:
        self.env, self.workers, self.factory = env, workers, FACTORIES[lane]
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = env.scratch_dir("http") / f"uvicorn-w{workers}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "Service":
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTSTORE_")}
        child_env.update(DRAFTSTORE_DATABASE_URL=self.env.database_url, DRAFTSTORE_BLOB_URL=self.env.blob_url,
                         DRAFTSTORE_COORD_URL=self.env.coord_url)
        src = str(REPO / "src") + os.pathsep + str(REPO)  # the code under test, and bench/ for the factory
        child_env["PYTHONPATH"] = src + os.pathsep + child_env["PYTHONPATH"] if child_env.get("PYTHONPATH") else src
        cmd = [sys.executable, "-m", "uvicorn", self.factory, "--factory",
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(self.workers),
               "--log-level", "warning", "--no-access-log"]
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=child_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 60
        ready = 0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited ({self.proc.returncode}):\n{self.log()}")
            try:
                # with several workers, answer from a few connections so every worker has started
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    ready += 1
                    if ready >= 2 * self.workers:
                        break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError(f"the service was not ready within 60 s:\n{self.log()}")
        progress(f"  service with {self.workers} worker(s) ready on {self.url} in {time.perf_counter() - t0:.1f}s")
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> "Service":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- runs ---------------------------------------------------------------------------------------
def _projects(store: Any, n: int, tag: str) -> list[str]:
    files = {f"src/agent_{i}.py": random_source(KIB) for i in range(10)}
    files["README.md"] = b"# bench agent project\n"
    return [store.create_project(f"bench-http-{tag}-{i}", files=files).id for i in range(n)]


def sequential(store: Any, service: Service, token: str, lib_project: str, http_projects: tuple[str, str],
               rounds: int) -> tuple[Samples, Samples, Samples]:
    """Library rounds and single-agent HTTP rounds (the lean client, then httpx), interleaved round by
    round, each on its own project (alike: created together, the same rounds)."""
    lib, lean, heavy = LibraryOps(store), StdlibOps(service.url, token), HttpxOps(service.url, token)
    lib_round, lean_round, heavy_round = (_Round(lib_project, 0), _Round(http_projects[0], 0),
                                          _Round(http_projects[1], 0))
    lib_s, lean_s, heavy_s = Samples(), Samples(), Samples()
    try:
        warm = Samples()
        for _ in range(2):  # warm-ups: pools, connections, statement caches
            lib_round.run(lib, warm)
            lean_round.run(lean, warm)
            heavy_round.run(heavy, warm)
        for _ in range(rounds):
            lib_round.run(lib, lib_s, short_turns=SHORT_TURNS)
            lean_round.run(lean, lean_s, short_turns=SHORT_TURNS)
            heavy_round.run(heavy, heavy_s, short_turns=SHORT_TURNS)
            for ops, out in ((lean, lean_s), (heavy, heavy_s)):
                for _ in range(10):  # the floor: a route that touches neither auth nor the store
                    t0 = time.perf_counter()
                    ops.healthz()
                    out.add("healthz", time.perf_counter() - t0)
    finally:
        lean.close()
        heavy.close()
    return lib_s, lean_s, heavy_s


def load(service: Service, token: str, projects: list[str], rounds: int) -> Samples:
    """``len(projects)`` agents at once, a thread and a client each, ``rounds`` rounds each."""
    out = Samples()
    agents = [(StdlibOps(service.url, token), _Round(pid, i)) for i, pid in enumerate(projects)]
    mine = [Samples() for _ in agents]  # each agent's own, merged into ``out`` at the end
    warm = Samples()
    workers: list[int | None] = [None] * len(agents)

    def map_workers() -> None:  # run by the barrier once every agent is connected, before any is released
        workers[:] = _worker_of_agent(service.port, [ops for ops, _ in agents])

    start = threading.Barrier(len(agents) + 1, action=map_workers)

    def agent(ops: HttpOps, r: _Round, got: Samples) -> None:
        try:
            r.run(ops, warm, pairs=2)  # untimed warm-up: connect, first requests on each worker
            start.wait()
            for _ in range(rounds):
                r.run(ops, got)
        except threading.BrokenBarrierError:
            pass
        except Exception as exc:  # noqa: BLE001 - one agent's crash is counted, not hidden
            out.error(f"agent crashed: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=agent, args=(ops, r, got), daemon=True) for (ops, r), got in zip(agents, mine)]
    for th in threads:
        th.start()
    try:
        start.wait(timeout=120)
    except threading.BrokenBarrierError:
        pass
    assert service.proc is not None
    t0, client0, server0 = time.perf_counter(), time.process_time(), _cpu_seconds(service.proc.pid)
    for th in threads:
        th.join()
    out.wall = time.perf_counter() - t0
    out.client_cpu = time.process_time() - client0
    out.server_cpu = _cpu_seconds(service.proc.pid) - server0
    for ops, _ in agents:
        ops.close()
    for got in mine:
        for op, xs in got.times.items():
            out.times[op] += xs
        out.errors.update(got.errors)
    out.by_worker = _per_worker(workers, mine)
    if warm.errors:
        out.errors.update({f"warm-up {k}": v for k, v in warm.errors.items()})
    return out


def _worker_of_agent(port: int, clients: list[StdlibOps]) -> list[int | None]:
    """The pid of the service worker holding each client's connection (None where unknown:
    no connection, or no ``ss`` on this machine), from the sockets' ports as ``ss`` lists them."""
    try:
        listing = subprocess.run(["ss", "-tnpH", "state", "established", f"( sport = :{port} )"],
                                 capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return [None] * len(clients)
    pid_of: dict[int, int] = {}
    peer_and_pid = re.compile(r":%d\s+\S+:(\d+)\s.*pid=(\d+)" % port)
    for line in listing.splitlines():
        found = peer_and_pid.search(line)
        if found:
            pid_of[int(found.group(1))] = int(found.group(2))
    out: list[int | None] = []
    for c in clients:
        sock = c.conn.sock if c.conn is not None else None
        out.append(pid_of.get(sock.getsockname()[1]) if sock is not None else None)
    return out


def _per_worker(workers: list[int | None], samples: list[Samples]) -> str:
    """Agents per worker and their tool calls' p50/p99: an uneven spread of kept-alive
    connections over the workers shows here as a worker with more agents and slower calls."""
    groups: dict[int | None, list[Samples]] = defaultdict(list)
    for w, got in zip(workers, samples):
        groups[w].append(got)
    if None in groups or len(groups) < 2:
        return ""
    parts = []
    for mine in sorted(groups.values(), key=len, reverse=True):
        calls = [x for got in mine for op in ("tool_started", "tool_completed") for x in got.times.get(op, [])]
        if calls:
            parts.append(f"{len(mine)} agents: p50 {p50(calls):.1f} / p99 {p99(calls):.1f} ms")
    return "per worker, tool calls: " + "; ".join(parts)


def profile(store: Any, service: Service, token: str, lib_project: str, http_project: str, pairs: int,
            out_dir: Path) -> None:
    """Where a small request's time goes: ``pairs`` tool-call pairs (the commonest request) in one turn,
    through the library, over HTTP, and over HTTP under py-spy; CPU per request and top frames to stderr."""
    assert service.proc is not None
    lib, client = LibraryOps(store), StdlibOps(service.url, token)

    def pass_(ops: _Ops, project: str) -> tuple[float, float, float, int]:
        """(wall s, bench-process CPU s, service CPU s, requests) of ``pairs`` pairs."""
        turn = ops.start_turn(project, "profile")
        cpu0, client0, t0 = _cpu_seconds(service.proc.pid), time.process_time(), time.perf_counter()  # type: ignore[union-attr]
        for _ in range(pairs):
            ops.tool_completed(turn, ops.tool_started(turn, "read_file", ARGS), RESULT)
        out = (time.perf_counter() - t0, time.process_time() - client0,
               _cpu_seconds(service.proc.pid) - cpu0, 2 * pairs)  # type: ignore[union-attr]
        ops.complete_turn(turn, "done")
        return out

    try:
        wall, cpu, _, n = pass_(lib, lib_project)
        progress(f"  profile, library: {n} calls, {1e3 * wall / n:.3f} ms wall and {1e3 * cpu / n:.3f} ms CPU per call")
        wall, client_cpu, server, n = pass_(client, http_project)
        progress(f"  profile, HTTP: {n} requests, {1e3 * wall / n:.3f} ms wall per request; CPU per request: "
                 f"service {1e3 * server / n:.3f} ms, bench client ({client.client}) {1e3 * client_cpu / n:.3f} ms")
        raw = out_dir / f"py-spy-w{service.workers}.txt"
        # --gil: only the thread holding the GIL is sampled, i.e. where the service's Python CPU goes
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                                str(service.proc.pid), "--rate", "1000", "--format", "raw", "--output", str(raw),
                                "--nonblocking", "--gil"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attach
        wall, _, _, n = pass_(client, http_project)
        spy.send_signal(signal.SIGINT)
        try:
            _, err = spy.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
    finally:
        client.close()
    if not raw.exists():
        progress(f"  py-spy wrote nothing: {err.decode(errors='replace')[-500:]}")
        return
    progress(f"  profile, HTTP under py-spy --gil (1000 Hz: samples only while a service thread holds the GIL): "
             f"{n} requests, {1e3 * wall / n:.3f} ms wall each; collapsed stacks in {raw}")
    for line in top_frames(raw.read_text(), n):
        progress("  " + line)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) and of its descendants alive now, from /proc."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += _cpu_seconds(int(child))
    except (OSError, ValueError, IndexError):
        pass
    return total


# where a sample is: the first of these markers met walking a stack from its leaf up (FastAPI/uvicorn specific)
STAGES = [
    ("draftstore/store.py", "the store call (library work, in a pool thread)"),
    ("service/auth.py", "auth / get_store dependency bodies"),
    ("solve_dependencies", "FastAPI dependency resolution (sync dependencies hop to the thread pool)"),
    ("run_endpoint_function", "thread-pool hop of the sync endpoint"),
    ("request_body_to_args", "request body validation"),
    ("Request.body", "request body read"), ("Request.json", "request body read"), ("_get_body", "request body read"),
    ("serialize_response", "response build and send"), ("Response.__call__", "response build and send"),
    ("JSON.render", "response build and send"), ("RequestResponseCycle.send", "response build and send"),
    ("_match (", "routing"), (".matches (", "routing"), ("Router.__call__ (starlette", "routing"),
    ("middleware/base.py", "BaseHTTPMiddleware (the @app.middleware body_limit)"),
    ("anyio/streams/memory", "BaseHTTPMiddleware (the @app.middleware body_limit)"),
    ("httptools_impl", "uvicorn protocol / httptools"),
    ("WorkerThread.run", "pool threads waking up / bookkeeping"),
    ("concurrent/futures/thread.py", "pool threads waking up / bookkeeping"),
    ("service/threads.py", "pool threads waking up / bookkeeping"),
    ("draftstore/events.py", "the event publisher thread"),
]
GENERIC = ("threading.py", "<frozen runpy>", "click/", "uvicorn/main.py", "uvicorn/__main__.py", "uvicorn/server.py",
           "uvicorn/_compat.py", "asyncio/runners.py", "concurrent/futures/thread.py", "anyio/_backends/_asyncio.py",
           "service/threads.py")


def top_frames(collapsed: str, requests: int, n: int = 15) -> list[str]:
    """Samples by stage of request handling, and the heaviest non-generic frames (inclusive)."""
    stages: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        k = int(count)
        frames = [f.strip() for f in stack.split(";") if f.strip()]
        if not frames:
            continue
        total += k
        stage = next((label for f in reversed(frames) for marker, label in STAGES if marker in f),
                     "event loop / other")
        stages[stage] += k
        for f in {_short(f) for f in frames if not any(g in f for g in GENERIC)}:
            incl[f] += k
    if not total:
        return ["(no samples)"]
    ms = 1.0 / max(1, requests)  # 1000 Hz: one sample = 1 ms of GIL time
    out = [f"{total} samples = {total * ms:.2f} ms of GIL time per request; by stage:"]
    out += [f"  {100 * c / total:5.1f}%  {c * ms:6.3f} ms/request  {name}" for name, c in stages.most_common()]
    out.append(f"heaviest frames (inclusive; thread and loop plumbing left out), top {n}:")
    out += [f"  {100 * c / total:5.1f}%  {c * ms:6.3f} ms/request  {f}" for f, c in incl.most_common(n)]
    return out


def _short(frame: str) -> str:
    """'func (path/to/module.py:123)' -> 'func (module path from site-packages or src)'."""
    for marker in ("site-packages/", "/src/", "/lib/python3"):
        i = frame.find(marker)
        if i >= 0:
            head = frame[: frame.find("(") + 1] if "(" in frame else ""
            return head + frame[i + len(marker):]
    return frame


# -- rows -----------------------------------------------------------------------------------------
def _notes(s: Samples) -> list[str]:
    if not s.errors:
        return []
    return ["ERRORS " + ", ".join(f"{k} x{v}" for k, v in s.errors.most_common(5))]


def seq_rows(lib: Samples, lean: Samples, heavy: Samples) -> list[Result]:
    out: list[Result] = []
    for op in OPS:
        h, b, x = lean.times.get(op, []), lib.times.get(op, []), heavy.times.get(op, [])
        if not h or not b or not x:
            out += [Info(f"http_{op}", 0.0, skipped="no samples"),
                    Result(f"http_{op}_overhead", OVERHEAD_GOAL_MS, skipped="no samples"),
                    Info(f"http_{op}_overhead_httpx", 0.0, skipped="no samples")]
            continue
        over, over_x = p50(h) - p50(b), p50(x) - p50(b)
        common = (f"sequential, 1 agent, 1 worker, http.client: HTTP p50 {p50(h):.3f} ms p99 {p99(h):.3f} ms "
                  f"(p99/p50 {p99(h) / p50(h):.2f}); library p50 {p50(b):.3f} ms p99 {p99(b):.3f} ms; "
                  f"overhead {over:+.3f} ms; httpx p50 {p50(x):.3f} ms, overhead {over_x:+.3f} ms; n={len(h)}/{len(b)}")
        if op == OPS[0] and lean.times.get("healthz") and heavy.times.get("healthz"):
            common += (f"; floor: GET /healthz (no auth, no store) p50 {p50(lean.times['healthz']):.3f} ms "
                       f"(httpx {p50(heavy.times['healthz']):.3f} ms)")
        out.append(Info(f"http_{op}", 0.0, p50(h), p50(b), ours_what="HTTP p50, 1 agent, 1 worker",
                        baseline_what="library p50, in-process, sequential", notes=[common] + _notes(lean)))
        out.append(Result(f"http_{op}_overhead", OVERHEAD_GOAL_MS, over, OVERHEAD_GOAL_MS,
                          ours_what="HTTP p50 - library p50 (ms), http.client",
                          baseline_what=f"the {OVERHEAD_GOAL_MS:g} ms budget"))
        out.append(Info(f"http_{op}_overhead_httpx", 0.0, over_x, OVERHEAD_GOAL_MS,
                        ours_what="HTTP p50 - library p50 (ms), httpx client",
                        baseline_what=f"the {OVERHEAD_GOAL_MS:g} ms budget", notes=_notes(heavy)))
    return out


def load_rows(lib: Samples, run: Samples, workers: int, agents: int) -> list[Result]:
    out: list[Result] = []
    rps = run.requests() / run.wall if run.wall else 0.0
    for op in OPS:
        h, b = run.times.get(op, []), lib.times.get(op, [])
        name = f"http_{op}_load_w{workers}"
        if not h or not b:
            out += [Info(name, 0.0, skipped="no samples"), Result(name + "_p99", P99_GOAL, skipped="no samples")]
            continue
        note = (f"{agents} agents, {workers} worker(s): p50 {p50(h):.3f} ms, p99 {p99(h):.3f} ms, "
                f"p99/p50 {p99(h) / p50(h):.2f}; overhead vs library p50 {p50(h) - p50(b):+.3f} ms; n={len(h)}")
        if op == OPS[0]:
            n = max(1, run.requests())
            note += (f"; run: {run.requests()} requests in {run.wall:.1f}s ({rps:.0f}/s), CPU per request: "
                     f"service {1e3 * run.server_cpu / n:.2f} ms, agents' clients {1e3 * run.client_cpu / n:.2f} ms")
            if run.by_worker:
                note += "; " + run.by_worker
        out.append(Info(name, 0.0, p50(h), p50(b), ours_what=f"HTTP p50, {agents} agents, {workers} worker(s)",
                        baseline_what="library p50, sequential", notes=[note] + _notes(run)))
        out.append(Result(name + "_p99", P99_GOAL, p99(h), p50(h),
                          ours_what=f"HTTP p99, {agents} agents, {workers} worker(s)", baseline_what="HTTP p50, same run"))
    return out


def group(ctx: Any, wanted: set[str]) -> list[Result]:
    """The whole HTTP scenario group (see the module docstring), once per lane wanted: the
    service as deployed (fast lane in front of FastAPI), then FastAPI alone (rows ``fastapi_*``)."""
    out: list[Result] = []
    for lane in FACTORIES:
        mine = {n[len(lane):] for n in wanted if n.startswith(lane) and (lane or not n.startswith(FASTAPI))}
        if mine:
            rows = _lane(ctx, mine, lane)
            for r in rows:
                r.name = lane + r.name
                r.comparison = bool(lane)  # FastAPI alone: what removing the fast lane would cost
            out += rows
    return out


def _lane(ctx: Any, wanted: set[str], lane: str) -> list[Result]:
    from .scenarios import QUICK

    sizes = HTTP_QUICK if ctx.sizes is QUICK else HTTP_FULL
    # the sequential run always happens: its library samples are every row's baseline
    want_w = {w for w in WORKERS if any(n.startswith("http_") and f"_load_w{w}" in n for n in wanted)}
    store, env = ctx.store, ctx.env
    t0 = time.perf_counter()
    lib_project, http_project, httpx_project = _projects(store, 3, f"seq-{secrets.token_hex(2)}")
    agents = _projects(store, sizes.agents, f"load-{secrets.token_hex(2)}") if want_w else []
    progress(f"  {lane or 'fast lane '}service: {3 + len(agents)} agent projects created in "
             f"{time.perf_counter() - t0:.1f}s")
    token = store.tokens.create("agent", name="bench-http")[1]
    out: list[Result] = []
    with Service(env, 1, lane) as svc:
        t0 = time.perf_counter()
        lib, lean, heavy = sequential(store, svc, token, lib_project, (http_project, httpx_project),
                                      ctx.n(sizes.seq_rounds))
        progress(f"  sequential: {ctx.n(sizes.seq_rounds)} rounds each, library and HTTP interleaved, "
                 f"in {time.perf_counter() - t0:.1f}s")
        out += seq_rows(lib, lean, heavy)
        where = os.environ.get("DRAFTSTORE_BENCH_HTTP_PROFILE", "")
        if where:  # "1", or a directory to keep the collapsed stacks in (the scratch dir is removed at the end)
            keep = Path(where) if where not in ("1", "yes", "true") else env.scratch_dir("http")
            keep.mkdir(parents=True, exist_ok=True)
            profile(store, svc, token, lib_project, http_project, sizes.profile_pairs, keep)
        if 1 in want_w:
            out += _load(svc, token, agents, ctx.n(sizes.load_rounds), lib, 1)
    if 4 in want_w:
        with Service(env, 4, lane) as svc:
            out += _load(svc, token, agents, ctx.n(sizes.load_rounds), lib, 4)
    return out


def _load(svc: Service, token: str, agents: list[str], rounds: int, lib: Samples, workers: int) -> list[Result]:
    t0 = time.perf_counter()
    run = load(svc, token, agents, rounds)
    progress(f"  load, {workers} worker(s): {len(agents)} agents x {rounds} round(s): {run.requests()} requests "
             f"in {run.wall:.1f}s ({time.perf_counter() - t0:.1f}s with warm-up); CPU: service "
             f"{run.server_cpu:.1f}s, agents' clients {run.client_cpu:.1f}s"
             + (f"; ERRORS {dict(run.errors)}" if run.errors else ""))
    return load_rows(lib, run, workers, len(agents))
