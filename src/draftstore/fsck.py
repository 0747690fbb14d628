"""fsck: does every reference resolve, and is every object what its key says?

Checks, each reported precisely (which row, which key):

- every tree a version, an open draft or a turn boundary names is complete:
  each node and each file resolves (stored alone or in a pack);
- every overlay row, turn state, offloaded payload, snapshot bundle and pack
  search index resolves, and so does every shard a (format-2) search index
  names; a search index that does not decode is reported malformed;
- every stored object's content hashes to its key (``verify_objects``: reads
  everything once; the slow part);
- every pack decodes, lists exactly the objects ``pack_object`` says it holds,
  at those offsets, and each of them hashes to its digest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from . import errors as E
from .database import Database
from .db.tables import DRAFTS, DRAFT_CHANGES, PACKS, PACK_OBJECTS, SNAPSHOTS, TOOL_CALLS, TURNS, VERSIONS
from .digest import EMPTY_TREE, Digest
from .objects import Objects
from .packs import Pack
from .search.trigrams import IndexDirectory, decode_index

__all__ = ["Problem", "FsckReport", "Checker"]

Progress = Callable[[str, int, int | None], None]


@dataclass(frozen=True)
class Problem:
    kind: str  # missing | corrupt | malformed | inconsistent
    where: str  # the row or object that refers, e.g. "version 3fa.. root"
    key: str  # the object (digest) at fault
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind:<12} {self.key}  ({self.where}){': ' + self.detail if self.detail else ''}"


@dataclass
class FsckReport:
    problems: list[Problem] = field(default_factory=list)
    trees_checked: int = 0
    references_checked: int = 0
    objects_verified: int = 0
    packs_verified: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


class Checker:
    def __init__(self, db: Database, objects: Objects) -> None:
        self.db = db
        self.objects = objects

    def run(self, verify_objects: bool = True, progress: Progress | None = None) -> FsckReport:
        t0 = time.monotonic()
        report = FsckReport()
        members: dict[str, set[str]] = {}
        with self.db.tx(read_only=True) as conn:
            for d, p in conn.execute(sa.select(PACK_OBJECTS.c.digest, PACK_OBJECTS.c.pack)):
                members.setdefault(p, set()).add(d)
            packs = conn.execute(sa.select(PACKS)).all()
            refs = self._references(conn)
        # listed after the references are read: an object is stored before the row that names
        # it commits, so on a store being written to every reference read is in this listing
        listed = {o.digest: o.size for o in self.objects.raw.iter_objects()}
        available = set(listed).union(*(ds for p, ds in members.items() if p in listed))

        def have(key: str) -> bool:
            return key in available or key == EMPTY_TREE

        # trees: every node and file reachable from a named root
        seen: set[str] = set()
        for where, root in refs["trees"]:
            report.trees_checked += 1
            self._tree(root, where, seen, have, report)
        for where, key in refs["objects"]:
            report.references_checked += 1
            if not have(key):
                report.problems.append(Problem("missing", where, key))
        for r in packs:
            where = f"pack row {r.tree[:12]}/{r.kind}/{r.part}"
            report.references_checked += 1
            if r.digest not in listed:
                report.problems.append(Problem("missing", where, r.digest, "the pack object"))
            elif verify_objects:
                self._pack(r, members.get(r.digest, set()), report)
            if r.search_index and r.search_index not in listed:
                report.problems.append(Problem("missing", where, r.search_index, "its search index"))
            elif r.search_index:
                self._index(r.search_index, where, listed, report)
        if verify_objects:
            keys = list(listed)
            for i in range(0, len(keys), 64):
                self._verify(keys[i:i + 64], report)
                if progress is not None:
                    progress("verify", min(i + 64, len(keys)), len(keys))
        report.seconds = time.monotonic() - t0
        return report

    def _verify(self, chunk: list[str], report: FsckReport) -> None:
        """Re-read and re-hash objects (in parallel; one by one when a chunk holds a bad one)."""
        for d in chunk:
            self.objects.cache.discard(d)  # read the stored bytes, not a copy in memory
        try:
            self.objects.raw.get_many([Digest(d) for d in chunk])
            report.objects_verified += len(chunk)
            return
        except (E.ChecksumMismatch, E.BlobNotFound):
            pass
        for d in chunk:
            try:
                self.objects.raw.get(Digest(d))
                report.objects_verified += 1
            except E.ChecksumMismatch as exc:
                report.problems.append(Problem("corrupt", "blob store", d, exc.message))
            except E.BlobNotFound:
                pass  # deleted while checking

    def _references(self, conn: Any) -> dict[str, list[tuple[str, str]]]:
        trees: list[tuple[str, str]] = []
        objects: list[tuple[str, str]] = []
        for vid, root in conn.execute(sa.select(VERSIONS.c.id, VERSIONS.c.code_manifest_key)):
            trees.append((f"version {vid} root", root))
        for did, root in conn.execute(sa.select(DRAFTS.c.id, DRAFTS.c.code_manifest_key)
                                      .where(DRAFTS.c.closed_at.is_(None))):
            trees.append((f"draft {did} root", root))
        for did, path, digest in conn.execute(sa.select(DRAFT_CHANGES.c.draft_id, DRAFT_CHANGES.c.path,
                                                        DRAFT_CHANGES.c.digest)
                                              .where(DRAFT_CHANGES.c.digest.is_not(None))):
            objects.append((f"draft {did} overlay {path!r}", digest))
        for r in conn.execute(sa.select(TURNS.c.id, TURNS.c.start_root, TURNS.c.end_root, TURNS.c.start_state_digest,
                                        TURNS.c.end_state_digest, TURNS.c.tool_calls_json)
                              .where(TURNS.c.pruned_at.is_(None))):
            for name, root in (("start", r.start_root), ("end", r.end_root)):
                if root:
                    trees.append((f"turn {r.id} {name} root", root))
            for name, key in (("start", r.start_state_digest), ("end", r.end_state_digest)):
                if key:
                    objects.append((f"turn {r.id} {name} state", key))
            for call in r.tool_calls_json or ():
                for k in ("args_digest", "result_digest"):
                    if call.get(k):
                        objects.append((f"turn {r.id} tool call {call['seq']} {k[:-7]}", call[k]))
        for tid, seq, a, res in conn.execute(sa.select(TOOL_CALLS.c.turn_id, TOOL_CALLS.c.seq, TOOL_CALLS.c.args_digest,
                                                       TOOL_CALLS.c.result_digest)):
            for name, key in (("args", a), ("result", res)):
                if key:
                    objects.append((f"turn {tid} tool call {seq} {name}", key))
        for sid, key in conn.execute(sa.select(SNAPSHOTS.c.id, SNAPSHOTS.c.bundle_key).where(
                SNAPSHOTS.c.bundle_key.is_not(None), SNAPSHOTS.c.status == "ready")):
            objects.append((f"snapshot {sid} bundle", key))
        return {"trees": trees, "objects": objects}

    def _tree(self, root: str, where: str, seen: set[str], have: Callable[[str], bool], report: FsckReport) -> None:
        todo = [(root, where)]
        while todo:
            d, at = todo.pop()
            if d in seen:
                continue
            seen.add(d)
            if not have(d):
                report.problems.append(Problem("missing", at, d, "tree node"))
                continue
            try:
                node = self.objects.trees.load(Digest(d))
            except E.ChecksumMismatch as exc:
                report.problems.append(Problem("corrupt", at, d, exc.message))
                continue
            except (E.IntegrityError, E.BlobNotFound) as exc:
                report.problems.append(Problem("malformed", at, d, exc.message))
                continue
            for name, e in node.items():
                if e.is_dir:
                    todo.append((e.digest, f"{at}{name}/" if at.endswith("/") else f"{at} > {name}/"))
                elif e.digest not in seen:
                    seen.add(e.digest)
                    report.references_checked += 1
                    if not have(e.digest):
                        label = f"{at}{name}" if at.endswith("/") else f"{at} > {name}"
                        report.problems.append(Problem("missing", label, e.digest, "file"))

    def _index(self, digest: str, where: str, listed: dict[str, int], report: FsckReport) -> None:
        """A search index (either format, or a spine's tree summary) decodes, and every
        shard and line table it names is stored."""
        try:
            raw = self.objects.raw.get(Digest(digest))
            idx = decode_index(raw)
            named = [(s, "a shard") for s in idx.shard_digest] if isinstance(idx, IndexDirectory) else []
            if isinstance(idx, IndexDirectory) and idx.lines:
                named.append((idx.lines, "the line table"))
        except E.ChecksumMismatch as exc:
            report.problems.append(Problem("corrupt", where, digest, exc.message))
            return
        except E.BlobNotFound:
            report.problems.append(Problem("missing", where, digest, "its search index"))
            return
        except E.IntegrityError as exc:
            report.problems.append(Problem("malformed", where, digest, exc.message))
            return
        finally:
            self.objects.cache.discard(digest)
        for obj, what in named:
            report.references_checked += 1
            if obj not in listed:
                report.problems.append(Problem("missing", where, obj, f"{what} of search index {digest[:12]}"))

    def _pack(self, row: Any, expected: set[str], report: FsckReport) -> None:
        where = f"pack row {row.tree[:12]}/{row.kind}/{row.part}"
        try:
            pack = Pack.decode(row.digest, self.objects.raw.get(Digest(row.digest)))
        except E.ChecksumMismatch as exc:
            report.problems.append(Problem("corrupt", where, row.digest, exc.message))
            return
        except E.IntegrityError as exc:
            report.problems.append(Problem("malformed", where, row.digest, exc.message))
            return
        if set(pack.objects) != expected:
            report.problems.append(Problem("inconsistent", where, row.digest,
                                           f"pack_object lists {len(expected)} objects, the pack holds "
                                           f"{len(pack.objects)}"))
        for digest in pack.objects:
            try:
                pack.take(digest)
            except E.ChecksumMismatch as exc:
                report.problems.append(Problem("corrupt", where, digest, exc.message))
            except E.IntegrityError as exc:  # a frame that does not decompress: the rest is not read
                report.problems.append(Problem("malformed", where, row.digest, exc.message))
                break
        report.packs_verified += 1
