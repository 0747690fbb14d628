"""What an agent reads: one pinned project state (a draft, a version, or empty).

A ``View`` is ``sealed tree + overlay``, with the overlay copied when the view
is made. Tree nodes and blobs are immutable, so every read from one view sees
one consistent state however the draft changes meanwhile; make a new view to
see newer writes.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from . import paging
from .digest import Digest
from .errors import PathNotFound, PatternInvalid
from .paths import normalize_dir, normalize_path
from .records import Page
from .search import CodeSearch, Planner, SearchResult, compile_glob, glob_base
from .settings import Limits
from .trees import Entry, FileEntry, StagedTree, TreeReader

__all__ = ["View", "FileStat", "DirEntry", "PathList"]

_EVERY_FILE = Planner()  # a view made without the store's search reads every file


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


class View:
    """A read-only, pinned project state.

    ``kind`` is ``"draft"``, ``"version"`` or ``"empty"`` (a project with no
    version and no draft); ``draft_id`` / ``version_id`` say which state it is.
    ``search`` plans ``search_code`` (the store's ``search.CodeSearch``, which reads
    the packed subtrees' indexes; without one every file is read, same answers).
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
        search: CodeSearch | None = None,
        summary: str | None = None,
    ) -> None:
        self._staged = StagedTree(trees, root, dict(overlay))
        self._trees = trees
        self._overlay = self._staged.overlay
        self._limits = limits or Limits()
        self._search = search if search is not None else _EVERY_FILE
        self._summary = summary
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
    def tree_summary(self) -> str | None:
        """Digest of the root's tree summary (``search.linetables``) as read with this
        state, "" for none; None: not read with it (a search looks it up)."""
        return self._summary

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
        """Paths matching ``glob`` (see ``draftstore.search.matcher`` for the rules), sorted,
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
        ``draftstore.search.matcher`` for the dialect). Files are searched in path
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
        return self._search.search_code(self, pattern, regex=regex, glob=glob, context=context,
                                        max_results=max_results, ignore_case=ignore_case, after=after,
                                        max_bytes=max_bytes)
