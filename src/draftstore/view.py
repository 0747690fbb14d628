"""What an agent reads: one pinned project state (a draft, a version, or empty).

A ``View`` is ``sealed tree + overlay``, with the overlay copied when the view
is made. Tree nodes and blobs are immutable, so every read from one view sees
one consistent state however the draft changes meanwhile; make a new view to
see newer writes.
"""

from __future__ import annotations

import bisect
import copy
import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from operator import itemgetter
from types import MappingProxyType
from typing import Any

from . import paging
from .digest import Digest
from .errors import PathNotFound, PatternInvalid
from .paths import normalize_dir, normalize_path
from .records import Page
from .search import Searcher, SearchResult, compile_glob, glob_base
from .searchindex import required_trigrams
from .settings import Limits
from .trees import Entry, FileEntry, StagedTree, TreeReader

__all__ = ["View", "FileStat", "DirEntry", "PathList"]


@dataclass(frozen=True)
class FileStat:
    path: str
    size: int
    digest: Digest
    executable: bool = False


@dataclass(frozen=True)
class DirEntry:
    name: str
    path: str
    kind: str  # "file" or "dir"
    size: int  # bytes for a file; files below it for a directory


class PathList(list[str]):
    """A sorted list of paths; ``truncated`` says the limit cut it short."""

    truncated: bool = False


def _sparse_text(lines: list[tuple[int, bytes]]) -> bytes:
    """A text whose line ``n`` is ``line`` for each (n, line) (ascending), every other line empty."""
    parts: list[bytes] = []
    at = 1
    for n, line in lines:
        parts.append(b"\n" * (n - at))
        parts.append(line)
        at = n
    return b"".join(parts)


