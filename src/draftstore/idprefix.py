"""Id prefixes: find the one record whose id starts with what a person typed.

Ids are 32 lowercase hex digits, long to type and to read. Wherever a person
gives an id (the CLI), any unique prefix of at least ``MIN_PREFIX`` characters
names the record. A full id is returned as typed without a query, so scripts
that pass full ids pay nothing. Errors: ``input.invalid`` for a prefix that is
too short, not hex, or names more than one record (the details list some of
them); the kind's own not-found code when nothing matches.
"""

from __future__ import annotations

import re

import sqlalchemy as sa

from . import errors as E
from .database import Database
from .db.tables import ID, PROJECTS, SNAPSHOTS, TOKENS, TURNS, VERSIONS

__all__ = ["MIN_PREFIX", "KINDS", "resolve"]

MIN_PREFIX = 6

#: kind -> (table, error raised when nothing matches)
KINDS: dict[str, tuple[sa.Table, type[E.NotFound]]] = {
    "project": (PROJECTS, E.ProjectNotFound),
    "version": (VERSIONS, E.VersionNotFound),
    "turn": (TURNS, E.TurnNotFound),
    "token": (TOKENS, E.TokenNotFound),
    "snapshot": (SNAPSHOTS, E.NotFound),
}

_HEX = re.compile(r"[0-9a-f]+")


def resolve(db: Database, kind: str, text: str, *, project_id: str | None = None) -> str:
    """The full id of the ``kind`` record whose id starts with ``text``.

    ``project_id`` narrows versions, turns and snapshots to one project (a
    prefix unique within it is enough). Reads only; changes nothing.
    """
    table, not_found = KINDS[kind]
    prefix = text.strip().lower()
    if not _HEX.fullmatch(prefix) or len(prefix) > ID:
        raise E.InvalidInput(f"{text!r} is not a {kind} id (32 hex digits, or a unique prefix of them)",
                             kind=kind, value=text[:80])
    if len(prefix) == ID:
        return prefix
    if len(prefix) < MIN_PREFIX:
        raise E.InvalidInput(f"id prefix {text!r} is too short: give at least {MIN_PREFIX} characters",
                             kind=kind, value=text, min_length=MIN_PREFIX)
    # ids are fixed-width hex: the prefix's range is [prefix000…, prefixfff…]
    low, high = prefix.ljust(ID, "0"), prefix.ljust(ID, "f")
    query = sa.select(table.c.id).where(table.c.id.between(low, high)).order_by(table.c.id).limit(6)
    if project_id is not None and "project_id" in table.c:
        query = query.where(table.c.project_id == project_id)
    with db.statement(read_only=True) as conn:
        ids = list(conn.execute(query).scalars())
    if not ids:
        raise not_found(f"no {kind} id starts with {prefix!r}", **{f"{kind}_prefix": prefix})
    if len(ids) > 1:
        shown = ", ".join(ids[:5]) + (", …" if len(ids) > 5 else "")
        raise E.InvalidInput(f"id prefix {prefix!r} names more than one {kind}: {shown}; give more characters",
                             kind=kind, value=prefix, candidates=ids[:5])
    return ids[0]
