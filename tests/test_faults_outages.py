"""Outages of the three backends, for real, in the middle of a turn.

Every story starts the servers it breaks itself (its own ``redis-server``, its
own SeaweedFS, its own PostgreSQL database whose backends it kills), so the
shared services other tests use are never touched. What is proved:

Redis (the coordinator: locks, event buffers, heartbeats; no truth)
  - FLUSHALL, then ``kill -9`` and a restart, mid-turn: every acknowledged write,
    JSON patch and tool call reads back after the turn ends; the turn accepts
    writes during the outage and after Redis returns.
  - A sweeper on another store does not reap the live worker whose heartbeat key
    vanished (the coordinator's ``since()`` gives workers one heartbeat TTL to
    beat again), while it does reap, once that grace is over, a turn whose worker
    stopped beating; with Redis down it reaps nobody.
  - A flush that lands inside a sweep (after its ``since()`` check, before its
    ``alive()`` reads) must not get a live worker reaped either.
  - Through a real service on that stack, SSE clients that come back with
    ``Last-Event-ID`` after the flush and the restart get ``stream.rebuilt`` and the
    durable events (tool calls, then the turn's end); one that stayed connected
    through the outage ends with the same durable history.

S3 (the blob store: content-addressed objects)
  - While SeaweedFS is stopped, writes that need a new object fail fast with
    ``backend.unavailable`` (``retryable``; HTTP 503 ``"retryable": true`` with
    ``Retry-After`` through the service) and change nothing (revision, file list,
    tool calls, projects); reads of objects read before the outage are served from
    the in-process cache. SeaweedFS restarted on the same data dir and ports keeps
    its data, and the same writes then succeed; a store with a cold cache reads
    everything back and fsck verifies every object.

PostgreSQL (the truth)
  - Pooled connections killed with ``pg_terminate_backend`` between operations:
    an operation fails with ``backend.unavailable`` (retryable) or succeeds, and
    the very next attempt succeeds (at most one failure per engine pool); killed
    while idle, they cost no failed operation at all (checkout finds them closed).
  - A connection killed inside each transaction (a batch write, a turn's end
    before and after the seal, a publish) fails the operation with a typed error,
    leaves no partial state (draft revision, status, root, files; turn status and
    tool calls; versions and head), and the retry succeeds; fsck finds no row
    naming a missing object.
  - A killer thread terminating connections while long batch writes, turn ends and
    publishes run: only typed errors, retries converge, the result is exact.
"""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest

from draftstore import Settings, Store
from draftstore import errors as E
from draftstore import faults
from draftstore.blobs import ObjectCache
from draftstore.blobs.s3 import S3BlobStore
from draftstore.coord.redis import RedisCoordinator
from draftstore.db.engine import create_db_engine
from service_fixtures import Service, _wait_ready, free_port, stack_env
from services import (PostgresDatabase, PrivateRedis, RedisServer, S3Service, load_seaweedfs_module, token,
                      unavailable)
from test_service_streams import DURABLE, EventSource, keys, new_project, start_turn, tool_call, wait_buffered

# one worker runs the whole file (parallel runs, tests/alone.py): its SeaweedFS is started once, not per worker
pytestmark = [pytest.mark.real, pytest.mark.xdist_group("faults_outages")]

MAX_FAIL_S = 10.0  # an operation against a dead backend must fail within this (issue 9)


