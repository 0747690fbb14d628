"""Pages of long lists: opaque cursors and capped limits.

A cursor is the key of the last item of a page (a number, or a timestamp and
an id), tagged with the list it belongs to and base64url-encoded: opaque to
callers, stable under concurrent inserts (keyset paging: an item added
meanwhile is never skipped or repeated), and refused (``input.invalid``) on
any other list or when malformed. A page never holds more than ``MAX_LIMIT``
items. Lists keyed by a number (versions, turns, head moves) also page newest
first (``numbered``); a cursor of one order is refused by the other.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa

from . import errors as E
from . import validation as check
from .records import Page

__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "limit", "encode", "decode", "page", "by_creation", "numbered"]

DEFAULT_LIMIT = 50
MAX_LIMIT = 200
# a cursor holding a path of 6,000 bytes of UTF-8 (base64-encoded) fits: six times the default path limit
MAX_CURSOR_CHARS = 8192

T = TypeVar("T")


def limit(value: Any) -> int:
    """A page size: an integer from 1 to ``MAX_LIMIT`` (None: ``DEFAULT_LIMIT``)."""
    if value is None:
        return DEFAULT_LIMIT
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_LIMIT:
        raise E.InvalidInput(f"limit is an integer from 1 to {MAX_LIMIT}", field="limit")
    return value


def encode(kind: str, key: Sequence[Any]) -> str:
    # UTF-8 as is (not \u escapes): a cursor holding a path of non-ASCII text stays short
    raw = json.dumps([kind, *[k.isoformat() if isinstance(k, datetime) else k for k in key]],
                     separators=(",", ":"), ensure_ascii=False)
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode(kind: str, cursor: Any, shape: Sequence[type]) -> list[Any] | None:
    """The key in ``cursor`` (None for the first page). ``shape`` gives the
    key's types (``datetime`` keys travel as ISO text)."""
    if cursor is None or cursor == "":
        return None
    bad = E.InvalidInput("cursor is not one this list handed out", field="cursor")
    if not isinstance(cursor, str) or len(cursor) > MAX_CURSOR_CHARS:
        raise bad
    try:
        raw = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: forged nesting
        raise bad from None
    if not isinstance(raw, list) or len(raw) != len(shape) + 1 or raw[0] != kind:
        raise bad
    key: list[Any] = []
    for value, typ in zip(raw[1:], shape):
        try:
            if typ is datetime:
                value = datetime.fromisoformat(value)
            elif typ is int and (not isinstance(value, int) or isinstance(value, bool) or abs(value) > 2**62):
                raise ValueError
            elif typ is str and (not isinstance(value, str) or "\x00" in value):
                raise ValueError
            elif typ is str:
                value.encode("utf-8")  # a lone surrogate is no key any list hands out
        except (TypeError, ValueError):  # UnicodeEncodeError included
            raise bad from None
        key.append(value)
    return key


def page(kind: str, rows: list[Any], n: int, key: Callable[[Any], Sequence[Any]],
         record: Callable[[Any], T]) -> Page[T]:
    """A page from up to ``n + 1`` rows (the extra row only says there is more)."""
    more = len(rows) > n
    rows = rows[:n]
    return Page([record(r) for r in rows], encode(kind, key(rows[-1])) if more and rows else None)


def by_creation(table: sa.Table, kind: str, cursor: Any, n: int) -> sa.Select:
    """Up to ``n + 1`` rows of ``table`` in creation order (``created_at``, then ``id``),
    after the item the ``kind`` cursor names."""
    key = decode(kind, cursor, (datetime, str))
    stmt = sa.select(table).order_by(table.c.created_at, table.c.id).limit(n + 1)
    if key is not None:
        stmt = stmt.where(sa.tuple_(table.c.created_at, table.c.id) > sa.tuple_(
            sa.bindparam("c", key[0], type_=table.c.created_at.type), sa.bindparam("i", key[1])))
    return stmt


def numbered(kind: str, column: Any, cursor: Any, newest_first: bool = False) -> tuple[str, Any, Any]:
    """Keyset paging over the integer ``column``: (the cursor kind of this order, the
    condition for the rows after the cursor's item, the ORDER BY clause). Oldest first
    by default; ``newest_first`` reverses it (with cursors of its own)."""
    check.flag("newest_first", newest_first)
    kind = f"{kind}.newest" if newest_first else kind
    key = decode(kind, cursor, (int,))
    if newest_first:
        return kind, (column < key[0]) if key else sa.true(), column.desc()
    return kind, column > (key[0] if key else 0), column
