"""The three backends a store talks to, and how every component talks to them.

One ``Backends`` object is shared by the store's components. It owns the
relational engine (transactions, one-shot statements, driver-error mapping),
the blob store with its object cache, the reader of objects stored alone or
in packs (``objects``) and the tree reader on it, the coordinator with the
event publisher, and the pool on which uploads overlap transactions.

Error boundary: driver failures become typed errors here, chained with
``from``: connection trouble is ``backend.unavailable``; a value the database
refuses is ``input.invalid`` (validation catches those first, so this is a
safety net, not a path). Integrity errors are left to the callers, who know
what a broken constraint means in their operation.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from . import errors as E
from .blobs import BlobStore, ObjectCache
from .coord import Coordinator
from .db.engine import create_db_engine, is_sqlite
from .db.groupcommit import GroupCommit
from .db.oneshot import OneShot
from .deferred import awaited, retry_unlocked
from .digest import EMPTY_TREE
from .events import Activity, EventPublisher
from .packs import PackedObjects
from .pools import settle, start_workers
from .settings import Limits, Settings
from .trees import TreeReader

__all__ = ["Backends"]

log = logging.getLogger("draftstore")

T = TypeVar("T")
R = TypeVar("R")
_READERS = 8  # threads of the read pool (``in_parallel``)


# the driver errors the database boundary turns into typed errors (``Backends._typed``)
_MAPPED = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DataError)


class Backends:
    """Engine + blob store + coordinator, with the plumbing every component shares.

    Thread-safe; one per ``Store``.
    """

    def __init__(self, engine: Engine, blobs: BlobStore, coord: Coordinator, settings: Settings,
                 cache: ObjectCache) -> None:
        self.settings = settings
        self.limits: Limits = settings.limits
        self.engine = engine
        self.blobs = blobs
        self.coord = coord
        self.cache = cache
        # reads find objects stored alone or inside packs; ``locate`` is set by the store (see packing)
        self.locate: Callable[[list[str]], dict[str, tuple[str, int, int]]] = lambda digests: {}
        self.objects = PackedObjects(blobs, cache, lambda digests: self.locate(digests), settings.pack_cache_bytes)
        self.trees = TreeReader(self.objects, cache)
        self.sqlite = is_sqlite(engine)
        # single-statement operations run on a pool of autocommit connections: one
        # round trip each, no BEGIN/COMMIT, no per-checkout isolation switching
        self.autocommit = engine if self.sqlite else create_db_engine(
            engine.url.render_as_string(hide_password=False), isolation_level="AUTOCOMMIT",
            pool_reset_on_return=None)
        if not self.sqlite:
            # connect the one-statement pool now, not on a request's first read
            try:
                self.autocommit.connect().close()
            except sa_exc.SQLAlchemyError:
                pass  # unreachable now: the first statement says so, typed
        # concurrent one-shot statements share a transaction and its commit (see GroupCommit)
        self.group_commit = GroupCommit(self.autocommit, enabled=settings.group_commit)
        try:  # the coordinator's state begins (at the latest) when a store opens on it
            coord.since()
        except E.DraftstoreError:
            pass  # unavailable now: the first operation says so, typed
        self.activity = Activity()  # operations running now: the event publisher appends between them
        self.events = EventPublisher(coord, activity=self.activity)
        # one thread per call that may wait on an upload: a write's does not queue behind a turn end's
        self._uploads = ThreadPoolExecutor(max_workers=settings.upload_threads,
                                           thread_name_prefix="draftstore-upload")
        self._reads = ThreadPoolExecutor(max_workers=_READERS, thread_name_prefix="draftstore-read")

    def close(self) -> None:
        self._uploads.shutdown(wait=True)
        self._reads.shutdown(wait=True)
        self.events.close()
        self.group_commit.close()
        if self.autocommit is not self.engine:
            self.autocommit.dispose()
        self.engine.dispose()
        self.blobs.close()
        self.coord.close()

    # -- the database ------------------------------------------------------------
    @contextmanager
    def db_errors(self) -> Iterator[None]:
        """The database boundary (see the module docstring)."""
        try:
            yield
        except _MAPPED as exc:
            raise self._typed(exc) from exc

    def _typed(self, exc: sa_exc.DBAPIError) -> E.DraftstoreError:
        """The typed error of a driver error ``db_errors`` maps."""
        if isinstance(exc, sa_exc.DataError):
            return E.InvalidInput(f"the database refused a value: {exc.orig}")
        if self.sqlite and "database is locked" in str(exc.orig):
            # another process held the embedded database past the busy timeout
            return E.DraftBusy("the embedded database is busy (another process is writing): retry",
                               reason="database is locked")
        return E.BackendUnavailable(f"database error: {exc.orig}")

    @contextmanager
    def tx(self, *, read_only: bool = False) -> Iterator[Connection]:
        """One database transaction; driver errors become typed errors.

        ``read_only`` lets SQLite readers run beside a writer (deferred BEGIN).
        """
        with self.activity.running(), self.db_errors(), self.engine.connect() as conn:
            if read_only:
                conn.execution_options(draftstore_read_only=True)
            with conn.begin():
                yield conn

    @contextmanager
    def statement(self, *, read_only: bool = False) -> Iterator[Connection]:
        """A connection for ONE statement, atomic on its own (autocommit where it helps)."""
        with self.db_errors(), self.autocommit.connect() as conn:
            if not self.sqlite:
                yield conn
                return
            if read_only:
                conn.execution_options(draftstore_read_only=True)
            with conn.begin():
                yield conn

    def one_shot(self, stmt: Any) -> OneShot:
        """A prebuilt single statement for a hot path (see ``OneShot``)."""
        return OneShot(stmt, self.autocommit)

    def run(self, stmt: OneShot, params: dict[str, Any], key: tuple[Any, ...] = ()) -> tuple[Any | None, int]:
        """Run a one-shot statement, committed (grouped with concurrent ones: ``GroupCommit``,
        which orders a group by ``key``); returns (first row or None, rowcount)."""
        # ``activity.running()`` and ``db_errors()`` spelt out: the tool-call records' path
        self.activity.enter()
        try:
            return self.group_commit.run(stmt, params, key)
        except _MAPPED as exc:
            raise self._typed(exc) from exc
        finally:
            self.activity.leave()

    def for_update(self, stmt: sa.Select, of: Any = None) -> sa.Select:
        """``SELECT ... FOR NO KEY UPDATE`` where rows can be locked (SQLite's BEGIN
        IMMEDIATE already serialises writers). No operation changes a key, and this
        lock, unlike FOR UPDATE, lets a concurrent foreign-key check (KEY SHARE) of
        the same row through: a writer that updates its draft row twice re-checks
        the draft's project, which a publish holding the project FOR UPDATE would
        block into a deadlock."""
        return stmt if self.sqlite else stmt.with_for_update(of=of, key_share=True)

    def check(self) -> dict[str, str | None]:
        """Each backend -> None if it answers, else the reason (for readiness probes)."""
        out: dict[str, str | None] = {}
        for name, probe in (("database", self._ping_database), ("blobs", lambda: self.blobs.has(EMPTY_TREE)),
                            ("coordinator", self.coord.ping)):
            try:
                probe()
                out[name] = None
            except Exception as exc:  # a probe reports; it never raises
                out[name] = str(exc) or type(exc).__name__
        return out

    def _ping_database(self) -> None:
        with self.statement(read_only=True) as conn:
            conn.execute(sa.text("SELECT 1"))

    # -- blobs ---------------------------------------------------------------------
    def upload(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run an upload beside the caller, which must wait for it (``.result()``)
        before committing anything that names what it stores."""
        return self._uploads.submit(fn, *args)

    def awaited(self, upload: Future[Any]) -> Any:
        """Inside a transaction: ``upload``'s result, or ``UploadPending`` once it has
        run ``LOCKED_WAIT_S`` (``draftstore.deferred``)."""
        return awaited(upload)

    def retry_unlocked(self, attempt: Callable[[], R]) -> R:
        """``attempt()`` (one transaction), again after the work it deferred is done
        with nothing locked (``draftstore.deferred``)."""
        return retry_unlocked(attempt)

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
        """Start the read pool's threads now, not in a request, each ready to read
        from the blob store (its connection open, on a store that has one per thread)."""
        start_workers(self._reads, _READERS, self.blobs.warm_thread)

    # -- coordinator -----------------------------------------------------------------
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
        self.events.emit(stream, type, data)

    def append_now(self, stream: str, type: str, data: dict[str, Any]) -> None:
        """Append an event that lives nowhere else (a text delta) before returning,
        in order after the events queued so far; raises if the coordinator refused it."""
        self.events.append_now(stream, type, data)

    def expire_stream(self, stream: str) -> None:
        """Let a stream's buffer go ``event_ttl_s`` after now (queued behind its events)."""
        self.events.expire(stream, self.settings.event_ttl_s)