# == small helpers ============================================================================
def wait_until(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(every)
    return value


def sleep_until_epoch(t: float) -> None:
    """Sleep until wall-clock time ``t`` (the coordinator's ``since()`` is wall-clock)."""
    while (left := t - time.time()) > 0:
        time.sleep(min(left, 0.2))


def expect_unavailable(op: Callable[[], Any], what: str) -> float:
    """Run ``op``: it must raise ``backend.unavailable`` (retryable) within MAX_FAIL_S. Returns the seconds taken."""
    started = time.monotonic()
    with pytest.raises(E.BackendUnavailable) as info:
        op()
    took = time.monotonic() - started
    assert info.value.code == "backend.unavailable" and info.value.retryable is True, (what, info.value)
    assert took < MAX_FAIL_S, f"{what} took {took:.1f}s to fail"
    return took


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def stack_of(db: PostgresDatabase, blob_url: str, coord_url: str) -> dict[str, str]:
    return {"database_url": db.url, "blob_url": blob_url, "coord_url": coord_url}


@pytest.fixture
def pg_db(real_pg_template: PostgresDatabase) -> Iterator[PostgresDatabase]:
    """A fresh database of this test alone (copied from the migrated template)."""
    db = PostgresDatabase.create(template=real_pg_template.name)
    yield db
    db.drop()


@pytest.fixture
def opened() -> Iterator[Callable[..., Store]]:
    """``opened(stack, **settings)`` opens a Store (closed after the test)."""
    stores: list[Store] = []

    def open_store(stack: dict[str, str], **settings: Any) -> Store:
        s = Store.open(**stack, settings=Settings(**settings), migrate=True)
        stores.append(s)
        return s

    yield open_store
    for s in reversed(stores):
        s.close()


def start_service(stack: dict[str, str], log: Path, env: dict[str, str] | None = None) -> Service:
    """The HTTP service (uvicorn subprocess) on ``stack``, with an admin token; ``Service.store`` is on it too."""
    port = free_port()
    store = Store.open(**stack, migrate=True)
    admin = store.tokens.create("admin", name="faults")[1]
    cmd = [sys.executable, "-m", "uvicorn", "draftstore.service.app:create_app", "--factory", "--host", "127.0.0.1",
           "--port", str(port), "--workers", "1", "--log-level", "warning", "--no-access-log"]
    with open(log, "ab") as out:  # a file, not a pipe: warnings logged during an outage must never block it
        proc = subprocess.Popen(cmd, env={**stack_env(stack), **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
    svc = Service(f"http://127.0.0.1:{port}", proc, store, admin)
    try:
        _wait_ready(svc.url, proc)
    except BaseException:
        svc.stop()
        store.close()
        raise
    return svc


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Callable[..., Service]]:
    started: list[Service] = []

    def start(stack: dict[str, str], env: dict[str, str] | None = None) -> Service:
        svc = start_service(stack, tmp_path / f"service-{len(started)}.log", env)
        started.append(svc)
        return svc

    yield start
    for svc in reversed(started):
        svc.stop()
        svc.store.close()


# == Redis ===================================================================================
@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path / "redis").start()
    yield server
    server.stop()


class Beater:
    """A worker's heartbeat loop, in a thread; ``paused()`` holds it between two beats."""

    def __init__(self, store: Store, turn_id: str, every: float = 0.2) -> None:
        self.store, self.turn_id, self.every = store, turn_id, every
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.beats = 0
        self.thread = threading.Thread(target=self._run, name="beater", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            with self.lock:
                try:
                    self.store.heartbeat(self.turn_id)
                    self.beats += 1
                except BaseException as exc:  # reported by the test
                    self.errors.append(exc)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self.lock:
            yield

    def __enter__(self) -> "Beater":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


class Ledger:
    """What a worker was told succeeded: files, tool calls (with results), character patches."""

    def __init__(self, store: Store, turn_id: str) -> None:
        self.store, self.turn_id = store, turn_id
        self.files: dict[str, bytes] = {}
        self.calls: list[tuple[int, str, Any]] = []
        self.characters: dict[str, Any] = {}

    def step(self, tag: str) -> None:
        """One unit of agent work: a tool call (started, completed), a file write, a character patch."""
        call = self.store.tool_started(self.turn_id, f"tool_{tag}", {"tag": tag})
        self.store.tool_completed(self.turn_id, call.seq, {"ok": tag})
        self.calls.append((call.seq, f"tool_{tag}", {"ok": tag}))
        data = f"# written {tag}\nTAG = {tag!r}\n".encode()
        self.store.write_file(self.turn_id, f"work/{tag}.py", data)
        self.files[f"work/{tag}.py"] = data
        self.store.patch_characters(self.turn_id, {tag: {"n": len(self.calls)}})
        self.characters[tag] = {"n": len(self.calls)}

    def verify(self, reader: Store) -> None:
        """Everything acknowledged reads back from ``reader`` (a store that never saw the outage)."""
        turn = reader.get_turn(self.turn_id)
        assert [(c.seq, c.tool_name, c.result, c.status) for c in turn.tool_calls] == [
            (seq, name, result, "completed") for seq, name, result in self.calls]
        end = reader.view_at_turn(self.turn_id, "end")
        for path, data in self.files.items():
            assert end.read_file(path) == data, path
        assert {k: v for k, v in end.characters.items() if k in self.characters} == self.characters


def test_redis_flushed_then_killed_and_restarted_mid_turn_loses_no_truth_and_never_reaps_the_live_worker(
        pg_db, real_s3: S3Service, own_redis: PrivateRedis, opened):
    ttl = 2.0
    stack = stack_of(pg_db, real_s3.url(f"t-{token()}"), own_redis.url("lib"))
    worker = opened(stack, heartbeat_ttl_s=ttl)
    sweeper = opened(stack, heartbeat_ttl_s=ttl)  # another replica, sharing only the backends
    live_p = worker.create_project(f"live-{token(3)}", files={"main.py": b"print(1)\n"})
    dead_p = worker.create_project(f"dead-{token(3)}", files={"main.py": b"print(2)\n"})
    live = worker.start_turn(live_p.id, "keep working", actor="worker-live")
    dead = worker.start_turn(dead_p.id, "abandoned", actor="worker-dead")
    worker.write_file(dead.id, "left.py", b"LEFT = 1\n")  # acknowledged; then its worker stops beating
    ledger = Ledger(worker, live.id)
    ledger.step("before")
    alive = lambda t: sweeper.coord.alive(f"turn:{t.id}")  # noqa: E731

    with Beater(worker, live.id) as beater:
        # both turns are older than a heartbeat TTL; only the live one's worker beats
        wait_until(lambda: not alive(dead), 10, "the abandoned turn's heartbeat to lapse")
        time.sleep(max(0.0, ttl + 0.2 - (time.time() - dead.started_at.timestamp())))
        assert alive(live)

        # 1. FLUSHALL between two beats: both heartbeat keys are gone, the sweep gives the grace
        with beater.paused():
            own_redis.flushall()
            flushed_at = time.time()
            assert not alive(live) and not alive(dead)
            assert sweeper.sweep()["turns_reaped"] == 0
            since = sweeper.coord.since()
            assert flushed_at - 0.5 <= since <= time.time()
        ledger.step("after-flush")
        # grace over: the live worker beat into the new state, the abandoned one did not
        sleep_until_epoch(since + ttl + 0.3)
        assert alive(live) and not alive(dead)
        assert sweeper.sweep() == {"turns_reaped": 1, "turns_failed": 0, "publishing_released": 0, "sandboxes_lost": 0}
        assert worker.get_turn(live.id, tool_calls=False).status == "running"

        # 2. kill -9: the turn goes on (writes, tool calls, patches, beats); a sweep reaps nobody
        own_redis.kill()
        started = time.monotonic()
        ledger.step("redis-down")
        worker.heartbeat(live.id)  # the beat is lost, the call is not refused
        assert sweeper.sweep() == {"turns_reaped": 0, "turns_failed": 0, "publishing_released": 0, "sandboxes_lost": 0}
        down_s = time.monotonic() - started
        assert down_s < MAX_FAIL_S, down_s

        # 3. restarted, empty (while the worker is between two beats): the key is gone again, and again
        # the grace protects the worker
        with beater.paused():
            own_redis.start()
            restarted_at = time.time()
            assert not alive(live)
            assert sweeper.sweep()["turns_reaped"] == 0
            since = sweeper.coord.since()
            assert restarted_at - 0.5 <= since <= time.time()
        ledger.step("after-restart")
        sleep_until_epoch(since + ttl + 0.3)
        assert alive(live)
        assert sweeper.sweep()["turns_reaped"] == 0
        ledger.step("after-grace")
    assert beater.errors == [] and beater.beats > 10, (beater.errors, beater.beats)

    ended = worker.complete_turn(live.id, "done")
    assert ended.status == "completed" and len(ended.tool_calls) == 5
    reader = opened(stack)  # a store that never saw any of it
    ledger.verify(reader)
    reaped = reader.get_turn(dead.id)
    assert (reaped.status, reaped.end_reason) == ("interrupted", "heartbeat_lapsed")
    assert reader.view_at_turn(dead.id, "end").read_file("left.py") == b"LEFT = 1\n"
    assert reader.fsck(verify_objects=False).ok
    print(f"redis: 1 flush + 1 kill/restart; {len(ledger.calls)} tool calls, {len(ledger.files)} files, "
          f"{len(ledger.characters)} patches all read back; {beater.beats} beats; ops while down took {down_s:.2f}s")


def test_a_flush_landing_inside_a_sweep_does_not_get_a_live_worker_reaped(
        pg_db, real_s3: S3Service, own_redis: PrivateRedis, opened, monkeypatch):
    ttl = 1.0
    stack = stack_of(pg_db, real_s3.url(f"t-{token()}"), own_redis.url("race"))
    worker = opened(stack, heartbeat_ttl_s=ttl)
    sweeper = opened(stack, heartbeat_ttl_s=ttl)
    p = worker.create_project(f"race-{token(3)}", files={"main.py": b"print(1)\n"})
    turn = worker.start_turn(p.id, "keep working")
    with Beater(worker, turn.id, every=0.1) as beater:
        # past the coordinator's own grace, and the turn older than a TTL: a normal sweep can reap
        sleep_until_epoch(max(sweeper.coord.since(), turn.started_at.timestamp()) + ttl + 0.3)
        assert sweeper.sweep()["turns_reaped"] == 0  # a beating worker is not reaped
        real_alive = sweeper.coord.alive

        def alive_right_after_a_flush(key: str) -> bool:
            # Redis is flushed (or restarted empty) after the sweep's since() read, before this read
            own_redis.flushall()
            return real_alive(key)

        with beater.paused():  # the worker is between two beats
            monkeypatch.setattr(sweeper.coord, "alive", alive_right_after_a_flush)
            swept = sweeper.sweep()
            monkeypatch.setattr(sweeper.coord, "alive", real_alive)
    assert beater.errors == []
    status = worker.get_turn(turn.id, tool_calls=False)
    assert (status.status, swept["turns_reaped"]) == ("running", 0), (status.end_reason, swept)

def reconnected_readers_miss_nothing(svc: Any, c: Any, t: str, last: str, seen: list[Any], watcher: Any,
                                     expected: list[tuple[str, Any]], watcher_timeout: float) -> tuple[list[Any], int]:
    """After the coordinator lost a running turn's buffer: a client that left before the loss
    comes back with its ``Last-Event-ID`` and gets the durable history rebuilt (once, in a new
    epoch), then the live events of the turn's last call and its end; the ``watcher`` that
    stayed connected is told of the loss (one or two ``stream.rebuilt``) and ends with the
    same durable history. The turn is completed here. Returns the durable events and how many
    ``stream.rebuilt`` the watcher saw."""
    with EventSource(svc.url, f"/v1/turns/{t}/events", token=svc.admin, last_event_id=last) as es:
        rebuilt = es.read_n(1 + len(expected))
        assert rebuilt[0].type == "stream.rebuilt" and rebuilt[0].json["deltas_missing"] is True
        assert keys(rebuilt[1:]) == expected
        assert rebuilt[-1].epoch not in (seen[-1].epoch, "-")  # the coordinator's new buffer
        assert es.poll(timeout=0.5) is None  # nothing twice
        seq = tool_call(c, t, "last")  # the turn goes on, live events follow
        r = c.post(f"/v1/turns/{t}/complete", json={"assistant_message": "done"})
        assert r.status_code == 200, r.text
        live = es.read_to_end(timeout=30)
    assert keys(live) == [("tool.started", seq), ("tool.completed", seq), ("turn.completed", None),
                          ("stream.end", None)]

    with watcher:  # told of the loss on its open stream; ends with the same durable history
        got = watcher.read_to_end(timeout=watcher_timeout)
    types = [e.type for e in got]
    assert watcher.ended and not watcher.aborted and types[-1] == "stream.end"
    assert 1 <= types.count("stream.rebuilt") <= 2, types
    marker = len(types) - 1 - types[::-1].index("stream.rebuilt")
    final = [(k, d.get("seq")) for k, d in svc.store.durable_events(t)]
    assert [k for k in keys(got[marker + 1:]) if k[0] in DURABLE] == final
    return final, types.count("stream.rebuilt")



def test_sse_clients_reconnecting_after_a_redis_flush_and_restart_get_the_durable_events(
        pg_db, real_s3: S3Service, own_redis: PrivateRedis, services):
    svc = services(stack_of(pg_db, real_s3.url(f"t-{token()}"), own_redis.url("svc")))
    c = svc.client()
    p = new_project(c, "outage")
    t = start_turn(c, p)
    tool_call(c, t)
    assert c.put(f"/v1/turns/{t}/files/a.py", content=b"A = 1\n").status_code == 204
    tool_call(c, t)
    wait_buffered(c, t, lambda ev: len(ev) == 6)  # started, 2 x (tool.started, tool.completed), draft.changed
    with EventSource(svc.url, f"/v1/turns/{t}/events", token=svc.admin) as es:
        seen = es.read_n(6)
    last = seen[-1].last_event_id
    # a second client stays connected through everything
    watcher = EventSource(svc.url, f"/v1/turns/{t}/events", token=svc.admin, last_event_id=seen[-2].last_event_id)
    assert watcher.read_n(1)[0].last_event_id == last

    written = {"a.py": b"A = 1\n"}

    def work(name: str) -> None:
        tool_call(c, t, name)
        r = c.put(f"/v1/turns/{t}/files/{name}.py", content=name.encode())
        assert r.status_code == 204, r.text
        written[f"{name}.py"] = name.encode()

    own_redis.flushall()
    work("after_flush")
    own_redis.kill()
    started = time.monotonic()
    work("redis_down")  # the service takes writes and tool calls while its coordinator is dead
    assert c.post(f"/v1/turns/{t}/heartbeat").status_code == 204
    down_s = time.monotonic() - started
    own_redis.start()
    work("after_restart")
    wait_buffered(c, t, lambda ev: bool(ev) and ev[-1]["type"] == "draft.changed")
    expected = [("turn.started", None)] + [(k, s) for s in range(1, 6) for k in ("tool.started", "tool.completed")]
    durable = [(k, d.get("seq")) for k, d in svc.store.durable_events(t)]
    assert durable == expected

    # the restarted Redis's buffer; the watcher saw the flush and the restart (or both as one)
    final, rebuilds = reconnected_readers_miss_nothing(svc, c, t, last, seen, watcher, expected, watcher_timeout=30)
    assert final[-1] == ("turn.completed", None) and len(final) == 1 + 2 * 6 + 1

    # the truth, read through the service
    turn = c.get(f"/v1/turns/{t}").json()
    assert turn["status"] == "completed"
    assert [(x["seq"], x["status"]) for x in turn["tool_calls"]] == [(s, "completed") for s in range(1, 7)]
    for path, data in written.items():
        r = c.get(f"/v1/projects/{p}/view/files/{path}")
        assert r.status_code == 200 and r.content == data, path
    print(f"sse: {rebuilds} rebuild(s) on the open stream; 6 tool calls, {len(written)} files; "
          f"requests while Redis was dead took {down_s:.2f}s")


# == S3 =======================================================================================
class OwnSeaweedFS:
    """A SeaweedFS of this module alone. ``stop()`` / ``start()`` restart the same instance: same data dir,
    same ports, same credentials (the instance keeps ``port_base`` and its keys; a new ``SeaweedFS(dir)``
    would pick new ones), so everything stored before the outage is there after it."""

    def __init__(self, base: Path) -> None:
        self.module = load_seaweedfs_module()
        self.bucket = f"faults-{token(4)}"
        self.outages = 0
        try:
            self.fs = self.module.SeaweedFS(base)
            self.fs.start()
        except self.module.SeaweedFSError as exc:
            unavailable("S3 (SeaweedFS)", exc)
        self.wait_writable()

    def running(self) -> bool:
        return self.fs.running()

    def stop(self) -> float:
        started = time.monotonic()
        self.fs.stop()
        self.outages += 1
        return time.monotonic() - started

    def start(self) -> float:
        """Start (again) and wait until it stores objects: the S3 port answers before the volume server
        takes writes (a PUT right after a restart can hang for seconds)."""
        started = time.monotonic()
        self.fs.start()
        self.wait_writable()
        return time.monotonic() - started

    def wait_writable(self, timeout: float = 60.0) -> None:
        import boto3
        from botocore.config import Config

        client = boto3.session.Session(
            aws_access_key_id=self.fs.access_key, aws_secret_access_key=self.fs.secret_key, region_name="us-east-1",
        ).client("s3", endpoint_url=self.fs.endpoint_url, config=Config(
            s3={"addressing_style": "path"}, connect_timeout=1, read_timeout=5, retries={"total_max_attempts": 1}))
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou,
                                             client.exceptions.BucketAlreadyExists):
                        client.create_bucket(Bucket=self.bucket)
                    client.put_object(Bucket=self.bucket, Key="probe", Body=token().encode())
                    return
                except Exception as exc:
                    assert time.monotonic() < deadline, f"SeaweedFS took no writes within {timeout}s: {exc}"
                    time.sleep(0.1)
        finally:
            client.close()

    def url(self, prefix: str) -> str:
        query = {"endpoint_url": self.fs.endpoint_url, "region": "us-east-1", "create": "1"}
        return f"s3://{self.bucket}/{prefix}?{urlencode(query)}"

    def blob_store(self, prefix: str, cache: ObjectCache) -> S3BlobStore:
        """Fail fast on a dead endpoint: connect 1 s, read 3 s, 2 attempts (the URL cannot say so)."""
        return S3BlobStore(self.bucket, prefix, endpoint_url=self.fs.endpoint_url, region="us-east-1", create=True,
                           cache=cache, aws_access_key_id=self.fs.access_key,
                           aws_secret_access_key=self.fs.secret_key, connect_timeout_s=1.0, read_timeout_s=3.0,
                           max_attempts=2)

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.fs.access_key, "AWS_SECRET_ACCESS_KEY": self.fs.secret_key,
                "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def seaweed_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnSeaweedFS]:
    fs = OwnSeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    yield fs
    fs.fs.stop()


@pytest.fixture
def seaweed(seaweed_module: OwnSeaweedFS) -> Iterator[OwnSeaweedFS]:
    """The module's SeaweedFS, running when the test starts and when it ends (even if it failed mid-outage)."""
    if not seaweed_module.running():
        seaweed_module.start()
    yield seaweed_module
    if not seaweed_module.running():
        seaweed_module.start()


def draft_state(store: Store, project_id: str, turn_id: str) -> tuple[Any, ...]:
    """Everything a failed write must leave as it was."""
    d = store.get_draft(project_id)
    t = store.get_turn(turn_id)
    return (d.revision, d.status, d.root, d.file_count, list(store.view(project_id).list_files()), t.status,
            [(c.seq, c.status) for c in t.tool_calls], len(store.list_projects()))


def test_text_sent_while_redis_is_down_is_refused_retryable_and_lands_once_it_is_back(
        pg_db, real_s3: S3Service, own_redis: PrivateRedis, services):
    """A delta lives only in the buffer: while Redis is down the service must not acknowledge
    one (503, retryable) rather than drop it silently; the turn itself goes on."""
    svc = services(stack_of(pg_db, real_s3.url(f"t-{token()}"), own_redis.url("svc")))
    c = svc.client()
    p = new_project(c, "deltas")
    t = start_turn(c, p)
    assert c.post(f"/v1/turns/{t}/deltas", json={"text": "before "}).status_code == 204
    own_redis.kill()
    r = c.post(f"/v1/turns/{t}/deltas", json={"text": "lost? "})
    assert r.status_code == 503, r.text
    assert r.json()["code"] == "backend.unavailable" and r.json()["retryable"] is True
    assert c.put(f"/v1/turns/{t}/files/a.py", content=b"A = 1\n").status_code == 204  # the turn goes on
    own_redis.start()  # empty: the buffer is gone, the stream will say so
    wait_until(lambda: c.post(f"/v1/turns/{t}/deltas", json={"text": "after"}).status_code == 204, 30,
               "a delta to be taken once Redis is back")
    # the buffer as it is now (a bare number: without one, the page is the history rebuilt, deltas missing)
    events = c.get(f"/v1/turns/{t}/events", params={"after": 0}, headers={"accept": "application/json"}).json()["events"]
    assert [e["data"]["text"] for e in events if e["type"] == "assistant.delta"] == ["after"]


def test_s3_down_writes_fail_retryable_and_change_nothing_cached_reads_go_on_and_the_writes_succeed_after(
        pg_db, real_redis: RedisServer, seaweed: OwnSeaweedFS):
    prefix = f"t-{token()}"
    cache = ObjectCache(64 * 1024 * 1024)
    store = Store(create_db_engine(pg_db.url), seaweed.blob_store(prefix, cache),
                  RedisCoordinator.from_url(real_redis.url(token())), Settings(), cache)
    try:
        before_files = {"main.py": b"print(1)\n", "src/util.py": b"def util():\n    return 1\n"}
        p = store.create_project(f"s3-{token(3)}", files=before_files)
        t = store.start_turn(p.id, "work")
        store.write_file(t.id, "cached.py", b"CACHED = True\n")
        expected = {**before_files, "cached.py": b"CACHED = True\n"}
        view = store.view(p.id)
        assert {path: view.read_file(path) for path in view.list_files()} == expected  # now in the cache
        state = draft_state(store, p.id, t.id)

        stop_s = seaweed.stop()
        writes: list[tuple[str, Callable[[], Any]]] = [
            ("write_file new", lambda: store.write_file(t.id, "new.py", b"NEW = 1\n")),
            ("write_file overwrite", lambda: store.write_file(t.id, "cached.py", b"CACHED = False\n")),
            ("apply_changes", lambda: store.apply_changes(t.id, {"b/one.py": b"1\n", "b/two.py": b"2\n",
                                                                 "main.py": None})),
            ("tool call, offloaded args", lambda: store.tool_started(t.id, "big", {"blob": "x" * 20_000})),
            ("complete_turn (seal)", lambda: store.complete_turn(t.id, "done")),
            ("create_project", lambda: store.create_project(f"s3-new-{token(3)}", files={"x.py": b"x\n"})),
        ]
        took = {what: expect_unavailable(op, what) for what, op in writes}
        assert draft_state(store, p.id, t.id) == state  # nothing changed: revision, files, turn, calls, projects
        # reads of what was read before the outage: served from the cache
        during = store.view(p.id)
        assert {path: during.read_file(path) for path in during.list_files()} == expected
        assert store.check_backends()["blobs"] is not None  # the probe does not trust the cache

        start_s = seaweed.start()
        for what, op in writes:  # the very same calls, now
            op()
        assert store.get_turn(t.id).status == "completed"
        version = store.publish(p.id, "after the outage")
    finally:
        store.close()

    # a store with a cold cache: everything, from before and after the outage, is in S3
    cold_cache = ObjectCache(0)
    cold = Store(create_db_engine(pg_db.url), seaweed.blob_store(prefix, cold_cache),
                 RedisCoordinator.from_url(real_redis.url(token())), Settings(), cold_cache)
    try:
        head = cold.view_at(p.id, version.id)
        assert {path: head.read_file(path) for path in head.list_files()} == {
            "src/util.py": before_files["src/util.py"], "cached.py": b"CACHED = False\n", "new.py": b"NEW = 1\n",
            "b/one.py": b"1\n", "b/two.py": b"2\n"}
        calls = cold.get_turn(t.id).tool_calls
        assert [c.tool_name for c in calls] == ["big"] and cold.read_payload(calls[0].args_digest) == {
            "blob": "x" * 20_000}
        report = cold.fsck(verify_objects=True)
        assert report.ok, report.problems
        assert len([pr for pr in cold.list_projects() if pr.name.startswith("s3-new-")]) == 1
    finally:
        cold.close()
    print(f"s3 (library): stop {stop_s:.1f}s, restart {start_s:.1f}s; {len(writes)} writes failed "
          f"backend.unavailable retryable in {', '.join(f'{w}: {s:.2f}s' for w, s in took.items())}; "
          f"{len(writes)} succeeded after; fsck verified {report.objects_verified} objects")


def test_s3_down_the_service_answers_503_retryable_keeps_the_draft_and_succeeds_after(
        pg_db, real_redis: RedisServer, seaweed: OwnSeaweedFS, services):
    # the service's S3 client has the defaults (connect 3 s, read 30 s, 3 attempts): the URL cannot change them
    stack = stack_of(pg_db, seaweed.url(f"t-{token()}"), real_redis.url(token()))
    svc = services(stack, env=seaweed.env())
    c = svc.client()
    p = new_project(c, "s3-down")
    t = start_turn(c, p)
    assert c.put(f"/v1/turns/{t}/files/a.py", content=b"A = 1\n").status_code == 204
    reads = {"main.py": b"print(1)\n", "a.py": b"A = 1\n"}

    def state() -> tuple[Any, ...]:
        draft = c.get(f"/v1/projects/{p}/draft").json()
        found = c.get(f"/v1/projects/{p}/view/find").json()["paths"]
        calls = c.get(f"/v1/turns/{t}").json()["tool_calls"]
        return draft["revision"], draft["root"], draft["status"], found, len(calls)

    for path, data in reads.items():  # read once: now in the service's cache
        assert c.get(f"/v1/projects/{p}/view/files/{path}").content == data
    before = state()

    seaweed.stop()
    requests: list[tuple[str, Callable[[], httpx.Response]]] = [
        ("PUT file", lambda: c.put(f"/v1/turns/{t}/files/b.py", content=b"B = 2\n")),
        ("POST changes", lambda: c.post(f"/v1/turns/{t}/changes",
                                        json={"changes": {"c.py": "QyA9IDMK", "main.py": None}})),
        ("POST tool call (offloaded args)", lambda: c.post(f"/v1/turns/{t}/tool-calls",
                                                           json={"tool_name": "big", "args": {"x": "y" * 20_000}})),
        ("POST complete", lambda: c.post(f"/v1/turns/{t}/complete", json={"assistant_message": "done"})),
    ]
    took = {}
    for what, send in requests:
        started = time.monotonic()
        r = send()
        took[what] = time.monotonic() - started
        assert r.status_code == 503, (what, r.status_code, r.text)
        body = r.json()
        assert (body["code"], body["retryable"]) == ("backend.unavailable", True), (what, body)
        assert r.headers.get("retry-after") == "1"
        assert took[what] < MAX_FAIL_S, (what, took[what])
    assert state() == before
    for path, data in reads.items():  # cached reads go on
        r = c.get(f"/v1/projects/{p}/view/files/{path}")
        assert r.status_code == 200 and r.content == data, path
    ready = c.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["blobs"] != "ok", ready.text

    seaweed.start()
    for what, send in requests:  # the same requests succeed
        r = send()
        assert r.status_code in (200, 201, 204), (what, r.status_code, r.text)
    assert c.get("/readyz").status_code == 200
    turn = c.get(f"/v1/turns/{t}").json()
    assert turn["status"] == "completed" and [x["tool_name"] for x in turn["tool_calls"]] == ["big"]
    got = {path: c.get(f"/v1/projects/{p}/view/files/{path}").content
           for path in c.get(f"/v1/projects/{p}/view/find").json()["paths"]}
    assert got == {"a.py": b"A = 1\n", "b.py": b"B = 2\n", "c.py": b"C = 3\n"}
    print(f"s3 (service): {len(requests)} requests answered 503 retryable in "
          f"{', '.join(f'{w}: {s:.2f}s' for w, s in took.items())}; all succeeded after the restart")


# == PostgreSQL ==================================================================================
class PgKiller:
    """``pg_terminate_backend`` from an admin connection, aimed at one database's client backends."""

    def __init__(self, db: PostgresDatabase) -> None:
        import psycopg

        self.db = db.name
        self.conn = psycopg.connect(db.admin_url, autocommit=True, connect_timeout=5)

    def kill(self, where: str = "true") -> int:
        """Terminate (and wait for) the test database's backends matching ``where``; returns how many."""
        row = self.conn.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
            f"WHERE datname = %s AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND ({where})",
            (self.db,)).fetchone()
        return int(row[0])

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def pg_store(pg_db: PostgresDatabase, real_s3: S3Service, real_redis: RedisServer,
             opened: Callable[..., Store]) -> Store:
    return opened(stack_of(pg_db, real_s3.url(f"t-{token()}"), real_redis.url(token())))


