"""Processes killed for real (``kill -9``) at every fault point and at random moments lose nothing
they acknowledged, leave no row naming a missing object and nothing that blocks the project.

Proved on the embedded stack and on the real one (PostgreSQL, Redis, SeaweedFS):

- Library workers are killed paused at each point of ``draftstore.faults`` (before and after a blob
  put, before and after the overlay row commits, mid-seal, mid-turn-end, mid-publish, mid-snapshot,
  mid-pack) and at random moments while they loop writes, batches, patches, tool calls, turn ends
  and publishes, printing one line per acknowledged operation. The random moments come from a
  seeded ``random.Random``; every failure names the seed (``DRAFTSTORE_KILL_SEED`` replays it).
- After every kill a Store in the test process finds: fsck's references clean before and after
  recovery; every acknowledged write byte-exact, every acknowledged tool call with its args and
  result, every acknowledged patch; the dead worker's turn ``interrupted`` by the first sweep begun
  a heartbeat TTL after the kill; no draft left ``publishing``; and what the point implies (a write
  killed before its commit is absent, after it present; a turn killed while ending is still running
  until the sweep seals it; a publish killed before its commit leaves the draft open, after it the
  version is head; a snapshot killed after its upload is built by the background work).
- The next job, a fresh process, continues the draft every time, from the dead turn's end root.
  At the end a fresh Store re-reads every file of every version.
- A draft snapshot killed after its upload is built by the background work, as a head one is.
- The HTTP service (uvicorn, started as tests/service_fixtures.py does) killed paused at write,
  turn-end and publish points and at random moments in a stream of PUTs: every 2xx survives, and
  a new service on the same stack serves it and continues the draft with a new turn.

Library workers are forked, one per job, from a process that imported draftstore once (and opened
nothing), so a kill costs a fork and a ``Store.open``, not an interpreter start.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from draftstore import Settings, Store
from draftstore.db.tables import DRAFTS, VERSIONS
from service_fixtures import Output, in_background, kill_service

TTL = 1.0  # heartbeat TTL of the workers, the services and the sweeper
SWEEP_EVERY = 0.2  # how often the test sweeps while it waits for a dead worker's turn
CLOCK_SLACK = 0.05
MIN_KILLS = 20
RANDOM_KILLS = 12
TOTALS: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

POINTS = [  # (point, the operation that reaches it), in an order each one's preconditions hold
    ("write.before_upload", "write"),
    ("write.before_commit", "batch"),
    ("write.after_commit", "write"),
    ("seal.before_swap", "complete"),
    ("turn.end.before_commit", "interrupt"),
    ("turn.end.after_commit", "complete"),
    ("publish.before_commit", "publish"),
    ("publish.after_commit", "publish"),  # leaves a version no one has packed yet, for the next one
    ("pack.after_upload", "background"),
    ("snapshot.after_upload", "snapshot"),
]
SERVICE_POINTS = [
    ("write.before_commit", "put"),
    ("write.after_commit", "put"),
    ("seal.before_swap", "complete"),
    ("turn.end.before_commit", "interrupt"),
    ("publish.before_commit", "publish"),
    ("publish.after_commit", "publish"),
]
SERVICE_RANDOM_KILLS = 2

ZYGOTE = textwrap.dedent(
    """
    import base64, json, os, sys, time, traceback
    from draftstore import Store, faults  # imported once; each job runs in a child forked below

    URLS = json.loads(sys.argv[1])


    def say(**facts):  # one write(2) of a short line to a pipe is atomic: a kill never cuts a line
        os.write(1, (json.dumps(facts) + "\\n").encode())


    def run(job):
        n, project, turn = job["job"], job["project"], None

        def ack(i, **facts):
            say(job=n, ack=i, **facts)

        def data(b64):
            return base64.b64decode(b64)

        with Store.open(**URLS) as store:
            ack(-1)
            for i, (kind, *a) in enumerate(job["ops"]):
                if kind == "begin":
                    t = (store.continue_turn if a[0] == "continue" else store.start_turn)(project, f"job {n}")
                    turn = t.id
                    ack(i, turn=t.id, continues=t.continues_turn_id, start_root=t.start_root)
                elif kind == "tool":
                    seq = store.tool_started(turn, a[0], a[1]).seq
                    ack(i, turn=turn, seq=seq)
                    store.tool_completed(turn, seq, a[2])
                    ack(i, turn=turn, seq=seq, completed=True)
                elif kind == "write":
                    store.write_file(turn, a[0], data(a[1]))
                    ack(i)
                elif kind == "batch":
                    store.apply_changes(turn, {p: data(d) for p, d in a[0].items()})
                    ack(i)
                elif kind == "patch":
                    store.patch_characters(turn, a[0])
                    ack(i)
                elif kind == "beat":
                    store.heartbeat(turn)
                    ack(i)
                elif kind == "complete":
                    ack(i, turn=turn, end_root=store.complete_turn(turn, a[0]).end_root)
                elif kind == "interrupt":
                    ack(i, turn=turn, end_root=store.interrupt_turn(turn, a[0]).end_root)
                elif kind == "publish":
                    v = store.publish(project, a[0])
                    ack(i, version=v.id, number=v.number)
                elif kind == "snapshot":
                    ack(i, snapshot=store.create_snapshot(project, a[0]).id)
                elif kind == "background":
                    ack(i, **store.run_background())
                elif kind == "arm":
                    faults.arm(a[0])
                    ack(i)
                elif kind == "idle":  # the plan is done: wait for the kill
                    time.sleep(a[0])


    say(zygote="ready")
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                run(job)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stderr.flush()
            os._exit(code)
        say(job=job["job"], pid=pid)
        say(job=job["job"], exit=os.waitpid(pid, 0)[1])
    """
)


# -- the workers ----------------------------------------------------------------------------------------
@dataclass
class Job:
    n: int
    ops: list[Any]
    err_mark: int
    pid: int = 0
    status: int | None = None
    acks: list[dict[str, Any]] = field(default_factory=list)

    def ack(self, i: int) -> dict[str, Any] | None:
        """The last acknowledgement of op ``i`` (a tool call has two), if it was acknowledged."""
        found = [a for a in self.acks if a["ack"] == i]
        return found[-1] if found else None


class Zygote:
    """A process that imported draftstore once and forks one worker per job, reporting each worker's
    pid and exit status; its stdout and stderr are read on threads, so every wait has a deadline."""

    def __init__(self, stack: dict[str, str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTSTORE_")}
        # one BLAS thread: nothing but the forking thread exists when a worker is forked
        env.update(DRAFTSTORE_HEARTBEAT_TTL_S=str(TTL), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, json.dumps(stack)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.out: queue.Queue[dict[str, Any]] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self.jobs = 0
        threading.Thread(target=self._read_out, daemon=True).start()
        threading.Thread(target=lambda: [self.err.put(line) for line in self.proc.stderr], daemon=True).start()
        ready = self._get(120, "the zygote to import draftstore")
        assert ready == {"zygote": "ready"}, ready

    def _read_out(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            try:
                self.out.put(json.loads(line))
            except ValueError:
                self.out.put({"stray": line})

    def _stderr_text(self) -> str:
        while not self.err.empty():
            self.stderr.append(self.err.get_nowait())
        return "".join(self.stderr[-60:])

    def _get(self, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.out.get(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() >= deadline:
                    pytest.fail(f"no line from the workers waiting for {what} (timeout {timeout:.0f}s, zygote "
                                f"exit status {self.proc.poll()}); stderr:\n{self._stderr_text()}")

    def _dispatch(self, job: Job, m: dict[str, Any]) -> None:
        if "stray" in m:  # not ours (a library printing to stdout): kept for failure messages
            self.stderr.append(m["stray"])
            return
        assert m.get("job") == job.n, f"a line from another job while running job {job.n}: {m}"
        if "pid" in m:
            job.pid = m["pid"]
        elif "exit" in m:
            job.status = m["exit"]
        else:
            job.acks.append(m)

    def _pump(self, job: Job, until: Callable[[Job], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not until(job):
            if job.status is not None:
                pytest.fail(f"job {job.n} exited (status {job.status}) before {what}; stderr:\n{self._stderr_text()}")
            self._dispatch(job, self._get(deadline - time.monotonic(), what))

    def start(self, project_id: str, ops: list[Any]) -> Job:
        self.jobs += 1
        self._stderr_text()
        job = Job(self.jobs, ops, len(self.stderr))
        self.proc.stdin.write(json.dumps({"job": job.n, "project": project_id, "ops": ops}) + "\n")  # type: ignore
        self.proc.stdin.flush()  # type: ignore[union-attr]
        self._pump(job, lambda j: j.pid > 0, 30, "its fork")
        return job

    def kill_when_paused(self, job: Job, point: str, timeout: float = 90) -> float:
        """Wait until the job's worker says it reached ``point``, kill -9 it; returns when (wall clock)."""
        deadline = time.monotonic() + timeout
        while not any(f"paused at {point}" in line for line in self.stderr[job.err_mark:]):
            try:
                self.stderr.append(self.err.get(timeout=0.05))
            except queue.Empty:
                pass
            while not self.out.empty():
                self._dispatch(job, self.out.get_nowait())
            if job.status is not None or time.monotonic() > deadline:
                pytest.fail(f"job {job.n} never paused at {point} (exit status {job.status}); "
                            f"stderr:\n{self._stderr_text()}")
        return self.kill(job)

    def kill_after(self, job: Job, op: int, delay: float) -> float:
        """Kill -9 the job's worker ``delay`` seconds after it acknowledged op ``op`` (-1: opened its store)."""
        self._pump(job, lambda j: j.ack(op) is not None, 60, f"the acknowledgement of op {op}")
        time.sleep(delay)  # the random moment itself, not a synchronisation
        return self.kill(job)

    def kill(self, job: Job) -> float:
        while not self.out.empty():
            self._dispatch(job, self.out.get_nowait())
        assert job.status is None, f"job {job.n} exited (status {job.status}) before its kill"
        os.kill(job.pid, signal.SIGKILL)
        at = time.time()
        self._pump(job, lambda j: j.status is not None, 60, "its death")  # every acknowledgement precedes this
        assert os.WIFSIGNALED(job.status) and os.WTERMSIG(job.status) == signal.SIGKILL, job.status  # type: ignore
        return at

    def finish(self, job: Job, timeout: float = 120) -> None:
        self._pump(job, lambda j: j.status is not None, timeout, "its end")
        assert job.status == 0, f"job {job.n} failed (status {job.status}); stderr:\n{self._stderr_text()}"

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def zygote(stack: dict[str, str]) -> Any:
    z = Zygote(stack)
    yield z
    z.close()


