"""A bounded in-process cache of immutable objects.

A digest names its content forever, so an entry never needs invalidation:
only eviction (least recently used) to stay under the byte budget.

Keys: a bare digest is that object's bytes (the blob stores and the pack
reader). A key with a prefix holds a decoded form, and each prefix belongs to
one module, which alone builds it (a helper next to its reader): ``tree:``
``trees``; ``covering:`` ``packing``; ``index:``, ``ixshard:``, ``summary:``,
``summary-of:`` and ``summary-unusable:`` ``search.packed``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

__all__ = ["ObjectCache"]


class ObjectCache:
    """LRU keyed by digest, bounded by the sum of entry sizes in bytes.

    Thread-safe. ``max_bytes=0`` disables caching. An entry larger than a
    quarter of the budget is not cached, so one big file cannot flush the
    tree nodes every read needs.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def add(self, key: str, value: Any, size: int | None = None) -> None:
        if self.max_bytes == 0:
            return
        n = size if size is not None else len(value)
        if n > self.max_bytes // 4:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, n)
            self._bytes += n
            while self._bytes > self.max_bytes and self._entries:
                _, (_, sz) = self._entries.popitem(last=False)
                self._bytes -= sz

    def discard(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