@pytest.fixture
def killer(pg_db: PostgresDatabase) -> Iterator[PgKiller]:
    k = PgKiller(pg_db)
    yield k
    k.close()


def retried(op: Callable[[], Any], failures: list[BaseException], attempts: int = 5,
            done: Callable[[], bool] | None = None) -> Any:
    """Call ``op`` until it succeeds, as a client told ``retryable`` would; each failure must be
    ``backend.unavailable``. ``done()``: the effect is already there (a commit whose answer was lost)."""
    for _ in range(attempts):
        try:
            return op()
        except E.BackendUnavailable as exc:
            assert exc.retryable and exc.code == "backend.unavailable"
            failures.append(exc)
            if done is not None and done():
                return None
    raise AssertionError(f"still failing after {attempts} attempts: {failures[-attempts:]}")


def test_pg_connections_killed_between_operations_fail_typed_and_the_pool_recovers_at_once(
        pg_store: Store, killer: PgKiller):
    store = pg_store
    p = store.create_project(f"pg-{token(3)}", files={"main.py": b"print(1)\n"})
    t = store.start_turn(p.id, "work")
    ledger = Ledger(store, t.id)
    ledger.step("warm")
    # fill both pools (transactions and one-statement autocommit) with several connections each
    barrier = threading.Barrier(6)

    def hold_two() -> None:
        with store.engine.connect() as a, store.database.autocommit.connect() as b:
            barrier.wait(timeout=30)
            a.exec_driver_sql("SELECT 1")
            b.exec_driver_sql("SELECT 1")

    threads = [threading.Thread(target=hold_two) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)

    ops: list[tuple[str, Callable[[int], Any]]] = [
        ("tool_started", lambda i: store.tool_started(t.id, "probe", {"i": i})),
        ("write_file", lambda i: store.write_file(t.id, f"probe/{i}.py", b"%d\n" % i)),
        ("patch_characters", lambda i: store.patch_characters(t.id, {"probe": i})),
        ("heartbeat", lambda i: store.heartbeat(t.id)),
        ("get_turn", lambda i: store.get_turn(t.id)),
        ("view.read_file", lambda i: store.view(p.id).read_file("main.py")),
    ]
    killed, failed = [], []
    for rnd in range(3):
        killed.append(killer.kill())
        assert killed[-1] >= 2, killed  # both pools had idle connections
        for name, op in ops:
            failures: list[BaseException] = []
            result = retried(lambda: op(rnd), failures, attempts=2)  # the very next attempt works
            if name == "tool_started":
                store.tool_completed(t.id, result.seq, {"round": rnd})
                ledger.calls.append((result.seq, "probe", {"round": rnd}))
            if name == "write_file":
                ledger.files[f"probe/{rnd}.py"] = b"%d\n" % rnd
            failed += [(rnd, name)] * len(failures)
        # one failure at most per pool: a disconnect is seen once, then the pool is renewed
        assert len([f for f in failed if f[0] == rnd]) <= 2, failed
    ledger.characters = {"warm": {"n": 1}, "probe": 2}
    store.complete_turn(t.id, "done")
    ledger.verify(store)
    assert store.fsck(verify_objects=False).ok
    print(f"pg idle kills: {killed} backends killed per round; failed attempts {len(failed)} "
          f"({failed}), each retried once successfully; {len(ops) * 3} operations done")