# -- what was acknowledged, and checking it ---------------------------------------------------------------
def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class Ledger:
    """Everything a client was told was stored; ``fresh_*`` are what no check has read back yet."""

    files: dict[str, bytes] = field(default_factory=dict)
    chars: dict[str, Any] = field(default_factory=dict)
    calls: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    fresh_files: set[str] = field(default_factory=set)
    fresh_calls: set[tuple[str, int]] = field(default_factory=set)

    def wrote(self, files: dict[str, bytes]) -> None:
        self.files.update(files)
        self.fresh_files.update(files)

    def called(self, turn: str, seq: int, name: str, args: Any, result: Any = None, completed: bool = False) -> None:
        call = self.calls.setdefault((turn, seq), {"name": name, "args": args})
        if completed:
            call["result"] = result
        self.fresh_calls.add((turn, seq))

    def record(self, job: Job) -> None:
        """Take in the acknowledgements a worker printed before it died."""
        for a in job.acks:
            if a["ack"] < 0:
                continue
            kind, *args = job.ops[a["ack"]]
            if kind == "tool":
                self.called(a["turn"], a["seq"], args[0], args[1], args[2], a.get("completed", False))
            elif kind == "write":
                self.wrote({args[0]: base64.b64decode(args[1])})
            elif kind == "batch":
                self.wrote({p: base64.b64decode(d) for p, d in args[0].items()})
            elif kind == "patch":
                self.chars.update(args[0])

    def verify(self, store: Store, project_id: str, where: str, everything: bool = False) -> tuple[int, int]:
        """Read back what was acknowledged (``everything``, else what no check read yet); returns counts."""
        view = store.view(project_id)
        paths = sorted(self.files if everything else self.fresh_files)
        for path in paths:
            assert view.exists(path), f"{where}: acknowledged write {path!r} is missing"
            assert view.read_file(path) == self.files[path], f"{where}: acknowledged write {path!r} differs"
        characters = view.characters
        for key, value in self.chars.items():
            assert characters.get(key) == value, f"{where}: acknowledged patch of {key!r} is missing"
        keys = sorted(self.calls if everything else self.fresh_calls)
        histories: dict[str, dict[int, Any]] = {}
        for turn, seq in keys:
            if turn not in histories:
                histories[turn] = {c.seq: c for c in store.get_turn(turn).tool_calls}
            want, got = self.calls[(turn, seq)], histories[turn].get(seq)
            assert got is not None, f"{where}: acknowledged tool call {seq} of turn {turn} is missing"
            args = store.read_payload(got.args_digest) if got.args_offloaded else got.args
            assert (got.tool_name, args) == (want["name"], want["args"]), f"{where}: tool call {seq} of {turn}"
            if "result" in want:
                result = store.read_payload(got.result_digest) if got.result_offloaded else got.result
                assert (got.status, result) == ("completed", want["result"]), f"{where}: tool call {seq} of {turn}"
            else:  # its completion was not acknowledged: it may or may not have committed (if not, the
                # turn's end, the sweep's reap of the dead worker's turn, made it interrupted)
                assert got.status in ("started", "interrupted", "completed"), \
                    f"{where}: tool call {seq} of {turn} is {got.status}"
        self.fresh_files.clear()
        self.fresh_calls.clear()
        return len(paths), len(keys)


