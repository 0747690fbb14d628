"""Buffering the store's events into the coordinator, off the caller's path.

Events (turn started, tool call recorded, draft changed, ...) feed SSE. They
are not truth: everything they say is in the database already. So an
operation never waits for the coordinator: ``EventPublisher.emit`` queues the
event and one background thread appends queued events in order. Within one
process, events of a stream keep the order of the operations that emitted
them. ``flush`` waits until everything queued so far is appended (the store
calls it before reading events and on close, so a process reads its own
events).

An event the coordinator refuses (it is unreachable) is not retried: its
stream is dropped before the next append to it, so the stream comes back
under a new epoch and its readers rebuild it from the database, instead of
reading on past a gap they cannot see.

A stream's first event (a turn's ``turn.started``) is appended before the
operation returns (``emit_now``): a reader that subscribes the moment the turn
is started must find a buffer holding the whole history; finding none, it could
not tell "not appended yet" from "lost", and would rebuild what was never lost.

The other exception is an event nothing else records: an assistant text delta
lives only in the buffer (no row per delta). ``append_now`` appends such an
event before it returns, after everything queued before it, and raises if the
coordinator refused it: once its caller acknowledges it, a process killed the
next moment does not take it along, and a turn ended through another process
afterwards ends the stream after it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .coord import Coordinator
from .errors import DraftstoreError

__all__ = ["Activity", "EventPublisher", "LINGER_S", "MAX_DEFER_S", "MAX_PAGE"]

log = logging.getLogger("draftstore.events")

# How long the publisher lets a burst of events gather before appending it (one
# round trip per burst). Kept short on purpose: events of one turn can come from
# several processes, each appending its own, and the buffer's order is the order
# of the appends: an event queued in one process can land after an event of the
# same turn emitted a few milliseconds later in another. (Deltas, which nothing
# else records, do not wait for it: ``append_now``.) Readers never wait for it: a
# flush cuts it short.
LINGER_S = 0.005
# After the linger, an append waits (at most this long) for a moment when no
# operation of this process is running: its round trip and ~0.2 ms of CPU then
# fall between requests instead of inside one (measured over HTTP: appended in
# the middle of file writes, it cost them 0.4 ms at the median). An idle process
# appends after the linger alone.
MAX_DEFER_S = 0.005  # about one file write: appends still land within 10 ms of their event
# the most buffered events one read returns, in Python (``Store.events``) as over HTTP (the JSON page)
MAX_PAGE = 1000


class Activity:
    """How many store operations are running in this process (``running``), so
    background work can wait for a gap between them (``wait_idle``)."""

    def __init__(self) -> None:
        self._running = 0
        self._cond = threading.Condition(threading.Lock())

    @contextmanager
    def running(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def enter(self) -> None:
        """An operation begins (``running`` without a generator, for the hottest paths)."""
        with self._cond:
            self._running += 1

    def leave(self) -> None:
        """The operation ``enter`` began has ended."""
        with self._cond:
            self._running -= 1
            if not self._running:
                self._cond.notify_all()

    def wait_idle(self, timeout: float, unless: Callable[[], bool] = lambda: False) -> bool:
        """Wait until no operation runs (or ``unless()``, checked whenever ``poke`` is
        called), at most ``timeout`` seconds; True if idle (or ``unless``)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._running or unless(), timeout)

    def poke(self) -> None:
        """Wake ``wait_idle`` to check its ``unless`` again."""
        with self._cond:
            self._cond.notify_all()

_STOP = object()
_EXPIRE = object()  # queue item (_EXPIRE, stream, ttl_s)


