"""Code state as a content-addressed Merkle tree: one object per directory.

A tree object lists a directory's entries, sorted by name, one per line::

    tree 1
    f <sha256> <size-in-bytes> <name>
    x <sha256> <size-in-bytes> <name>     (an executable file)
    d <sha256> <files-below> <name>

It is stored in the blob store like any blob, so its digest names the whole
subtree: versions share structure, publish copies one key, and diff skips a
subtree whose digest did not change. Decoding does no I/O; ``TreeReader``
loads nodes through the blob store and keeps decoded nodes in the in-process
cache (a digest never changes, so the cache never goes stale).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from .blobs import BlobStore, ObjectCache
from .deferred import NodeNotCached
from .digest import EMPTY_TREE, Digest, digest_of
from .errors import IntegrityError

__all__ = ["Entry", "FileEntry", "file_entry", "encode_tree", "decode_tree", "TreeReader", "CachedNodes", "StagedTree",
           "SealPlan"]

_HEADER = b"tree 1\n"


@dataclass(frozen=True, slots=True)
class Entry:
    """One directory entry. For a file ``size`` is bytes; for a dir, files below it."""

    name: str
    kind: str  # "f" (file), "x" (executable file) or "d" (directory)
    digest: Digest
    size: int

    @property
    def is_dir(self) -> bool:
        return self.kind == "d"

    @property
    def executable(self) -> bool:
        return self.kind == "x"

    def file(self) -> "FileEntry":
        return FileEntry(self.digest, self.size, self.kind == "x")


class FileEntry(NamedTuple):
    """A file in a state: its content's digest, size in bytes, and whether it is executable.

    The one type for "a file" across the tree, the staging overlay, views and
    diffs. Where a change is meant, ``None`` stands for a deletion.
    """

    digest: Digest
    size: int
    executable: bool = False


def file_entry(digest: str | None, size: int, executable: bool = False) -> FileEntry | None:
    """An overlay row's value: the new file, or None for a deletion."""
    return None if digest is None else FileEntry(Digest(digest), size, bool(executable))


def encode_tree(entries: Mapping[str, Entry]) -> bytes:
    """Canonical bytes of a directory: same entries, same bytes, same digest."""
    lines = [_HEADER]
    for name in sorted(entries):
        e = entries[name]
        lines.append(f"{e.kind} {e.digest} {e.size} {name}\n".encode())
    return b"".join(lines)


def decode_tree(data: bytes) -> dict[str, Entry]:
    """Parse a tree object. Raises ``integrity.error`` on a malformed object."""
    if not data.startswith(_HEADER):
        raise IntegrityError("object is not a tree")
    out: dict[str, Entry] = {}
    try:
        for line in data[len(_HEADER):].decode().split("\n"):
            if not line:
                continue
            kind, digest, size, name = line.split(" ", 3)
            if kind not in ("f", "x", "d"):
                raise ValueError(f"unknown entry kind {kind!r}")
            out[name] = Entry(name, kind, str.__new__(Digest, digest), int(size))
    except ValueError as exc:
        raise IntegrityError(f"malformed tree object: {exc}") from exc
    return out


def _node_key(digest: str) -> str:
    """The object-cache key of a decoded tree node (this module's own: no other writes it)."""
    return "tree:" + digest


def _tree_size(entries: Mapping[str, Entry]) -> int:
    # approximate memory of a decoded node, for the cache budget
    return 120 + 160 * len(entries)


@dataclass(frozen=True)
class SealPlan:
    """New root, files under it, and the new tree objects (bytes, decoded) to store."""

    root: Digest
    files: int
    nodes: list[tuple[bytes, dict[str, Entry]]]