def assert_references_resolve(store: Store, where: str) -> None:
    report = store.fsck(verify_objects=False)
    assert report.ok, f"{where}: fsck found\n" + "\n".join(map(str, report.problems[:30]))


def assert_nothing_publishing(store: Store, where: str) -> None:
    with store.engine.connect() as conn:
        stuck = conn.execute(sa.select(DRAFTS.c.id).where(DRAFTS.c.status == "publishing",
                                                          DRAFTS.c.closed_at.is_(None))).all()
    assert not stuck, f"{where}: drafts left publishing: {stuck}"


def reap(store: Store, project_id: str, killed_at: float, where: str) -> float | None:
    """Sweep every SWEEP_EVERY until no turn of the project runs; the first sweep begun a TTL after the
    kill must end the dead worker's turn. Returns seconds from the kill to the reap (None: none ran)."""
    running = [t.id for t in store.list_turns(project_id) if t.status == "running"]
    if not running:
        return None
    hard_deadline = time.monotonic() + 60
    while True:
        began = time.time()
        store.sweep()
        if all(store.get_turn(t, tool_calls=False).status != "running" for t in running):
            break
        assert began < killed_at + TTL + CLOCK_SLACK, (
            f"{where}: a sweep begun {began - killed_at:.2f}s after the kill (heartbeat TTL {TTL}s) "
            f"left the dead worker's turn running")
        assert time.monotonic() < hard_deadline, f"{where}: the dead worker's turn was never reaped"
        time.sleep(SWEEP_EVERY)
    reaped_in = time.time() - killed_at
    for t in running:
        turn = store.get_turn(t, tool_calls=False)
        assert (turn.status, turn.end_reason) == ("interrupted", "heartbeat_lapsed"), f"{where}: {turn}"
        assert turn.end_root == store.get_draft(project_id).root, f"{where}: the sweep did not seal the turn"
    return reaped_in


