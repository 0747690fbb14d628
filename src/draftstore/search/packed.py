"""The search indexes of packed subtrees: reading them, and the candidates of a query.

Every ``tree``/``files`` pack has a trigram index (``trigrams``) and a tree
with a spine pack may have a tree summary (``linetables``); ``packing``
writes them and says which packs cover a tree. This module reads them: it
decodes index directories, shards and summaries (each kept in the object
cache: a digest never changes, so a decoded object never goes stale) and
answers, per pack, the files a query may match.

The cache keys of those decoded objects are this module's (``index_key``
and the other ``_key`` helpers below); no other module writes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..blobs import BlobStore, ObjectCache
from ..digest import Digest
from ..errors import BlobNotFound, IntegrityError
from ..packs import FrameLocation, PackedObjects
from .linetables import LineTable
from .trigrams import IndexDirectory, IndexShard, Query, SearchIndex, decode_index

if TYPE_CHECKING:
    from ..packing import Covered

__all__ = ["PackCover", "PackedIndexes", "Unit", "index_key"]

log = logging.getLogger("draftstore.search")

_RECHECK_S = 30.0  # a "no summary" or an unreadable summary is asked again after this


def index_key(digest: str) -> str:
    """The object-cache key of a decoded search index (either format)."""
    return "index:" + digest


def _shard_key(digest: str) -> str:
    return "ixshard:" + digest


def _summary_key(digest: str) -> str:
    return "summary:" + digest


def _summary_of_key(root: str) -> str:
    return "summary-of:" + root


def _unusable_key(digest: str) -> str:
    return "summary-unusable:" + digest


class PackCover(Protocol):
    """What the search needs to know of a tree's packs (``packing.Packing`` is one)."""

    def covering(self, root: Digest, under: str = "") -> tuple[list[Covered], list[Digest]]:
        """The packed subtrees of ``root`` below ``under``, and the directories no pack covers."""
        ...

    def spine_summary(self, root: Digest) -> str | None:
        """Digest of the tree summary ``root``'s spine row names, or None."""
        ...


@dataclass(frozen=True)
class Unit:
    """The index answer of one packed subtree: its kind (``tree`` or ``files``), the
    relative paths its indexes list (``files`` packs only: which files a walk skips),
    and {relative path: digest} of the files that may match."""

    kind: str
    listed: set[str]
    hits: dict[str, Digest]


