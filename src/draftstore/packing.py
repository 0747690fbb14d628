"""Packing trees: which subtrees become packs, writing them, and finding them again.

Reading the packs' search indexes and summaries is the ``search`` package's
(``search.packed``); this module says which packs cover a tree.

Pack roots are chosen from the tree alone, top-down: a directory with at
most ``MAX_PACK_FILES`` files below it is packed whole (its nodes and files:
kind ``tree``); a larger directory contributes its own files (kind ``files``)
and its node to the tree's *spine* pack (kind ``spine``, keyed by the root).
Because the choice depends only on the subtree, an unchanged subtree has the
same pack in every version and draft that holds it; writing a tree's packs
writes only the packs that do not exist yet. Each ``tree``/``files`` pack has
a trigram index of its text files (``search.trigrams``), stored as its own object,
with a line table of its rarest trigrams; a spine row names its tree's summary
of those (``search.linetables``), written once the tree's packs are committed.

Writes happen on import (``create_project``: the files go to packs, not one
PUT each) and off the publish path (``pack_version``). Rows are committed
only after every object they name is stored, and the parts of one pack root
in one transaction (a reader finding one part finds them all).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping, Set
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from . import faults
from .database import Database
from .db.tables import PACKS, PACK_OBJECTS, utcnow
from .digest import Digest, digest_of
from .errors import DraftstoreError
from .objects import Objects
from .packs import MAX_PACK_BYTES, MAX_PACK_FILES, MAX_PACKED_FILE, encode_pack, frame_locations
from .pools import drain
from .search.linetables import LineTable, build_summary
from .search.trigrams import IndexDirectory, build_index_objects, decode_index
from .trees import Entry, encode_tree

__all__ = ["Packing", "PackStats", "Covered"]

log = logging.getLogger("draftstore.packing")

_CHUNK = 500  # digests per IN (...) lookup
_RECHECK_S = 30.0


@dataclass
class _Unit:
    tree: Digest
    kind: str  # tree | files | spine
    part: int
    prefix: str  # path of the unit's directory ('' for the root), with a trailing '/'
    nodes: list[Digest] = field(default_factory=list)
    files: list[tuple[str, Entry]] = field(default_factory=list)  # (path relative to the unit's directory, entry)
    loose: list[tuple[str, Entry]] = field(default_factory=list)  # too large to pack: stored alone, still indexed
    bytes: int = 0
    cover: list[list[str]] | None = None  # spine: [prefix, tree, kind] of every tree/files pack of the tree


@dataclass
class PackStats:
    packs: int = 0
    objects: int = 0
    bytes: int = 0  # uncompressed bytes packed
    stored_bytes: int = 0  # bytes written (compressed packs, indexes, large files)
    loose: int = 0  # files too large for a pack, stored on their own

    def add(self, other: "PackStats") -> None:
        self.packs += other.packs
        self.objects += other.objects
        self.bytes += other.bytes
        self.stored_bytes += other.stored_bytes
        self.loose += other.loose


@dataclass(frozen=True)
class Covered:
    """A subtree with a ``tree`` or ``files`` pack: its path prefix and its packs' rows."""

    prefix: str
    kind: str
    rows: tuple[Any, ...]


# PostgreSQL: a pack's object rows in one statement (arrays unnested server-side), not one
# INSERT per row (psycopg's executemany): 10,000 rows took 1.3 s that way on a slow VM. The
# arrays travel as array literals joined in C (hex digests and integers need no quoting):
# psycopg adapts a list element by element in Python, 25 of the 70 ms of 2,500 rows here
_PG_OBJECT_ROWS = sa.text(
    'INSERT INTO pack_object (digest, pack, "offset", length) '
    'SELECT digest, CAST(:pack AS varchar), "offset", length FROM unnest(CAST(:digests AS varchar[]), '
    'CAST(:offsets AS bigint[]), CAST(:lengths AS bigint[])) AS packed(digest, "offset", length) '
    "ON CONFLICT DO NOTHING")


def _array_literal(values: Iterable[Any]) -> str:
    """A PostgreSQL array literal of hex digests or integers (no element needs quoting)."""
    return "{" + ",".join(map(str, values)) + "}"


