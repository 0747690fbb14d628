"""The events handle: the coordinator as the components use it.

``Coordination`` holds the coordinator (locks, event buffers, heartbeats,
a turn's shared text) and the publisher that appends events to it off the
callers' path. Nothing it holds is truth: a lost lock only costs wasted
work (compare-and-swap on rows is what makes operations correct), and a lost
event buffer is rebuilt from the database.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import errors as E
from .coord import Coordinator
from .events import Activity, EventPublisher

__all__ = ["Coordination"]


class Coordination:
    """The coordinator, its event publisher, and this process's activity.

    Thread-safe; one per ``Store``. ``event_ttl_s`` is how long a finished
    stream's buffer is kept (``expire_stream``).
    """

    def __init__(self, coord: Coordinator, activity: Activity, *, event_ttl_s: float) -> None:
        self.coord = coord
        #: operations running now in this process: the publisher appends between them
        self.activity = activity
        self.publisher = EventPublisher(coord, activity=activity)
        self.event_ttl_s = event_ttl_s
        try:  # the coordinator's state begins (at the latest) when a store opens on it
            coord.since()
        except E.DraftstoreError:
            pass  # unavailable now: the first operation says so, typed

    def close(self) -> None:
        """Append what is queued, then close the coordinator."""
        self.publisher.close()
        self.coord.close()

    @contextmanager
    def try_lock(self, name: str, ttl_s: float,
                 busy: type[Exception] | tuple[type[Exception], ...] = E.LockTimeout) -> Iterator[bool]:
        """Hold the coordinator lock ``name`` if it can be had at once: yields True (and
        releases it after), or False when acquiring raised ``busy`` (held elsewhere; a
        caller that skips the work on any coordinator failure passes ``DraftstoreError``)."""
        try:
            lock = self.coord.acquire(name, ttl_s=ttl_s, timeout_s=0)
        except busy:
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    def emit(self, stream: str, type: str, data: dict[str, Any]) -> None:
        """Queue an event for SSE (never waited for: events are rebuildable from rows)."""
        self.publisher.emit(stream, type, data)

    def append_now(self, stream: str, type: str, data: dict[str, Any]) -> None:
        """Append an event that lives nowhere else (a text delta) before returning,
        in order after the events queued so far; raises if the coordinator refused it."""
        self.publisher.append_now(stream, type, data)

    def expire_stream(self, stream: str) -> None:
        """Let a stream's buffer go ``event_ttl_s`` after now (queued behind its events)."""
        self.publisher.expire(stream, self.event_ttl_s)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every event queued before this call is appended; False if that
        took longer than ``timeout`` seconds."""
        return self.publisher.flush(timeout)

    def ping(self) -> None:
        """One round trip to the coordinator; raises if it does not answer."""
        self.coord.ping()
