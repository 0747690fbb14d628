"""``db upgrade``, ``db current`` and ``config``: the schema and the settings in effect."""

from __future__ import annotations

from typing import Any

import click

from ..settings import Limits, Settings
from .output import echo, emit_json, table
from .root import json_option, main


@main.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


def _engine() -> Any:
    from ..db.engine import create_db_engine

    return create_db_engine(Settings.load().resolved_database_url())


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(revision: str) -> None:
    """Migrate the configured database to the newest schema (idempotent)."""
    from ..db.migrate import current_revision, upgrade

    engine = _engine()
    try:
        before = current_revision(engine)
        upgrade(engine, revision)
        after = current_revision(engine)
    finally:
        engine.dispose()
    echo(f"schema {before or 'empty'} -> {after}")


@db.command("current")
@json_option
def db_current(as_json: bool) -> None:
    """Print the schema revision of the database and the one this code needs."""
    from ..db.migrate import current_revision, head_revision

    engine = _engine()
    try:
        current, needed = current_revision(engine), head_revision()
    finally:
        engine.dispose()
    if as_json:
        emit_json({"database": current, "code_needs": needed, "current": current == needed})
    else:
        echo(f"database: {current or 'empty'}  code needs: {needed}")


@main.command("config")
@json_option
def config(as_json: bool) -> None:
    """Every DRAFTSTORE_* setting: its value in effect and what it does."""
    s = Settings.load()
    rows: list[tuple[str, Any, str]] = []
    for name, field in Settings.model_fields.items():
        if name == "limits":
            continue
        rows.append((f"DRAFTSTORE_{name.upper()}", getattr(s, name), field.description or ""))
    for name, field in Limits.model_fields.items():
        rows.append((f"DRAFTSTORE_{name.upper()}", getattr(s.limits, name), field.description or ""))
    resolved = {"database": s.resolved_database_url(), "blobs": s.resolved_blob_url(),
                "coordinator": s.resolved_coord_url()}
    if as_json:
        emit_json({"settings": {k: v for k, v, _ in rows}, "resolved": resolved})
        return
    table(("variable", "value", "meaning"), [(k, "-" if v is None else v, d) for k, v, d in rows])
    echo()
    for what, url in resolved.items():
        echo(f"{what}: {_hide_password(url)}")


def _hide_password(url: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url
