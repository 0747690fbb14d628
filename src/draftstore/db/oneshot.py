"""A single statement run in autocommit on the hot paths, as cheaply as the driver allows."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from .engine import lost_connection
from .pooler import undeclared_pooler

__all__ = ["OneShot", "wrap_driver_error"]


class OneShot:
    """One statement, atomic on its own, run in autocommit.

    On PostgreSQL it is compiled once and executed on the pooled DBAPI
    connection directly: on the tool-call path SQLAlchemy's execution layer
    cost as much as the statement itself (measured: 1.75x two raw INSERTs
    through it, 1.34x without). Driver errors are re-raised as SQLAlchemy's
    (``IntegrityError``, ``OperationalError``, ...), so callers map one family.
    Elsewhere (SQLite) it is an ordinary SQLAlchemy execution.
    """

    def __init__(self, stmt: Any, engine: sa.Engine) -> None:
        self.stmt = stmt
        self.engine = engine
        self.raw = engine.dialect.name == "postgresql"
        if self.raw:
            compiled = stmt.compile(dialect=engine.dialect)
            self.sql = compiled.string
            # literals baked into the statement ('started', 0, 1, ...) are bind values too
            self.fixed = {name: bp.value for bp, name in compiled.bind_names.items() if bp.value is not None}

    def send(self, cur: Any, params: dict[str, Any]) -> None:
        """PostgreSQL: execute on a psycopg cursor (in a pipeline, only queued)."""
        cur.execute(self.sql, {**self.fixed, **params})

    @staticmethod
    def outcome(cur: Any) -> tuple[Any | None, int]:
        """(first row or None, rowcount) of the statement ``send`` executed on ``cur``."""
        return cur.fetchone() if cur.description else None, cur.rowcount

    def run(self, params: dict[str, Any]) -> tuple[Any | None, int]:
        """Execute on a connection of the pool; returns (first row or None, rowcount)."""
        if not self.raw:
            with self.engine.begin() as conn:
                res = conn.execute(self.stmt, params)
                row = res.first() if res.returns_rows else None
                return row, res.rowcount
        conn = self.engine.raw_connection()
        try:
            return self.run_on(conn, params)
        except sa.exc.OperationalError:
            conn.invalidate()  # a broken connection must not go back to the pool
            raise
        finally:
            conn.close()

    def run_on(self, conn: Any, params: dict[str, Any]) -> tuple[Any | None, int]:
        """PostgreSQL: execute on ``conn``, a pooled connection the caller checked out
        (and gives back, or invalidates after an ``OperationalError``)."""
        import psycopg

        try:
            with conn.cursor() as cur:
                self.send(cur, params)
                return self.outcome(cur)
        except psycopg.Error as exc:
            raise wrap_driver_error(exc, self.sql, params, broken=conn.driver_connection.broken) from exc


def wrap_driver_error(exc: Exception, sql: str, params: dict[str, Any], *, broken: bool = False) -> Exception:
    """psycopg's error as SQLAlchemy's of the same family (``IntegrityError``, ...), or
    ``backend.pooler`` for the symptom of an undeclared pooler (``pooler.py``), as an
    engine's own statements get it. Any error on a connection the driver reports ``broken``
    is an ``OperationalError`` (the connection was lost: ``engine.lost_connection``)."""
    import psycopg

    pooled = undeclared_pooler(exc)
    if pooled is not None:
        return pooled
    if broken and not isinstance(exc, psycopg.OperationalError):
        return lost_connection(exc, sql, params)

    wrapper: type[sa.exc.DBAPIError] = sa.exc.DBAPIError
    for base, mapped in ((psycopg.IntegrityError, sa.exc.IntegrityError),
                         (psycopg.OperationalError, sa.exc.OperationalError),
                         (psycopg.InterfaceError, sa.exc.InterfaceError),
                         (psycopg.DataError, sa.exc.DataError)):
        if isinstance(exc, base):
            wrapper = mapped
            break
    err = wrapper(sql, params, exc)
    err.__cause__ = exc
    return err
