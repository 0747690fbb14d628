"""Group commit: one-shot statements of concurrent callers share one transaction and one commit.

On PostgreSQL each commit waits for its WAL to reach the disk. Under load,
with every tool-call record its own autocommit statement, a record's
statement waited ~9 ms for the database while it used 0.27 ms of CPU, most
of it queued behind other backends' flushes (measured with the four-worker
HTTP load in ``bench/http_ops.py``: most active statements were waiting on
the WAL write lock). When several threads of a process run one-shot statements at
once (the agents' tool-call records), ``GroupCommit`` runs them as one
transaction: the first caller to arrive while no group is running leads;
callers arriving while it runs wait, and the next of them leads them all as
the next group. The group is sent in one round trip (psycopg's pipeline
mode): ``BEGIN``, the statements in the order of their callers' lock keys
(arrival order among equal keys), ``COMMIT``. Every group takes its row locks
in that one order, so two processes' groups touching the same rows wait for
each other rather than deadlock.

Guarantees:

- a caller alone (no group running) runs its statement at once, as
  ``OneShot.run`` would: no added wait at low load;
- every caller gets its own statement's outcome, the first row it returned
  and its row count, only after the group's commit: what a caller is told is
  durable is durable;
- a statement of a group sees the statements before it in the group (one
  transaction), so two records of one turn in a group take consecutive seqs,
  in the order they arrived;
- if a statement breaks a constraint, or the database picks the group as a
  deadlock victim, nothing of the group was committed: each statement is then
  run again alone (``OneShot.run``), and each caller gets its own outcome,
  error or not;
- any other error (a broken connection, whose commit may or may not have
  happened) reaches every caller of the group, as it would have reached a
  caller running alone, and nothing is run again.

Elsewhere than PostgreSQL (SQLite serialises its writers itself), and with the
``group_commit`` setting off, each call is ``OneShot.run``.

One group runs at a time, so the groups (and callers alone) share one
connection, checked out of the pool once and kept: a checkout and its return
through the pool cost ~45 us of a ~330 us record (measured on the tool-call
path). Before each use it is checked as the pool checks a checkout: a
connection the server has closed (a restart, ``pg_terminate_backend``, an
idle timeout) has something to read, and is replaced rather than used. One
that breaks during a statement, or whose state an error leaves unknown, is
discarded. ``close`` gives it back.

The trade, measured with fifty agents over HTTP (``bench/http_ops.py``): the
slow calls of a turn (starts, ends, file writes) wait much less, because a
process's records now run as one transaction at a time instead of one per
waiting record (the number of WAL flushes hardly changed; the time spent in
them fell by about a third); the records themselves wait longer, since one
that arrives while a group runs waits for that group's round trip before its
own. docs/benchmarks.md has the current figures.
"""

from __future__ import annotations

import threading
from typing import Any

import sqlalchemy as sa

from .engine import server_closed
from .oneshot import OneShot, wrap_driver_error

__all__ = ["GroupCommit"]

MAX_GROUP = 64  # statements per transaction at most; later arrivals form the next group


class _Call:
    __slots__ = ("stmt", "params", "key", "done", "outcome", "error")

    def __init__(self, stmt: OneShot, params: dict[str, Any], key: tuple[Any, ...]) -> None:
        self.stmt = stmt
        self.params = params
        self.key = key
        self.done = False
        self.outcome: tuple[Any | None, int] = (None, 0)
        self.error: BaseException | None = None