class View:
    """A read-only, pinned project state.

    ``kind`` is ``"draft"``, ``"version"`` or ``"empty"`` (a project with no
    version and no draft); ``draft_id`` / ``version_id`` say which state it is.
    """

    def __init__(
        self,
        *,
        trees: TreeReader,
        project_id: str,
        kind: str,
        root: Digest,
        overlay: Mapping[str, FileEntry | None],
        characters: Any,
        world_settings: Any,
        version_id: str | None = None,
        draft_id: str | None = None,
        revision: int | None = None,
        limits: Limits | None = None,
        packing: Any = None,
        summary: str | None = None,
    ) -> None:
        self._staged = StagedTree(trees, root, dict(overlay))
        self._trees = trees
        self._overlay = self._staged.overlay
        self._limits = limits or Limits()
        self._packing = packing  # finds the trigram indexes of packed subtrees (None: scan every file)
        self._summary = summary  # digest of the root's tree summary, "" for none, None: look it up
        self.project_id = project_id
        self.kind = kind
        self.root = root
        self.version_id = version_id
        self.draft_id = draft_id
        self.revision = revision
        self._characters = characters
        self._world_settings = world_settings

    def __repr__(self) -> str:
        target = self.draft_id or self.version_id or "-"
        return f"<View {self.kind} {target} root={self.root[:12]} overlay={len(self._overlay)}>"

    @property
    def trees(self) -> TreeReader:
        """The tree reader this view reads nodes and blobs through."""
        return self._trees

    @property
    def overlay(self) -> Mapping[str, FileEntry | None]:
        """Changes staged on top of ``root`` (path -> file, None = deleted), read-only."""
        return MappingProxyType(self._overlay)

    @property
    def characters(self) -> Any:
        return copy.deepcopy(self._characters)

    @property
    def world_settings(self) -> Any:
        return copy.deepcopy(self._world_settings)

    # -- single files ------------------------------------------------------
    def file(self, path: str) -> FileEntry | None:
        """The file at canonical ``path`` in this state, or None (no validation: see ``stat``)."""
        return self._staged.file(path)

    def stat(self, path: str) -> FileStat:
        """Size and digest of a file. Raises ``path.not_found``, ``path.denied``."""
        p = normalize_path(path, self._limits)
        f = self.file(p)
        if f is None:
            raise PathNotFound(f"no file {p!r} in this {self.kind}", path=p)
        return FileStat(p, f.size, f.digest, f.executable)

    def read_file(self, path: str) -> bytes:
        """Content of a file. Raises ``path.not_found``, ``path.denied``."""
        st = self.stat(path)
        return self._trees.blobs.get(st.digest)

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self.read_file(path).decode(encoding)

    def exists(self, path: str) -> bool:
        """True if ``path`` is a file in this state (directories: see ``is_dir``)."""
        p = normalize_path(path, self._limits)
        return self.file(p) is not None

    # -- listings ------------------------------------------------------------
    def iter_files(self, under: str = "") -> Iterator[tuple[str, FileStat]]:
        """Every file (below directory ``under``) as (path, stat), sorted; merges tree and overlay."""
        prefix = under + "/" if under else ""
        sub = self._trees.dir_digest(self.root, under) if under else self.root
        walk = self._trees.walk(sub, prefix) if sub is not None else iter(())
        if not self._overlay:
            for path, e in walk:
                yield path, FileStat(path, e.size, e.digest, e.executable)
            return
        extra = sorted((p, v) for p, v in self._overlay.items() if v is not None and p.startswith(prefix))
        i = 0
        for path, e in walk:
            while i < len(extra) and extra[i][0] < path:
                p, f = extra[i]
                yield p, FileStat(p, f.size, f.digest, f.executable)
                i += 1
            if i < len(extra) and extra[i][0] == path:
                p, f = extra[i]
                yield p, FileStat(p, f.size, f.digest, f.executable)
                i += 1
                continue
            if path in self._overlay:  # deleted
                continue
            yield path, FileStat(path, e.size, e.digest, e.executable)
        for p, f in extra[i:]:
            yield p, FileStat(p, f.size, f.digest, f.executable)

    def list_files(self) -> list[str]:
        """Every file path, sorted."""
        return [p for p, _ in self.iter_files()]

    def file_count(self) -> int:
        if not self._overlay:
            return self._trees.count(self.root)
        return sum(1 for _ in self.iter_files())

    def _tree_children(self, dirpath: str) -> Mapping[str, Entry]:
        d = self._trees.dir_digest(self.root, dirpath)
        return self._trees.load(d) if d is not None else {}

    def is_dir(self, path: str) -> bool:
        d = normalize_dir(path, self._limits)
        return d == "" or self._staged.is_dir(d)

    def list_dir(self, path: str = "") -> list[DirEntry]:
        """Entries of directory ``path`` ('' is the root), sorted by name.

        Raises ``path.not_found`` if ``path`` is not a directory.
        """
        d = normalize_dir(path, self._limits)
        if d and not self.is_dir(d):
            raise PathNotFound(f"no directory {d!r} in this {self.kind}", path=d)
        prefix = d + "/" if d else ""
        entries: dict[str, DirEntry] = {}
        for name, e in self._tree_children(d).items():
            p = prefix + name
            if e.is_dir:
                entries[name] = DirEntry(name, p, "dir", e.size)
            elif p not in self._overlay:
                entries[name] = DirEntry(name, p, "file", e.size)
        touched_dirs: set[str] = set()
        for p, v in self._overlay.items():
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix):]
            name, sep, _ = rest.partition("/")
            if sep:
                touched_dirs.add(name)
            elif v is not None:
                entries[name] = DirEntry(name, p, "file", v.size)
        for name in touched_dirs:  # an overlay can create a directory or empty one
            p = prefix + name
            if self.is_dir(p):
                entries[name] = DirEntry(name, p, "dir", sum(1 for _ in self.iter_files(p)))
            else:
                entries.pop(name, None)
        return [entries[n] for n in sorted(entries)]

    def page_dir(self, path: str = "", cursor: str | None = None, limit: int | None = None) -> Page[DirEntry]:
        """One page of ``list_dir(path)`` (by name; ``limit`` capped at ``paging.MAX_LIMIT``),
        ``next_cursor`` for the next. Raises like ``list_dir``, and ``input.invalid``
        for a cursor of another list."""
        key = paging.decode("dir", cursor, (str,))
        n = paging.limit(limit)
        entries = self.list_dir(path)
        if key is not None:
            entries = entries[bisect.bisect_right([e.name for e in entries], key[0]):]
        return paging.page("dir", entries[:n + 1], n, lambda e: [e.name], lambda e: e)

    def find_files(self, glob: str = "**", limit: int = 1000, after: str | None = None) -> PathList:
        """Paths matching ``glob`` (see ``draftstore.search`` for the rules), sorted,
        at most ``limit`` (``truncated`` set when cut); with ``after``, only the paths
        after it (the next page of a cut answer). Raises ``pattern.invalid``."""
        rx = compile_glob(glob)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise PatternInvalid("limit is a positive integer", limit=limit)
        if after is not None and not isinstance(after, str):
            raise PatternInvalid("after is a path", after=str(after)[:200])
        base = glob_base(glob)
        out = PathList()
        if base and not self.is_dir(base):
            return out
        for path, _ in self.iter_files(base):
            if after is not None and path <= after:
                continue
            if rx.match(path):
                if len(out) == limit:
                    out.truncated = True
                    break
                out.append(path)
        return out

    def search_code(
        self,
        pattern: str,
        regex: bool = False,
        glob: str | None = None,
        context: int = 0,
        max_results: int = 100,
        ignore_case: bool = False,
        after: tuple[str, int] | None = None,
        max_bytes: int | None = None,
    ) -> SearchResult:
        """Lines matching ``pattern`` (a literal, or an RE2 regex with ``regex=True``).

        RE2 matches in time linear in the text (no agent pattern can hang a
        worker); backreferences and lookaround are ``pattern.invalid`` (see
        ``draftstore.search`` for the dialect). Files are searched in path
        order, optionally only those matching ``glob``; binary files (a NUL
        byte in the first 8 KiB) are skipped. Lines split on "\\n" as in grep;
        each match carries path, 1-based line number, the line and up to
        ``context`` lines before and after. At most ``max_results`` matches;
        ``truncated`` says more exist, and ``after=(path, line)`` of the last
        match reported goes on from there (the matches that come after it in
        file then line order). With ``max_bytes``, it also stops (``truncated``)
        before the match whose lines would take the characters found past
        that budget (the first match is always kept). Raises ``pattern.invalid``.
        """
        searcher = Searcher(pattern, regex=regex, context=context, max_results=max_results,
                            ignore_case=ignore_case, after=after, max_bytes=max_bytes)
        rx = compile_glob(glob) if glob else None
        base = glob_base(glob) if glob else ""
        if base and not self.is_dir(base):
            return SearchResult()
        if not regex and not context and not base:
            answered = self._summarised(pattern, ignore_case, rx)
            if answered is not None:
                summarised, written = answered
                # the overlay's files are read as the search reaches them, from the cursor's on
                files = self._prefetched(iter(searcher.from_cursor(written)))
                return searcher.run(heapq.merge(summarised, files, key=itemgetter(0)))
        indexed = self._index_units(pattern, regex, ignore_case, base)
        if indexed is None:
            selected: Any = ((path, st.digest) for path, st in self.iter_files(base) if rx is None or rx.match(path))
        else:
            units, complete = indexed
            selected = self._candidates(units, base, complete)
            if rx is not None:
                selected = [(p, d) for p, d in selected if rx.match(p)]
        # files before the cursor's are not read (nor prefetched)
        return searcher.run(self._prefetched(iter(searcher.from_cursor(selected))))

    def _summarised(self, pattern: str, ignore_case: bool, rx: Any
                    ) -> tuple[list[tuple[str, Any]], list[tuple[str, Digest]]] | None:
        """The files a literal search must look at, answered from the tree summary
        (``lineindex``) with no file of the tree read: (path, read) of the summarised
        files and (path, digest) of the overlay's, each in path order; None when it
        cannot answer (no summary, or none of the literal's trigrams is in it).

        Each summarised file reads as its lines that hold the literal's rarest
        summarised trigram, at their own line numbers, the other lines empty. A line
        the literal matches holds every trigram it requires, so it is among them:
        the search reports exactly the lines a full scan does. Without context
        lines only (the lines around a match are not kept), and literals only (a
        regex may look at the whole text: ``\\A``, ``\\z``). Overlay files are read
        as they are."""
        if self._packing is None or "\n" in pattern or "\r" in pattern:
            return None
        query = required_trigrams(pattern, False, ignore_case)
        if not query or len(query) != 1 or not query[0]:
            return None
        summary = self._packing.tree_summary(self.root, self._summary)
        if summary is None:
            return None
        counts = [(n, t) for t in query[0] if (n := summary.count(t)) is not None]
        if not counts:
            return None
        overlay = self._overlay
        summarised = sorted((path, lambda lines=lines: _sparse_text(lines))
                            for path, lines in summary.lines(min(counts)[1]).items()
                            if path not in overlay and (rx is None or rx.match(path)))
        written = sorted(f for f in self._written() if rx is None or rx.match(f[0]))
        return summarised, written

    def _index_units(self, pattern: str, regex: bool, ignore_case: bool, base: str) -> Any:
        """The trigram indexes of the packed subtrees below ``base``: (prefix -> (kind,
        {listed relative paths}, {candidate relative path: digest}), complete: every
        file below ``base`` is listed by one of them); None when no index can narrow
        this search (no packs, or a pattern nothing is certain of)."""
        if self._packing is None:
            return None
        query = required_trigrams(pattern, regex, ignore_case)
        if query is None:
            return None
        covered, uncovered = self._packing.covering(self.root, base)
        indexed = [c for c in covered if all(row.search_index for row in c.rows)]  # else: file by file
        complete = not uncovered and len(indexed) == len(covered)
        covered = indexed
        found = self._packing.search_candidates((row for c in covered for row in c.rows), query)
        units: dict[str, tuple[str, set[str], dict[str, Digest]]] = {}
        for c in covered:
            listed: set[str] = set()  # only a files pack's walk needs it (which files to skip)
            hits: dict[str, Digest] = {}
            for row in c.rows:
                paths, mine = found[row.search_index]
                if c.kind == "files":
                    listed |= paths()
                hits.update(mine)
            units[c.prefix] = (c.kind, listed, hits)
        return (units, complete) if units else None

    def _candidates(self, units: dict[str, tuple[str, set[str], dict[str, Digest]]],
                    base: str, complete: bool) -> list[tuple[str, Digest]]:
        """The files that may match, in path order: index candidates of packed subtrees,
        every file no index lists (none when ``complete``: no tree node is read), and
        every file the overlay writes."""
        overlay = self._overlay
        out: list[tuple[str, Any]] = []
        for prefix, (_, _, hits) in units.items():
            out.extend((prefix + rel, d) for rel, d in hits.items() if prefix + rel not in overlay)
        whole = {prefix for prefix, (kind, _, _) in units.items() if kind == "tree"}

        def walk(digest: Digest, prefix: str) -> Iterator[tuple[str, Any]]:
            own = units.get(prefix)
            skip_files = own[1] if own is not None and own[0] == "files" else set()
            for name, e in sorted(self._trees.load(digest).items()):
                path = prefix + name
                if e.is_dir:
                    if path + "/" not in whole:
                        yield from walk(e.digest, path + "/")
                elif name not in skip_files and path not in overlay:
                    yield path, e.digest

        start = self._trees.dir_digest(self.root, base) if base else self.root
        prefix = f"{base}/" if base else ""
        if not complete and start is not None and prefix not in whole:
            out.extend(walk(start, prefix))
        out.extend(self._written(prefix))
        out.sort()
        return out

    def _written(self, prefix: str = "") -> list[tuple[str, Digest]]:
        """(path, digest) of the files the overlay writes below ``prefix`` (any order)."""
        return [(p, v.digest) for p, v in self._overlay.items() if v is not None and p.startswith(prefix)]

    def _prefetched(self, files: Iterator[tuple[str, Digest]], chunk: int = 256) -> Iterator[tuple[str, Any]]:
        """(path, read) pairs whose contents are fetched a chunk at a time in
        parallel (one GET per uncached file, overlapped), in path order."""
        blobs = self._trees.blobs
        batch: list[tuple[str, Digest]] = []
        for item in files:
            batch.append(item)
            if len(batch) == chunk:
                yield from self._fetch_batch(blobs, batch)
                batch = []
        yield from self._fetch_batch(blobs, batch)

    @staticmethod
    def _fetch_batch(blobs: Any, batch: list[tuple[str, Digest]]) -> Iterator[tuple[str, Any]]:
        if not batch:
            return
        contents = blobs.get_many([d for _, d in batch])
        for path, d in batch:
            yield path, (lambda data=contents[d]: data)