@dataclass
class Tally:
    kills: int = 0
    writes: int = 0
    calls: int = 0
    continued: int = 0
    slowest_reap: float = 0.0

    def killed(self, reaped_in: float | None) -> None:
        self.kills += 1
        if reaped_in is not None:
            self.slowest_reap = max(self.slowest_reap, reaped_in)

    def summary(self, flavour: str, what: str, seed: int) -> str:
        TOTALS[flavour].update(kills=self.kills, writes=self.writes, calls=self.calls)
        return (f"kills survived: {self.kills}, writes verified: {self.writes}, tool calls verified: {self.calls} "
                f"[{flavour} {what}; seed {seed}; continued from a fresh process {self.continued} times; "
                f"slowest reap {self.slowest_reap:.2f}s after a kill (TTL {TTL}s, sweep every {SWEEP_EVERY}s)]")


def flavour_of(stack: dict[str, str]) -> str:
    return "embedded" if stack["database_url"].startswith("sqlite") else "real"


def seeded() -> tuple[int, random.Random]:
    seed = int(os.environ.get("DRAFTSTORE_KILL_SEED") or random.SystemRandom().randrange(2**32))
    return seed, random.Random(seed)


@pytest.fixture(scope="module", autouse=True)
def file_totals() -> Any:
    yield
    for flavour, c in sorted(TOTALS.items()):
        print(f"\n[{flavour}, whole file] kills survived: {c['kills']}, writes verified: {c['writes']}, "
              f"tool calls verified: {c['calls']}")