class EventPublisher:
    """Ordered, asynchronous appends to a coordinator's event buffers.

    Bounded: when ``max_pending`` events wait (the coordinator is down or
    slow), new ones are dropped with a warning rather than blocking the
    operation that emitted them.
    """

    def __init__(self, coord: Coordinator, max_pending: int = 100_000, linger_s: float = LINGER_S,
                 max_batch: int = 500, activity: Activity | None = None, max_defer_s: float = MAX_DEFER_S) -> None:
        self.coord = coord
        self.linger_s = linger_s
        self.activity = activity  # None: append after the linger, whatever runs
        self.max_defer_s = max_defer_s
        self._hurry = threading.Event()  # set by flush: stop lingering
        self._flushes = 0  # flushes queued and not yet reached (no linger while any waits)
        self._flushes_lock = threading.Lock()
        self.max_batch = max_batch
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        # events and expiries queued and not yet settled (appended, or given up on): while
        # none is, ``append_now`` need not hand off to the publisher thread to keep order
        self._unsettled = 0
        self._unsettled_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.dropped = 0
        # streams some of whose events the coordinator refused: each is dropped (trimmed) before
        # its next append, so it comes back under a new epoch and its readers rebuild from the database
        self._lost: set[str] = set()
        self._lost_lock = threading.Lock()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    t = threading.Thread(target=self._run, name="draftstore-events", daemon=True)
                    t.start()
                    self._thread = t

    def emit(self, stream: str, type: str, data: dict[str, Any]) -> None:
        self._ensure_thread()
        self._settle(-1)
        try:
            self._queue.put_nowait((stream, type, data))
        except queue.Full:
            self._settle(1)
            self.dropped += 1
            log.warning("event %s on %s dropped: %d events already pending", type, stream, self._queue.qsize())

    def expire(self, stream: str, ttl_s: float) -> None:
        """Let ``stream``'s buffer expire ``ttl_s`` from when its queued events are
        appended (queued behind them, so the expiry covers the last event too)."""
        self._ensure_thread()
        self._settle(-1)
        try:
            self._queue.put_nowait((_EXPIRE, stream, ttl_s))
        except queue.Full:
            self._settle(1)
            log.warning("expiry of %s dropped: %d events already pending", stream, self._queue.qsize())

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every event queued before this call is appended (or dropped)."""
        if self._thread is None:
            return True
        done = threading.Event()
        with self._flushes_lock:
            self._flushes += 1
        try:
            self._queue.put((None, None, done), timeout=timeout)
        except queue.Full:
            with self._flushes_lock:
                self._flushes -= 1
            return False
        self._hurry.set()
        if self.activity is not None:
            self.activity.poke()
        return done.wait(timeout)

    def append_now(self, stream: str, type: str, data: dict[str, Any]) -> int:
        """Append one event now, after every event queued before this call; returns
        its id. Raises the coordinator's error (typed) if it could not be appended:
        for an event that lives nowhere else, so its caller acknowledges it only once
        it is in the buffer.

        When nothing this process queued is still unsettled (the common case between a
        turn's tool calls), there is nothing to keep order with: the event is appended
        on the caller's thread at once, without waking the publisher thread."""
        with self._unsettled_lock:
            idle = self._unsettled == 0
        if not idle:
            self.flush()
        self._recreate_lost()
        return self.coord.append(stream, type, data)

    def emit_now(self, stream: str, type: str, data: dict[str, Any]) -> None:
        """Append a stream's first event before returning (``append_now``), so a reader
        that subscribes as soon as its caller answers finds the buffer there and whole.
        A coordinator that refuses it is logged, not raised: the event is in the
        database, and a stream whose first event is missing is rebuilt from there."""
        try:
            self.append_now(stream, type, data)
        except DraftstoreError as exc:
            log.warning("event %s on %s not buffered (its readers rebuild it from the database): %s",
                        type, stream, exc)

    def _settle(self, n: int) -> None:
        """``n`` queued items settled (negative: ``-n`` more queued)."""
        with self._unsettled_lock:
            self._unsettled -= n

    def close(self) -> None:
        if self._thread is not None:
            self.flush()
            self._queue.put(_STOP)
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while True:
            self._hurry.clear()
            item = self._queue.get()
            batch = [item]
            if item is not _STOP and isinstance(item[0], str) and not self._flushes:
                # let a burst gather, then take it all: one round trip and one
                # wake-up per burst instead of per event (a flush cuts it short);
                # then wait for a gap between this process's operations (bounded)
                self._hurry.wait(self.linger_s)
                if self.activity is not None and not self._flushes:
                    self.activity.wait_idle(self.max_defer_s, unless=lambda: self._flushes > 0)
            while len(batch) < self.max_batch and batch[-1] is not _STOP:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            # the whole batch's events in one round trip, then its expiries, then the flushes
            # it holds are answered: an expiry queued between two events of a burst (a turn's
            # end, then the next turn's start) does not split the burst into two appends. An
            # expiry then lands after events queued behind it too, which only starts its
            # time-to-live a little later (an append keeps a stream's expiry).
            events: list[tuple[str, str, dict[str, Any]]] = []
            expiries, flushes = [], []
            for e in batch:
                if e is _STOP:  # only ever the last of a batch
                    continue
                (events if isinstance(e[0], str) else expiries if e[0] is _EXPIRE else flushes).append(e)
            self._append(events)
            for _, stream, ttl_s in expiries:
                self._expire(stream, ttl_s)
            for _, _, done in flushes:
                with self._flushes_lock:
                    self._flushes -= 1
                done.set()
            # only once their appends returned: an append_now that finds nothing unsettled
            # must find these in the buffer already
            self._settle(len(events) + len(expiries))
            if batch[-1] is _STOP:  # everything before it is appended
                return

    def _append(self, events: list[tuple[str, str, dict[str, Any]]]) -> None:
        if not events:
            return
        try:
            self._recreate_lost()
            self.coord.append_many(events)
        except Exception as exc:  # never let one bad batch kill the publisher
            with self._lost_lock:
                self._lost.update(stream for stream, _, _ in events)
            if isinstance(exc, DraftstoreError):
                log.warning("%d events not buffered (their streams start anew once the coordinator "
                            "answers): %s", len(events), exc)
            else:
                log.exception("%d events not buffered", len(events))

    def _recreate_lost(self) -> None:
        """Drop the streams that lost events, before anything more is appended to them: a reader
        that kept its place in one would otherwise go on past the gap without knowing. Raises
        the coordinator's error (the streams stay marked)."""
        with self._lost_lock:
            for stream in sorted(self._lost):
                self.coord.trim(stream)
                self._lost.discard(stream)

    def _expire(self, stream: str, ttl_s: float) -> None:
        try:
            self.coord.expire(stream, ttl_s)
        except DraftstoreError as exc:
            log.warning("stream %s left without expiry: %s", stream, exc)
        except Exception:
            log.exception("stream %s left without expiry", stream)
