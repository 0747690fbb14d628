"""The coordinator contract: locks, per-stream event buffers, heartbeats.

No truth lives in a coordinator. Locks are an optimisation (correctness comes
from compare-and-swap on database rows); events can be rebuilt from the
database; a missing heartbeat only means "presumed dead".
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["LEGACY_EPOCH", "Coordinator", "Event", "Lock", "Tail", "new_epoch"]

# The epoch of a stream created by a release that knew no epochs (read from an
# upgraded SQLite file, or a Redis stream without its epoch key). Not random:
# it is only as trustworthy as the assumption that no such release still
# appends, and a stream recreated by this release never gets it.
LEGACY_EPOCH = "legacy"


@dataclass(frozen=True)
class Event:
    """One buffered event. ``id`` is a positive integer, strictly increasing per stream."""

    id: int
    type: str
    data: dict[str, Any] = field(default_factory=dict)


def new_epoch() -> str:
    """A fresh epoch token for a stream being created: 64 random bits, so two
    incarnations of one stream never share one in practice."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Tail:
    """One atomic snapshot of a stream: its epoch, id range and events after a point.

    - ``epoch``: token given to the stream when it was created; None if the
      stream does not exist (never written, trimmed, expired or lost). Stable
      while the stream exists (also across dropping old events); a stream
      created again gets a different one, and its ids restart at 1. A stream
      that may have lost its newest events without being dropped (Redis served
      by another server process: a replica that took over, a restart from a
      snapshot) reads under a different one too.
    - ``events``: buffered events with id > ``after``, oldest first, at most ``limit``.
    - ``first_id`` / ``last_id``: oldest and newest id still buffered (0 if none).

    A reader that saw ids up to ``n`` in epoch ``e`` can trust ``events`` as
    the exact continuation only if ``epoch == e`` and ``n >= first_id - 1``:
    a different epoch means the ids now name other events, a smaller ``n``
    means events it never saw were dropped. Either way it must rebuild what it
    needs from the database. ``n > last_id`` in the same epoch cannot come from
    this stream: treat it as a mismatch too.
    """

    epoch: str | None
    events: list[Event]
    first_id: int
    last_id: int


@runtime_checkable
class Lock(Protocol):
    name: str

    def release(self) -> bool:
        """Release if still held by this owner; False if it had expired or was taken over."""
        ...


@runtime_checkable
class Coordinator(Protocol):
    """Locks with timeouts, append-only event buffers, heartbeats with TTL.

    - ``acquire(name, ttl_s, timeout_s)`` returns a ``Lock`` or raises
      ``lock.timeout``; a lock whose holder died frees itself after ``ttl_s``.
      Only the owner can release it.
    - ``append(stream, type, data)`` returns the event id: 1, 2, 3, ... per stream.
      ``append_many([(stream, type, data), ...])`` appends several in order (one
      round trip where the backend allows) and returns their ids.
      ``read(stream, after=0, limit)`` returns events with id > after, in order.
      Buffers are bounded (``max_events`` newest kept).
      ``trim(stream)`` drops a buffer now; ``expire(stream, ttl_s)`` drops it
      ttl_s seconds from now (replacing an earlier expiry). Appending after
      ``expire`` keeps the expiry; once dropped, a stream reads as empty and its
      ids start again at 1. Expiring an absent stream is a no-op. (For streams
      of ended turns, which must not accumulate one per turn forever.)
    - ``tail(stream, after=0, limit)`` returns a ``Tail``: the stream's epoch,
      its buffered id range and the events with id > after, all from one
      atomic snapshot. The first append to a stream that does not exist
      (never written, trimmed, expired or lost) creates it with a new epoch,
      atomically with its event 1; dropping old events (``max_events``) keeps
      it. SSE replay compares epochs to tell "after n" in this stream from
      "after n" in an earlier one (see ``Tail``).
    - ``beat(key, ttl_s)`` marks key alive for ttl_s; ``alive(key)`` tells.
    - ``append_text(key, text, ttl_s, max_bytes)`` appends ``text`` to the text
      ``key`` (absent or expired: empty) and keeps it ``ttl_s`` from now; it
      returns the text's length in UTF-8 bytes after, or -1, changing nothing,
      when that would be over ``max_bytes``. ``get_text(key)`` is the text (None:
      absent or expired); ``drop_text(key)`` deletes it. (A running turn's
      assistant text, shared by every process its deltas reach.)
    - ``ping()`` returns if the backend can be used, else raises
      ``backend.unavailable`` (a health check; the in-process one never raises).
    """

    url: str

    def acquire(self, name: str, ttl_s: float = 30.0, timeout_s: float = 10.0) -> Lock: ...

    def append(self, stream: str, type: str, data: dict[str, Any] | None = None) -> int: ...

    def append_many(self, events: Sequence[tuple[str, str, dict[str, Any] | None]]) -> list[int]: ...

    def read(self, stream: str, after: int = 0, limit: int = 1000) -> list[Event]: ...

    def tail(self, stream: str, after: int = 0, limit: int = 1000) -> Tail: ...

    def trim(self, stream: str) -> None: ...

    def expire(self, stream: str, ttl_s: float) -> None: ...

    def beat(self, key: str, ttl_s: float) -> None: ...

    def alive(self, key: str) -> bool: ...

    def forget(self, key: str) -> None: ...

    def append_text(self, key: str, text: str, ttl_s: float, max_bytes: int) -> int: ...

    def get_text(self, key: str) -> str | None: ...

    def drop_text(self, key: str) -> None: ...

    def ping(self) -> None: ...

    def since(self) -> float:
        """When this coordinator's state began (epoch seconds): a new SQLite file, a new
        process (in-process), or a Redis that was flushed or restarted. No heartbeat
        older than that can be held, so a recovery sweep gives workers one heartbeat
        TTL after it to beat again before it reaps anything."""
        ...

    def close(self) -> None: ...


@contextmanager
def locked(coord: Coordinator, name: str, ttl_s: float = 30.0, timeout_s: float = 10.0) -> Iterator[Lock]:
    """``with locked(coord, name):`` — acquire, and release on exit."""
    lock = coord.acquire(name, ttl_s=ttl_s, timeout_s=timeout_s)
    try:
        yield lock
    finally:
        lock.release()