class GroupCommit:
    """Runs ``OneShot`` statements of concurrent threads in shared transactions (see the module)."""

    def __init__(self, engine: sa.Engine, *, enabled: bool = True, max_group: int = MAX_GROUP) -> None:
        self.engine = engine
        self.grouped = enabled and engine.dialect.name == "postgresql"
        self.max_group = max_group
        self._cond = threading.Condition(threading.Lock())
        self._waiting: list[_Call] = []
        self._leading = False  # a group is running
        # for tests and diagnostics: groups of more than one statement run; those rolled back
        # by a broken constraint or a deadlock, then run statement by statement; the deadlocks
        self.groups = 0
        self.reruns = 0
        self.deadlocks = 0
        self._conn: Any = None  # the groups' pooled connection, kept checked out (see the module)

    def close(self) -> None:
        """Give the kept connection back to the pool (when no statement runs)."""
        with self._cond:
            self._release()

    def _connection(self) -> Any:
        """The kept connection; a new one when there is none or the server closed it."""
        conn = self._conn
        if conn is not None and server_closed(conn.dbapi_connection):
            self._discard()
            conn = None
        if conn is None:
            conn = self._conn = self.engine.raw_connection()
        return conn

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.invalidate()  # closed, and never back in the pool
            finally:
                conn.close()

    def run(self, stmt: OneShot, params: dict[str, Any], key: tuple[Any, ...] = ()) -> tuple[Any | None, int]:
        """Execute ``stmt`` with ``params``, committed; returns (first row or None, rowcount).

        ``key`` orders the statements of a group: give the key of the rows the
        statement locks first (a turn's id, then a call's seq), all of one type.
        """
        if not self.grouped:
            return stmt.run(params)
        call = _Call(stmt, params, key)
        cond = self._cond
        with cond:
            if not self._leading and not self._waiting:
                self._lead([call])  # nothing runs or waits: at once, alone, without queueing
            else:
                self._waiting.append(call)
            while not call.done:
                if self._leading:
                    cond.wait()
                    continue
                group = self._waiting[: self.max_group]
                del self._waiting[: self.max_group]
                self._lead(group)
        if call.error is not None:
            raise call.error
        return call.outcome

    def _lead(self, group: list[_Call]) -> None:
        """Run ``group`` as the leader: called, and returns, holding ``_cond``, which
        is released meanwhile; marks every call done and wakes the waiters."""
        cond = self._cond
        self._leading = True
        cond.release()
        try:
            self._execute(group)
        finally:
            cond.acquire()
            self._leading = False
            for c in group:
                c.done = True
            if len(group) > 1 or self._waiting:  # a group of one is its leader's own call
                cond.notify_all()

    def _execute(self, group: list[_Call]) -> None:
        """Run ``group`` and record each call's outcome or error; never raises."""
        if len(group) == 1:
            self._alone(group[0])
            return
        import psycopg
        from psycopg import errors as pg_errors

        self.groups += 1
        group = sorted(group, key=lambda c: c.key)  # stable: arrival order among equal keys
        try:
            pg = self._connection().driver_connection
            cursors = []
            with pg.pipeline(), pg.transaction():
                for c in group:
                    cur = pg.cursor()
                    c.stmt.send(cur, c.params)
                    cursors.append(cur)
            for c, cur in zip(group, cursors):
                c.outcome = OneShot.outcome(cur)
        except (psycopg.IntegrityError, pg_errors.DeadlockDetected) as exc:
            # rolled back as a whole: each statement alone decides its own caller's outcome
            self.reruns += 1
            self.deadlocks += isinstance(exc, pg_errors.DeadlockDetected)
            self._release()  # back to the pool as after any rolled-back transaction; the reruns take another
            for c in group:
                self._alone(c)
        except psycopg.Error as exc:
            broken = self._conn is not None and self._conn.driver_connection.broken
            if broken or isinstance(exc, psycopg.OperationalError):
                self._discard()  # a broken connection must not be used again
            for c in group:
                c.error = wrap_driver_error(exc, c.stmt.sql, c.params, broken=broken)
        except BaseException as exc:  # noqa: BLE001 - every caller gets it, as a caller alone would
            self._discard()  # interrupted somewhere in the pipeline: its state is unknown
            for c in group:
                c.error = exc

    def _alone(self, c: _Call) -> None:
        try:
            c.outcome = c.stmt.run_on(self._connection(), c.params)
        except sa.exc.OperationalError as exc:
            self._discard()  # broken (or none could be had): the next statement takes a new one
            c.error = exc
        except (sa.exc.IntegrityError, sa.exc.DataError) as exc:
            c.error = exc  # the statement's own error: in autocommit, nothing stays open
        except BaseException as exc:  # noqa: BLE001 - the caller's own outcome
            self._discard()
            c.error = exc