class TreeReader:
    """Reads and writes tree nodes through a blob store, caching decoded nodes."""

    def __init__(self, blobs: BlobStore, cache: ObjectCache) -> None:
        self.blobs = blobs
        self.cache = cache

    # -- reading -------------------------------------------------------------
    def load(self, digest: Digest) -> dict[str, Entry]:
        """Decoded entries of tree ``digest`` (do not mutate the result)."""
        key = _node_key(digest)
        node = self.cache.get(key)
        if node is None:
            node = {} if digest == EMPTY_TREE else decode_tree(self.blobs.get(digest))
            self.cache.add(key, node, _tree_size(node))
        return node

    def lookup(self, root: Digest, path: str) -> Entry | None:
        """Entry at canonical ``path`` under ``root`` (file or dir), or None. O(depth)."""
        node = self.load(root)
        parts = path.split("/")
        for i, part in enumerate(parts):
            entry = node.get(part)
            if entry is None:
                return None
            if i == len(parts) - 1:
                return entry
            if not entry.is_dir:
                return None
            node = self.load(entry.digest)
        return None

    def dir_digest(self, root: Digest, path: str) -> Digest | None:
        """Digest of directory ``path`` ('' is the root), or None if it is not a directory."""
        if path == "":
            return root
        entry = self.lookup(root, path)
        return entry.digest if entry is not None and entry.is_dir else None

    def walk(self, root: Digest, prefix: str = "") -> Iterator[tuple[str, Entry]]:
        """Every file under tree ``root`` as (path, entry), sorted by the whole path
        string (so ``a-b`` and ``a.b`` come before ``a/x``, as in a sorted path list)."""
        node = self.load(root)
        for name in sorted(node, key=lambda n: n + "/" if node[n].is_dir else n):
            entry = node[name]
            path = f"{prefix}{name}"
            if entry.is_dir:
                yield from self.walk(entry.digest, path + "/")
            else:
                yield path, entry

    def files(self, root: Digest) -> dict[str, Entry]:
        """Every file under tree ``root``: path -> entry, in no particular order (``walk``
        without its sorting and its generator frames, for a whole-tree check)."""
        out: dict[str, Entry] = {}
        todo = [("", root)]
        while todo:
            prefix, digest = todo.pop()
            for name, entry in self.load(digest).items():
                if entry.kind == "d":
                    todo.append((f"{prefix}{name}/", entry.digest))
                else:
                    out[prefix + name] = entry
        return out

    def count(self, root: Digest) -> int:
        return sum(e.size if e.is_dir else 1 for e in self.load(root).values())

    # -- writing ------------------------------------------------------------
    def seal(self, root: Digest, changes: Mapping[str, FileEntry | None]) -> tuple[Digest, int]:
        """Fold ``changes`` (canonical path -> new file or None) into ``root``.

        Returns (new root, files in it). Only the directories on changed
        paths are rewritten: O(changed x depth) new objects, uploaded in one
        parallel batch before this returns, so a root handed out is always
        complete in the blob store. Deleting an absent path is a no-op;
        directories left empty disappear. Callers guarantee no file/dir clash
        (the store checks that at write time).
        """
        plan = self.plan(root, changes)
        self.store(plan)
        return plan.root, plan.files

    def plan(self, root: Digest, changes: Mapping[str, FileEntry | None]) -> "SealPlan":
        """The new tree objects ``seal`` would write, computed without I/O
        beyond reading existing nodes. Nothing may refer to ``plan.root``
        before ``store(plan)`` has returned."""
        if not changes:
            return SealPlan(root, self.count(root), [])
        new_nodes: list[tuple[bytes, dict[str, Entry]]] = []
        top = [(p.split("/"), c) for p, c in changes.items()]
        result = self._apply(root, top, new_nodes)
        if result is None:
            new_nodes.append((encode_tree({}), {}))
            result = (EMPTY_TREE, 0)
        return SealPlan(result[0], result[1], new_nodes)

    def store(self, plan: "SealPlan") -> None:
        """Upload a plan's tree objects (in parallel); cache them once stored."""
        if not plan.nodes:
            return
        self.blobs.put_many([data for data, _ in plan.nodes])
        self.remember(plan.nodes)

    def remember(self, nodes: Iterable[tuple[bytes, Mapping[str, Entry]]]) -> None:
        """Keep decoded nodes in memory, as ``load`` would after reading them: (bytes,
        entries) of nodes stored already, or about to be by the caller (a node's digest
        names its bytes, so a node in memory is never wrong, only maybe not yet readable
        by another process)."""
        for data, node in nodes:
            self.cache.add(_node_key(digest_of(data)), node, _tree_size(node))

    def _apply(
        self,
        digest: Digest | None,
        changes: list[tuple[list[str], FileEntry | None]],
        new_nodes: list[tuple[bytes, dict[str, Entry]]],
    ) -> tuple[Digest, int] | None:
        entries = dict(self.load(digest)) if digest is not None else {}
        nested: dict[str, list[tuple[list[str], FileEntry | None]]] = defaultdict(list)
        for parts, change in changes:
            name = parts[0]
            if len(parts) > 1:
                nested[name].append((parts[1:], change))
            elif change is None:
                cur = entries.get(name)
                if cur is not None and not cur.is_dir:
                    del entries[name]
            else:
                entries[name] = Entry(name, "x" if change.executable else "f", change.digest, change.size)
        for name, sub in nested.items():
            cur = entries.get(name)
            sub_root = cur.digest if cur is not None and cur.is_dir else None
            res = self._apply(sub_root, sub, new_nodes)
            if res is None:
                if cur is not None and cur.is_dir:
                    del entries[name]
            else:
                entries[name] = Entry(name, "d", res[0], res[1])
        if not entries:
            return None
        data = encode_tree(entries)
        new_nodes.append((data, entries))
        files = sum(e.size if e.is_dir else 1 for e in entries.values())
        return digest_of(data), files


