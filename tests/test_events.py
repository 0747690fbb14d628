"""The event publisher: bursts are appended together, in order, and a flush never waits out the linger."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from draftstore import Settings
from draftstore.errors import BackendUnavailable, InvalidInput
from draftstore.events import MAX_PAGE, Activity, EventPublisher


def test_a_burst_is_appended_in_order_after_the_linger_and_a_flush_cuts_the_linger_short(coordinator: Any) -> None:
    publisher = EventPublisher(coordinator, linger_s=30.0)  # far longer than this test may take
    try:
        for i in range(50):
            publisher.emit("turn:t1", "tool.started", {"seq": i})
        time.sleep(0.2)
        assert coordinator.read("turn:t1") == []  # still gathering the burst
        t0 = time.monotonic()
        assert publisher.flush(timeout=10)
        assert time.monotonic() - t0 < 10  # the flush woke the publisher: it did not sleep out 30 s
        events = coordinator.read("turn:t1")
        assert [e.data["seq"] for e in events] == list(range(50))
        assert [e.id for e in events] == sorted(e.id for e in events)
        # a flush from another thread while events keep coming: every event before it is there after it
        stop = threading.Event()
        emitted = [50]  # events emitted so far (the writer bumps it after each emit)

        def writer() -> None:
            while not stop.is_set():
                publisher.emit("turn:t1", "tool.started", {"seq": emitted[0]})
                emitted[0] += 1
                time.sleep(0.001)

        th = threading.Thread(target=writer)
        th.start()
        try:
            for _ in range(5):
                time.sleep(0.02)
                before = emitted[0]
                assert publisher.flush(timeout=10)
                seen = [e.data["seq"] for e in coordinator.read("turn:t1", limit=100_000)]
                assert seen == list(range(len(seen)))  # in order, nothing missing in between
                assert len(seen) >= before  # everything emitted before the flush
        finally:
            stop.set()
            th.join()
        assert publisher.flush(timeout=10)
        assert publisher._flushes == 0  # noqa: SLF001 - every flush was reached
    finally:
        publisher.close()


def test_events_are_appended_without_a_flush_once_the_linger_is_over(coordinator: Any) -> None:
    publisher = EventPublisher(coordinator, linger_s=0.05)
    try:
        publisher.emit("turn:t2", "draft.changed", {"paths": ["a.py"]})
        deadline = time.monotonic() + 10
        while not coordinator.read("turn:t2") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [e.type for e in coordinator.read("turn:t2")] == ["draft.changed"]
    finally:
        publisher.close()


def _wait_for(coordinator: Any, stream: str, n: int, timeout: float = 10.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while len(events := coordinator.read(stream)) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return events


def test_an_append_waits_for_a_gap_between_operations_but_never_longer_than_its_bound(coordinator: Any) -> None:
    activity = Activity()
    publisher = EventPublisher(coordinator, linger_s=0.001, activity=activity, max_defer_s=30.0)
    try:
        release = threading.Event()
        entered = threading.Event()

        def operation() -> None:
            with activity.running():
                entered.set()
                release.wait(20)

        op = threading.Thread(target=operation)
        op.start()
        assert entered.wait(5)
        publisher.emit("turn:t3", "tool.started", {"seq": 1})
        time.sleep(0.3)
        assert coordinator.read("turn:t3") == []  # an operation is running: the append waits
        release.set()
        op.join()
        assert [e.data["seq"] for e in _wait_for(coordinator, "turn:t3", 1)] == [1]  # appended in the gap

        # a flush does not wait for the gap
        release.clear()
        entered.clear()
        op = threading.Thread(target=operation)
        op.start()
        assert entered.wait(5)
        publisher.emit("turn:t3", "tool.completed", {"seq": 1})
        time.sleep(0.2)  # the publisher is waiting for the gap now
        assert len(coordinator.read("turn:t3")) == 1
        t0 = time.monotonic()
        assert publisher.flush(timeout=10)
        assert time.monotonic() - t0 < 10
        assert [e.type for e in coordinator.read("turn:t3")] == ["tool.started", "tool.completed"]
        release.set()
        op.join()
    finally:
        publisher.close()

    # a process that is never idle still appends, once the bound is over
    bounded = EventPublisher(coordinator, linger_s=0.001, activity=activity, max_defer_s=0.2)
    try:
        with activity.running():
            bounded.emit("turn:t4", "tool.started", {"seq": 1})
            assert [e.type for e in _wait_for(coordinator, "turn:t4", 1)] == ["tool.started"]
    finally:
        bounded.close()


def test_append_now_lands_after_everything_queued_before_it_without_waiting_out_the_linger(coordinator: Any) -> None:
    publisher = EventPublisher(coordinator, linger_s=30.0)
    try:
        for i in range(3):
            publisher.emit("turn:t5", "tool.started", {"seq": i})
        t0 = time.monotonic()
        new_id = publisher.append_now("turn:t5", "assistant.delta", {"text": "now"})
        assert time.monotonic() - t0 < 10
        events = coordinator.read("turn:t5")  # no flush: it is there when append_now returns
        assert [e.type for e in events] == ["tool.started"] * 3 + ["assistant.delta"]
        assert events[-1].id == new_id
    finally:
        publisher.close()


class _Wrapped:
    """The coordinator under test with some of its methods intercepted (the rest pass through)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _GatedAppends(_Wrapped):
    """A coordinator whose batched appends (the publisher thread's) wait for ``gate``."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def append_many(self, events: Any) -> Any:
        self.entered.set()
        assert self.gate.wait(10)
        return self.inner.append_many(events)


def test_append_now_waits_for_a_batch_the_publisher_has_taken_but_not_yet_appended(coordinator: Any) -> None:
    # the case a queue-is-empty test would get wrong: the publisher thread took the
    # tool call's event off the queue and is appending it; append_now must land after it
    gated = _GatedAppends(coordinator)
    publisher = EventPublisher(gated, linger_s=0.0)
    try:
        publisher.emit("turn:t6", "tool.started", {"seq": 1})
        assert gated.entered.wait(10)  # in flight: off the queue, not in the buffer
        landed: list[int] = []
        th = threading.Thread(target=lambda: landed.append(
            publisher.append_now("turn:t6", "assistant.delta", {"text": "after"})))
        th.start()
        time.sleep(0.2)
        assert landed == [] and coordinator.read("turn:t6") == []  # still waiting behind the batch
        gated.gate.set()
        th.join(10)
        assert [e.type for e in coordinator.read("turn:t6")] == ["tool.started", "assistant.delta"]
        assert landed == [coordinator.read("turn:t6")[-1].id]
        # everything settled: the next append_now goes straight to the coordinator,
        # without a flush reaching the publisher thread
        flushes = []
        real_flush = publisher.flush
        publisher.flush = lambda timeout=10.0: flushes.append(1) or real_flush(timeout)  # type: ignore[method-assign]
        publisher.append_now("turn:t6", "assistant.delta", {"text": "direct"})
        assert flushes == []
        assert [e.data.get("text") for e in coordinator.read("turn:t6")][-1] == "direct"
        publisher.emit("turn:t6", "tool.completed", {"seq": 1})
        publisher.append_now("turn:t6", "assistant.delta", {"text": "last"})
        assert flushes == [1]  # something queued before it: ordered through the publisher
        assert [e.type for e in coordinator.read("turn:t6")][-2:] == ["tool.completed", "assistant.delta"]
    finally:
        gated.gate.set()
        publisher.close()


def test_events_emitted_while_the_publisher_closes_are_settled_so_append_now_stays_direct(coordinator: Any) -> None:
    publisher = EventPublisher(coordinator, linger_s=0.0)
    publisher.emit("turn:t7", "tool.started", {"seq": 1})
    real_flush = publisher.flush

    def flush_then_emit(timeout: float = 10.0) -> bool:  # an emit between close's flush and its stop
        done = real_flush(timeout)
        publisher.emit("turn:t7", "tool.completed", {"seq": 1})
        return done

    publisher.flush = flush_then_emit  # type: ignore[method-assign]
    publisher.close()
    publisher.flush = real_flush  # type: ignore[method-assign]
    try:
        assert [e.type for e in coordinator.read("turn:t7")] == ["tool.started", "tool.completed"]
        assert publisher._unsettled == 0  # noqa: SLF001 - nothing left counted as pending
    finally:
        publisher.close()


class Refusing(_Wrapped):
    """The coordinator under test, refusing appends while ``down``: an outage as the publisher meets it
    (the events and epochs are the real coordinator's)."""

    def __init__(self, coord: Any) -> None:
        super().__init__(coord)
        self.down = False

    def append_many(self, events: Any) -> Any:
        if self.down:
            raise BackendUnavailable("coordinator unreachable (test)")
        return self.inner.append_many(events)


def test_a_stream_that_lost_events_comes_back_under_a_new_epoch(coordinator: Any) -> None:
    """An append the coordinator refused is not retried; its stream is dropped before the next
    append to it, so a reader that kept its place sees another epoch (and rebuilds) instead of
    reading on past the gap. A stream that lost nothing keeps its epoch and ids."""
    flaky = Refusing(coordinator)
    publisher = EventPublisher(flaky, linger_s=0.0)
    try:
        publisher.emit("turn:t1", "tool.started", {"seq": 1})
        publisher.emit("turn:t2", "tool.started", {"seq": 1})
        assert publisher.flush(timeout=10)
        t1, t2 = coordinator.tail("turn:t1", 0, 10), coordinator.tail("turn:t2", 0, 10)
        flaky.down = True
        publisher.emit("turn:t1", "tool.started", {"seq": 2})  # lost with the outage
        assert publisher.flush(timeout=10)
        flaky.down = False
        publisher.emit("turn:t1", "tool.started", {"seq": 3})
        publisher.emit("turn:t2", "tool.started", {"seq": 2})
        assert publisher.flush(timeout=10)
        after = coordinator.tail("turn:t1", 0, 10)
        assert after.epoch is not None and after.epoch != t1.epoch
        assert [e.data["seq"] for e in after.events] == [3] and after.first_id == 1
        kept = coordinator.tail("turn:t2", 0, 10)
        assert kept.epoch == t2.epoch and [e.data["seq"] for e in kept.events] == [1, 2]
        # append_now (a delta) on a stream that lost events starts it anew too, first
        flaky.down = True
        publisher.emit("turn:t2", "tool.started", {"seq": 3})
        assert publisher.flush(timeout=10)
        flaky.down = False
        publisher.append_now("turn:t2", "assistant.delta", {"text": "x"})
        again = coordinator.tail("turn:t2", 0, 10)
        assert again.epoch != t2.epoch and [e.type for e in again.events] == ["assistant.delta"]
    finally:
        publisher.close()


class _Calls(_Wrapped):
    """A coordinator that records which appends and expiries reach it, in order."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls: list[tuple[str, Any]] = []

    def append_many(self, events: Any) -> Any:
        self.calls.append(("append", [(stream, type) for stream, type, _ in events]))
        return self.inner.append_many(events)

    def expire(self, stream: str, ttl_s: float) -> None:
        self.calls.append(("expire", stream))
        self.inner.expire(stream, ttl_s)


def test_a_turns_end_and_the_next_turns_start_are_one_append_then_the_expiry(coordinator: Any) -> None:
    # a turn ends (its events, then its stream's expiry) and the next starts within one linger:
    # one round trip for the four events, then the expiry, never append / expire / append
    calls = _Calls(coordinator)
    publisher = EventPublisher(calls, linger_s=30.0)
    try:
        publisher.emit("turn:t1", "turn.ended", {"turn_id": "t1"})
        publisher.emit("project:p", "turn.ended", {"turn_id": "t1"})
        publisher.expire("turn:t1", 3600)
        publisher.emit("turn:t2", "turn.started", {"turn_id": "t2"})
        publisher.emit("project:p", "turn.started", {"turn_id": "t2"})
        assert publisher.flush(timeout=10)
        assert calls.calls == [
            ("append", [("turn:t1", "turn.ended"), ("project:p", "turn.ended"),
                        ("turn:t2", "turn.started"), ("project:p", "turn.started")]),
            ("expire", "turn:t1"),
        ]
        assert [e.type for e in coordinator.read("project:p")] == ["turn.ended", "turn.started"]
        assert [e.type for e in coordinator.read("turn:t1")] == ["turn.ended"]  # expires later, not now
        # an expiry alone is still carried out, with no empty append before it
        calls.calls.clear()
        publisher.expire("turn:t2", 3600)
        assert publisher.flush(timeout=10)
        assert calls.calls == [("expire", "turn:t2")]
    finally:
        publisher.close()


# == what the store's events say =================================================================
def end_events(store: Any, turn_id: str, project_id: str) -> tuple[Any, Any]:
    """The turn's end event on its own stream and on its project's."""
    ends = [e for e in store.events(f"turn:{turn_id}") if e.type in TURN_END]
    on_project = [e for e in store.events(f"project:{project_id}")
                  if e.type in TURN_END and e.data["turn_id"] == turn_id]
    assert len(ends) == len(on_project) == 1, (ends, on_project)
    return ends[0], on_project[0]


TURN_END = {"turn.completed", "turn.interrupted", "turn.failed", "turn.rolled_back"}


def test_every_turn_end_event_says_why_the_turn_ended_so_a_cancel_is_told_from_a_crash(
        store_factory: Any) -> None:
    # a sweeper whose heartbeat TTL is short, so a turn nobody beats for is reaped in this test
    store = store_factory(settings=Settings(heartbeat_ttl_s=0.3))
    project = store.create_project(f"ends-{time.monotonic_ns()}", files={"a.txt": "a"})
    ways: list[tuple[str, Callable[[str], Any], str, str]] = [
        ("completed", lambda t: store.complete_turn(t, "done"), "turn.completed", "completed"),
        ("interrupted", lambda t: store.interrupt_turn(t), "turn.interrupted", "interrupted"),
        ("failed", lambda t: store.fail_turn(t, "boom"), "turn.failed", "failed"),
        ("cancelled", lambda t: store.cancel_turn(t), "turn.interrupted", "cancelled"),
        ("discarded", lambda t: store.discard_draft(project.id), "turn.rolled_back", "discarded"),
    ]
    for _, end, type_, reason in ways:
        turn = store.start_turn(project.id, "go")
        end(turn.id)
        on_turn, on_project = end_events(store, turn.id, project.id)
        assert (on_turn.type, on_turn.data["end_reason"]) == (type_, reason)
        assert (on_project.type, on_project.data["end_reason"]) == (type_, reason)
        # the history rebuilt from the database says the same
        assert store.durable_events(turn.id)[-1] == (type_, on_turn.data)

    # a worker that died: its heartbeat lapses, the sweep reaps the turn
    turn = store.start_turn(project.id, "go")
    store.coord.forget(f"turn:{turn.id}")
    deadline = time.monotonic() + 30
    while store.sweep()["turns_reaped"] == 0:  # after the coordinator's grace and the turn's TTL
        assert time.monotonic() < deadline, "the sweep never reaped the turn"
        time.sleep(0.1)
    on_turn, on_project = end_events(store, turn.id, project.id)
    assert (on_turn.type, on_turn.data["end_reason"], on_project.data["end_reason"]) == (
        "turn.interrupted", "heartbeat_lapsed", "heartbeat_lapsed")
    assert store.get_turn(turn.id).end_reason == "heartbeat_lapsed"  # the record's word, the event's word


def test_store_events_caps_its_limit_as_the_http_page_does(store: Any) -> None:
    project = store.create_project(f"capped-{time.monotonic_ns()}", files={"a.txt": "a"})
    turn = store.start_turn(project.id, "go")
    for _ in range(3):
        store.tool_started(turn.id, "view_file", {"path": "a.txt"})
    stream = f"turn:{turn.id}"
    assert [e.id for e in store.events(stream, limit=MAX_PAGE)] == [1, 2, 3, 4]
    assert [e.id for e in store.events(stream, after=1, limit=2)] == [2, 3]
    for bad in ({"limit": MAX_PAGE + 1}, {"limit": 0}, {"limit": 10**9}, {"limit": "5"}, {"limit": True},
                {"after": -1}, {"after": "0"}):
        with pytest.raises(InvalidInput) as refused:
            store.events(stream, **bad)
        assert refused.value.code == "input.invalid" and refused.value.details["field"] in bad, bad


def test_a_turns_start_is_in_its_buffer_before_start_turn_returns(store: Any) -> None:
    # read straight from the coordinator (Store.events would flush first): what a subscriber that
    # connects the moment the turn is started finds, in this process or another
    project = store.create_project(f"at-once-{time.monotonic_ns()}", files={"a.txt": "a"})
    for i in range(20):
        turn = store.start_turn(project.id, "go") if i == 0 else store.continue_turn(project.id, "on")
        tail = store.coord.tail(f"turn:{turn.id}")
        assert tail.epoch is not None and [(e.id, e.type) for e in tail.events] == [(1, "turn.started")], i
        assert tail.events[0].data == {"turn_id": turn.id, "project_id": project.id}
        store.complete_turn(turn.id, "done")
