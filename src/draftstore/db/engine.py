"""Engines for the relational store, and the schema check.

SQLite (embedded default) gets WAL, a busy timeout and ``BEGIN IMMEDIATE`` for
every transaction, so concurrent writers queue instead of failing late with
"database is locked". PostgreSQL runs through psycopg 3 with a pool, directly or
behind a transaction-mode pooler the URL declares (``?pooler=transaction``:
``pooler.py``). JSON documents are serialised by ``validation.dump_json`` on both.
"""

from __future__ import annotations

import select
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url

from ..errors import BackendUnavailable, ConfigInvalid
from ..private import private_file
from ..validation import dump_json
from . import pooler

__all__ = ["create_db_engine", "is_sqlite", "lost_connection", "server_closed"]


def is_sqlite(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite"


def server_closed(dbapi_conn: Any) -> bool:
    """Whether an idle connection has something to read: the server's goodbye or EOF
    (an idle live connection has nothing). No round trip: one ``poll`` call."""
    try:
        fd = dbapi_conn.fileno()
    except Exception:  # closed or broken: certainly dead
        return True
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(0))  # readable, hung up or in error
        ready, _, _ = select.select([fd], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(ready)


def lost_connection(exc: BaseException, statement: Any, params: Any) -> sa.exc.OperationalError:
    """The driver's ``exc``, raised on a connection it reports broken, as the lost connection it is."""
    err = sa.exc.OperationalError(statement, params, exc)
    err.__cause__ = exc
    return err


def create_db_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url``; ``postgresql://`` is taken to mean psycopg 3, and a
    ``?pooler=transaction`` parameter declares PgBouncer in transaction pooling
    (``pooler.py``; any other mode is ``config.invalid``)."""
    try:
        u = make_url(url)
    except Exception as exc:
        raise ConfigInvalid(f"invalid database URL: {exc}", url=url) from exc
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    if u.get_backend_name() not in ("sqlite", "postgresql"):
        raise ConfigInvalid(f"unsupported database URL scheme {u.drivername!r}: use sqlite:///PATH or "
                            "postgresql://USER@HOST/DB", url=u.render_as_string(hide_password=True))
    pooler.check_url(u)
    # JSON columns: values checked and serialised once by draftstore.validation pass through
    kwargs.setdefault("json_serializer", dump_json)
    if u.get_backend_name() == "sqlite":
        db = u.database
        if not db or db == ":memory:" or "memory" in str(u.query.get("mode", "")):
            # every pooled connection would open its own empty database
            raise ConfigInvalid("an in-memory SQLite database is not supported (each connection would see a "
                                "different empty database): use sqlite:///PATH", url=str(u))
        try:
            private_file(db)  # 0600 in a 0700 directory, before SQLite creates it 0644 (private.py)
        except OSError as exc:
            raise BackendUnavailable(f"cannot create {db}: {exc}") from exc
        engine = sa.create_engine(
            u,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=8,
            max_overflow=16,
            **kwargs,
        )

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
            # take transaction control from pysqlite so BEGIN IMMEDIATE is ours
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            # writers take the write lock up front; read-only transactions stay deferred
            read_only = conn.get_execution_options().get("draftstore_read_only", False)
            conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

        return engine
    if u.get_backend_name() == "postgresql":
        kwargs.setdefault("pool_size", 10)
        # most recently used first: its prepared statements (on a direct connection) are warm
        kwargs.setdefault("pool_use_lifo", True)
        kwargs.setdefault("max_overflow", 20)
        engine = sa.create_engine(u, **kwargs)
        pooler.declare(engine)  # the URL keeps ``pooler``: engines derived from ``engine.url`` follow it

        @event.listens_for(engine, "checkout")
        def _drop_dead(dbapi_conn: Any, record: Any, proxy: Any) -> None:
            # A connection the server ended while it sat in the pool (a restart, a failover,
            # pg_terminate_backend, an idle timeout) has something to read: the server's
            # goodbye, or EOF. An idle live one has nothing. Found here, the pool replaces it
            # instead of failing the caller's operation: a pre-ping without the round trip.
            if server_closed(dbapi_conn):
                raise sa.exc.DisconnectionError("the server closed this pooled connection")

        @event.listens_for(engine, "handle_error")
        def _lost_is_operational(ctx: Any) -> Exception | None:
            # A connection lost under a statement is an OperationalError on a direct connection. Behind
            # PgBouncer, a server connection that died under a client's transaction reaches psycopg as
            # two answers to one command (an InternalError), the connection marked broken: the same loss.
            if ctx.is_disconnect and not isinstance(ctx.sqlalchemy_exception, sa.exc.OperationalError):
                return lost_connection(ctx.original_exception, ctx.statement, ctx.parameters)
            return None

        return engine
    return sa.create_engine(u, **kwargs)
