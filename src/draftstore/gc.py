"""Garbage collection: mark every object something retained reaches, sweep the rest.

Roots (``roots``): every version's tree; every open draft's tree and overlay;
discarded drafts' trees while their retention lasts; retained turns' boundary
roots, boundary states and offloaded tool payloads (a running turn's always);
every snapshot bundle not marked failed. Marking walks the trees once
(shared subtrees are visited once) and adds every node and file. A pack is
kept while any object inside it is marked (so an object stored only in a pack
is never lost), with its search index and the shards that index names
(a format-2 index: its directory is read to find them).

Sweeping lists the blob store and deletes what is neither marked nor younger
than the grace period (``gc_grace_s``, one hour by default): an object written
for a transaction that has not committed yet (a write, a seal, an import
whose version row is still to come) is young, and so never swept. Storing an
object again makes it young (``BlobStore.put``), and the sweep reads each
object's age once more right before deleting it, so content written anew after
the listing stays. (What remains is the moment between that last check and the
delete itself; S3 has no conditional delete to close it.) Pack rows follow the
same grace.

A dry run deletes nothing and says what would go. An interrupted run leaves a
consistent store; running again finishes the job (marking is recomputed,
deleting is idempotent). Turns whose retention ended are marked ``pruned``
when a run applies, so reading their boundary states says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from . import errors as E
from . import faults
from .database import Database
from .db.tables import (DRAFTS, DRAFT_CHANGES, PACKS, PACK_OBJECTS, PROJECTS, SNAPSHOTS, TOOL_CALLS, TURNS, VERSIONS,
                        utcnow)
from .digest import EMPTY_TREE, Digest
from .objects import Objects
from .records import SnapshotStatus, TurnStatus, aware
from .search.trigrams import index_shards
from .settings import Settings

__all__ = ["Collector", "GCStats", "Retention"]

log = logging.getLogger("draftstore.gc")

Progress = Callable[[str, int, int | None], None]  # (phase, done, total or None)


@dataclass(frozen=True)
class Retention:
    """How long a project keeps what is not truth for ever (None: for ever)."""

    turns_days: float | None  # ended turns' boundary roots, boundary states, offloaded payloads
    discarded_days: float | None  # discarded drafts' trees


@dataclass
class GCStats:
    dry_run: bool
    objects_listed: int = 0
    objects_reachable: int = 0
    objects_swept: int = 0  # deleted, or (dry run) would be
    bytes_swept: int = 0
    objects_young: int = 0  # unreachable but within the grace period: kept
    packs_dropped: int = 0  # pack rows whose objects were all unreachable
    turns_pruned: int = 0  # turns whose retention ended (marked pruned on apply)
    seconds: float = 0.0
    swept: list[str] = field(default_factory=list)  # up to 100 swept digests, for the report


class Collector:
    def __init__(self, db: Database, objects: Objects, retention: Callable[[str], Retention], *,
                 grace_s: float) -> None:
        self.db = db
        self.objects = objects
        self.grace_s = grace_s
        self.retention = retention

    # -- roots ------------------------------------------------------------------------------
    def roots(self) -> tuple[set[str], set[str], list[str]]:
        """(tree roots, other objects to keep, turns whose retention ended)."""
        now = utcnow()
        trees: set[str] = set()
        keep: set[str] = set()
        expired: list[str] = []
        with self.db.tx(read_only=True) as conn:
            trees.update(conn.execute(sa.select(VERSIONS.c.code_manifest_key)).scalars())
            for r in conn.execute(sa.select(DRAFTS.c.id, DRAFTS.c.project_id, DRAFTS.c.code_manifest_key,
                                            DRAFTS.c.closed_at, DRAFTS.c.closed_reason)):
                if r.closed_reason == "published":
                    continue  # its tree is its version's, kept by the version row while it exists
                if r.closed_at is None:
                    trees.add(r.code_manifest_key)
                elif not self._expired(self.retention(r.project_id).discarded_days, r.closed_at, now):
                    trees.add(r.code_manifest_key)
            keep.update(d for d in conn.execute(sa.select(DRAFT_CHANGES.c.digest)
                                                .where(DRAFT_CHANGES.c.digest.is_not(None))).scalars())
            for r in conn.execute(sa.select(TURNS.c.id, TURNS.c.project_id, TURNS.c.status, TURNS.c.ended_at,
                                            TURNS.c.start_root, TURNS.c.end_root, TURNS.c.start_state_digest,
                                            TURNS.c.end_state_digest, TURNS.c.tool_calls_json, TURNS.c.pruned_at)):
                if r.status != TurnStatus.RUNNING and (
                        r.pruned_at is not None
                        or self._expired(self.retention(r.project_id).turns_days, r.ended_at, now)):
                    if r.pruned_at is None:
                        expired.append(r.id)
                    continue
                trees.update(x for x in (r.start_root, r.end_root) if x)
                keep.update(x for x in (r.start_state_digest, r.end_state_digest) if x)
                for call in r.tool_calls_json or ():
                    keep.update(call.get(k) for k in ("args_digest", "result_digest") if call.get(k))
            for a, b in conn.execute(sa.select(TOOL_CALLS.c.args_digest, TOOL_CALLS.c.result_digest)):
                keep.update(x for x in (a, b) if x)
            keep.update(k for k in conn.execute(sa.select(SNAPSHOTS.c.bundle_key).where(
                SNAPSHOTS.c.bundle_key.is_not(None), SNAPSHOTS.c.status != SnapshotStatus.FAILED.value)).scalars())
        trees.discard(EMPTY_TREE)
        return trees, keep, expired

    @staticmethod
    def _expired(days: float | None, at: Any, now: Any) -> bool:
        return days is not None and at is not None and aware(at) < now - timedelta(days=days)  # type: ignore[operator]

    # -- mark --------------------------------------------------------------------------------
    def mark(self, trees: Iterable[str], progress: Progress | None = None) -> set[str]:
        """Every tree node and file reachable from ``trees`` (each subtree walked once)."""
        marked: set[str] = set()
        todo = [Digest(t) for t in trees]
        while todo:
            d = todo.pop()
            if d in marked:
                continue
            marked.add(d)
            for e in self.objects.trees.load(d).values():
                if e.is_dir:
                    if e.digest not in marked:
                        todo.append(e.digest)
                else:
                    marked.add(e.digest)
            if progress is not None and len(marked) % 5000 < 50:
                progress("mark", len(marked), None)
        return marked

    def live_packs(self, marked: set[str], grace_cutoff: Any) -> tuple[set[str], list[Any]]:
        """(digests of packs to keep, with their indexes; pack rows to drop): a pack is
        kept while any object in it is marked, or while it is younger than the grace."""
        members: dict[str, bool] = {}
        with self.db.tx(read_only=True) as conn:
            for digest, pack in conn.execute(sa.select(PACK_OBJECTS.c.digest, PACK_OBJECTS.c.pack)):
                if digest in marked:
                    members[pack] = True
                else:
                    members.setdefault(pack, False)
            rows = conn.execute(sa.select(PACKS)).all()
        keep: set[str] = set()
        drop: list[Any] = []
        indexes: list[str] = []
        for r in rows:
            young = aware(r.created_at) > grace_cutoff  # type: ignore[operator]
            if members.get(r.digest) or young or (r.kind == "spine" and r.tree in marked):
                keep.add(r.digest)
                if r.search_index:
                    keep.add(r.search_index)
                    indexes.append(r.search_index)
            else:
                drop.append(r)
        keep |= self._index_shards(indexes)
        return keep, drop

    def _index_shards(self, indexes: list[str]) -> set[str]:
        """The shards the kept search indexes name. An index that is missing or
        unreadable keeps nothing more (its pack's search falls back; fsck reports it)."""
        out: set[str] = set()
        todo = list(dict.fromkeys(indexes))
        for i in range(0, len(todo), 64):
            chunk = [Digest(d) for d in todo[i:i + 64]]
            try:
                got = self.objects.raw.get_many(chunk)
            except (E.BlobNotFound, E.ChecksumMismatch):
                got = {}
                for d in chunk:
                    try:
                        got[d] = self.objects.raw.get(d)
                    except (E.BlobNotFound, E.ChecksumMismatch):
                        continue
            for d, raw in got.items():
                try:
                    out.update(index_shards(raw))
                except E.IntegrityError:
                    log.warning("search index %s is malformed: its shards are not kept", d[:12])
                self.objects.cache.discard(d)
        return out

    # -- the whole run ------------------------------------------------------------------------
    def run(self, dry_run: bool = True, progress: Progress | None = None) -> GCStats:
        t0 = time.monotonic()
        stats = GCStats(dry_run=dry_run)
        grace_s = self.grace_s
        cutoff = utcnow() - timedelta(seconds=grace_s)
        # young means younger than the grace *at the start of the run*: an object written
        # after the roots were read is never older than that, however long marking takes
        oldest = time.time() - grace_s
        trees, keep, expired = self.roots()
        marked = self.mark(trees, progress)
        marked |= keep
        packs, drop = self.live_packs(marked, cutoff)
        marked |= packs
        stats.objects_reachable = len(marked)
        stats.packs_dropped = len(drop)
        stats.turns_pruned = len(expired)
        if not dry_run:
            self._drop_rows(drop, expired)
        doomed: list[tuple[str, int]] = []
        for obj in self.objects.raw.iter_objects():
            stats.objects_listed += 1
            if progress is not None and stats.objects_listed % 1000 == 0:
                progress("list", stats.objects_listed, None)
            if obj.digest in marked:
                continue
            if obj.modified > oldest:
                stats.objects_young += 1
                continue
            doomed.append((obj.digest, obj.size))
        faults.point("gc.before_sweep")
        for i, (digest, size) in enumerate(doomed):
            if not dry_run:
                # stored again since it was listed (a write refers to it anew): keep it
                modified = self.objects.raw.modified(Digest(digest))
                if modified is None or modified > oldest:
                    stats.objects_young += modified is not None
                    continue
                self.objects.raw.delete(Digest(digest))
            stats.objects_swept += 1
            stats.bytes_swept += size
            if len(stats.swept) < 100:
                stats.swept.append(digest)
            if progress is not None and (i + 1) % 200 == 0:
                progress("sweep", i + 1, len(doomed))
        if progress is not None:
            progress("sweep", len(doomed), len(doomed))
        stats.seconds = time.monotonic() - t0
        return stats

    def _drop_rows(self, drop: list[Any], expired: list[str]) -> None:
        now = utcnow()
        with self.db.tx() as conn:
            for r in drop:
                conn.execute(PACKS.delete().where(PACKS.c.tree == r.tree, PACKS.c.kind == r.kind,
                                                  PACKS.c.part == r.part))
            gone = {r.digest for r in drop}
            if gone:
                still = set(conn.execute(sa.select(PACKS.c.digest).where(PACKS.c.digest.in_(gone))).scalars())
                for digest in gone - still:  # a pack another row still names keeps its objects' rows
                    conn.execute(PACK_OBJECTS.delete().where(PACK_OBJECTS.c.pack == digest))
            if expired:
                conn.execute(TURNS.update().where(TURNS.c.id.in_(expired)).values(pruned_at=now))


def project_retention(db: Database, settings: Settings) -> Callable[[str], Retention]:
    """The retention of a project: its own settings, else the store's defaults."""
    cache: dict[str, Retention] = {}
    with db.tx(read_only=True) as conn:
        rows = conn.execute(sa.select(PROJECTS.c.id, PROJECTS.c.retain_turns_days,
                                      PROJECTS.c.retain_discarded_days)).all()
    defaults = settings
    for r in rows:
        cache[r.id] = Retention(
            r.retain_turns_days if r.retain_turns_days is not None else defaults.retain_turns_days,
            r.retain_discarded_days if r.retain_discarded_days is not None else defaults.retain_discarded_days)
    fallback = Retention(defaults.retain_turns_days, defaults.retain_discarded_days)
    return lambda project_id: cache.get(project_id, fallback)