class PackedIndexes:
    """Reads the search indexes and tree summaries of packed trees.

    ``in_parallel(fn, items)`` runs independent chains of reads side by side
    (``Objects.in_parallel``); ``objects`` reads frames of packs, ``blobs``
    reads the index objects themselves (always stored alone)."""

    def __init__(self, *, packs: PackCover, blobs: BlobStore, objects: PackedObjects, cache: ObjectCache,
                 in_parallel: Callable[[Callable[[Any], Any], list[Any]], list[Any]]) -> None:
        self._packs = packs
        self._blobs = blobs
        self._objects = objects
        self._cache = cache
        self._in_parallel = in_parallel

    def units(self, root: Digest, base: str, query: Query) -> tuple[dict[str, Unit], bool] | None:
        """The index answers of the packed subtrees of ``root`` below directory ``base``,
        by path prefix, and whether every file below ``base`` is listed by one of them
        (no tree node need be read); None when no index covers any of it."""
        covered, uncovered = self._packs.covering(root, base)
        indexed = [c for c in covered if all(row.search_index for row in c.rows)]  # else: file by file
        complete = not uncovered and len(indexed) == len(covered)
        found = self.candidates((row for c in indexed for row in c.rows), query)
        units: dict[str, Unit] = {}
        for c in indexed:
            listed: set[str] = set()  # only a files pack's walk needs it (which files to skip)
            hits: dict[str, Digest] = {}
            for row in c.rows:
                paths, mine = found[row.search_index]
                if c.kind == "files":
                    listed |= paths()
                hits.update(mine)
            units[c.prefix] = Unit(c.kind, listed, hits)
        return (units, complete) if units else None

    def indexes(self, digests: Iterable[str]) -> dict[str, SearchIndex | IndexDirectory]:
        """Search index objects (either format: a format-2 directory without its
        shards), decoded; the ones not in memory are fetched in parallel (an index
        never changes, so a decoded one is kept in the cache)."""
        return self._decoded(index_key, digests, lambda d, raw: decode_index(raw))

    def _decoded(self, key: Callable[[str], str], digests: Iterable[str],
                 decode: Callable[[str, bytes], Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        todo: list[Digest] = []
        for d in dict.fromkeys(digests):
            obj = self._cache.get(key(d))
            if obj is None:
                todo.append(Digest(d))
            else:
                out[d] = obj
        for d, raw in (self._blobs.get_many(todo).items() if todo else ()):
            obj = decode(d, raw)
            self._cache.add(key(d), obj, obj.size)
            self._cache.discard(d)  # the raw bytes are not needed twice
            out[d] = obj
        return out

    def tree_summary(self, root: Digest, known: str | None = None) -> LineTable | None:
        """The tree summary of ``root`` (``linetables``), or None: the tree has no spine
        pack, or its spine row names no summary. ``known``: the summary's digest as the
        caller read it ("" for none); otherwise the spine row is looked up (and a
        "none" asked again after ``_RECHECK_S``, as background packing may write one).
        A summary that cannot be read is not tried again for ``_RECHECK_S``.
        One GET cold; nothing warm."""
        if known is not None:
            digest = known or None
        else:
            key = _summary_of_key(root)
            cached = self._cache.get(key)
            if cached is None or (cached[0] is None and time.monotonic() - cached[1] >= _RECHECK_S):
                cached = (self._packs.spine_summary(root), time.monotonic())
                self._cache.add(key, cached, 200)
            digest = cached[0]
        failed = self._cache.get(_unusable_key(digest)) if digest is not None else None
        if digest is None or (failed is not None and time.monotonic() - failed < _RECHECK_S):
            return None
        try:
            table: LineTable = self._decoded(_summary_key, [digest], lambda d, raw: LineTable.decode(raw))[digest]
        except (BlobNotFound, IntegrityError) as exc:  # searches go on without it; fsck reports it
            log.warning("tree summary %s of %s unusable: %s", digest[:12], root[:12], exc)
            self._cache.add(_unusable_key(digest), time.monotonic(), 100)  # tried again after _RECHECK_S
            return None
        return table if table.summary else None

    def candidates(self, rows: Iterable[Any], query: Query
                   ) -> dict[str, tuple[Callable[[], Set[str]], dict[str, Digest]]]:
        """For each pack row with a search index, by index digest: (a function giving
        every relative path the index lists, {relative path: digest} of the files that
        may match ``query``: a superset of the listed files that match).

        Each index is one chain of reads, and the chains run side by side: a
        format-2 index reads its directory, then the few shards the query needs,
        then the frames of the pack that hold its candidates (one ranged read per
        run of nearby frames, each frame checked against its hash), so the
        candidates' contents are in the object cache afterwards."""
        unique = list({r.search_index: r for r in rows if r.search_index}.values())
        cold = [r for r in unique if index_key(r.search_index) not in self._cache]
        found = dict(zip((r.search_index for r in cold),
                         self._in_parallel(lambda r: self._candidates_of(r, query), cold)))
        for r in unique:  # indexes in memory already: no thread hop (their candidates are most often cached too)
            if r.search_index not in found:
                found[r.search_index] = self._candidates_of(r, query)
        return found

    def _candidates_of(self, row: Any, query: Query) -> tuple[Callable[[], Set[str]], dict[str, Digest]]:
        idx = self.indexes([row.search_index])[row.search_index]
        if isinstance(idx, SearchIndex):
            files = dict(idx.files)
            return (lambda: set(files)), {rel: Digest(files[rel]) for rel in idx.candidates(query)}
        need = {sh: idx.width for sh in idx.shards_for(query)}
        shards = self._decoded(_shard_key, need, lambda d, raw: IndexShard.decode(raw, need[d])) if need else {}
        hits: dict[str, Digest] = {}
        frames: list[tuple[str, FrameLocation]] = []
        pending: list[int] = []  # the ordinal of each entry of frames
        paths, known, cache = idx.paths, idx.found, self._cache
        for i in idx.candidates(query, shards):
            d = known.get(i)
            if d is not None and d in cache:  # read before and still cached: nothing to locate
                hits[paths[i]] = d  # type: ignore[assignment]
                continue
            loc = idx.location(i)
            if isinstance(loc, str):
                hits[paths[i]] = Digest(loc)
            else:
                frames.append((row.digest, loc))
                pending.append(i)
        if frames:
            got = self._objects.read_frames(frames)
            for key, i in zip(frames, pending):
                known[i] = d = got[key]
                hits[paths[i]] = d
        return idx.listed, hits