# -- plans: the operations a worker runs -------------------------------------------------------------------
class Plan:
    """Operations for one job, drawn from the seeded generator; every path is new, so an acknowledged
    write must read back exactly as written whatever was killed after it."""

    def __init__(self, rng: random.Random, job: int) -> None:
        self.rng, self.job, self.i = rng, job, 0

    def _path(self, sub: str = "") -> str:
        self.i += 1
        return f"j{self.job:03d}/{sub}{self.i:03d}.bin"

    def _content(self) -> bytes:
        size = self.rng.choice((0, 1, 40, 700, 3000, 40_000))
        if self.rng.random() < 0.5:
            return self.rng.randbytes(size)
        return (f"# job {self.job} op {self.i}\n".encode() * (size // 20 + 1))[:size]

    def _payload(self) -> Any:
        r = self.rng.random()
        if r < 0.15:  # over DRAFTSTORE_INLINE_PAYLOAD_BYTES: offloaded to the blob store
            return {"big": self.rng.randbytes(5000).hex()}
        if r < 0.25:  # a NUL character: offloaded as well
            return {"text": f"nul\x00inside {self.i}"}
        return {"path": f"f{self.i}.py", "n": self.rng.randrange(10**6), "text": "héllo ✓"}

    def write(self) -> list[Any]:
        return ["write", self._path(), b64(self._content())]

    def batch(self) -> list[Any]:
        sub = f"b{self.i + 1:03d}/"
        return ["batch", {self._path(sub): b64(self._content()) for _ in range(self.rng.randint(2, 5))}]

    def tool(self) -> list[Any]:
        self.i += 1
        name = self.rng.choice(("view_file", "write_file", "search_code", "run_tests"))
        return ["tool", name, self._payload(), self._payload()]

    def patch(self) -> list[Any]:
        self.i += 1
        return ["patch", {f"j{self.job}_{self.i}": {"hp": self.rng.randrange(1000), "name": "drágon"}}]

    def work(self, count: int) -> list[Any]:
        """Acknowledged work: at least one write (so a turn end has something to seal) and one tool call."""
        ops = [self.write(), self.tool()]
        for _ in range(count):
            ops.append(self.rng.choice((self.write, self.batch, self.tool, self.patch, lambda: ["beat"]))())
        return ops

    def loop(self, count: int) -> list[Any]:
        """What a worker does until killed at a random moment: work, and now and then a turn end and a publish."""
        ops: list[Any] = []
        while len(ops) < count:
            r = self.rng.random()
            if r < 0.03:
                ops += [["complete", f"done {self.job}"], ["publish", f"job {self.job}"], ["begin", "start"]]
            elif r < 0.05:
                ops += [["complete", f"done {self.job}"], ["begin", "continue"]]
            else:
                ops.append(self.rng.choices((self.write, self.batch, self.tool, self.patch, lambda: ["beat"]),
                                            weights=(3, 1, 3, 1, 1))[0]())
        return ops + [["idle", 600]]


# -- the library campaign ----------------------------------------------------------------------------------
class Campaign:
    def __init__(self, store: Store, zygote: Zygote, rng: random.Random, tmp_path: Path) -> None:
        self.store, self.zygote, self.rng, self.tmp = store, zygote, rng, tmp_path
        self.ledger, self.tally = Ledger(), Tally()
        files = {"main.py": b"print(1)\n", "lib/util.py": b"def util():\n    return 1\n"}
        self.p = store.create_project("kills", files=files, characters={"hero": {"hp": 10}}).id
        self.ledger.wrote(files)
        self.ledger.chars["hero"] = {"hp": 10}
        store.sweep()  # starts the coordinator's clock, so its grace after a restart is over before any kill

    def begin(self) -> tuple[list[Any], dict[str, Any]]:
        """Continue the draft if there is one (else start a turn), and what its acknowledgement must say."""
        if self.store.get_project(self.p).active_draft_id is None:
            return ["begin", "start"], {"continues": None}
        draft = self.store.get_draft(self.p)
        return ["begin", "continue"], {"continues": draft.last_turn_id, "start_root": draft.root}

    def check_begin(self, job: Job, expect: dict[str, Any], where: str) -> str | None:
        a = job.ack(0)
        if a is None:
            return None  # killed before it began: the next job continues instead
        assert a["continues"] == expect["continues"], f"{where}: continued {a['continues']}, not {expect}"
        if "start_root" in expect:
            assert a["start_root"] == expect["start_root"], f"{where}: the new turn did not start at the draft's root"
            self.tally.continued += 1
        return a["turn"]

    def recovered(self, job: Job, killed_at: float, where: str) -> None:
        """What every kill must leave: references resolve, the dead turn is reaped (sealed) in time,
        nothing is publishing, every acknowledged thing reads back."""
        self.ledger.record(job)
        assert_references_resolve(self.store, f"{where}, right after the kill")
        reaped_in = reap(self.store, self.p, killed_at, where)
        assert_references_resolve(self.store, f"{where}, after the sweep")
        assert_nothing_publishing(self.store, where)
        writes, calls = self.ledger.verify(self.store, self.p, where)
        self.tally.writes += writes
        self.tally.calls += calls
        self.tally.killed(reaped_in)

    def at_point(self, point: str, op: str) -> None:
        store, p = self.store, self.p
        begin, expect = self.begin()
        plan = Plan(self.rng, self.zygote.jobs + 1)
        ops = [begin] + plan.work(self.rng.randint(1, 4))
        if op == "publish":
            ops.append(["complete", f"done before {point}"])
        final = {"write": plan.write, "batch": plan.batch, "snapshot": lambda: ["snapshot", "head"]}.get(
            op, lambda: [op, f"{op} at {point}"])()
        ops += [["arm", point], final]
        versions = [v.id for v in store.list_versions(p)]
        where = f"kill {self.tally.kills + 1} at {point}"

        job = self.zygote.start(p, ops)
        killed_at = self.zygote.kill_when_paused(job, point)
        turn = self.check_begin(job, expect, where)
        assert turn is not None and job.ack(len(ops) - 2) is not None, f"{where}: killed before it was armed"

        # what the point implies, before any recovery
        inflight = {final[1]: base64.b64decode(final[2])} if op == "write" else (
            {k: base64.b64decode(v) for k, v in final[1].items()} if op == "batch" else {})
        view = store.view(p)
        if point in ("write.before_upload", "write.before_commit"):
            assert not any(view.exists(path) for path in inflight), f"{where}: an unacknowledged write committed"
        elif point == "write.after_commit":
            self.ledger.wrote(inflight)  # committed, though never acknowledged: it must read back too
        elif point in ("seal.before_swap", "turn.end.before_commit"):
            t = store.get_turn(turn, tool_calls=False)
            assert (t.status, t.end_root, t.assistant_message) == ("running", None, None), f"{where}: {t}"
        elif point == "turn.end.after_commit":
            t = store.get_turn(turn, tool_calls=False)
            assert (t.status, t.assistant_message) == ("completed", final[1]), f"{where}: {t}"
        elif point == "publish.before_commit":
            draft = store.get_draft(p)
            completed = job.ack(len(ops) - 3)
            assert [v.id for v in store.list_versions(p)] == versions, f"{where}: a version was published"
            assert (draft.status, draft.root) == ("paused", completed["end_root"]), f"{where}: {draft}"  # type: ignore
        elif point == "publish.after_commit":
            project, now = store.get_project(p), store.list_versions(p)
            assert [v.id for v in now[:-1]] == versions and project.current_version_id == now[-1].id, where
            assert project.active_draft_id is None, f"{where}: the published draft is still open"
        elif point == "pack.after_upload":
            with store.engine.connect() as conn:
                unpacked = conn.execute(sa.select(VERSIONS.c.id).where(VERSIONS.c.project_id == p,
                                                                       VERSIONS.c.packed_at.is_(None))).all()
            assert unpacked, f"{where}: the version was marked packed though its packer died"
        elif point == "snapshot.after_upload":
            snap = store.list_snapshots(p)[-1]
            assert (snap.status, snap.bundle_key) == ("pending", None), f"{where}: {snap}"

        self.recovered(job, killed_at, where)

        if point in ("seal.before_swap", "turn.end.before_commit"):  # the sweep ended it, sealing its writes
            end = store.view_at_turn(turn, "end")
            mine = [path for path in self.ledger.files if path.startswith(f"j{job.n:03d}/")]
            assert mine and all(end.read_file(path) == self.ledger.files[path] for path in mine), where
        elif point == "pack.after_upload":
            for v in store.list_versions(p):  # unpacked or not, every version reads whole
                view = store.view_at(p, v.id)
                assert all(len(view.read_file(path)) == view.stat(path).size for path in view.list_files()), where
        elif point == "snapshot.after_upload":  # the background work builds the dead worker's snapshot
            assert store.run_background()["snapshots_built"] == 1, where
            snap = store.list_snapshots(p)[-1]
            assert snap.status == "ready", f"{where}: {snap}"
            made = store.materialize(p, self.tmp / f"sandbox-{job.n}", "head")
            head = store.view_at(p, store.get_project(p).current_version_id)  # type: ignore[arg-type]
            assert (made.path, made.snapshot_id, made.files) == ("snapshot", snap.id, len(head.list_files())), where
            for path in head.list_files():
                assert (self.tmp / f"sandbox-{job.n}" / path).read_bytes() == head.read_file(path), where

    def at_random(self) -> None:
        begin, expect = self.begin()
        ops = [begin] + Plan(self.rng, self.zygote.jobs + 1).loop(250)
        # now and then the kill lands while the worker opens its store or begins its turn
        anchor, delay = (-1, self.rng.uniform(0, 0.3)) if self.rng.random() < 0.2 else (0, self.rng.uniform(0, 1.0))
        where = f"kill {self.tally.kills + 1} at random ({delay:.3f}s after op {anchor})"
        job = self.zygote.start(self.p, ops)
        killed_at = self.zygote.kill_after(job, anchor, delay)
        self.check_begin(job, expect, where)
        self.recovered(job, killed_at, where)

    def finish(self) -> None:
        """A last worker continues, completes and publishes; exits normally."""
        begin, expect = self.begin()
        plan = Plan(self.rng, self.zygote.jobs + 1)
        ops = [begin] + plan.work(3) + [["complete", "the end"], ["publish", "after every kill"]]
        job = self.zygote.start(self.p, ops)
        self.zygote.finish(job)
        self.check_begin(job, expect, "the last worker")
        self.ledger.record(job)


def test_workers_killed_at_every_fault_point_and_at_random_moments_lose_nothing_acknowledged(
        stack, store_factory, zygote, tmp_path):
    seed, rng = seeded()
    flavour = flavour_of(stack)
    store = store_factory(settings=Settings(heartbeat_ttl_s=TTL))
    try:
        c = Campaign(store, zygote, rng, tmp_path)
        for point, op in POINTS:
            c.at_point(point, op)
        for _ in range(RANDOM_KILLS):
            c.at_random()
        c.finish()

        # a fresh Store (nothing cached) reads back everything ever acknowledged, and every version whole
        fresh = store_factory(settings=Settings(heartbeat_ttl_s=TTL))
        assert_references_resolve(fresh, "at the end")
        assert_nothing_publishing(fresh, "at the end")
        assert not [t for t in fresh.list_turns(c.p) if t.status == "running"]
        c.tally.writes, c.tally.calls = c.ledger.verify(fresh, c.p, "at the end", everything=True)
        for v in fresh.list_versions(c.p):
            view = fresh.view_at(c.p, v.id)
            for path in view.list_files():
                assert len(view.read_file(path)) == view.stat(path).size
        assert c.tally.kills >= MIN_KILLS, c.tally
        assert c.tally.continued >= len(POINTS) // 2, c.tally
    except BaseException as exc:
        exc.add_note(f"kill campaign seed {seed} ({flavour}): rerun with DRAFTSTORE_KILL_SEED={seed}")
        raise
    print("\n" + c.tally.summary(flavour, "library workers", seed))


def test_a_draft_snapshot_killed_after_its_upload_is_built_by_the_background_work(
        stack, store_factory, zygote, tmp_path):
    """As a head snapshot killed there is (see the campaign): the bundle is stored, the row says
    ``pending``, the draft has not moved, so the background work can finish it."""
    store = store_factory()
    p = store.create_project("snap", files={"main.py": b"print(1)\n"}).id
    t = store.start_turn(p, "work")
    store.write_file(t.id, "dragon.py", b"DRAGON = 1\n")
    store.complete_turn(t.id, "done")
    draft = store.get_draft(p)

    job = zygote.start(p, [["arm", "snapshot.after_upload"], ["snapshot", "draft"]])
    zygote.kill_when_paused(job, "snapshot.after_upload")
    TOTALS[flavour_of(stack)]["kills"] += 1
    pending = store.list_snapshots(p)[-1]
    assert (pending.source_kind, pending.status, pending.root) == ("draft", "pending", draft.root)

    store.run_background()
    snap = store.list_snapshots(p)[-1]
    assert (snap.id, snap.status, snap.root) == (pending.id, "ready", draft.root), (
        f"the dead worker's draft snapshot was not built: {snap.status} ({snap.error})")
    made = store.materialize(p, tmp_path / "sandbox", "draft")
    assert (made.path, made.snapshot_id, made.files) == ("snapshot", snap.id, 2)
    assert (tmp_path / "sandbox" / "dragon.py").read_bytes() == b"DRAGON = 1\n"


# -- the HTTP service ----------------------------------------------------------------------------------------
class ServiceCampaign:
    def __init__(self, service_factory: Callable[..., Any], store: Store, rng: random.Random) -> None:
        self.start_service, self.store, self.rng = service_factory, store, rng
        self.ledger, self.tally, self.step = Ledger(), Tally(), 0
        self.p = store.create_project("service-kills", files={"main.py": b"print(1)\n"}).id
        self.ledger.wrote({"main.py": b"print(1)\n"})
        store.sweep()

    def service(self, pause_at: str | None) -> tuple[Any, httpx.Client, Output]:
        env = {"DRAFTSTORE_HEARTBEAT_TTL_S": str(TTL), "DRAFTSTORE_BACKGROUND_INTERVAL_S": "0"}
        if pause_at:
            env["DRAFTSTORE_PAUSE_AT"] = pause_at
        svc = self.start_service(env=env)
        return svc, svc.client(), Output(svc.proc)

    def begin(self, c: httpx.Client, where: str) -> str:
        """Continue the draft through this service (start a turn if none is open)."""
        draft = self.store.get_draft(self.p) if self.store.get_project(self.p).active_draft_id else None
        r = c.post(f"/v1/projects/{self.p}/turns", json={"user_message": where, "continue": draft is not None})
        assert r.status_code == 201, f"{where}: {r.status_code} {r.text}"
        if draft is not None:
            turn = r.json()
            assert (turn["continues_turn_id"], turn["start_root"]) == (draft.last_turn_id, draft.root), where
            self.tally.continued += 1
        return r.json()["id"]

    def put(self, c: httpx.Client, turn: str) -> tuple[str, bytes, httpx.Response]:
        self.step += 1
        path = f"s{self.step:03d}/{self.rng.randrange(10**6)}.bin"
        data = self.rng.randbytes(self.rng.choice((0, 9, 900, 30_000)))
        return path, data, c.put(f"/v1/turns/{turn}/files/{path}", content=data)

    def tool(self, c: httpx.Client, turn: str) -> None:
        args, result = {"path": "main.py", "n": self.step}, {"ok": self.rng.randrange(10**6), "big": "x" * 9000}
        r = c.post(f"/v1/turns/{turn}/tool-calls", json={"tool_name": "view_file", "args": args})
        assert r.status_code == 201, r.text
        seq = r.json()["seq"]
        self.ledger.called(turn, seq, "view_file", args)
        r = c.post(f"/v1/turns/{turn}/tool-calls/{seq}/complete", json={"result": result})
        assert r.status_code == 204, r.text
        self.ledger.called(turn, seq, "view_file", args, result, completed=True)

    def recovered(self, killed_at: float, where: str) -> None:
        assert_references_resolve(self.store, f"{where}, right after the kill")
        reaped_in = reap(self.store, self.p, killed_at, where)
        assert_references_resolve(self.store, f"{where}, after the sweep")
        assert_nothing_publishing(self.store, where)
        writes, calls = self.ledger.verify(self.store, self.p, where)
        self.tally.writes += writes
        self.tally.calls += calls
        self.tally.killed(reaped_in)

    def at_point(self, point: str, op: str) -> None:
        where = f"service kill {self.tally.kills + 1} at {point}"
        svc, c, out = self.service(point)
        turn = self.begin(c, where)
        self.tool(c, turn)
        r = c.patch(f"/v1/turns/{turn}/characters", json={"patch": {f"s{self.step}": {"hp": self.step}}})
        assert r.status_code == 200, r.text
        self.ledger.chars[f"s{self.step}"] = {"hp": self.step}
        if op != "put":  # a PUT would pause at a write point
            for _ in range(2):
                path, data, r = self.put(c, turn)
                assert r.status_code == 204, r.text
                self.ledger.wrote({path: data})
        if op == "publish":
            assert c.post(f"/v1/turns/{turn}/complete", json={"assistant_message": "done"}).status_code == 200
        versions = [v.id for v in self.store.list_versions(self.p)]
        self.step += 1
        path, data = f"s{self.step:03d}/paused.bin", self.rng.randbytes(500)
        thread, reply = in_background({
            "put": lambda: c.put(f"/v1/turns/{turn}/files/{path}", content=data),
            "complete": lambda: c.post(f"/v1/turns/{turn}/complete", json={"assistant_message": "done"}),
            "interrupt": lambda: c.post(f"/v1/turns/{turn}/interrupt", json={"partial_response": {"t": "x"}}),
            "publish": lambda: c.post(f"/v1/projects/{self.p}/publish", json={"summary": where}),
        }[op])
        out.wait_for(f"paused at {point}")
        killed_at = kill_service(svc.proc)
        thread.join(timeout=30)
        assert "error" in reply, f"{where}: the paused request was answered: {reply}"

        view = self.store.view(self.p)
        if point == "write.before_commit":
            assert not view.exists(path), f"{where}: an unanswered write committed before its commit"
        elif point == "write.after_commit":
            self.ledger.wrote({path: data})  # committed, though never answered
        elif point in ("seal.before_swap", "turn.end.before_commit"):
            assert self.store.get_turn(turn, tool_calls=False).status == "running", where
        elif point == "publish.before_commit":
            assert [v.id for v in self.store.list_versions(self.p)] == versions, where
            assert self.store.get_draft(self.p).status == "paused", where
        elif point == "publish.after_commit":
            assert self.store.get_project(self.p).current_version_id == self.store.list_versions(self.p)[-1].id
            assert self.store.get_project(self.p).active_draft_id is None, where
        self.recovered(killed_at, where)

    def at_random(self) -> None:
        where = f"service kill {self.tally.kills + 1} at random in a stream of writes"
        delay = self.rng.uniform(0.05, 1.0)
        svc, c, _ = self.service(None)
        turn = self.begin(c, where)
        first, unexpected = threading.Event(), []

        def stream() -> None:
            try:
                while True:
                    if self.rng.random() < 0.25:
                        self.tool(c, turn)
                    else:
                        path, data, r = self.put(c, turn)
                        if r.status_code != 204:
                            unexpected.append(r)
                            return
                        self.ledger.wrote({path: data})
                    first.set()
            except (httpx.HTTPError, AssertionError) as exc:  # the kill; anything else is reported below
                if not isinstance(exc, httpx.TransportError):
                    unexpected.append(exc)

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        assert first.wait(60), f"{where}: no write was acknowledged"
        time.sleep(delay)  # the random moment itself, not a synchronisation
        killed_at = kill_service(svc.proc)
        thread.join(timeout=60)
        assert not thread.is_alive() and not unexpected, f"{where} ({delay:.3f}s): {unexpected}"
        self.recovered(killed_at, f"{where} ({delay:.3f}s)")

    def finish(self) -> None:
        """A new service continues the draft, publishes it, and serves every acknowledged write."""
        svc, c, _ = self.service(None)
        turn = self.begin(c, "after every kill")
        path, data, r = self.put(c, turn)
        assert r.status_code == 204, r.text
        self.ledger.wrote({path: data})
        assert c.post(f"/v1/turns/{turn}/complete", json={"assistant_message": "done"}).status_code == 200
        r = c.post(f"/v1/projects/{self.p}/publish", json={"summary": "after every kill"})
        assert r.status_code == 201, r.text
        for path, data in self.ledger.files.items():
            got = c.get(f"/v1/projects/{self.p}/view/files/{path}", params={"at": "head"})
            assert (got.status_code, got.content) == (200, data), path


def test_a_service_killed_mid_request_keeps_every_2xx_and_a_new_service_continues_the_draft(
        stack, service_factory, store_factory):
    seed, rng = seeded()
    flavour = flavour_of(stack)
    sweeper = store_factory(settings=Settings(heartbeat_ttl_s=TTL))
    try:
        c = ServiceCampaign(service_factory, sweeper, rng)
        for point, op in SERVICE_POINTS:
            c.at_point(point, op)
        for _ in range(SERVICE_RANDOM_KILLS):
            c.at_random()
        c.finish()
        fresh = store_factory(settings=Settings(heartbeat_ttl_s=TTL))
        assert_references_resolve(fresh, "at the end")
        c.tally.writes, c.tally.calls = c.ledger.verify(fresh, c.p, "at the end", everything=True)
        assert c.tally.kills == len(SERVICE_POINTS) + SERVICE_RANDOM_KILLS
    except BaseException as exc:
        exc.add_note(f"service kill seed {seed} ({flavour}): rerun with DRAFTSTORE_KILL_SEED={seed}")
        raise
    print("\n" + c.tally.summary(flavour, "HTTP service", seed))
