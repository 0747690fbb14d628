"""Coordinator conformance: locks, event buffers and heartbeats behave alike everywhere.

Runs on the embedded MemoryCoordinator and on RedisCoordinator against a real
Redis (``coordinator`` fixture). A backend is done when it passes this.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from draftstore.coord import Coordinator, MemoryCoordinator, locked, open_coordinator
from draftstore.coord.redis import RedisCoordinator
from draftstore.errors import BackendUnavailable, LockTimeout


def _same_flavour(coord: Any, max_events: int) -> Any:
    """A coordinator of the same backend and namespace with a smaller event buffer."""
    if isinstance(coord, MemoryCoordinator):
        return MemoryCoordinator(max_events=max_events)
    return RedisCoordinator.from_url(f"{coord.url}&max_events={max_events}")


def _run_threads(n: int, target: Any) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # collected and asserted by the caller
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return errors


# -- locks ------------------------------------------------------------------------------------
def test_a_lock_lets_one_thread_at_a_time_into_the_critical_section(coordinator: Coordinator) -> None:
    assert isinstance(coordinator, Coordinator)
    state = {"counter": 0, "inside": 0, "max_inside": 0}

    def worker(_: int) -> None:
        for _ in range(10):
            lock = coordinator.acquire("draft:p1", ttl_s=10, timeout_s=20)
            try:
                state["inside"] += 1
                state["max_inside"] = max(state["max_inside"], state["inside"])
                seen = state["counter"]
                time.sleep(0.001)  # widen the race window a lock must close
                state["counter"] = seen + 1
                state["inside"] -= 1
            finally:
                assert lock.release() is True

    assert _run_threads(6, worker) == []
    assert state["counter"] == 60
    assert state["max_inside"] == 1


def test_a_released_lock_can_be_taken_at_once(coordinator: Coordinator) -> None:
    lock = coordinator.acquire("publish:p1", ttl_s=5, timeout_s=1)
    assert lock.name == "publish:p1"
    assert lock.release() is True
    again = coordinator.acquire("publish:p1", ttl_s=5, timeout_s=0)
    assert again.release() is True


def test_waiting_for_a_held_lock_times_out_with_lock_timeout(coordinator: Coordinator) -> None:
    held = coordinator.acquire("publish:p2", ttl_s=30, timeout_s=1)
    started = time.monotonic()
    with pytest.raises(LockTimeout) as info:
        coordinator.acquire("publish:p2", ttl_s=30, timeout_s=0.3)
    waited = time.monotonic() - started
    assert info.value.code == "lock.timeout"
    assert 0.25 <= waited < 5
    # A try-once acquire fails at once too.
    with pytest.raises(LockTimeout):
        coordinator.acquire("publish:p2", ttl_s=30, timeout_s=0)
    assert held.release() is True


def test_a_lock_whose_holder_died_frees_itself_after_its_ttl(coordinator: Coordinator) -> None:
    coordinator.acquire("turn:dead-worker", ttl_s=0.3, timeout_s=1)  # never released
    started = time.monotonic()
    successor = coordinator.acquire("turn:dead-worker", ttl_s=10, timeout_s=5)
    assert time.monotonic() - started < 3
    assert successor.release() is True


def test_only_the_owner_can_release_a_lock(coordinator: Coordinator) -> None:
    stale = coordinator.acquire("draft:p3", ttl_s=0.2, timeout_s=1)
    time.sleep(0.3)
    current = coordinator.acquire("draft:p3", ttl_s=30, timeout_s=1)
    # The old holder wakes up late: its release must not free the new owner's lock.
    assert stale.release() is False
    with pytest.raises(LockTimeout):
        coordinator.acquire("draft:p3", ttl_s=30, timeout_s=0.1)
    assert current.release() is True
    assert current.release() is False  # a second release is a no-op


def test_locks_with_different_names_do_not_block_each_other(coordinator: Coordinator) -> None:
    a = coordinator.acquire("draft:a", ttl_s=30, timeout_s=1)
    b = coordinator.acquire("draft:b", ttl_s=30, timeout_s=0)
    assert a.release() and b.release()


def test_locked_releases_the_lock_even_when_the_block_fails(coordinator: Coordinator) -> None:
    with pytest.raises(RuntimeError):
        with locked(coordinator, "draft:p4", ttl_s=30, timeout_s=1):
            raise RuntimeError("the work failed")
    coordinator.acquire("draft:p4", ttl_s=30, timeout_s=0).release()


# -- event buffers ------------------------------------------------------------------------------
def test_event_ids_count_up_from_one_per_stream(coordinator: Coordinator) -> None:
    ids = [coordinator.append("turn:t1", "token", {"text": f"chunk {i}"}) for i in range(5)]
    assert ids == [1, 2, 3, 4, 5]
    events = coordinator.read("turn:t1")
    assert [e.id for e in events] == [1, 2, 3, 4, 5]
    assert [e.type for e in events] == ["token"] * 5
    assert events[3].data == {"text": "chunk 3"}


def test_event_data_round_trips_as_json(coordinator: Coordinator) -> None:
    data = {"text": "caf\u00e9 \u2603 \U0001f600", "n": 3, "nested": {"ok": True, "list": [1, None, "x"]}}
    coordinator.append("turn:t2", "tool_call.completed", data)
    coordinator.append("turn:t2", "turn.started")
    first, second = coordinator.read("turn:t2")
    assert first.data == data
    assert second.type == "turn.started" and second.data == {}


def test_a_reconnecting_reader_replays_only_what_it_missed(coordinator: Coordinator) -> None:
    for i in range(10):
        coordinator.append("turn:t3", "token", {"i": i})
    # Last-Event-ID: 6 -> events 7..10, in order.
    assert [e.id for e in coordinator.read("turn:t3", after=6)] == [7, 8, 9, 10]
    assert [e.data["i"] for e in coordinator.read("turn:t3", after=6)] == [6, 7, 8, 9]
    assert [e.id for e in coordinator.read("turn:t3", after=2, limit=3)] == [3, 4, 5]
    assert coordinator.read("turn:t3", after=10) == []
    assert coordinator.read("turn:never-written") == []


def test_the_event_buffer_keeps_only_the_newest_events(coordinator: Coordinator) -> None:
    small = _same_flavour(coordinator, max_events=5)
    try:
        ids = [small.append("turn:t4", "token", {"i": i}) for i in range(12)]
        assert ids == list(range(1, 13))  # trimming never restarts the numbering
        assert [e.id for e in small.read("turn:t4")] == [8, 9, 10, 11, 12]
        assert [e.id for e in small.read("turn:t4", after=10)] == [11, 12]
    finally:
        small.close()


def test_streams_are_independent(coordinator: Coordinator) -> None:
    assert coordinator.append("project:a", "x") == 1
    assert coordinator.append("project:a", "x") == 2
    assert coordinator.append("project:b", "y") == 1
    assert [e.type for e in coordinator.read("project:a")] == ["x", "x"]
    assert [e.type for e in coordinator.read("project:b")] == ["y"]


def test_trimming_a_stream_drops_its_buffer(coordinator: Coordinator) -> None:
    coordinator.append("turn:t5", "token")
    coordinator.append("turn:t6", "token")
    coordinator.trim("turn:t5")
    assert coordinator.read("turn:t5") == []
    assert len(coordinator.read("turn:t6")) == 1
    coordinator.trim("turn:never-written")  # absent is fine


def test_concurrent_appenders_lose_nothing_and_never_share_an_id(coordinator: Coordinator) -> None:
    n_threads, per_thread = 8, 50
    got: dict[int, list[int]] = {i: [] for i in range(n_threads)}

    def appender(i: int) -> None:
        for j in range(per_thread):
            got[i].append(coordinator.append("turn:busy", "token", {"thread": i, "seq": j}))

    assert _run_threads(n_threads, appender) == []
    all_ids = [x for ids in got.values() for x in ids]
    assert sorted(all_ids) == list(range(1, n_threads * per_thread + 1))
    for ids in got.values():
        assert ids == sorted(ids)  # each appender sees its own ids increase
    events = coordinator.read("turn:busy", limit=10_000)
    assert [e.id for e in events] == list(range(1, n_threads * per_thread + 1))
    for i in range(n_threads):
        assert [e.data["seq"] for e in events if e.data["thread"] == i] == list(range(per_thread))


# -- heartbeats ----------------------------------------------------------------------------------
def test_a_heartbeat_is_alive_until_its_ttl_passes(coordinator: Coordinator) -> None:
    assert not coordinator.alive("turn:t7")
    coordinator.beat("turn:t7", ttl_s=0.3)
    assert coordinator.alive("turn:t7")
    time.sleep(0.45)
    assert not coordinator.alive("turn:t7")


def test_beating_again_extends_the_heartbeat(coordinator: Coordinator) -> None:
    coordinator.beat("turn:t8", ttl_s=0.4)
    time.sleep(0.25)
    coordinator.beat("turn:t8", ttl_s=0.4)
    time.sleep(0.25)
    assert coordinator.alive("turn:t8")


def test_forgetting_a_heartbeat_ends_it_at_once(coordinator: Coordinator) -> None:
    coordinator.beat("turn:t9", ttl_s=60)
    coordinator.forget("turn:t9")
    assert not coordinator.alive("turn:t9")
    coordinator.forget("turn:t9")  # absent is fine


# -- Redis specifics -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_redis_is_a_typed_backend_unavailable() -> None:
    coord = open_coordinator(f"redis://127.0.0.1:{_free_port()}/0?prefix=nowhere")
    assert isinstance(coord, RedisCoordinator)
    for attempt in (
        lambda: coord.append("s", "x"),
        lambda: coord.acquire("l", timeout_s=0),
        lambda: coord.alive("k"),
    ):
        with pytest.raises(BackendUnavailable) as info:
            attempt()
        assert info.value.code == "backend.unavailable"
        assert info.value.__cause__ is not None  # the redis-py error, chained
    coord.close()


@pytest.mark.real
def test_a_lock_taken_by_one_replica_excludes_another(real_redis) -> None:  # type: ignore[no-untyped-def]
    url = real_redis.url("replicas")
    one, two = RedisCoordinator.from_url(url), RedisCoordinator.from_url(url)
    try:
        lock = one.acquire("draft:shared", ttl_s=30, timeout_s=1)
        with pytest.raises(LockTimeout):
            two.acquire("draft:shared", ttl_s=30, timeout_s=0.1)
        assert one.append("turn:shared", "a") == 1
        assert two.append("turn:shared", "b") == 2
        assert [e.type for e in two.read("turn:shared")] == ["a", "b"]
        assert lock.release()
    finally:
        one.close()
        two.close()


@pytest.mark.real
def test_each_prefix_is_its_own_namespace(real_redis) -> None:  # type: ignore[no-untyped-def]
    a = RedisCoordinator.from_url(real_redis.url("ns-a"))
    b = RedisCoordinator.from_url(real_redis.url("ns-b"))
    try:
        a.append("turn:x", "only-in-a")
        a.beat("turn:x", 60)
        a.acquire("draft:x", ttl_s=30, timeout_s=0)
        assert b.read("turn:x") == []
        assert not b.alive("turn:x")
        b.acquire("draft:x", ttl_s=30, timeout_s=0).release()
    finally:
        a.close()
        b.close()
