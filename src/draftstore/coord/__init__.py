"""Coordinators: locks, SSE event buffers and heartbeats; never truth.

``open_coordinator(url)``: ``memory://`` (embedded default) or ``redis://host:port/db``
(``rediss://`` for TLS; ``?prefix=name`` namespaces every key).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ..errors import ConfigInvalid
from .base import Coordinator, Event, Lock, locked
from .memory import MemoryCoordinator

__all__ = ["Coordinator", "Event", "Lock", "locked", "MemoryCoordinator", "open_coordinator"]


def open_coordinator(url: str) -> Coordinator:
    """Open the coordinator named by ``url``. Raises ``config.invalid`` on an unknown scheme."""
    scheme = urlsplit(url).scheme
    if scheme in ("memory", ""):
        return MemoryCoordinator()
    if scheme in ("redis", "rediss", "unix"):
        from .redis import RedisCoordinator

        return RedisCoordinator.from_url(url)
    raise ConfigInvalid(f"unknown coordinator URL scheme {scheme!r}", url=url)
