"""The coordinator on a real Redis Cluster (3 masters, 1 replica each; tests/services.py).

The coordinator conformance suite runs on the cluster through the ``cluster``
param of the ``coordinator`` fixture. Here:

- URLs: ``redis+cluster://`` forms, and what is refused (``config.invalid``);
  an unreachable cluster is a typed ``backend.unavailable``.
- Stories written for the ``stack`` fixture run once more with their stack's
  coordinator on the session's cluster (``stack`` is ``cluster_stack`` in this
  module): a turn's lifecycle through the library (continued by another store,
  reaped by the sweep, its events replayed) and SSE through the real service
  (reconnecting clients miss nothing and see nothing twice; a late subscriber
  gets the whole history).
- Failover, for real, in a cluster of the test's own: ``kill -9`` of a master
  while every coordinator call on its slots runs in a loop: each succeeds or
  fails with ``backend.unavailable`` (never an untyped redis-py error), all work
  again once the replica took over, and the stream reads under a new epoch.
- ``kill -9`` of the master owning a running turn's keys, mid-turn, then its
  replica takes over. As after
  a Redis restart (tests/test_faults_outages.py): every acknowledged write, patch
  and tool call reads back; the turn goes on during the outage; a sweep during
  the outage reaps nobody, one after the failover gives the live worker its
  grace (its heartbeat lapsed while it could not beat) while the sweep before
  the fault did reap an abandoned turn; SSE clients coming back with
  ``Last-Event-ID`` get ``stream.rebuilt`` and the durable history, one that stayed
  connected ends with the same history.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from draftstore import errors as E
from draftstore.coord import open_coordinator
from draftstore.coord.redis import RedisCoordinator
from services import LocalRedisCluster, S3Service, token
from test_faults_outages import (  # noqa: F401 (fixtures)
    MAX_FAIL_S,
    Beater,
    Ledger,
    opened,
    pg_db,
    services,
    sleep_until_epoch,
    reconnected_readers_miss_nothing,
    stack_of,
    wait_until,
)
from test_service_streams import (  # noqa: F401 (stories run again here)
    DURABLE,
    EventSource,
    keys,
    new_project,
    start_turn,
    test_a_client_that_keeps_reconnecting_with_last_event_id_misses_nothing_and_sees_nothing_twice,
    test_a_turns_stream_ends_after_its_end_event_and_a_late_subscriber_gets_the_whole_history,
    tool_call,
    wait_buffered,
)
from test_real_services import test_the_stack_names_three_stores_that_open  # noqa: F401
from test_turns import (  # noqa: F401
    test_a_turns_events_can_be_replayed_in_order,
    test_an_interrupted_turn_can_be_continued_by_a_new_store_instance,
    test_the_sweep_interrupts_a_turn_whose_heartbeat_lapsed,
)

pytestmark = pytest.mark.real

QUIET = {"turns_reaped": 0, "turns_failed": 0, "publishing_released": 0, "sandboxes_lost": 0}


@pytest.fixture
def stack(cluster_stack: dict[str, str]) -> dict[str, str]:
    """The stories imported above run on PostgreSQL + S3 + the session's Redis Cluster."""
    return cluster_stack


@pytest.fixture
def own_cluster() -> Iterator[LocalRedisCluster]:
    """A cluster of this test alone: killing its masters touches nobody else."""
    cluster = LocalRedisCluster().start()
    yield cluster
    cluster.stop()


# == URLs ======================================================================================
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_cluster_url_names_its_startup_nodes_and_shows_no_password() -> None:
    coord = open_coordinator("redis+cluster://:s3cret@127.0.0.1:7000,127.0.0.1:7001?prefix=app&max_events=5")
    assert isinstance(coord, RedisCoordinator) and coord.cluster
    assert (coord.prefix, coord.max_events) == ("app", 5)
    assert "s3cret" not in coord.url and "s3cret" not in repr(coord)
    coord.close()  # never connected: nothing to close, no error


