"""PostgreSQL behind a transaction-mode pooler (PgBouncer ``pool_mode = transaction``).

In transaction pooling a client's consecutive transactions may run on
different server connections, and other clients' transactions on the one it
just used, so nothing may rely on state a server session keeps between
transactions. The one such state the driver creates on its own is a
server-side prepared statement: psycopg prepares a query after its fifth
execution on a connection (``prepare_threshold``), under a per-connection
name (``_pg3_0``, ``_pg3_1``, ...). Behind the pooler that name already
exists on the server connection another client prepared it on
(``DuplicatePreparedStatement``), or is missing on the one this client's
next transaction landed on (``InvalidSqlStatementName``).

The database URL declares the pooler: ``?pooler=transaction``. The parameter
is taken out before the driver sees it (libpq would refuse it) and psycopg
is told never to prepare (``prepare_threshold=None``): each statement is
parsed by the server each time, as with any unprepared query. The engine's
URL keeps the parameter, so an engine derived from it (the autocommit pool of
one-statement operations) is declared too.

Nothing else draftstore does keeps session state between transactions, so
the rest runs unchanged behind the pooler: no advisory locks (row locks,
``FOR NO KEY UPDATE``, inside the transaction), no ``SET`` (the isolation
level is client-side in psycopg), no temporary tables, no LISTEN/NOTIFY, no
cursors held past a commit; an autocommit statement is a transaction of its
own; a group commit (``groupcommit.py``) is one ``BEGIN`` ... ``COMMIT``
pipelined in one round trip, so the pooler keeps it on one server connection.

Guarantees:

- ``?pooler=transaction``: no statement is ever prepared on the server;
- without it, the symptom of an undeclared pooler (a ``_pg3_*`` statement
  duplicated or missing) is ``backend.pooler`` naming the parameter, never a
  bare driver error;
- migrations are not run through a declared pooler: ``config.pooled_migration``
  (``migrate.upgrade``) asks for PostgreSQL's own address. A migration is one
  long transaction of DDL holding table locks, which belongs on a connection of
  its own, outside the pooler's limits and timeouts;
- any other value of ``pooler`` is ``config.invalid``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import URL, Engine

from ..errors import ConfigInvalid, PoolerUndeclared

__all__ = ["PARAM", "MODES", "pooler_of", "check_url", "declare", "undeclared_pooler"]

PARAM = "pooler"
MODES = ("transaction",)

# psycopg names the statements it prepares ``_pg3_<n>``, per client connection
_OURS = "_pg3_"


def pooler_of(url: URL) -> str | None:
    """The pooler mode ``url`` declares (``transaction``), or None (checked by ``check_url``)."""
    value = url.query.get(PARAM)
    return value if isinstance(value, str) else None


def check_url(url: URL) -> None:
    """``config.invalid`` unless ``url``'s ``pooler`` parameter is absent or a known mode."""
    value = url.query.get(PARAM)
    if value is None:
        return
    if url.get_backend_name() != "postgresql":
        raise ConfigInvalid(f"?{PARAM}= applies to PostgreSQL URLs only", url=url.render_as_string(True))
    if isinstance(value, tuple) or value not in MODES:
        raise ConfigInvalid(f"unknown {PARAM} mode {value!r} in the database URL: use ?{PARAM}=transaction "
                            "(PgBouncer in transaction pooling), or nothing for a direct connection",
                            url=url.render_as_string(True))


def declare(engine: Engine) -> None:
    """Connect ``engine`` as its URL says: ``pooler`` never reaches the driver, and a
    declared pooler turns server-side prepared statements off. An engine whose URL
    declares no pooler reports the symptoms of one as ``backend.pooler``."""
    declared = pooler_of(engine.url) is not None

    @event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        cparams.pop(PARAM, None)
        if declared:
            cparams["prepare_threshold"] = None

    if not declared:
        @event.listens_for(engine, "handle_error")
        def _undeclared(ctx: Any) -> Exception | None:
            return undeclared_pooler(ctx.original_exception)


def undeclared_pooler(exc: BaseException) -> PoolerUndeclared | None:
    """``backend.pooler`` if ``exc`` is a driver error that only a pooler in between
    explains (one of psycopg's own prepared statements duplicated or missing), else None."""
    from psycopg import errors as pg_errors

    if not isinstance(exc, (pg_errors.DuplicatePreparedStatement, pg_errors.InvalidSqlStatementName)):
        return None
    if _OURS not in str(exc):
        return None
    typed = PoolerUndeclared(
        f"the database lost or mixed up this connection's prepared statements ({str(exc).splitlines()[0]}): "
        f"a transaction-mode pooler such as PgBouncer sits in between. Add ?{PARAM}=transaction to "
        "DRAFTSTORE_DATABASE_URL", parameter=f"{PARAM}=transaction")
    typed.__cause__ = exc
    return typed
