"""The coordinator contract: locks, per-stream event buffers, heartbeats.

No truth lives in a coordinator. Locks are an optimisation (correctness comes
from compare-and-swap on database rows); events can be rebuilt from the
database; a missing heartbeat only means "presumed dead".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Coordinator", "Event", "Lock"]


@dataclass(frozen=True)
class Event:
    """One buffered event. ``id`` is a positive integer, strictly increasing per stream."""

    id: int
    type: str
    data: dict[str, Any] = field(default_factory=dict)


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
    - ``beat(key, ttl_s)`` marks key alive for ttl_s; ``alive(key)`` tells.
    """

    url: str

    def acquire(self, name: str, ttl_s: float = 30.0, timeout_s: float = 10.0) -> Lock: ...

    def append(self, stream: str, type: str, data: dict[str, Any] | None = None) -> int: ...

    def append_many(self, events: Sequence[tuple[str, str, dict[str, Any] | None]]) -> list[int]: ...

    def read(self, stream: str, after: int = 0, limit: int = 1000) -> list[Event]: ...

    def trim(self, stream: str) -> None: ...

    def expire(self, stream: str, ttl_s: float) -> None: ...

    def beat(self, key: str, ttl_s: float) -> None: ...

    def alive(self, key: str) -> bool: ...

    def forget(self, key: str) -> None: ...

    def close(self) -> None: ...


@contextmanager
def locked(coord: Coordinator, name: str, ttl_s: float = 30.0, timeout_s: float = 10.0) -> Iterator[Lock]:
    """``with locked(coord, name):`` — acquire, and release on exit."""
    lock = coord.acquire(name, ttl_s=ttl_s, timeout_s=timeout_s)
    try:
        yield lock
    finally:
        lock.release()