@pytest.mark.parametrize("url", [
    "redis+cluster://127.0.0.1:7000/2?prefix=app",  # a cluster has db 0 only
    "redis+cluster://127.0.0.1:7000?prefix=a{b}",  # a hash tag in the prefix would pull keys into one slot
    "redis+cluster://127.0.0.1:notaport?prefix=app",
    "redis+cluster://127.0.0.1:7000,:7001?prefix=app",
    "redis+cluster://127.0.0.1:7000?prefix=app&max_events=many",
])
def test_a_malformed_cluster_url_is_refused_as_config_invalid(url: str) -> None:
    with pytest.raises(E.ConfigInvalid) as info:
        open_coordinator(url)
    assert info.value.code == "config.invalid"


def test_an_unreachable_cluster_is_a_typed_backend_unavailable_and_opening_does_not_wait_for_it() -> None:
    coord = open_coordinator(f"redis+cluster://127.0.0.1:{_free_port()},127.0.0.1:{_free_port()}?prefix=nowhere")
    for attempt in (
        lambda: coord.append("s", "x"),
        lambda: coord.acquire("l", timeout_s=0),
        lambda: coord.alive("k"),
        lambda: coord.tail("s"),
        coord.since,
        coord.ping,
    ):
        started = time.monotonic()
        with pytest.raises(E.BackendUnavailable) as info:
            attempt()
        assert info.value.code == "backend.unavailable" and info.value.retryable is True
        assert info.value.__cause__ is not None  # the redis-py error, chained
        assert time.monotonic() - started < MAX_FAIL_S
    coord.close()


def test_a_cluster_url_naming_a_server_not_in_cluster_mode_fails_typed(real_redis) -> None:
    from urllib.parse import urlsplit

    base = urlsplit(real_redis.base_url)
    coord = open_coordinator(f"redis+cluster://{base.hostname}:{base.port or 6379}?prefix=dstest-{token()}")
    with pytest.raises(E.DraftstoreError) as info:
        coord.append("turn:x", "never")
    assert info.value.code == "backend.unavailable" and "cluster mode" in str(info.value).lower()
    coord.close()


def test_each_master_keeps_its_own_since_and_a_stream_keeps_its_keys_in_one_slot(real_redis_cluster) -> None:
    from redis.crc import key_slot

    coord = RedisCoordinator.from_url(real_redis_cluster.url(f"dstest-{token()}"))
    try:
        since = coord.since()
        keys_ = coord._since_keys()
        # one key per master, each in a slot that master serves
        assert sorted(real_redis_cluster.master_of(k) for k in keys_) == sorted(real_redis_cluster.master_ports())
        assert coord.since() == since
        events, epoch = coord._stream_keys("turn:x")
        assert key_slot(events.encode()) == key_slot(epoch.encode())
    finally:
        coord.close()