class CachedNodes(TreeReader):
    """A tree reader for a transaction holding row locks: it reads only nodes in
    memory. A node that is not raises ``NodeNotCached`` (the transaction rolls back,
    the node is read with nothing locked, the operation runs again), ``budget``
    times at most; past that (a cache too small to keep them) it reads them itself."""

    def __init__(self, trees: TreeReader, budget: int = 8) -> None:
        super().__init__(trees.blobs, trees.cache)
        self.source = trees
        self.budget = budget

    def load(self, digest: Digest) -> dict[str, Entry]:
        if self.budget > 0 and digest != EMPTY_TREE:
            node = self.cache.get(_node_key(digest))
            if node is not None:
                return node  # type: ignore[no-any-return]
            self.budget -= 1
            raise NodeNotCached(lambda: self.source.load(digest), digest)
        return super().load(digest)


class StagedTree:
    """A sealed tree with staged changes on top: ``root + overlay``.

    ``overlay`` maps canonical paths to the new file, or None for a deletion.
    Answers "which file is at this path" and "is this a directory" for the
    merged state without materialising it: O(depth) node reads per lookup.
    """

    __slots__ = ("trees", "root", "overlay")

    def __init__(self, trees: TreeReader, root: Digest, overlay: dict[str, FileEntry | None]) -> None:
        self.trees = trees
        self.root = root
        self.overlay = overlay

    def stage(self, path: str, entry: FileEntry | None) -> None:
        self.overlay[path] = entry

    def file(self, path: str) -> FileEntry | None:
        """The file at canonical ``path``, or None (absent, deleted or a directory)."""
        if path in self.overlay:
            return self.overlay[path]
        entry = self.trees.lookup(self.root, path)
        return None if entry is None or entry.is_dir else entry.file()

    def is_dir(self, path: str) -> bool:
        """True if canonical ``path`` holds at least one file."""
        prefix = path + "/"
        if any(v is not None and p.startswith(prefix) for p, v in self.overlay.items()):
            return True
        d = self.trees.dir_digest(self.root, path)
        return d is not None and any(p not in self.overlay for p, _ in self.trees.walk(d, prefix))
