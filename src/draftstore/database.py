"""The database handle: the relational engine and every way a component talks to it.

``Database`` owns the engine for transactions (``tx``), a pool of autocommit
connections for single statements (``statement``), the prebuilt statements of
the hot paths and their group commit (``one_shot``, ``run``), and the row-lock
idiom of the dialect (``for_update``). Components receive it as an explicit
constructor argument and own their SQL; nothing else here knows a table.

Error boundary: driver failures become typed errors here, chained with
``from``: connection trouble is ``backend.unavailable``; a value the database
refuses is ``input.invalid`` (validation catches those first, so this is a
safety net, not a path); SQLite's "database is locked" past the busy timeout
is ``draft.busy``. Integrity errors are left to the callers, who know what a
broken constraint means in their operation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from . import errors as E
from .db.engine import create_db_engine, is_sqlite
from .db.groupcommit import GroupCommit
from .db.oneshot import OneShot
from .events import Activity

__all__ = ["Database"]

# the driver errors the database boundary turns into typed errors (``Database._typed``)
_MAPPED = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DataError)


class Database:
    """One relational database (SQLite or PostgreSQL) as the components use it.

    Thread-safe; one per ``Store``. ``activity`` counts the operations running in
    this process (every transaction and one-shot statement is one), so background
    work can wait for a gap between them.
    """

    def __init__(self, engine: Engine, activity: Activity, *, group_commit: bool = True) -> None:
        self.engine = engine
        self.activity = activity
        #: True on SQLite (the embedded default): no row locks, BEGIN IMMEDIATE serialises writers
        self.sqlite = is_sqlite(engine)
        #: single-statement operations run on a pool of autocommit connections: one round
        #: trip each, no BEGIN/COMMIT, no per-checkout isolation switching (the engine itself on SQLite)
        self.autocommit = engine if self.sqlite else create_db_engine(
            engine.url.render_as_string(hide_password=False), isolation_level="AUTOCOMMIT",
            pool_reset_on_return=None)
        if not self.sqlite:
            # connect the one-statement pool now, not on a request's first read
            try:
                self.autocommit.connect().close()
            except sa_exc.SQLAlchemyError:
                pass  # unreachable now: the first statement says so, typed
        #: concurrent one-shot statements share a transaction and its commit (see ``GroupCommit``);
        #: its counters (``groups``, ``reruns``, ``deadlocks``) say how grouping went
        self.group_commit = GroupCommit(self.autocommit, enabled=group_commit)

    def close(self) -> None:
        self.group_commit.close()
        if self.autocommit is not self.engine:
            self.autocommit.dispose()
        self.engine.dispose()

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
        """A prebuilt single statement for a hot path (see ``OneShot``), run by ``run``."""
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

    def ping(self) -> None:
        """One round trip (``SELECT 1``); raises a typed error if the database does not answer."""
        with self.statement(read_only=True) as conn:
            conn.execute(sa.text("SELECT 1"))
