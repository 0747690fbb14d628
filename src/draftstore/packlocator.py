"""Where packed objects live: the database's ``pack_object`` rows.

The pack-aware reader (``PackedObjects``) asks ``PackLocator.locate`` for the
digests it found nowhere in memory; the answer names the pack, the offset and
the length of each digest stored in a pack (an object may sit in several
packs: any one will do, since every object taken from a pack is re-hashed).
"""

from __future__ import annotations

import sqlalchemy as sa

from .database import Database
from .db.tables import PACK_OBJECTS
from .packs import Location

__all__ = ["PackLocator"]

_CHUNK = 500  # digests per IN (...) lookup


class PackLocator:
    """Looks digests up in ``pack_object``; read-only, thread-safe."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def locate(self, digests: list[str]) -> dict[str, Location]:
        """digest -> (pack, offset, length) for the digests that live in a pack; digests
        stored only on their own are absent from the answer."""
        out: dict[str, Location] = {}
        with self.db.statement(read_only=True) as conn:
            for i in range(0, len(digests), _CHUNK):
                rows = conn.execute(sa.select(PACK_OBJECTS.c.digest, PACK_OBJECTS.c.pack, PACK_OBJECTS.c.offset,
                                              PACK_OBJECTS.c.length)
                                    .where(PACK_OBJECTS.c.digest.in_(digests[i:i + _CHUNK]))).all()
                for r in rows:
                    out.setdefault(r.digest, (r.pack, r.offset, r.length))
        return out
