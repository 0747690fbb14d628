"""Work a transaction declines to do while it holds row locks.

A transaction that locks rows must not wait on the blob store: a slow or
retrying S3 would hold the rows (and, on SQLite, the whole database's write
lock) for as long as it takes. Where such a wait can arise, the transaction
raises a ``Deferred`` instead. The transaction rolls back, ``retry_unlocked``
does the deferred work with nothing locked (``Deferred.do``), then runs the
operation again, which finds the work done. Each attempt re-reads and
re-checks what it locks, so the outcome is the one a single attempt would
have had; only the time spent waiting moved out of the locks.

Two kinds of work are deferred:

- ``UploadPending``: an upload started before the transaction (the blobs of
  a write, the tree objects of a seal, a turn's end state) is still running
  after ``LOCKED_WAIT_S`` (``awaited``). ``do`` waits for it; an upload waited
  for is done, so it never stops an attempt twice.
- ``NodeNotCached``: a tree node a write checks its paths against is not in
  memory (``trees.CachedNodes``). ``do`` reads it into the cache. A reader
  defers at most a few nodes; past that (a cache too small to keep them) it
  reads them under the locks, as before, so the attempts always end.

``Deferred`` never leaves the store: every transaction that can raise it runs
under ``retry_unlocked``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, TypeVar

__all__ = ["Deferred", "UploadPending", "NodeNotCached", "LOCKED_WAIT_S", "awaited", "retry_unlocked"]

R = TypeVar("R")

# how long a transaction holding row locks waits for an upload started before it
LOCKED_WAIT_S = 1.0


class Deferred(Exception):
    """Internal: work to do with nothing locked before the operation runs again."""

    def do(self) -> None:
        raise NotImplementedError


class UploadPending(Deferred):
    """An upload outlasted ``LOCKED_WAIT_S`` under the locks."""

    def __init__(self, upload: Future[Any]) -> None:
        super().__init__("an upload outlasted the wait under locks")
        self.upload = upload

    def do(self) -> None:
        self.upload.exception()  # its failure, if any, is the next attempt's to raise


class NodeNotCached(Deferred):
    """A tree node needed under the locks is not in memory."""

    def __init__(self, read: Callable[[], Any], digest: str) -> None:
        super().__init__(f"tree node {digest[:12]} is not in memory")
        self.read = read

    def do(self) -> None:
        self.read()


def awaited(upload: Future[Any]) -> Any:
    """Inside a transaction: ``upload``'s result (raising its failure) if it comes
    within ``LOCKED_WAIT_S``; past that, ``UploadPending``."""
    try:
        return upload.result(timeout=LOCKED_WAIT_S)
    except TimeoutError:
        if upload.done():  # the upload itself ended in a timeout: that is its failure
            raise
        raise UploadPending(upload) from None


def retry_unlocked(attempt: Callable[[], R]) -> R:
    """``attempt()`` (one transaction), run again after each ``Deferred`` it raised
    is done with nothing locked."""
    while True:
        try:
            return attempt()
        except Deferred as deferred:
            deferred.do()
