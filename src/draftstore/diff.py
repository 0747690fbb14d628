"""Diff between two project states (versions, drafts, turn boundaries).

The code part walks both Merkle trees together and never descends into a
subtree whose digest is the same on both sides, so the work grows with what
changed, not with project size; an overlay (unsealed draft writes) is
folded in path by path. Characters and world settings are diffed as JSON
Patch (RFC 6902) operations.

A diff can be read in pages (``after`` and ``limit``: the changed files in
path order, after a path): the tree walk and rename detection cover the
whole change (metadata only), while file contents are read, and text diffs
made, only for the files of the page. A page also ends once its text diffs
reach ``PAGE_TEXT_BYTES``, so no page is unbounded in bytes either. The JSON
Patch operations come with the first page.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

import jsonpatch

from . import paging
from .digest import Digest
from .trees import Entry, FileEntry, TreeReader
from .view import View

__all__ = ["FileDiff", "Diff", "diff_views", "MAX_TEXT_DIFF_BYTES"]

MAX_TEXT_DIFF_BYTES = 1024 * 1024
PAGE_TEXT_BYTES = 4 * 1024 * 1024  # a page of a diff ends once its text diffs reach this (one file at least)


@dataclass(frozen=True)
class FileDiff:
    """One changed file. ``status``: added | modified | deleted | renamed.

    ``unified`` is a unified text diff for text files (None for binary files,
    for files over 1 MiB, or when text diffs were not asked for).
    """

    path: str
    status: str
    old_path: str | None = None
    old_digest: str | None = None
    new_digest: str | None = None
    old_size: int | None = None
    new_size: int | None = None
    binary: bool = False
    unified: str | None = None
    old_executable: bool | None = None
    new_executable: bool | None = None


@dataclass
class Diff:
    files: list[FileDiff] = field(default_factory=list)
    characters: list[dict[str, Any]] = field(default_factory=list)
    world_settings: list[dict[str, Any]] = field(default_factory=list)
    nodes_visited: int = 0  # tree nodes compared: proportional to the change
    #: read in pages: the cursor of the next page of files (None: this was the last)
    next_cursor: str | None = None

    @property
    def empty(self) -> bool:
        return not (self.files or self.characters or self.world_settings)

    def by_path(self) -> dict[str, FileDiff]:
        return {f.path: f for f in self.files}


class _TreeDiff:
    def __init__(self, trees: TreeReader) -> None:
        self.trees = trees
        self.nodes = 0
        self.changes: dict[str, tuple[FileEntry | None, FileEntry | None]] = {}

    def run(self, a: Digest, b: Digest, prefix: str = "") -> None:
        if a == b:
            return
        self.nodes += 2
        ea, eb = self.trees.load(a), self.trees.load(b)
        for name in sorted(ea.keys() | eb.keys()):
            x, y = ea.get(name), eb.get(name)
            if x == y:
                continue
            path = prefix + name
            if x is not None and y is not None and x.is_dir and y.is_dir:
                self.run(x.digest, y.digest, path + "/")
                continue
            self._side(x, path, old=True)
            self._side(y, path, old=False)

    def _side(self, e: Entry | None, path: str, old: bool) -> None:
        if e is None:
            return
        items = self.trees.walk(e.digest, path + "/") if e.is_dir else [(path, e)]
        for p, f in items:
            before, after = self.changes.get(p, (None, None))
            value = f.file()
            self.changes[p] = (value, after) if old else (before, value)


def _text(data: bytes) -> str | None:
    if b"\x00" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def diff_views(a: View, b: View, *, text: bool = True, detect_renames: bool = True,
               after: str | None = None, limit: int | None = None) -> Diff:
    """What changed from state ``a`` to state ``b``. Reads only changed objects.
    With ``limit``: one page, the files after path ``after`` (module docstring),
    with ``next_cursor`` set when more follow."""
    trees = a.trees
    td = _TreeDiff(trees)
    td.run(a.root, b.root)
    changes = td.changes
    for path in a.overlay.keys() | b.overlay.keys():
        old, new = a.file(path), b.file(path)
        if old == new:
            changes.pop(path, None)
        else:
            changes[path] = (old, new)
    added = {p: n for p, (o, n) in changes.items() if o is None and n is not None}
    deleted = {p: o for p, (o, n) in changes.items() if n is None and o is not None}
    renamed: dict[str, str] = {}
    if detect_renames and added and deleted:
        by_digest: dict[str, list[str]] = {}
        for p, f in sorted(deleted.items()):
            by_digest.setdefault(f.digest, []).append(p)
        for p, f in sorted(added.items()):
            olds = by_digest.get(f.digest)
            if olds:
                renamed[p] = olds.pop(0)
    gone = set(renamed.values())
    files: list[FileDiff] = []
    text_bytes = 0
    more_after: str | None = None
    for path in sorted(changes):
        old, new = changes[path]
        if path in gone or old == new or (after is not None and path <= after):
            continue
        if limit is not None and files and (len(files) >= limit or text_bytes >= PAGE_TEXT_BYTES):
            more_after = files[-1].path
            break
        old_path = renamed.get(path)
        if old_path is not None:
            old = changes[old_path][0]
            assert old is not None and new is not None
            files.append(FileDiff(path, "renamed", old_path, old.digest, new.digest, old.size, new.size,
                                  old_executable=old.executable, new_executable=new.executable))
            continue
        status = "added" if old is None else "deleted" if new is None else "modified"
        files.append(_file_diff(trees, path, status, old, new, text))
        text_bytes += len(files[-1].unified or "")
    first = after is None
    return Diff(
        files=files,
        characters=jsonpatch.make_patch(a.characters, b.characters).patch if first else [],
        world_settings=jsonpatch.make_patch(a.world_settings, b.world_settings).patch if first else [],
        nodes_visited=td.nodes,
        next_cursor=None if more_after is None else paging.encode("diff", [more_after]),
    )


def _file_diff(trees: TreeReader, path: str, status: str, old: FileEntry | None, new: FileEntry | None,
               text: bool) -> FileDiff:
    base = dict(path=path, status=status, old_digest=old.digest if old else None,
                new_digest=new.digest if new else None, old_size=old.size if old else None,
                new_size=new.size if new else None, old_executable=old.executable if old else None,
                new_executable=new.executable if new else None)
    if not text or max(old.size if old else 0, new.size if new else 0) > MAX_TEXT_DIFF_BYTES:
        return FileDiff(**base)  # type: ignore[arg-type]
    a = _text(trees.blobs.get(old.digest)) if old else ""
    b = _text(trees.blobs.get(new.digest)) if new else ""
    if a is None or b is None:
        return FileDiff(**base, binary=True)  # type: ignore[arg-type]
    unified = "".join(difflib.unified_diff(
        a.splitlines(keepends=True), b.splitlines(keepends=True),
        fromfile="/dev/null" if old is None else f"a/{path}",
        tofile="/dev/null" if new is None else f"b/{path}",
    ))
    return FileDiff(**base, unified=unified)  # type: ignore[arg-type]
