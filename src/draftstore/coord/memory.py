"""Coordinator backend: in-process (embedded default).

Good for one process with many threads. Several processes sharing one SQLite
file each get their own coordinator; that stays correct because no truth
lives here (locks only save wasted work, the database decides).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

from ..errors import LockTimeout
from .base import Event

__all__ = ["MemoryCoordinator"]


@dataclass
class _MemoryLock:
    name: str
    token: int
    coord: "MemoryCoordinator"

    def release(self) -> bool:
        return self.coord._release(self.name, self.token)


class MemoryCoordinator:
    def __init__(self, max_events: int = 10_000) -> None:
        self.url = "memory://"
        self.max_events = max_events
        self._cv = threading.Condition()
        self._locks: dict[str, tuple[int, float]] = {}
        self._tokens = itertools.count(1)
        self._streams: dict[str, tuple[int, deque[Event]]] = {}
        self._beats: dict[str, float] = {}

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
            last, buf = self._streams.get(stream, (0, deque(maxlen=self.max_events)))
            event = Event(last + 1, type, dict(data or {}))
            buf.append(event)
            self._streams[stream] = (event.id, buf)
            self._cv.notify_all()
            return event.id

    def append_many(self, events: Sequence[tuple[str, str, dict[str, Any] | None]]) -> list[int]:
        with self._cv:
            return [self.append(stream, type, data) for stream, type, data in events]

    def read(self, stream: str, after: int = 0, limit: int = 1000) -> list[Event]:
        with self._cv:
            _, buf = self._streams.get(stream, (0, deque()))
            return [e for e in buf if e.id > after][:limit]

    def trim(self, stream: str) -> None:
        with self._cv:
            self._streams.pop(stream, None)

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

    def close(self) -> None:
        pass
