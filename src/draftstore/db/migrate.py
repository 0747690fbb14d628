"""Alembic, driven from code: ``upgrade`` and the schema-is-current check.

The migration scripts ship inside the package (``draftstore/migrations``), so
an installed draftstore can migrate its own database without a checkout.

Opening a store checks the schema in every process (the service, each CLI
command): that check reads ``alembic_version`` with one query and compares it
with ``SCHEMA_HEAD``, without importing Alembic (~90 ms of start-up) or
reading the scripts. Alembic is imported only to migrate, or to read the
scripts' own head (``scripts_head``, which a test holds equal to
``SCHEMA_HEAD``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from ..errors import BackendUnavailable, IntegrityError, PooledMigration, SchemaOutdated
from .pooler import PARAM, pooler_of

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = ["alembic_config", "upgrade", "current_revision", "head_revision", "scripts_head", "check_schema",
           "SCHEMA_HEAD"]

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"
VERSION_TABLE = "alembic_version"  # Alembic's default, which ``migrations/env.py`` keeps

SCHEMA_HEAD = "0011"
"""The newest migration in ``migrations/versions``: a new migration moves it
(``tests/test_migration.py`` fails until it does)."""


def alembic_config(url: str | None = None) -> "Config":
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate the database behind ``engine`` to ``revision``; idempotent.

    A database already at head costs one query: nothing else is loaded.
    Migrations go to PostgreSQL directly: through a URL that declares a
    transaction-mode pooler, a migration to run is refused with
    ``config.pooled_migration`` and nothing is changed (``pooler.py``).
    """
    current = current_revision(engine)
    if revision == "head" and current == head_revision():
        return
    if pooler_of(engine.url) is not None:
        raise PooledMigration(
            f"migrations go to PostgreSQL directly, not through a {pooler_of(engine.url)}-mode pooler: run "
            f"`draftstore db upgrade` with DRAFTSTORE_DATABASE_URL set to the database's own address (without "
            f"?{PARAM}=...); the schema is at {current or 'nothing'}, nothing was changed",
            current=current, head=head_revision())
    from alembic import command

    cfg = alembic_config()
    sqlite = engine.dialect.name == "sqlite"
    with _connect(engine) as conn:
        if sqlite:
            # SQLite alters a table by copying it and dropping the old one, which
            # the foreign keys of other tables refuse; the pragma only takes
            # effect outside a transaction. Integrity is checked before commit.
            conn.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")
        try:
            with conn.begin():
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
                if sqlite:
                    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise IntegrityError(f"migration left {len(broken)} rows with broken foreign keys; "
                                             "nothing was changed", rows=[tuple(r) for r in broken[:10]])
        finally:
            if sqlite:
                conn.connection.driver_connection.execute("PRAGMA foreign_keys=ON")


def head_revision() -> str:
    """The newest migration this code ships."""
    return SCHEMA_HEAD


def scripts_head() -> str | None:
    """The head of the migration scripts as Alembic reads them (loads Alembic)."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _connect(engine: Engine) -> Connection:
    """A connection, or ``backend.unavailable`` naming the database that did not answer."""
    try:
        return engine.connect()
    except sa_exc.OperationalError as exc:
        where = engine.url.render_as_string(hide_password=True)
        raise BackendUnavailable(f"database unreachable at {where}: {str(exc.orig).splitlines()[0]}") from exc


def current_revision(engine: Engine) -> str | None:
    """The migration the database is at (None: never migrated), read from
    ``alembic_version`` as Alembic writes it."""
    with _connect(engine) as conn:
        if not sa.inspect(conn).has_table(VERSION_TABLE):
            return None
        rows = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    if len(rows) > 1:
        raise IntegrityError(f"the database records {len(rows)} schema heads ({', '.join(sorted(rows))}); "
                             "draftstore's migrations have one", heads=sorted(rows))
    return rows[0] if rows else None


def check_schema(engine: Engine) -> None:
    """Raise ``schema.outdated`` unless the database is at the newest migration."""
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise SchemaOutdated(
            f"database schema is at {current or 'nothing'}, this draftstore needs {head}: "
            "run `draftstore db upgrade`",
            current=current,
            head=head,
        )
