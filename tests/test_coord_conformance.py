"""Coordinator conformance: locks, event buffers and heartbeats behave alike everywhere.

Runs on the embedded MemoryCoordinator and SqliteCoordinator and on
RedisCoordinator against a real Redis (``coordinator`` fixture). A backend is
done when it passes this. The SQLite coordinator's reason to exist -- one file
shared by every Store and process on the same embedded data -- is tested at the
end, with real OS processes.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from draftstore.coord import (
    LEGACY_EPOCH,
    Coordinator,
    MemoryCoordinator,
    SqliteCoordinator,
    Tail,
    locked,
    open_coordinator,
)
from draftstore.coord.redis import RedisCoordinator, _served_epoch
from draftstore.coord.sqlite import SCHEMA_VERSION
from draftstore.errors import BackendError, BackendUnavailable, ConfigInvalid, LockTimeout


def _same_flavour(coord: Any, max_events: int) -> Any:
    """A coordinator of the same backend and namespace with a smaller event buffer."""
    if isinstance(coord, MemoryCoordinator):
        return MemoryCoordinator(max_events=max_events)
    if isinstance(coord, SqliteCoordinator):
        return SqliteCoordinator(coord.path, max_events=max_events)
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


# -- stream expiry (event streams of ended turns must not pile up) --------------------------------
def test_an_expired_stream_reads_empty_and_later_appends_number_from_one(coordinator: Coordinator) -> None:
    for i in range(3):
        coordinator.append("turn:ended", "token", {"i": i})
    coordinator.append("turn:still-running", "token")
    coordinator.expire("turn:ended", ttl_s=0.3)
    assert [e.id for e in coordinator.read("turn:ended")] == [1, 2, 3]  # readable until the ttl passes
    time.sleep(0.5)
    assert coordinator.read("turn:ended") == []
    assert [e.id for e in coordinator.read("turn:still-running")] == [1]  # other streams untouched
    assert coordinator.append("turn:ended", "token") == 1


def test_appending_after_expire_does_not_cancel_the_expiry(coordinator: Coordinator) -> None:
    coordinator.append("turn:late", "turn.ended")
    coordinator.expire("turn:late", ttl_s=0.3)
    assert coordinator.append("turn:late", "late.event") == 2  # numbering goes on meanwhile
    time.sleep(0.5)
    assert coordinator.read("turn:late") == []


def test_expiring_a_stream_that_does_not_exist_changes_nothing(coordinator: Coordinator) -> None:
    coordinator.expire("turn:never-written", ttl_s=0.2)
    assert coordinator.read("turn:never-written") == []
    # A stream created afterwards does not inherit an expiry.
    assert coordinator.append("turn:never-written", "token") == 1
    time.sleep(0.4)
    assert [e.id for e in coordinator.read("turn:never-written")] == [1]


def test_expiring_again_replaces_the_earlier_expiry(coordinator: Coordinator) -> None:
    coordinator.append("turn:resumed", "token")
    coordinator.expire("turn:resumed", ttl_s=0.2)
    coordinator.expire("turn:resumed", ttl_s=60)
    time.sleep(0.4)
    assert [e.id for e in coordinator.read("turn:resumed")] == [1]


def test_a_trimmed_stream_starts_afresh_without_the_old_expiry(coordinator: Coordinator) -> None:
    coordinator.append("turn:t10", "token")
    coordinator.expire("turn:t10", ttl_s=0.2)
    coordinator.trim("turn:t10")
    assert coordinator.append("turn:t10", "token") == 1
    time.sleep(0.4)
    assert [e.id for e in coordinator.read("turn:t10")] == [1]


# -- stream epochs and tail (SSE replay must notice a buffer that restarted or lost events) -------
ABSENT = Tail(None, [], 0, 0)


def test_a_new_stream_has_an_epoch_and_its_id_range(coordinator: Coordinator) -> None:
    assert coordinator.tail("turn:e1") == ABSENT
    coordinator.append("turn:e1", "turn.started")
    first = coordinator.tail("turn:e1")
    assert isinstance(first.epoch, str) and first.epoch not in ("", LEGACY_EPOCH)
    assert (first.first_id, first.last_id) == (1, 1)
    coordinator.append_many([("turn:e1", "token", {"i": i}) for i in range(2)])
    tail = coordinator.tail("turn:e1")
    assert (tail.epoch, tail.first_id, tail.last_id) == (first.epoch, 1, 3)
    assert [(e.id, e.type) for e in tail.events] == [(1, "turn.started"), (2, "token"), (3, "token")]
    assert tail.events[2].data == {"i": 1}
    assert coordinator.append("turn:e2", "x") == 1
    assert coordinator.tail("turn:e2").epoch not in (None, first.epoch)  # each stream its own


def test_the_epoch_survives_dropping_old_events_and_first_id_moves_up(coordinator: Coordinator) -> None:
    small = _same_flavour(coordinator, max_events=3)
    try:
        small.append("turn:e3", "token", {"i": 0})
        epoch = small.tail("turn:e3").epoch
        for i in range(1, 7):
            small.append("turn:e3", "token", {"i": i})
            tail = small.tail("turn:e3")
            assert tail.epoch == epoch
            assert (tail.first_id, tail.last_id) == (max(1, i - 1), i + 1)
        # A reader that saw up to 2 missed 3 and 4: first_id (5) > 2 + 1 tells it so.
        gap = small.tail("turn:e3", after=2)
        assert (gap.first_id, [e.id for e in gap.events]) == (5, [5, 6, 7])
        assert [e.data["i"] for e in small.tail("turn:e3", after=5).events] == [5, 6]
    finally:
        small.close()


def test_a_trimmed_stream_comes_back_with_a_new_epoch_and_ids_from_one(coordinator: Coordinator) -> None:
    for _ in range(3):
        coordinator.append("turn:e4", "token")
    before = coordinator.tail("turn:e4").epoch
    coordinator.trim("turn:e4")
    assert coordinator.tail("turn:e4") == ABSENT
    assert coordinator.append("turn:e4", "token") == 1
    after = coordinator.tail("turn:e4")
    assert after.epoch is not None and after.epoch != before
    assert (after.first_id, after.last_id, [e.id for e in after.events]) == (1, 1, [1])


def test_an_expired_stream_comes_back_with_a_new_epoch_and_ids_from_one(coordinator: Coordinator) -> None:
    coordinator.append("turn:e5", "token")
    coordinator.append("turn:e5", "turn.ended")
    coordinator.expire("turn:e5", ttl_s=0.3)
    before = coordinator.tail("turn:e5")
    assert before.epoch is not None and before.last_id == 2  # whole until the ttl passes
    time.sleep(0.5)
    assert coordinator.tail("turn:e5") == ABSENT
    assert coordinator.append("turn:e5", "turn.started") == 1
    after = coordinator.tail("turn:e5")
    assert after.epoch is not None and after.epoch != before.epoch
    assert (after.first_id, after.last_id) == (1, 1)


def test_tail_returns_events_after_a_point_with_the_whole_range(coordinator: Coordinator) -> None:
    for i in range(10):
        coordinator.append("turn:e6", "token", {"i": i})
    epoch = coordinator.tail("turn:e6").epoch

    def seen(after: int, limit: int = 1000) -> tuple[Any, ...]:
        t = coordinator.tail("turn:e6", after=after, limit=limit)
        return t.epoch, t.first_id, t.last_id, [e.id for e in t.events]

    assert seen(6) == (epoch, 1, 10, [7, 8, 9, 10])
    assert seen(2, limit=3) == (epoch, 1, 10, [3, 4, 5])
    assert seen(10) == (epoch, 1, 10, [])
    assert seen(0, limit=0) == (epoch, 1, 10, [])  # just the epoch and range
    assert seen(-5, limit=2) == (epoch, 1, 10, [1, 2])
    assert [e.data["i"] for e in coordinator.tail("turn:e6", after=8).events] == [8, 9]
    assert coordinator.tail("turn:never-written", after=3, limit=5) == ABSENT


def test_tail_is_one_snapshot_while_appenders_run(coordinator: Coordinator) -> None:
    small = _same_flavour(coordinator, max_events=5)
    stop = threading.Event()
    try:
        small.append("turn:e7", "token")
        epoch = small.tail("turn:e7").epoch

        def appender(_: int) -> None:
            while not stop.is_set():
                small.append_many([("turn:e7", "token", None)] * 3)

        def reader(_: int) -> None:
            try:
                for _ in range(200):
                    t = small.tail("turn:e7")
                    # A torn read (range from one state, events from another) breaks one of these.
                    assert t.epoch == epoch
                    assert t.last_id - t.first_id + 1 == min(t.last_id, 5)
                    assert [e.id for e in t.events] == list(range(t.first_id, t.last_id + 1))
            finally:
                stop.set()

        assert _run_threads(3, lambda i: (appender if i else reader)(i)) == []
    finally:
        small.close()


def test_ping_answers_when_the_backend_is_usable(coordinator: Coordinator) -> None:
    assert coordinator.ping() is None


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


# -- texts ----------------------------------------------------------------------------------------
def test_a_text_grows_by_appends_in_order_and_is_dropped(coordinator: Coordinator) -> None:
    key = f"partial:{random.random()}"
    assert coordinator.get_text(key) is None
    assert coordinator.append_text(key, "héllo", ttl_s=60, max_bytes=100) == 6  # UTF-8 bytes
    assert coordinator.append_text(key, " wörld", ttl_s=60, max_bytes=100) == 13
    assert coordinator.append_text(key, "", ttl_s=60, max_bytes=100) == 13
    assert coordinator.get_text(key) == "héllo wörld"
    coordinator.drop_text(key)
    assert coordinator.get_text(key) is None
    coordinator.drop_text(key)  # absent is fine
    assert coordinator.append_text(key, "again", ttl_s=60, max_bytes=100) == 5
    assert coordinator.get_text(key) == "again"
    coordinator.drop_text(key)


def test_an_append_past_the_cap_is_refused_and_changes_nothing(coordinator: Coordinator) -> None:
    key = f"partial:{random.random()}"
    assert coordinator.append_text(key, "x" * 8, ttl_s=60, max_bytes=10) == 8
    assert coordinator.append_text(key, "ééé", ttl_s=60, max_bytes=10) == -1  # 6 bytes: over
    assert coordinator.get_text(key) == "x" * 8
    assert coordinator.append_text(key, "yz", ttl_s=60, max_bytes=10) == 10  # exactly the cap
    assert coordinator.get_text(key) == "x" * 8 + "yz"
    coordinator.drop_text(key)


def test_a_text_expires_ttl_after_its_last_append(coordinator: Coordinator) -> None:
    key = f"partial:{random.random()}"
    coordinator.append_text(key, "a", ttl_s=0.4, max_bytes=100)
    time.sleep(0.25)
    coordinator.append_text(key, "b", ttl_s=0.4, max_bytes=100)  # extends it
    time.sleep(0.25)
    assert coordinator.get_text(key) == "ab"
    time.sleep(0.3)
    assert coordinator.get_text(key) is None
    assert coordinator.append_text(key, "c", ttl_s=60, max_bytes=100) == 1  # expired: it starts again
    assert coordinator.get_text(key) == "c"
    coordinator.drop_text(key)


def test_appends_from_many_threads_lose_nothing(coordinator: Coordinator) -> None:
    key = f"partial:{random.random()}"

    def appender(i: int) -> None:
        for j in range(50):
            assert coordinator.append_text(key, f"<{i}:{j}>", ttl_s=60, max_bytes=1_000_000) > 0

    assert _run_threads(4, appender) == []
    text = coordinator.get_text(key)
    for i in range(4):
        mine = [int(m) for m in re.findall(rf"<{i}:(\d+)>", text)]
        assert mine == list(range(50))  # every append, each thread's in its order
    coordinator.drop_text(key)


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
        lambda: coord.tail("s"),
        coord.ping,
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


@pytest.mark.real
def test_a_stream_lost_from_redis_comes_back_with_a_new_epoch(real_redis) -> None:  # type: ignore[no-untyped-def]
    import redis

    coord = RedisCoordinator.from_url(real_redis.url("lost"))
    raw = redis.Redis.from_url(real_redis.base_url)
    try:
        for _ in range(3):
            coord.append("turn:x", "token")
        before = coord.tail("turn:x").epoch
        # What a FLUSHALL or a restart without persistence does to this namespace
        # (never flush the shared server: delete only this test's own keys).
        keys = list(raw.scan_iter(match=f"{coord.prefix}:*"))
        # a stream's two keys share their hash tag (one cluster slot)
        assert {k.decode() for k in keys} == {f"{coord.prefix}:events:{{turn:x}}", f"{coord.prefix}:epoch:{{turn:x}}"}
        raw.delete(*keys)
        assert coord.tail("turn:x") == ABSENT
        assert coord.append("turn:x", "token") == 1
        after = coord.tail("turn:x")
        assert after.epoch is not None and after.epoch != before
        assert (after.first_id, after.last_id) == (1, 1)
    finally:
        coord.close()
        raw.close()


@pytest.mark.real
def test_redis_epoch_keys_follow_their_stream(real_redis) -> None:  # type: ignore[no-untyped-def]
    import redis

    coord = RedisCoordinator.from_url(real_redis.url("epoch-keys"))
    raw = redis.Redis.from_url(real_redis.base_url, decode_responses=True)
    events, epoch = (f"{coord.prefix}:{kind}:{{turn:y}}" for kind in ("events", "epoch"))
    try:
        coord.append("turn:y", "token")
        # the epoch a reader gets is the stored one bound to the server process that answers
        assert coord.tail("turn:y").epoch == _served_epoch(raw.get(epoch), raw.info("server")["run_id"])
        coord.expire("turn:y", ttl_s=60)  # both keys go together
        # Absolute deadlines (Redis 7): two PTTLs are read at different moments.
        # The epoch key never goes first, or the stream would read as "legacy".
        assert 0 < raw.pexpiretime(events) <= raw.pexpiretime(epoch) <= raw.pexpiretime(events) + 50
        assert 59_000 < raw.pttl(epoch) <= 60_000
        coord.trim("turn:y")
        assert raw.exists(events, epoch) == 0

        # Only the events key lost (evicted, say): the leftover epoch key is not
        # reported, and the stream created next replaces it (and its ttl).
        coord.append("turn:y", "token")
        coord.expire("turn:y", ttl_s=60)
        old = coord.tail("turn:y").epoch
        raw.delete(events)
        assert coord.tail("turn:y") == ABSENT
        coord.append("turn:y", "token")
        assert coord.tail("turn:y").epoch not in (None, old)
        assert raw.pttl(epoch) == -1

        # Events but no epoch key: written by a release before epochs. It stays
        # "legacy" while it lives; recreated, it gets a real epoch.
        raw.delete(epoch)
        assert coord.tail("turn:y").epoch == LEGACY_EPOCH
        assert coord.append("turn:y", "token") == 2
        assert coord.tail("turn:y") == Tail(LEGACY_EPOCH, coord.read("turn:y"), 1, 2)
        coord.trim("turn:y")
        coord.append("turn:y", "token")
        assert coord.tail("turn:y").epoch not in (None, LEGACY_EPOCH)
    finally:
        coord.close()
        raw.close()


@pytest.mark.alone  # it counts the server's calls: no other test of the run may call it meanwhile
@pytest.mark.real
def test_a_batch_of_appends_is_one_round_trip_and_survives_a_lost_script(real_redis) -> None:  # type: ignore[no-untyped-def]
    import redis

    coord = RedisCoordinator.from_url(real_redis.url("evalsha"))
    raw = redis.Redis.from_url(real_redis.base_url, decode_responses=True)

    def calls(command: str) -> int:
        return int(raw.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))

    try:
        coord.append_many([("turn:s", "token", {"i": 0})])  # the script is loaded (once) if it was not
        exists, evalsha = calls("script|exists"), calls("evalsha")
        assert coord.append_many([("turn:s", "token", {"i": i}) for i in (1, 2, 3)]) == [2, 3, 4]
        # no SCRIPT EXISTS before each batch: only the three appends reach the server
        assert (calls("script|exists"), calls("evalsha")) == (exists, evalsha + 3)

        # The server does not know the script (restarted, SCRIPT FLUSH): every call answers
        # NOSCRIPT and runs nothing, so the batch is loaded and re-run once, in order.
        coord._append_script.sha = "0" * 40
        assert coord.append_many([("turn:s", "token", {"i": i}) for i in (4, 5)]) == [5, 6]
        assert [e.data["i"] for e in coord.read("turn:s")] == [0, 1, 2, 3, 4, 5]
        assert [e.id for e in coord.read("turn:s")] == [1, 2, 3, 4, 5, 6]
    finally:
        coord.close()
        raw.close()


def _redis_server(port: int, workdir: Path) -> "subprocess.Popen[bytes]":
    """A redis-server of this test alone on ``port``, loading ``workdir``/dump.rdb if there is one."""
    import shutil

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        from services import unavailable

        unavailable("redis-server", "not on PATH")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while True:
        try:
            with redis.Redis(port=port, socket_connect_timeout=1) as r:
                r.ping()
            return proc
        except redis.ConnectionError:
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)


@pytest.mark.real
def test_a_redis_restarted_from_its_snapshot_gives_streams_a_new_epoch_and_since_starts_again(tmp_path: Path) -> None:
    """Writes after the snapshot are lost, so its streams may hand out ids readers saw already:
    the restarted server's streams read as new epochs (readers rebuild) and the sweep's grace
    starts again, as after a flush; the data itself came back."""
    import redis

    port = _free_port()
    server = _redis_server(port, tmp_path)
    coord = RedisCoordinator.from_url(f"redis://127.0.0.1:{port}/0?prefix=snap")
    try:
        coord.append("turn:x", "a")
        before, since = coord.tail("turn:x"), coord.since()
        with redis.Redis(port=port) as r:
            r.save()  # what a periodic RDB save or an AOF rewrite leaves on disk
        assert coord.append("turn:x", "lost with the process") == 2
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
        time.sleep(0.05)
        server = _redis_server(port, tmp_path)
        after = coord.tail("turn:x")
        assert [e.type for e in after.events] == ["a"]  # the snapshot's content is back ...
        assert after.epoch not in (None, before.epoch)  # ... under a new epoch: id 2 will name another event
        assert coord.append("turn:x", "b") == 2
        assert coord.since() > since
    finally:
        coord.close()
        server.terminate()
        server.wait(timeout=10)


# -- SQLite specifics: one file shared by every Store and process on the same data -------------------
def _python(code: str) -> "subprocess.Popen[str]":
    """Another OS process running ``code`` with this interpreter (the venv's, draftstore installed)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _finish(proc: "subprocess.Popen[str]") -> None:
    proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_two_coordinators_on_one_file_share_heartbeats_locks_and_events(tmp_path: Path) -> None:
    # Two Stores in one process on the same embedded data: each opens its own coordinator.
    sweeper, worker = SqliteCoordinator(tmp_path / "coord.db"), SqliteCoordinator(tmp_path / "coord.db")
    try:
        worker.beat("turn:live", ttl_s=30)
        assert sweeper.alive("turn:live")  # so the sweeper does not reap a live turn
        worker.forget("turn:live")
        assert not sweeper.alive("turn:live")

        lock = worker.acquire("draft:p1", ttl_s=30, timeout_s=0)
        with pytest.raises(LockTimeout):
            sweeper.acquire("draft:p1", ttl_s=30, timeout_s=0.1)
        assert sweeper.acquire("draft:p2", ttl_s=30, timeout_s=0).release()
        assert lock.release()
        assert sweeper.acquire("draft:p1", ttl_s=30, timeout_s=0).release()

        assert worker.append("turn:t", "a") == 1
        assert sweeper.append("turn:t", "b") == 2
        assert [e.type for e in sweeper.read("turn:t")] == ["a", "b"]
        worker.expire("turn:t", ttl_s=0.2)
        time.sleep(0.4)
        assert sweeper.read("turn:t") == []
    finally:
        sweeper.close()
        worker.close()


def test_a_heartbeat_and_events_from_another_process_are_seen_here(tmp_path: Path) -> None:
    path = tmp_path / "coord.db"
    here = SqliteCoordinator(path)
    try:
        here.append("turn:w", "turn.started")  # this process writes first: the other one continues
        worker = _python(
            f"""
            from draftstore.coord import SqliteCoordinator
            coord = SqliteCoordinator({str(path)!r})
            coord.beat("turn:w", ttl_s=60)
            print(coord.append_many([("turn:w", "token", {{"i": i}}) for i in range(3)]))
            coord.close()
            """
        )
        out, _ = worker.communicate(timeout=60)
        assert worker.returncode == 0
        assert out.strip() == "[2, 3, 4]"
        assert here.alive("turn:w")
        assert [(e.id, e.type) for e in here.read("turn:w")] == [
            (1, "turn.started"), (2, "token"), (3, "token"), (4, "token"),
        ]
        assert here.read("turn:w")[3].data == {"i": 2}
    finally:
        here.close()


def test_a_lock_held_by_another_process_blocks_this_one_until_released(tmp_path: Path) -> None:
    path = tmp_path / "coord.db"
    here = SqliteCoordinator(path)
    holder = _python(
        f"""
        import sys
        from draftstore.coord import SqliteCoordinator
        coord = SqliteCoordinator({str(path)!r})
        lock = coord.acquire("publish:p1", ttl_s=60, timeout_s=10)
        print("locked", flush=True)
        sys.stdin.readline()  # hold it until told to let go
        assert lock.release()
        coord.close()
        """
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockTimeout):
            here.acquire("publish:p1", ttl_s=30, timeout_s=0.3)
        holder.stdin.write("release\n")
        holder.stdin.flush()
        # Waits for the other process to let go, then gets it.
        here.acquire("publish:p1", ttl_s=30, timeout_s=30).release()
        _finish(holder)
    finally:
        if holder.returncode is None:  # the test failed half-way: do not leave it waiting
            holder.kill()
            holder.communicate()
        here.close()


def test_a_process_that_died_holding_a_lock_frees_it_after_its_ttl(tmp_path: Path) -> None:
    path = tmp_path / "coord.db"
    _finish(
        _python(
            f"""
            import os
            from draftstore.coord import SqliteCoordinator
            SqliteCoordinator({str(path)!r}).acquire("turn:crashed", ttl_s=0.3, timeout_s=5)
            os._exit(0)  # dies without releasing or closing
            """
        )
    )
    here = SqliteCoordinator(path)
    try:
        here.acquire("turn:crashed", ttl_s=30, timeout_s=10).release()
    finally:
        here.close()


def test_appenders_in_several_processes_get_unique_gap_free_ids(tmp_path: Path) -> None:
    path = tmp_path / "coord.db"
    SqliteCoordinator(path).close()  # create the schema once, before the race
    n_procs, per_proc = 4, 40
    procs = [
        _python(
            f"""
            from draftstore.coord import SqliteCoordinator
            coord = SqliteCoordinator({str(path)!r})
            for j in range({per_proc}):
                coord.append("turn:busy", "token", {{"proc": {i}, "seq": j}})
            coord.close()
            """
        )
        for i in range(n_procs)
    ]
    for proc in procs:
        _finish(proc)
    here = SqliteCoordinator(path)
    try:
        events = here.read("turn:busy", limit=10_000)
        assert [e.id for e in events] == list(range(1, n_procs * per_proc + 1))
        for i in range(n_procs):
            assert [e.data["seq"] for e in events if e.data["proc"] == i] == list(range(per_proc))
    finally:
        here.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_worker_forked_after_opening_keeps_using_the_shared_file(tmp_path: Path) -> None:
    coord = SqliteCoordinator(tmp_path / "coord.db")
    try:
        coord.append("turn:f", "before.fork")  # the pool now holds an open connection
        pid = os.fork()
        if pid == 0:  # the forked worker: must open its own connections, not reuse the parent's
            ok = coord.append("turn:f", "in.child") == 2 and coord.alive("turn:f") is False
            coord.beat("turn:f", ttl_s=60)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert [e.type for e in coord.read("turn:f")] == ["before.fork", "in.child"]
        assert coord.alive("turn:f")
    finally:
        coord.close()


def test_expired_streams_leave_the_file_not_just_the_reads(tmp_path: Path) -> None:
    path = tmp_path / "coord.db"
    coord = SqliteCoordinator(path)
    try:
        for t in range(3):
            coord.append(f"turn:ended-{t}", "turn.ended")
            coord.expire(f"turn:ended-{t}", ttl_s=0.2)
        time.sleep(0.4)
        coord.append("turn:next", "turn.started")  # an append purges expired streams on its way
        with sqlite3.connect(path) as raw:
            streams = {s for (s,) in raw.execute("SELECT stream FROM streams")}
            leftover = raw.execute("SELECT count(*) FROM events WHERE stream LIKE 'turn:ended-%'").fetchone()[0]
        raw.close()
        assert streams == {"turn:next"}
        assert leftover == 0
    finally:
        coord.close()


def test_the_sqlite_url_names_a_file_relative_or_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    relative = open_coordinator("sqlite:///state/rel.db?max_events=3")
    absolute = open_coordinator(f"sqlite:///{tmp_path}/abs dir/abs.db")  # four slashes: an absolute path
    try:
        assert isinstance(relative, SqliteCoordinator) and isinstance(absolute, SqliteCoordinator)
        assert Path(relative.path) == tmp_path / "state" / "rel.db"  # parent directory created
        assert Path(absolute.path) == tmp_path / "abs dir" / "abs.db"
        assert [relative.append("s", "x") for _ in range(5)] == [1, 2, 3, 4, 5]
        assert [e.id for e in relative.read("s")] == [3, 4, 5]  # max_events=3
        # .url opens the same file again, wherever the process has moved since.
        monkeypatch.chdir("/")
        again = open_coordinator(relative.url)
        assert [e.id for e in again.read("s")] == [3, 4, 5]
        again.close()
    finally:
        relative.close()
        absolute.close()
    for bad in ("sqlite://host/x.db", "sqlite://", f"sqlite:///{tmp_path}/x.db?max_events=many",
                f"sqlite:///{tmp_path}/x.db?max_events=0", f"sqlite:///{tmp_path}/x.db?timeout=3"):
        with pytest.raises(ConfigInvalid):
            open_coordinator(bad)


def test_an_unusable_coordinator_file_is_a_typed_backend_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(BackendUnavailable) as info:
        SqliteCoordinator(tmp_path / "a-file" / "coord.db")
    assert info.value.code == "backend.unavailable" and info.value.__cause__ is not None

    (tmp_path / "garbage.db").write_bytes(b"this is not an SQLite database file, not at all" * 100)
    with pytest.raises(BackendError) as err:
        SqliteCoordinator(tmp_path / "garbage.db")
    assert err.value.code.startswith("backend.") and isinstance(err.value.__cause__, sqlite3.Error)


# The schema of version 1, as the first release wrote it (do not update this with the code).
_SCHEMA_V1 = """
CREATE TABLE locks (name TEXT PRIMARY KEY, token TEXT NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE streams (stream TEXT PRIMARY KEY, last_id INTEGER NOT NULL, expires_at REAL);
CREATE TABLE events (stream TEXT NOT NULL, id INTEGER NOT NULL, type TEXT NOT NULL, data TEXT NOT NULL,
                     PRIMARY KEY (stream, id));
CREATE TABLE beats (key TEXT PRIMARY KEY, expires_at REAL NOT NULL);
CREATE INDEX streams_expiry ON streams (expires_at) WHERE expires_at IS NOT NULL;
CREATE INDEX beats_expiry ON beats (expires_at);
CREATE INDEX locks_expiry ON locks (expires_at);
PRAGMA user_version = 1;
"""


def test_a_version_1_file_is_upgraded_in_place_and_its_streams_are_legacy(tmp_path: Path) -> None:
    path = tmp_path / "coord.db"
    with sqlite3.connect(path) as raw:
        raw.executescript(_SCHEMA_V1)
        raw.execute("INSERT INTO streams VALUES ('turn:old', 2, NULL)")
        raw.executemany("INSERT INTO events VALUES ('turn:old', ?, 'token', ?)", [(1, '{"i":0}'), (2, '{"i":1}')])
        raw.execute("INSERT INTO beats VALUES ('turn:old', ?)", (time.time() + 60,))
    raw.close()

    coord = SqliteCoordinator(path)
    try:
        with sqlite3.connect(path) as raw:
            assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
            assert raw.execute("SELECT epoch FROM streams").fetchall() == [(LEGACY_EPOCH,)]
        raw.close()
        old = coord.tail("turn:old")
        assert (old.epoch, old.first_id, old.last_id) == (LEGACY_EPOCH, 1, 2)
        assert [e.data for e in old.events] == [{"i": 0}, {"i": 1}]
        assert coord.alive("turn:old")  # nothing else was lost on the way
        assert coord.append("turn:old", "token") == 3
        assert coord.tail("turn:old").epoch == LEGACY_EPOCH  # for as long as it lives
        coord.trim("turn:old")
        coord.append("turn:old", "token")
        assert coord.tail("turn:old").epoch not in (None, LEGACY_EPOCH)
        coord.append("turn:new", "token")
        new = coord.tail("turn:new").epoch
        assert new not in (None, LEGACY_EPOCH)
    finally:
        coord.close()
    # Opening again changes nothing: the upgrade ran once.
    again = SqliteCoordinator(path)
    try:
        assert again.tail("turn:new").epoch == new
    finally:
        again.close()


def test_a_version_1_and_a_new_file_end_up_with_the_same_schema(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "old.db") as raw:
        raw.executescript(_SCHEMA_V1)
    raw.close()
    SqliteCoordinator(tmp_path / "old.db").close()
    SqliteCoordinator(tmp_path / "new.db").close()

    def columns(name: str) -> list[Any]:
        with sqlite3.connect(tmp_path / name) as raw:
            return [raw.execute(f"PRAGMA table_xinfo({t})").fetchall() for t in ("locks", "streams", "events", "beats")]

    assert columns("old.db") == columns("new.db")


def test_a_closed_sqlite_coordinator_fails_its_ping(tmp_path: Path) -> None:
    coord = SqliteCoordinator(tmp_path / "coord.db")
    coord.ping()
    coord.close()
    with pytest.raises(BackendUnavailable):
        coord.ping()


def test_a_coordinator_file_from_a_newer_release_is_refused_not_misread(tmp_path: Path) -> None:
    path = tmp_path / "coord.db"
    SqliteCoordinator(path).close()
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
        raw.execute("PRAGMA user_version = 99")
    raw.close()
    with pytest.raises(BackendError, match="v99"):
        SqliteCoordinator(path)


def test_closing_closes_every_connection_and_can_be_repeated(tmp_path: Path) -> None:
    path = tmp_path / "coord.db"
    coord = SqliteCoordinator(path)
    start = threading.Barrier(6)

    def busy(i: int) -> None:
        start.wait()  # all at once, so several connections are open together
        for j in range(20):
            coord.append(f"turn:{i}", "token", {"j": j})
            coord.beat(f"turn:{i}", ttl_s=30)

    assert _run_threads(6, busy) == []
    assert Path(f"{path}-wal").exists()
    coord.close()
    # SQLite deletes the WAL file when the last connection to the database closes.
    assert not Path(f"{path}-wal").exists()
    coord.close()
    with pytest.raises(BackendUnavailable):
        coord.append("turn:0", "late")


def test_since_is_when_the_coordinators_state_began_and_stays_put(coordinator: Coordinator) -> None:
    first = coordinator.since()
    assert time.time() - 3600 < first <= time.time() + 1
    coordinator.beat("turn:x", 5)
    time.sleep(0.05)
    assert coordinator.since() == first
