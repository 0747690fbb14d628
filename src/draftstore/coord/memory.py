"""Coordinator backend: in-process.

Good for one process with many threads, and for tests. Every instance is its
own world: two Stores (or processes) on the same data do not see each other's
locks, events or heartbeats, so one may presume the other's live turn dead.
Use ``SqliteCoordinator`` (embedded) or Redis when several share the data.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..errors import ConfigInvalid, LockTimeout
from .base import Event, Tail, new_epoch

__all__ = ["MemoryCoordinator"]

PURGE_BATCH = 8  # expired streams deleted per append: bounds an append's cost


class _Stream(NamedTuple):
    last_id: int  # the counter: survives the deque dropping old events
    epoch: str  # given at creation, kept until the stream is dropped
    events: deque[Event]


@dataclass
class _MemoryLock:
    name: str
    token: int
    coord: "MemoryCoordinator"

    def release(self) -> bool:
        return self.coord._release(self.name, self.token)


class MemoryCoordinator:
    """Locks, bounded event buffers and heartbeats in this process's memory.

    Same guarantees as the other backends, within one instance: one lock owner
    at a time, freed after its ttl, released only by its owner; event ids 1, 2,
    3, ... per stream without gaps or duplicates; newest ``max_events`` kept;
    a new epoch per stream creation; ``expire`` drops a stream after its ttl;
    heartbeats live for their ttl. Thread-safe (one condition variable guards
    everything, so ``tail`` is a consistent snapshot).
    """

    def __init__(self, max_events: int = 10_000) -> None:
        if max_events < 1:  # the newest event must survive: it carries the stream's counter
            raise ConfigInvalid("max_events must be at least 1", max_events=max_events)
        self.url = "memory://"
        self.max_events = max_events
        self._cv = threading.Condition()
        self._locks: dict[str, tuple[int, float]] = {}
        self._tokens = itertools.count(1)
        self._streams: dict[str, _Stream] = {}
        self._deadlines: dict[str, float] = {}  # stream -> when expire() drops it
        # (deadline, stream), soonest first, for the opportunistic purge. An
        # entry whose deadline no longer matches _deadlines is stale: skipped.
        self._expiry_queue: list[tuple[float, str]] = []
        self._beats: dict[str, float] = {}
        self._texts: dict[str, tuple[list[str], int, float]] = {}  # key -> (chunks, UTF-8 bytes, expiry)
        self._since = time.time()

    # -- locks -------------------------------------------------------------
    def acquire(self, name: str, ttl_s: float = 30.0, timeout_s: float = 10.0) -> _MemoryLock:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                now = time.monotonic()
                held = self._locks.get(name)
                if held is None or held[1] <= now:
                    token = next(self._tokens)
                    self._locks[name] = (token, now + ttl_s)
                    return _MemoryLock(name, token, self)
                remaining = min(deadline, held[1]) - now
                if now >= deadline:
                    raise LockTimeout(f"lock {name!r} not acquired within {timeout_s}s", lock=name)
                self._cv.wait(timeout=max(remaining, 0.001))

    def _release(self, name: str, token: int) -> bool:
        with self._cv:
            held = self._locks.get(name)
            if held is None or held[0] != token:
                return False
            del self._locks[name]
            self._cv.notify_all()
            return held[1] > time.monotonic()

    # -- event buffers -----------------------------------------------------
    def append(self, stream: str, type: str, data: dict[str, Any] | None = None) -> int:
        with self._cv:
            now = time.monotonic()
            self._purge_expired(now)
            self._drop_if_expired(stream, now)
            current = self._streams.get(stream)
            if current is None:  # created (again): a new epoch tells readers its ids restart
                current = _Stream(0, new_epoch(), deque(maxlen=self.max_events))
            event = Event(current.last_id + 1, type, dict(data or {}))
            current.events.append(event)
            self._streams[stream] = current._replace(last_id=event.id)
            self._cv.notify_all()
            return event.id

    def append_many(self, events: Sequence[tuple[str, str, dict[str, Any] | None]]) -> list[int]:
        with self._cv:
            return [self.append(stream, type, data) for stream, type, data in events]

    def read(self, stream: str, after: int = 0, limit: int = 1000) -> list[Event]:
        with self._cv:
            self._drop_if_expired(stream, time.monotonic())
            current = self._streams.get(stream)
            return [] if current is None else self._after(current.events, after, limit)

    def tail(self, stream: str, after: int = 0, limit: int = 1000) -> Tail:
        """Epoch, buffered id range and events with id > ``after`` (at most ``limit``),
        read under the lock: one consistent snapshot."""
        with self._cv:
            self._drop_if_expired(stream, time.monotonic())
            current = self._streams.get(stream)
            if current is None:
                return Tail(None, [], 0, 0)
            buf = current.events  # never empty: max_events >= 1 keeps the newest
            return Tail(current.epoch, self._after(buf, after, limit), buf[0].id, buf[-1].id)

    @staticmethod
    def _after(buf: deque[Event], after: int, limit: int) -> list[Event]:
        # Buffered ids are contiguous (first, first + 1, ...): skip by position.
        if not buf or limit <= 0:
            return []
        start = max(0, int(after) + 1 - buf[0].id)
        return list(itertools.islice(buf, start, start + limit))

    def trim(self, stream: str) -> None:
        with self._cv:
            self._streams.pop(stream, None)
            self._deadlines.pop(stream, None)

    def expire(self, stream: str, ttl_s: float) -> None:
        """Drop the stream ``ttl_s`` from now (replacing an earlier expiry); no-op if absent."""
        with self._cv:
            now = time.monotonic()
            self._drop_if_expired(stream, now)
            if stream in self._streams:
                self._deadlines[stream] = now + ttl_s
                heapq.heappush(self._expiry_queue, (now + ttl_s, stream))

    def _drop_if_expired(self, stream: str, now: float) -> None:
        deadline = self._deadlines.get(stream)
        if deadline is not None and deadline <= now:
            del self._deadlines[stream]
            self._streams.pop(stream, None)

    def _purge_expired(self, now: float) -> None:
        """Drop up to PURGE_BATCH streams whose expiry passed (nobody may read them again)."""
        for _ in range(PURGE_BATCH):
            if not self._expiry_queue or self._expiry_queue[0][0] > now:
                return
            _, stream = heapq.heappop(self._expiry_queue)
            self._drop_if_expired(stream, now)  # a stale entry (re-expired, trimmed) drops nothing

    # -- heartbeats --------------------------------------------------------
    def beat(self, key: str, ttl_s: float) -> None:
        with self._cv:
            self._beats[key] = time.monotonic() + ttl_s

    def alive(self, key: str) -> bool:
        with self._cv:
            exp = self._beats.get(key)
            return exp is not None and exp > time.monotonic()

    def forget(self, key: str) -> None:
        with self._cv:
            self._beats.pop(key, None)

    def append_text(self, key: str, text: str, ttl_s: float, max_bytes: int) -> int:
        size = len(text.encode("utf-8"))
        now = time.monotonic()
        with self._cv:
            chunks, total, expiry = self._texts.get(key) or ([], 0, now)
            if expiry <= now and chunks:  # expired: it starts again
                chunks, total = [], 0
            if total + size > max_bytes:
                return -1
            chunks.append(text)
            self._texts[key] = (chunks, total + size, now + ttl_s)
            return total + size

    def get_text(self, key: str) -> str | None:
        with self._cv:
            entry = self._texts.get(key)
            if entry is None or entry[2] <= time.monotonic():
                return None
            return "".join(entry[0])

    def drop_text(self, key: str) -> None:
        with self._cv:
            self._texts.pop(key, None)

    def ping(self) -> None:
        """Always usable: it lives in this process."""

    def since(self) -> float:
        return self._since

    def close(self) -> None:
        pass