_STORE_AHEAD = 2  # units of one write stored side by side
_STORED_AHEAD = 4  # units stored, or being stored, past the next one to commit (bounds what waits in memory)


def _insert_ignoring_duplicates(db: Database) -> Any:
    if db.sqlite:
        from sqlalchemy.dialects.sqlite import insert
    else:
        from sqlalchemy.dialects.postgresql import insert
    return lambda table: insert(table).on_conflict_do_nothing()


def _covering_key(root: str, under: str) -> str:
    """The object-cache key of ``Packing.covering``'s answer for a subtree (this module's own)."""
    return f"covering:{root}:{under}"


class Packing:
    def __init__(self, db: Database, objects: Objects) -> None:
        self.db = db
        self.objects = objects

    def _rows_for(self, trees: Iterable[str]) -> dict[str, list[Any]]:
        trees = list(dict.fromkeys(trees))
        found: dict[str, list[Any]] = {}
        with self.db.statement(read_only=True) as conn:
            for i in range(0, len(trees), _CHUNK):
                for r in conn.execute(sa.select(PACKS).where(PACKS.c.tree.in_(trees[i:i + _CHUNK]))).all():
                    found.setdefault(r.tree, []).append(r)
        return found

    def spine_summary(self, root: Digest) -> str | None:
        """Digest of the tree summary ``root``'s spine row names (``search.linetables``),
        or None: the tree has no spine pack, or none was written."""
        spine = next((r for r in self._rows_for([root]).get(root, ()) if r.kind == "spine"), None)
        return spine.search_index if spine is not None else None

    def warm_up(self) -> None:
        """Run the pack-row lookup once, for no tree: SQLAlchemy compiles it now, not
        in the first search or cold read."""
        self._rows_for([""])

    # -- planning ------------------------------------------------------------------------
    def plan(self, root: Digest, nodes: Mapping[str, dict[str, Entry]] | None = None) -> list[_Unit]:
        """The packs of the tree ``root`` that do not exist yet. ``nodes``: decoded
        tree nodes not stored yet (an import's). Walks level by level and never
        descends into a subtree that is packed already (a one-file change reads
        the nodes on its path, not the whole tree)."""
        load = (lambda d: nodes[d] if nodes is not None and d in nodes else self.objects.trees.load(d))
        units: list[_Unit] = []
        spine: list[Digest] = []

        def collect(d: Digest, rel: str, unit_nodes: list[Digest], files: list[tuple[str, Entry]]) -> None:
            unit_nodes.append(d)
            for name, e in sorted(load(d).items()):
                if e.is_dir:
                    collect(e.digest, f"{rel}{name}/", unit_nodes, files)
                else:
                    files.append((rel + name, e))

        def split(tree: Digest, kind: str, prefix: str, unit_nodes: list[Digest], files: list[tuple[str, Entry]]) -> None:
            first = unit = _Unit(tree, kind, 0, prefix, list(unit_nodes))
            units.append(unit)
            for rel, e in files:
                if e.size > MAX_PACKED_FILE:
                    first.loose.append((rel, e))
                    continue
                if unit.bytes + e.size > MAX_PACK_BYTES and unit.files:
                    unit = _Unit(tree, kind, unit.part + 1, prefix)
                    units.append(unit)
                unit.files.append((rel, e))
                unit.bytes += e.size

        cover: list[list[str]] = []  # every pack root, existing or planned: the spine row records it
        frontier = [(root, "")]
        while frontier:
            have = {(d, r.kind) for d, rows in self._rows_for(d for d, _ in frontier).items() for r in rows}
            nxt: list[tuple[Digest, str]] = []
            for d, prefix in frontier:
                if (d, "tree") in have:
                    cover.append([prefix, d, "tree"])
                    continue
                node = load(d)
                if sum(e.size if e.is_dir else 1 for e in node.values()) <= MAX_PACK_FILES:
                    unit_nodes: list[Digest] = []
                    files: list[tuple[str, Entry]] = []
                    collect(d, "", unit_nodes, files)
                    split(d, "tree", prefix, unit_nodes, files)
                    cover.append([prefix, d, "tree"])
                    continue
                spine.append(d)
                direct = [(name, e) for name, e in sorted(node.items()) if not e.is_dir]
                if direct:
                    cover.append([prefix, d, "files"])
                    if (d, "files") not in have:
                        split(d, "files", prefix, [], direct)
                nxt += [(e.digest, f"{prefix}{name}/") for name, e in sorted(node.items()) if e.is_dir]
            frontier = nxt
        if spine and not any(r.kind == "spine" for r in self._rows_for([root]).get(root, [])):
            units.append(_Unit(root, "spine", 0, "", spine, cover=cover))
        return units

    # -- writing -------------------------------------------------------------------------
    def write(self, root: Digest, *, nodes: Mapping[str, tuple[bytes, dict[str, Entry]]] | None = None,
              blobs: Mapping[str, bytes] | None = None) -> PackStats:
        """Write the packs of tree ``root`` that do not exist yet (and the files too
        large for a pack, on their own). ``nodes``/``blobs``: content not stored
        anywhere yet (an import); everything else is read through the store. Two units
        are built and uploaded side by side; rows are committed in plan order, each
        after its objects are stored."""
        decoded = {d: entries for d, (_, entries) in (nodes or {}).items()}
        stats = PackStats()
        units = self.plan(root, decoded)
        group: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        # _STORE_AHEAD units are stored at a time on the read pool (an index build's numpy
        # work and the uploads release the GIL; 2 cores): the next one starts as soon as
        # either ends, not when the oldest is committed (a core sat idle meanwhile); rows
        # are committed in plan order, at most _STORED_AHEAD units past the next to commit
        running: dict[int, Future[Any]] = {}
        stored: dict[int, tuple[dict[str, Any], list[dict[str, Any]], PackStats]] = {}
        started = committed = 0

        def start_more() -> None:
            nonlocal started
            while started < len(units) and len(running) < _STORE_AHEAD and started - committed < _STORED_AHEAD:
                running[started] = self.objects.beside(self._store_unit, units[started], nodes or {}, blobs or {})
                started += 1

        try:
            start_more()
            while committed < len(units):
                wait(list(running.values()), return_when=FIRST_COMPLETED)
                for i in sorted(i for i, f in running.items() if f.done()):
                    stored[i] = running.pop(i).result()  # a unit's failure ends the write here
                start_more()  # before the commits below, which take a while
                while committed in stored:
                    pack_row, object_rows, unit_stats = stored.pop(committed)
                    group.append((pack_row, object_rows))
                    stats.add(unit_stats)
                    unit, nxt = units[committed], units[committed + 1] if committed + 1 < len(units) else None
                    if nxt is None or (nxt.tree, nxt.kind) != (unit.tree, unit.kind):
                        # every part of a pack root in one transaction: a reader (or another
                        # packer's plan) that finds one part's row finds them all
                        self._commit(group)
                        group.clear()
                    committed += 1
                start_more()
        except BaseException:
            drain(list(running.values()))  # nothing of this write goes on after it failed
            raise
        spine = next((u for u in units if u.kind == "spine"), None)
        if spine is not None and spine.cover is not None:
            self._write_summary(root, spine.cover)
        return stats

    def _write_summary(self, root: Digest, cover: list[list[str]]) -> None:
        """Write the tree summary of ``root`` (``search.linetables``) and name it in its spine
        row, once every pack of the tree is committed. Nothing when a pack of the tree
        has no line table (written before them); a failure is logged, not raised: the
        summary only speeds up searches, which without it read the packs' indexes."""
        try:
            rows = self._rows_for(t for _, t, _ in cover)
            units: list[tuple[str, str]] = []  # (prefix, index digest), every part of every pack
            for prefix, tree, kind in cover:
                mine = sorted((r for r in rows.get(tree, ()) if r.kind == kind), key=lambda r: r.part)
                if not mine or not all(r.search_index for r in mine):
                    return
                units += [(prefix, r.search_index) for r in mine]
            raw_dirs = self.objects.raw.get_many([Digest(d) for d in dict.fromkeys(d for _, d in units)])
            tables: list[str] = []
            for _, d in units:
                idx = decode_index(raw_dirs[Digest(d)])
                if not isinstance(idx, IndexDirectory) or not idx.lines:
                    return
                tables.append(idx.lines)
            raw = self.objects.raw.get_many([Digest(t) for t in dict.fromkeys(tables)])
            decoded = {t: LineTable.decode(raw[t]) for t in raw}
            summary = build_summary([(prefix, decoded[t]) for (prefix, _), t in zip(units, tables)])
            if summary is None:
                return
            digest = self.objects.raw.put(summary)
            with self.db.tx() as conn:
                conn.execute(sa.update(PACKS).where(PACKS.c.tree == root, PACKS.c.kind == "spine", PACKS.c.part == 0)
                             .values(search_index=digest))
        except DraftstoreError as exc:
            log.warning("tree summary of %s not written: %s", root[:12], exc)

    def _commit(self, group: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> None:
        # another process may write the same pack at the same time (same bytes, same digest): first one wins
        insert = _insert_ignoring_duplicates(self.db)
        with self.db.tx() as conn:
            for pack_row, object_rows in group:
                conn.execute(insert(PACKS).values(**pack_row))
                if not object_rows:  # a files pack of large files only holds none: its index is what it is for
                    continue
                if self.db.sqlite:
                    conn.execute(insert(PACK_OBJECTS), object_rows)
                else:
                    # every object row of a pack names that pack
                    conn.execute(_PG_OBJECT_ROWS, {"pack": pack_row["digest"],
                                                   "digests": _array_literal(r["digest"] for r in object_rows),
                                                   "offsets": _array_literal(r["offset"] for r in object_rows),
                                                   "lengths": _array_literal(r["length"] for r in object_rows)})

    def _store_unit(self, unit: _Unit, nodes: Mapping[str, tuple[bytes, Any]], blobs: Mapping[str, bytes]
                    ) -> tuple[dict[str, Any], list[dict[str, Any]], PackStats]:
        """Store one unit's objects (pack, index, files too large to pack); returns its
        ``pack`` row and ``pack_object`` rows, for the caller to commit, and what it stored."""
        stats = PackStats()
        node_bytes = [(d, nodes[d][0] if d in nodes else encode_tree(self.objects.trees.load(d))) for d in unit.nodes]
        everything = unit.files + unit.loose
        wanted = [e.digest for _, e in everything if e.digest not in blobs]
        fetched = self.objects.pack_aware.get_many(wanted) if wanted else {}
        content = {e.digest: blobs[e.digest] if e.digest in blobs else fetched[e.digest] for _, e in everything}
        if unit.loose:  # stored on their own, before the rows that index them
            self.objects.raw.put_many([content[e.digest] for _, e in unit.loose])
            stats.loose += len(unit.loose)
            stats.stored_bytes += sum(e.size for _, e in unit.loose)
        raw, index = encode_pack(node_bytes + [(e.digest, content[e.digest]) for _, e in unit.files])
        index_digest = None
        stored = len(raw)
        if unit.kind != "spine":
            built = build_index_objects([(rel, e.digest, content[e.digest]) for rel, e in everything],
                                        frame_locations(raw))
            named = built.shards + ([built.lines] if built.lines is not None else [])
            if named:  # before the directory that names them
                self.objects.raw.put_many(named)
            index_digest = self.objects.raw.put(built.directory)
            stored += len(built.directory) + sum(map(len, named))
        pack = self.objects.raw.put(raw)
        faults.point("pack.after_upload")
        stats.packs += 1
        stats.objects += len(index)
        stats.bytes += sum(n for _, _, n in index)
        stats.stored_bytes += stored
        return ({"digest": pack, "tree": unit.tree, "kind": unit.kind, "part": unit.part, "objects": len(index),
                 "bytes": sum(n for _, _, n in index), "search_index": index_digest, "created_at": utcnow(),
                 "cover": json.dumps(unit.cover) if unit.cover is not None else None},
                [{"digest": d, "pack": pack, "offset": off, "length": n} for d, off, n in index], stats)

    def import_tree(self, files: Mapping[str, bytes], executable: frozenset[str]) -> tuple[Digest, int, PackStats]:
        """Store new files as a tree written in packs (no PUT per file). Returns (root, files, stats)."""
        from .digest import EMPTY_TREE
        from .trees import FileEntry

        digests = {p: digest_of(data) for p, data in files.items()}  # each file hashed once
        blobs = {digests[p]: data for p, data in files.items()}
        changes = {p: FileEntry(digests[p], len(data), p in executable) for p, data in files.items()}
        plan = self.objects.trees.plan(EMPTY_TREE, changes)
        nodes = {digest_of(data): (data, entries) for data, entries in plan.nodes}
        stats = self.write(plan.root, nodes=nodes, blobs=blobs)
        self.objects.trees.remember(plan.nodes)  # warm: the importer is about to read them
        return plan.root, plan.files, stats

    # -- reading -------------------------------------------------------------------------
    def covering(self, root: Digest, under: str = "") -> tuple[list[Covered], list[Digest]]:
        """The packed subtrees of ``root`` below directory ``under`` (tree packs, and
        files packs of large directories), and the directories reached that hold
        files no pack covers (none: every file below ``under`` is in a pack).

        A whole tree (``under=""``) whose spine row records its cover costs two
        row lookups and no object read; otherwise this walks the spine (loading
        spine packs, which are small, and unpacked nodes; never a tree pack)."""
        key = _covering_key(root, under)
        cached = self.objects.cache.get(key)
        if cached is not None and (not cached[1] or time.monotonic() - cached[2] < _RECHECK_S):
            return cached[0], cached[1]
        start = self.objects.trees.dir_digest(root, under) if under else root
        if start is None:
            return [], []
        covered: list[Covered] = []
        uncovered: list[Digest] = []
        frontier = [(start, f"{under}/" if under else "")]
        rows = self._rows_for([start])
        summary = next((r.cover for r in rows.get(start, ()) if r.kind == "spine" and r.cover), None)
        recorded = self._recorded_cover(summary) if summary is not None and not under else None
        if recorded is not None:
            covered, frontier = recorded, []
        while frontier:
            spines = [r.digest for d, _ in frontier for r in rows.get(d, ()) if r.kind == "spine"]
            if spines:
                self.objects.pack_aware.load_packs(spines)
            nxt: list[tuple[Digest, str]] = []
            for d, prefix in frontier:
                mine = rows.get(d, [])
                trees = tuple(sorted((r for r in mine if r.kind == "tree"), key=lambda r: r.part))
                if trees:
                    covered.append(Covered(prefix, "tree", trees))
                    continue
                files = tuple(sorted((r for r in mine if r.kind == "files"), key=lambda r: r.part))
                node = self.objects.trees.load(d)
                if files:
                    covered.append(Covered(prefix, "files", files))
                elif any(not e.is_dir for e in node.values()):
                    uncovered.append(d)
                for name, e in sorted(node.items()):
                    if e.is_dir:
                        nxt.append((e.digest, f"{prefix}{name}/"))
            frontier = nxt
            if frontier:
                rows = self._rows_for(d for d, _ in frontier)
        # a tree never changes; an answer with unpacked parts is asked again after
        # _RECHECK_S, so packs the background job writes meanwhile are found
        self.objects.cache.add(key, (covered, uncovered, time.monotonic()), 200 + 300 * (len(covered) + len(uncovered)))
        return covered, uncovered

    def _recorded_cover(self, cover_json: str) -> list[Covered] | None:
        """The units a spine row's cover names, with their rows; None if any of them
        has no row (a pack was removed since: the caller walks the spine instead)."""
        try:
            entries = [(str(p), str(t), str(k)) for p, t, k in json.loads(cover_json)]
        except (ValueError, TypeError):
            return None
        rows = self._rows_for(t for _, t, _ in entries)
        out: list[Covered] = []
        for prefix, tree, kind in entries:
            mine = tuple(sorted((r for r in rows.get(tree, ()) if r.kind == kind), key=lambda r: r.part))
            if not mine:
                return None
            out.append(Covered(prefix, kind, mine))
        return out

    def prefetch(self, root: Digest, under: str = "", kinds: Set[str] = frozenset({"tree", "files"})) -> int:
        """Load every pack of the subtree (in parallel), so a whole-tree read costs a
        few GETs, not one per file; ``kinds={"tree"}``: only the packs that hold tree
        nodes (a walk). Returns how many packs are in memory for it."""
        covered, _ = self.covering(root, under)
        packs = [r.digest for c in covered if c.kind in kinds for r in c.rows]
        self.objects.pack_aware.load_packs(packs)
        return len(packs)