# == failover, mid-turn ==========================================================================
def test_a_master_killed_mid_turn_loses_no_truth_and_its_replica_taking_over_never_gets_the_live_worker_reaped(
        pg_db, real_s3: S3Service, own_cluster: LocalRedisCluster, opened) -> None:
    ttl = 2.0  # shorter than a failover: the live worker's heartbeat lapses while its master is gone
    prefix = f"lib-{token(3)}"
    stack = stack_of(pg_db, real_s3.url(f"t-{token()}"), own_cluster.url(prefix))
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
    # the master owning the live turn's heartbeat and event buffer (one hash tag, one slot)
    owner = own_cluster.master_of(f"{prefix}:beat:{{turn:{live.id}}}")
    assert owner == own_cluster.master_of(f"{prefix}:events:{{turn:{live.id}}}")
    replica = own_cluster.replica_of(owner)

    with Beater(worker, live.id) as beater:
        # 1. before the fault, the sweep works: it reaps the abandoned turn, not the beating one
        wait_until(lambda: not alive(dead), 10, "the abandoned turn's heartbeat to lapse")
        sleep_until_epoch(max(sweeper.coord.since(), dead.started_at.timestamp()) + ttl + 0.3)
        assert alive(live)
        assert sweeper.sweep() == {**QUIET, "turns_reaped": 1}

        with beater.paused():  # the worker is between two beats from here until the failover is over
            # 2. kill -9 of that master: the turn goes on (writes, tool calls, patches); a sweep reaps nobody
            own_cluster.kill(owner)
            killed_at, started = time.time(), time.monotonic()
            ledger.step("master-down")
            worker.heartbeat(live.id)  # the beat is lost, the call is not refused
            assert sweeper.sweep() == QUIET
            down_s = time.monotonic() - started
            assert down_s < MAX_FAIL_S, down_s

            # 3. its replica takes over, without the live worker's beat (it lapsed meanwhile): the
            # new master's state is new, so the sweep gives the worker its grace
            own_cluster.wait_failover(replica)
            wait_until(lambda: not alive(live), 10, "the live turn's heartbeat to lapse on the new master")
            assert sweeper.sweep() == QUIET
            since = sweeper.coord.since()
            assert killed_at < since <= time.time()
        ledger.step("after-failover")
        sleep_until_epoch(since + ttl + 0.3)
        assert alive(live)
        assert sweeper.sweep() == QUIET
        ledger.step("after-grace")
        # locks on the new master's slots work as before
        name = f"draft:{live_p.id}"
        lock = sweeper.coord.acquire(name, ttl_s=30, timeout_s=5)
        with pytest.raises(E.LockTimeout):
            worker.coord.acquire(name, ttl_s=30, timeout_s=0)
        assert lock.release()
    assert beater.errors == [] and beater.beats > 10, (beater.errors, beater.beats)

    ended = worker.complete_turn(live.id, "done")
    assert ended.status == "completed" and len(ended.tool_calls) == 4
    reader = opened(stack)  # a store that never saw any of it
    ledger.verify(reader)
    reaped = reader.get_turn(dead.id)
    assert (reaped.status, reaped.end_reason) == ("interrupted", "heartbeat_lapsed")
    assert reader.view_at_turn(dead.id, "end").read_file("left.py") == b"LEFT = 1\n"
    assert reader.fsck(verify_objects=False).ok
    print(f"cluster: master :{owner} killed, :{replica} took over; {len(ledger.calls)} tool calls, "
          f"{len(ledger.files)} files, {len(ledger.characters)} patches all read back; {beater.beats} beats; "
          f"ops while the master was down took {down_s:.2f}s")


