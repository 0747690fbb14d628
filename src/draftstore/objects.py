"""The objects handle: content-addressed objects as the components read and write them.

``Objects`` holds the blob store twice over, under names that say which is
which: ``pack_aware`` reads an object by its digest wherever it lives (the
object cache, a pack in memory, a pack found through the database's
``pack_object`` rows, or the object stored alone), while ``raw`` is the blob
store itself, for what a component writes, lists or deletes, and for objects
that are only ever stored alone (turn states, offloaded payloads, bundles,
indexes), read without a pack lookup. Beside them: the tree reader on the
pack-aware reader, the object cache, the upload pool on which uploads overlap
transactions, and the read pool for independent chains of reads.

Objects are immutable, so every cache here only saves work: ``clear_caches``
never changes what a read returns.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from .blobs import BlobStore, ObjectCache
from .digest import EMPTY_TREE
from .packs import Location, PackedObjects
from .pools import settle, start_workers
from .trees import TreeReader

__all__ = ["Objects"]

T = TypeVar("T")
R = TypeVar("R")
_READERS = 8  # threads of the read pool (``in_parallel``)


class Objects:
    """The blob store, pack-aware reads, trees and the pools that move objects.

    Thread-safe; one per ``Store``. ``locate(digests)`` answers where packed
    objects live (``PackLocator.locate``): it is given at construction, so the
    pack-aware reader is whole from the start.
    """

    def __init__(self, raw: BlobStore, cache: ObjectCache, locate: Callable[[list[str]], dict[str, Location]],
                 *, pack_cache_bytes: int, upload_threads: int) -> None:
        #: the blob store itself: writes, listing, deletes, and reads of objects never packed
        self.raw = raw
        #: objects held in memory, by digest (and decoded forms under prefixed keys)
        self.cache = cache
        #: reads that find an object alone or inside a pack; writes pass through to ``raw``
        self.pack_aware = PackedObjects(raw, cache, locate, pack_cache_bytes)
        #: Merkle tree nodes, read through ``pack_aware``
        self.trees = TreeReader(self.pack_aware, cache)
        # one thread per call that may wait on an upload: a write's does not queue behind a turn end's
        self._uploads = ThreadPoolExecutor(max_workers=upload_threads, thread_name_prefix="draftstore-upload")
        self._reads = ThreadPoolExecutor(max_workers=_READERS, thread_name_prefix="draftstore-read")

    def close(self) -> None:
        """Wait for the uploads and reads in flight, then close the blob store."""
        self._uploads.shutdown(wait=True)
        self._reads.shutdown(wait=True)
        self.raw.close()

    def upload(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run an upload beside the caller, which must wait for it (``.result()``, or
        ``deferred.awaited`` inside a transaction) before committing anything that
        names what it stores."""
        return self._uploads.submit(fn, *args)

    def in_parallel(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        """``[fn(item) for item in items]``, the calls run side by side on the read
        pool (for independent chains of reads: each may wait on the blob store's own
        transfer pool, never on this one). Returns once every call settled; raises
        the first failure in ``items`` order."""
        if len(items) <= 1:
            return [fn(item) for item in items]
        return settle(self._reads, fn, items)

    def beside(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        """Start ``fn(*args)`` on the read pool (a read the caller needs later); the
        caller collects it with ``.result()``."""
        return self._reads.submit(fn, *args)

    def start_readers(self) -> None:
        """Start the read pool's threads now, not in a request."""
        start_workers(self._reads, _READERS)

    def clear_caches(self) -> None:
        """Forget every object and decoded pack held in memory: the next reads fetch
        from the blob store. Changes nothing stored."""
        self.cache.clear()
        self.pack_aware.packs.clear()

    def ping(self) -> None:
        """Ask the blob store for one object; raises if it does not answer."""
        self.raw.has(EMPTY_TREE)