def test_pg_connections_killed_while_idle_cost_no_failed_operation(pg_store: Store, killer: PgKiller):
    store = pg_store
    p = store.create_project(f"pg-idle-{token(3)}", files={"main.py": b"print(1)\n"})
    t = store.start_turn(p.id, "work")
    store.tool_started(t.id, "warm", {})
    store.write_file(t.id, "warm.py", b"W = 1\n")
    assert killer.kill() >= 2
    store.tool_started(t.id, "after the kill", {})  # one-statement pool
    store.write_file(t.id, "after.py", b"A = 1\n")  # transaction pool


def test_pg_connection_killed_inside_each_transaction_leaves_no_partial_state_and_the_retry_succeeds(
        pg_store: Store, killer: PgKiller, monkeypatch):
    store = pg_store
    armed: set[str] = set()
    kills: list[tuple[str, int]] = []
    real_point = faults.point

    def point(name: str) -> None:
        if name in armed:  # the operation's transaction is open, waiting for its client: kill that backend
            armed.discard(name)
            kills.append((name, killer.kill("state = 'idle in transaction'")))
        real_point(name)

    monkeypatch.setattr(faults, "point", point)
    p = store.create_project(f"pg-tx-{token(3)}", files={"main.py": b"print(1)\n", "lib/a.py": b"A = 1\n"})
    v1 = store.get_project(p.id).current_version_id
    t = store.start_turn(p.id, "work")
    call = store.tool_started(t.id, "edit", {"n": 40})

    def state() -> tuple[Any, ...]:
        proj = store.get_project(p.id)
        try:
            d = store.get_draft(p.id)
            draft: Any = (d.id, d.revision, d.status, d.root, d.file_count, d.closed_at)
        except E.DraftNone:
            draft = None
        turn = store.get_turn(t.id)
        view = store.view(p.id)
        files = {path: digest(view.read_file(path)) for path in view.list_files()}
        return (proj.current_version_id, proj.active_draft_id, draft, turn.status, turn.end_root,
                [(c.seq, c.status) for c in turn.tool_calls], files, len(store.list_versions(p.id)),
                len(store.head_moves(p.id)))

    def killed_at(name: str, op: Callable[[], Any], retry: bool = True) -> Any:
        """Kill the operation's connection at ``name``: a typed error and nothing changed; then retry."""
        before = state()
        armed.add(name)
        with pytest.raises(E.BackendUnavailable) as info:
            op()
        assert name not in armed, f"{name} was never reached"
        assert info.value.retryable and info.value.code == "backend.unavailable"
        assert state() == before, f"partial state after a kill at {name}"
        return op() if retry else None  # the retry, on a renewed pool

    batch = {f"gen/f{i:02d}.py": f"N = {i}\n".encode() for i in range(40)}
    killed_at("write.before_commit", lambda: store.apply_changes(t.id, {**batch, "lib/a.py": None}))
    store.tool_completed(t.id, call.seq, {"written": 40})
    killed_at("seal.before_swap", lambda: store.complete_turn(t.id, "first try"), retry=False)
    # the ending transaction again, this time after the seal moved the root (same transaction)
    ended = killed_at("turn.end.before_commit", lambda: store.complete_turn(t.id, "third try"))
    assert ended.status == "completed" and ended.assistant_message == "third try"
    v2 = killed_at("publish.before_commit", lambda: store.publish(p.id, "v2", actor="admin"))

    assert [name for name, _ in kills] == ["write.before_commit", "seal.before_swap", "turn.end.before_commit",
                                            "publish.before_commit"]
    assert all(n == 1 for _, n in kills), kills  # exactly the operation's own backend
    proj = store.get_project(p.id)
    assert proj.current_version_id == v2.id and proj.active_draft_id is None and v2.number == 2
    assert [m.to_version_id for m in store.head_moves(p.id)] == [v1, v2.id]
    head = store.view(p.id)
    assert {path: head.read_file(path) for path in head.list_files()} == {**batch, "main.py": b"print(1)\n"}
    assert [(c.seq, c.status, c.result) for c in store.get_turn(t.id).tool_calls] == [
        (1, "completed", {"written": 40})]
    report = store.fsck(verify_objects=False)
    assert report.ok, report.problems
    print(f"pg in-transaction kills: {kills}; each failed backend.unavailable, state unchanged, retry succeeded")


