"""Coordinators: locks, SSE event buffers and heartbeats; never truth.

``open_coordinator(url)``: ``sqlite:///path.db`` (one file shared by every process
on the same embedded data; ``sqlite:////abs/path.db`` for an absolute path),
``memory://`` (this process only), ``redis://host:port/db`` (``rediss://`` for
TLS) or ``redis+cluster://host:port,host:port`` (a Redis Cluster; ``rediss+cluster://``
for TLS); ``?prefix=name`` namespaces every Redis key. ``?max_events=N`` bounds
each event buffer on any of them but ``memory://``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ..errors import ConfigInvalid
from .base import LEGACY_EPOCH, Coordinator, Event, Lock, Tail, locked
from .memory import MemoryCoordinator
from .sqlite import SqliteCoordinator

__all__ = [
    "LEGACY_EPOCH",
    "Coordinator",
    "Event",
    "Lock",
    "Tail",
    "locked",
    "MemoryCoordinator",
    "SqliteCoordinator",
    "open_coordinator",
]


def open_coordinator(url: str) -> Coordinator:
    """Open the coordinator named by ``url``. Raises ``config.invalid`` on an unknown scheme."""
    scheme = urlsplit(url).scheme
    if scheme in ("memory", ""):
        return MemoryCoordinator()
    if scheme == "sqlite":
        return SqliteCoordinator.from_url(url)
    if scheme in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        from .redis import RedisCoordinator

        return RedisCoordinator.from_url(url)
    raise ConfigInvalid(f"unknown coordinator URL scheme {scheme!r}", url=url)
