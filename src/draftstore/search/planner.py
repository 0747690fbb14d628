"""Which files a code search reads, and in what order: the ``CodeSearch`` a ``View`` calls.

A search over ``sealed tree + overlay`` is planned three ways, cheapest first:

1. a literal without context lines, over the whole tree, is answered from the
   tree summary (``linetables``) when it holds one of the literal's trigrams:
   no file of the tree is read, only the overlay's;
2. otherwise the trigram indexes of the packed subtrees (``packed``) name the
   files that may match; files no index lists and the overlay's are added;
3. otherwise (no index, or a pattern no trigram is certain of) every file.

Whatever the plan, the matcher (``matcher.Searcher``) reads the chosen files
in path order and confirms each line, so every plan reports exactly the
matches a full scan does; an index only ever leaves out files that cannot match.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from operator import itemgetter
from typing import Any, Callable, Protocol

from ..blobs import BlobStore
from ..digest import Digest
from ..trees import FileEntry, TreeReader
from .matcher import Glob, Searcher, SearchResult, compile_glob, glob_base
from .packed import PackedIndexes, Unit
from .trigrams import required_trigrams

__all__ = ["CodeSearch", "SearchedState", "Planner"]

Read = Callable[[], bytes]


class _Listed(Protocol):
    @property
    def digest(self) -> Digest: ...


class SearchedState(Protocol):
    """What a search reads: one pinned state, ``root + overlay`` (a ``View``)."""

    @property
    def root(self) -> Digest: ...

    @property
    def overlay(self) -> Mapping[str, FileEntry | None]:
        """path -> the file written, or None (deleted), on top of ``root``."""
        ...

    @property
    def trees(self) -> TreeReader: ...

    @property
    def tree_summary(self) -> str | None:
        """Digest of the root's tree summary as read with the state ("" for none), or
        None: not known, look it up."""
        ...

    def is_dir(self, path: str) -> bool: ...

    def iter_files(self, under: str = "") -> Iterator[tuple[str, _Listed]]:
        """Every file below ``under`` (tree and overlay merged), in path order."""
        ...


class CodeSearch(Protocol):
    """A code search over a pinned state (``View.search_code`` documents the arguments,
    the guarantees and the errors)."""

    def search_code(self, state: SearchedState, pattern: str, *, regex: bool = False, glob: str | None = None,
                    context: int = 0, max_results: int = 100, ignore_case: bool = False,
                    after: tuple[str, int] | None = None, max_bytes: int | None = None) -> SearchResult: ...


def _sparse_text(lines: list[tuple[int, bytes]]) -> bytes:
    """A text whose line ``n`` is ``line`` for each (n, line) (ascending), every other line empty."""
    parts: list[bytes] = []
    at = 1
    for n, line in lines:
        parts.append(b"\n" * (n - at))
        parts.append(line)
        at = n
    return b"".join(parts)


def _sparse_reader(lines: list[tuple[int, bytes]]) -> Read:
    return lambda: _sparse_text(lines)


def _reader(data: bytes) -> Read:
    return lambda: data


def _written(state: SearchedState, prefix: str = "") -> list[tuple[str, Digest]]:
    """(path, digest) of the files the overlay writes below ``prefix`` (any order)."""
    return [(p, v.digest) for p, v in state.overlay.items() if v is not None and p.startswith(prefix)]


class Planner:
    """The ``CodeSearch`` of a store: plans each search from the packed subtrees'
    indexes (``indexes``; None: every file is read, the plan an index must equal)."""

    def __init__(self, indexes: PackedIndexes | None = None) -> None:
        self._indexes = indexes

    def search_code(self, state: SearchedState, pattern: str, *, regex: bool = False, glob: str | None = None,
                    context: int = 0, max_results: int = 100, ignore_case: bool = False,
                    after: tuple[str, int] | None = None, max_bytes: int | None = None) -> SearchResult:
        searcher = Searcher(pattern, regex=regex, context=context, max_results=max_results,
                            ignore_case=ignore_case, after=after, max_bytes=max_bytes)
        rx = compile_glob(glob) if glob else None
        base = glob_base(glob) if glob else ""
        if base and not state.is_dir(base):
            return SearchResult()
        blobs = state.trees.blobs
        if not regex and not context and not base:
            answered = self._summarised(state, pattern, ignore_case, rx)
            if answered is not None:
                summarised, written = answered
                # the overlay's files are read as the search reaches them, from the cursor's on
                files = _prefetched(blobs, iter(searcher.from_cursor(written)))
                return searcher.run(heapq.merge(summarised, files, key=itemgetter(0)))
        indexed = self._units(state, pattern, regex, ignore_case, base)
        selected: Any
        if indexed is None:
            selected = ((path, st.digest) for path, st in state.iter_files(base) if rx is None or rx.match(path))
        else:
            units, complete = indexed
            selected = _candidates(state, units, base, complete)
            if rx is not None:
                selected = [(p, d) for p, d in selected if rx.match(p)]
        # files before the cursor's are not read (nor prefetched)
        return searcher.run(_prefetched(blobs, iter(searcher.from_cursor(selected))))

    def _summarised(self, state: SearchedState, pattern: str, ignore_case: bool, rx: Glob | None
                    ) -> tuple[list[tuple[str, Read]], list[tuple[str, Digest]]] | None:
        """The files a literal search must look at, answered from the tree summary
        (``linetables``) with no file of the tree read: (path, read) of the summarised
        files and (path, digest) of the overlay's, each in path order; None when it
        cannot answer (no summary, or none of the literal's trigrams is in it).

        Each summarised file reads as its lines that hold the literal's rarest
        summarised trigram, at their own line numbers, the other lines empty. A line
        the literal matches holds every trigram it requires, so it is among them:
        the search reports exactly the lines a full scan does. Without context
        lines only (the lines around a match are not kept), and literals only (a
        regex may look at the whole text: ``\\A``, ``\\z``). Overlay files are read
        as they are."""
        if self._indexes is None or "\n" in pattern or "\r" in pattern:
            return None
        query = required_trigrams(pattern, False, ignore_case)
        if not query or len(query) != 1 or not query[0]:
            return None
        summary = self._indexes.tree_summary(state.root, state.tree_summary)
        if summary is None:
            return None
        counts = [(n, t) for t in query[0] if (n := summary.count(t)) is not None]
        if not counts:
            return None
        overlay = state.overlay
        listed = summary.lines(min(counts)[1]) or {}  # listed: it has a count
        summarised = sorted(((path, _sparse_reader(lines)) for path, lines in listed.items()
                             if path not in overlay and (rx is None or rx.match(path))), key=itemgetter(0))
        written = sorted(f for f in _written(state) if rx is None or rx.match(f[0]))
        return summarised, written

    def _units(self, state: SearchedState, pattern: str, regex: bool, ignore_case: bool, base: str
               ) -> tuple[dict[str, Unit], bool] | None:
        """The index answers of the packed subtrees below ``base`` (``PackedIndexes.units``);
        None when no index can narrow this search (no packs, or a pattern nothing is
        certain of)."""
        if self._indexes is None:
            return None
        query = required_trigrams(pattern, regex, ignore_case)
        if query is None:
            return None
        return self._indexes.units(state.root, base, query)


def _candidates(state: SearchedState, units: dict[str, Unit], base: str, complete: bool) -> list[tuple[str, Digest]]:
    """The files that may match, in path order: index candidates of packed subtrees,
    every file no index lists (none when ``complete``: no tree node is read), and
    every file the overlay writes."""
    overlay, trees = state.overlay, state.trees
    out: list[tuple[str, Digest]] = []
    for prefix, unit in units.items():
        out.extend((prefix + rel, d) for rel, d in unit.hits.items() if prefix + rel not in overlay)
    whole = {prefix for prefix, unit in units.items() if unit.kind == "tree"}

    def walk(digest: Digest, prefix: str) -> Iterator[tuple[str, Digest]]:
        own = units.get(prefix)
        skip_files = own.listed if own is not None and own.kind == "files" else set()
        for name, e in sorted(trees.load(digest).items()):
            path = prefix + name
            if e.is_dir:
                if path + "/" not in whole:
                    yield from walk(e.digest, path + "/")
            elif name not in skip_files and path not in overlay:
                yield path, e.digest

    start = trees.dir_digest(state.root, base) if base else state.root
    prefix = f"{base}/" if base else ""
    if not complete and start is not None and prefix not in whole:
        out.extend(walk(start, prefix))
    out.extend(_written(state, prefix))
    out.sort()
    return out


def _prefetched(blobs: BlobStore, files: Iterator[tuple[str, Digest]], chunk: int = 256
                ) -> Iterator[tuple[str, Read]]:
    """(path, read) pairs whose contents are fetched a chunk at a time in
    parallel (one GET per uncached file, overlapped), in path order."""
    batch: list[tuple[str, Digest]] = []
    for item in files:
        batch.append(item)
        if len(batch) == chunk:
            yield from _fetch_batch(blobs, batch)
            batch = []
    yield from _fetch_batch(blobs, batch)


def _fetch_batch(blobs: BlobStore, batch: list[tuple[str, Digest]]) -> Iterator[tuple[str, Read]]:
    if not batch:
        return
    contents = blobs.get_many([d for _, d in batch])
    for path, d in batch:
        yield path, _reader(contents[d])