def test_an_interrupt_whose_connection_is_killed_keeps_the_streamed_text_for_its_retry(
        pg_store: Store, killer: PgKiller, monkeypatch):
    store = pg_store
    kills: list[int] = []
    real_point = faults.point

    def point(name: str) -> None:
        if name == "turn.end.before_commit" and not kills:
            kills.append(killer.kill("state = 'idle in transaction'"))
        real_point(name)

    monkeypatch.setattr(faults, "point", point)
    p = store.create_project(f"pg-text-{token(3)}", files={"main.py": b"print(1)\n"})
    t = store.start_turn(p.id, "talk")
    for piece in ("The dragon ", "wakes ", "and "):
        store.append_delta(t.id, piece)
    with pytest.raises(E.BackendUnavailable):
        store.interrupt_turn(t.id)
    assert kills == [1] and store.get_turn(t.id).status == "running"
    ended = store.interrupt_turn(t.id)  # the retry: the text streamed before the failed end is all there
    assert ended.status == "interrupted" and ended.partial_response == {"text": "The dragon wakes and "}
    assert store.get_turn(t.id).partial_response == {"text": "The dragon wakes and "}


def test_pg_connections_killed_while_long_writes_turn_ends_and_publishes_run(
        pg_db: PostgresDatabase, real_s3: S3Service, real_redis: RedisServer, opened: Callable[..., Store]):
    stack = stack_of(pg_db, real_s3.url(f"t-{token()}"), real_redis.url(token()))
    store = opened(stack)
    armed = threading.Event()
    stop = threading.Event()
    kills: list[str] = []
    errors: list[BaseException] = []

    def kill_loop() -> None:
        # once armed, terminate the first backend of the database found inside a transaction
        k = PgKiller(pg_db)
        try:
            while not stop.is_set():
                if not armed.wait(0.05):
                    continue
                row = k.conn.execute(
                    "SELECT pid, state, left(query, 40) FROM pg_stat_activity WHERE datname = %s "
                    "AND backend_type = 'client backend' AND xact_start IS NOT NULL AND pid <> pg_backend_pid() "
                    "LIMIT 1", (k.db,)).fetchone()
                if row is not None and armed.is_set():
                    if k.conn.execute("SELECT pg_terminate_backend(%s, 5000)", (row[0],)).fetchone()[0]:
                        kills.append(f"{row[1]}: {row[2]}")
                        armed.clear()
                else:
                    time.sleep(0.001)
        except BaseException as exc:
            errors.append(exc)
        finally:
            k.close()

    thread = threading.Thread(target=kill_loop, name="pg-killer", daemon=True)
    thread.start()
    # every call is retried as a client told "retryable" would: a kill may also land just after an operation
    # returned its connection to the pool, and then the next operation on that connection pays for it
    failures: dict[str, list[BaseException]] = {k: [] for k in ("apply_changes", "complete_turn", "publish", "other")}
    other = failures["other"]
    p = retried(lambda: store.create_project(f"pg-long-{token(3)}", files={"main.py": b"print(0)\n"}), other)
    expected = {"main.py": b"print(0)\n"}
    rounds = 4
    try:
        for rnd in range(rounds):
            t = retried(lambda: store.start_turn(p.id, f"round {rnd}"), other)
            batch = {f"r{rnd}/d{i % 10}/f{i:03d}.py": (f"R{rnd}_{i} = {i}\n" * 40).encode() for i in range(250)}
            armed.set()
            retried(lambda: store.apply_changes(t.id, batch), failures["apply_changes"])
            expected.update(batch)
            armed.set()
            retried(lambda: store.complete_turn(t.id, f"round {rnd} done"), failures["complete_turn"],
                    done=lambda: retried(lambda: store.get_turn(t.id, tool_calls=False), other).status != "running")
            armed.set()
            retried(lambda: store.publish(p.id, f"round {rnd}"), failures["publish"],
                    done=lambda: retried(lambda: store.get_project(p.id), other).active_draft_id is None)
            armed.clear()
    finally:
        stop.set()
        armed.clear()
        thread.join(timeout=30)
    assert errors == [], errors
    mid_flight = sum(len(failures[k]) for k in ("apply_changes", "complete_turn", "publish"))
    assert kills and mid_flight >= 1, (kills, failures)  # the killer did hit operations mid-flight

    reader = opened(stack)  # fresh pools: the result, exactly
    versions = reader.list_versions(p.id)
    assert len(versions) == 1 + rounds and reader.get_project(p.id).current_version_id == versions[-1].id
    head = reader.view(p.id)
    assert sorted(head.list_files()) == sorted(expected)
    assert all(head.read_file(path) == data for path, data in expected.items())
    assert [t.status for t in reader.list_turns(p.id)] == ["completed"] * rounds
    report = reader.fsck(verify_objects=False)
    assert report.ok, report.problems
    print(f"pg kills mid-flight: {len(kills)} ({kills}); failed attempts "
          f"{ {k: len(v) for k, v in failures.items()} }, every one backend.unavailable and retried to success; "
          f"{rounds} rounds x 250 files published exactly")