def test_every_coordinator_call_through_a_failover_succeeds_or_fails_typed_and_the_stream_gets_a_new_epoch(
        own_cluster: LocalRedisCluster) -> None:
    prefix = f"ops-{token(3)}"
    coord = RedisCoordinator.from_url(own_cluster.url(prefix))
    stream = "turn:failover"
    try:
        coord.append(stream, "before")
        coord.beat(stream, 60)
        epoch, since = coord.tail(stream).epoch, coord.since()
        owner = own_cluster.master_of(f"{prefix}:events:{{{stream}}}")
        replica = own_cluster.replica_of(owner)
        ops = {  # every key below has the stream's hash tag: all on the master killed
            "append": lambda: coord.append(stream, "during"),
            "append_many": lambda: coord.append_many([(stream, "during", None)]),
            "tail": lambda: coord.tail(stream),
            "read": lambda: coord.read(stream),
            "expire": lambda: coord.expire(stream, 600),
            "beat": lambda: coord.beat(stream, 60),
            "alive": lambda: coord.alive(stream),
            "lock": lambda: coord.acquire(stream, ttl_s=1, timeout_s=0).release(),
            "text": lambda: coord.append_text(stream, "x", 60, 1 << 20),
            "since": coord.since,
            "ping": coord.ping,
        }
        outcomes: dict[str, list[str]] = {name: [] for name in ops}
        untyped: list[BaseException] = []
        over = threading.Event()

        def call_until_over(name: str) -> None:
            while not over.is_set():
                started = time.monotonic()
                try:
                    ops[name]()
                    outcomes[name].append("ok")
                except E.BackendUnavailable as exc:
                    ok = exc.code == "backend.unavailable" and exc.retryable and exc.__cause__ is not None
                    outcomes[name].append("unavailable" if ok else f"malformed: {exc!r}")
                except BaseException as exc:  # what must never happen
                    untyped.append(exc)
                if time.monotonic() - started >= MAX_FAIL_S:
                    outcomes[name].append(f"slow: {time.monotonic() - started:.1f}s")
                time.sleep(0.05)

        own_cluster.kill(owner)
        threads = [threading.Thread(target=call_until_over, args=(name,), daemon=True) for name in ops]
        for t in threads:
            t.start()
        own_cluster.wait_failover(replica)
        over.set()
        for t in threads:
            t.join(timeout=3 * MAX_FAIL_S)
        print({name: " ".join(seen) for name, seen in outcomes.items()})
        assert untyped == [], untyped
        assert {o for seen in outcomes.values() for o in seen} <= {"ok", "unavailable"}, outcomes
        # the fault was real: every call found the shard without a master at first
        assert all(seen and seen[0] == "unavailable" for seen in outcomes.values()), outcomes
        for name, op in ops.items():  # and after the failover every one works again
            op()
        after = coord.tail(stream)
        assert after.epoch not in (None, epoch)  # another server answers: readers must rebuild
        assert coord.since() > since
    finally:
        coord.close()


def test_sse_clients_reconnecting_after_a_master_failover_get_the_durable_events(
        pg_db, real_s3: S3Service, own_cluster: LocalRedisCluster, services) -> None:
    prefix = f"svc-{token(3)}"
    svc = services(stack_of(pg_db, real_s3.url(f"t-{token()}"), own_cluster.url(prefix)))
    c = svc.client()
    p = new_project(c, "failover")
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

    owner = own_cluster.master_of(f"{prefix}:events:{{turn:{t}}}")
    replica = own_cluster.replica_of(owner)
    own_cluster.kill(owner)
    started = time.monotonic()
    work("master_down")  # the service takes writes and tool calls while the turn's master is dead
    assert c.post(f"/v1/turns/{t}/heartbeat").status_code == 204
    down_s = time.monotonic() - started
    assert down_s < MAX_FAIL_S, down_s
    own_cluster.wait_failover(replica)
    work("after_failover")
    wait_buffered(c, t, lambda ev: bool(ev) and ev[-1]["type"] == "draft.changed")
    expected = [("turn.started", None)] + [(k, s) for s in range(1, 5) for k in ("tool.started", "tool.completed")]
    durable = [(k, d.get("seq")) for k, d in svc.store.durable_events(t)]
    assert durable == expected

    # the new master's buffer; the watcher saw the failover (and the events lost during it)
    final, rebuilds = reconnected_readers_miss_nothing(svc, c, t, last, seen, watcher, expected, watcher_timeout=60)
    assert final[-1] == ("turn.completed", None) and len(final) == 1 + 2 * 5 + 1

    # the truth, read through the service
    turn = c.get(f"/v1/turns/{t}").json()
    assert turn["status"] == "completed"
    assert [(x["seq"], x["status"]) for x in turn["tool_calls"]] == [(s, "completed") for s in range(1, 6)]
    for path, data in written.items():
        r = c.get(f"/v1/projects/{p}/view/files/{path}")
        assert r.status_code == 200 and r.content == data, path
    print(f"sse: master :{owner} killed, :{replica} took over; {rebuilds} rebuild(s) on the "
          f"open stream; 5 tool calls, {len(written)} files; requests while it was dead took {down_s:.2f}s")
