"""Sandbox snapshots and materialise: a state's files written to a directory, fast.

A snapshot is a tar + zstd bundle of one state's tree (a version, or a draft
with no unsealed writes), stored content-addressed in the blob store, with a
``sandbox_snapshot`` row (pending | ready | failed | stale) naming the tree
root it was built from. It is a cache, never truth: ``materialize`` uses a
ready snapshot whose root is the state's, checks every file it extracts
against the tree, and falls back to rebuilding from the blobs (marking the
snapshot ``failed`` when its bundle is missing or corrupt, ``stale`` when its
root is no longer the state's). Deleting every snapshot loses nothing.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from collections.abc import Callable, Iterator
from hashlib import sha256
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import zstandard

from . import errors as E
from . import faults
from . import paging
from . import validation as check
from .coordination import Coordination
from .database import Database
from .db.tables import DRAFTS, PROJECTS, SNAPSHOTS, utcnow
from .digest import Digest
from .dirwriter import DirectoryWriter
from .ids import new_id
from .objects import Objects
from .packing import Packing
from .records import Page, Snapshot, SnapshotStatus, aware
from .settings import Limits
from .view import View

__all__ = ["Snapshots", "Materialized"]

Progress = Callable[[int, int], None]  # (files done, files in all)
_CHUNK = 256


@dataclass(frozen=True)
class Materialized:
    """What ``materialize`` did: ``path`` is ``snapshot`` or ``rebuild``."""

    path: str
    files: int
    bytes: int
    root: str
    snapshot_id: str | None
    #: the state that was written: ``version`` or ``draft``, its id, and its JSON documents
    source_kind: str = ""
    source_id: str = ""
    characters: Any = None
    world_settings: Any = None


def snapshot_record(r: Any) -> Snapshot:
    return Snapshot(id=r.id, project_id=r.project_id, source_kind=r.source_kind, source_id=r.source_id, root=r.root,
                    status=SnapshotStatus(r.status), bundle_key=r.bundle_key, external_ref=r.external_ref,
                    files=r.files, size_bytes=r.size_bytes, error=r.error, created_at=aware(r.created_at),
                    finished_at=aware(r.finished_at))


class Snapshots:
    def __init__(self, db: Database, objects: Objects, coordination: Coordination, limits: Limits, packing: Packing,
                 resolve: Callable[[str, str], tuple[View, str, str]]) -> None:
        self.db = db
        self.objects = objects
        self.coordination = coordination
        self.limits = limits
        self.packing = packing
        # (project_id, state) -> (view, source kind, source id)
        self._resolve = resolve

    # -- rows -----------------------------------------------------------------------------
    def list(self, project_id: str) -> list[Snapshot]:
        check.project_id(project_id)
        with self.db.tx(read_only=True) as conn:
            _project_exists(conn, project_id)
            rows = conn.execute(sa.select(SNAPSHOTS).where(SNAPSHOTS.c.project_id == project_id)
                                .order_by(SNAPSHOTS.c.created_at, SNAPSHOTS.c.id)).all()
        return [snapshot_record(r) for r in rows]

    def page(self, project_id: str, cursor: str | None, limit: int | None) -> Page[Snapshot]:
        check.project_id(project_id)
        n = paging.limit(limit)
        with self.db.tx(read_only=True) as conn:
            _project_exists(conn, project_id)
            rows = conn.execute(paging.by_creation(SNAPSHOTS, "snapshots", cursor, n)
                                .where(SNAPSHOTS.c.project_id == project_id)).all()
        return paging.page("snapshots", rows, n, lambda r: (r.created_at, r.id), snapshot_record)

    def _insert(self, conn: Any, project_id: str, kind: str, source_id: str, root: str, status: SnapshotStatus,
                external_ref: str | None = None) -> str:
        sid = new_id()
        conn.execute(SNAPSHOTS.insert().values(id=sid, project_id=project_id, source_kind=kind, source_id=source_id,
                                               root=root, status=status, external_ref=external_ref, files=0,
                                               size_bytes=0, created_at=utcnow(),
                                               finished_at=None if status == "pending" else utcnow()))
        if status == SnapshotStatus.READY:
            _name_on_draft(conn, kind, source_id, root, sid)
        return sid

    def _get(self, snapshot_id: str) -> Snapshot:
        with self.db.statement(read_only=True) as conn:
            row = conn.execute(sa.select(SNAPSHOTS).where(SNAPSHOTS.c.id == snapshot_id)).one()
        return snapshot_record(row)

    def _mark(self, snapshot_id: str, status: SnapshotStatus, **values: Any) -> None:
        with self.db.tx() as conn:
            conn.execute(SNAPSHOTS.update().where(SNAPSHOTS.c.id == snapshot_id)
                         .values(status=status, finished_at=utcnow(), **values))
            if status == SnapshotStatus.READY:
                row = conn.execute(sa.select(SNAPSHOTS.c.source_kind, SNAPSHOTS.c.source_id, SNAPSHOTS.c.root)
                                   .where(SNAPSHOTS.c.id == snapshot_id)).one()
                _name_on_draft(conn, row.source_kind, row.source_id, row.root, snapshot_id)

    def schedule(self, conn: Any, project_id: str, version_id: str, root: str) -> str:
        """Within the caller's transaction (a publish): a pending snapshot of the version."""
        return self._insert(conn, project_id, "version", version_id, root, SnapshotStatus.PENDING)

    def record(self, project_id: str, state: str, external_ref: str) -> Snapshot:
        """Record a snapshot kept outside draftstore (e.g. a sandbox provider's id) as ready."""
        ref = check.text("external_ref", external_ref, max_chars=1024)
        view, kind, source_id = self._sealed(project_id, state)
        with self.db.tx() as conn:
            sid = self._insert(conn, project_id, kind, source_id, view.root, SnapshotStatus.READY, ref)
        return self._get(sid)

    def _sealed(self, project_id: str, state: str) -> tuple[View, str, str]:
        view, kind, source_id = self._resolve(project_id, state)
        if view.overlay:
            raise E.DraftBusy("the draft has unsealed writes (a turn is running): snapshot it after the turn ends",
                              project_id=project_id)
        return view, kind, source_id

    def best(self, project_id: str, state: str) -> Snapshot | None:
        """The ready snapshot that restores ``state`` ("draft", "head" or a version id)
        exactly: its root is the state's root. An external one (``external_ref``) before a
        bundle, the newest first within each; None when none fits, and for a draft with
        unsealed writes (no snapshot holds them). Raises ``project.not_found``,
        ``version.not_found``, ``state.not_found`` (no version or draft yet)."""
        check.project_id(project_id)
        view, _, _ = self._resolve(project_id, state)
        if view.overlay:
            return None
        external_first = sa.case((SNAPSHOTS.c.external_ref.is_not(None), 0), else_=1)
        with self.db.statement(read_only=True) as conn:
            row = conn.execute(sa.select(SNAPSHOTS).where(
                SNAPSHOTS.c.project_id == project_id, SNAPSHOTS.c.root == str(view.root),
                SNAPSHOTS.c.status == SnapshotStatus.READY.value,
                sa.or_(SNAPSHOTS.c.external_ref.is_not(None), SNAPSHOTS.c.bundle_key.is_not(None)),
            ).order_by(external_first, SNAPSHOTS.c.created_at.desc(), SNAPSHOTS.c.id.desc()).limit(1)).first()
        return None if row is None else snapshot_record(row)

    # -- building ------------------------------------------------------------------------------
    def create(self, project_id: str, state: str = "head", progress: Progress | None = None) -> Snapshot:
        """Build a snapshot of ``state`` now ("head", "draft" or a version id)."""
        view, kind, source_id = self._sealed(project_id, state)
        with self.db.tx() as conn:
            sid = self._insert(conn, project_id, kind, source_id, view.root, SnapshotStatus.PENDING)
        return self._build(sid, view, progress)

    def build_pending(self, limit: int = 10) -> int:
        """Build up to ``limit`` pending snapshots (scheduled by publish, or left pending by a
        builder that died); returns how many were built. Each is built from the root its row
        names."""
        with self.db.tx(read_only=True) as conn:
            rows = conn.execute(sa.select(SNAPSHOTS).where(SNAPSHOTS.c.status == SnapshotStatus.PENDING.value)
                                .order_by(SNAPSHOTS.c.created_at).limit(limit)).all()
        built = 0
        for r in rows:  # one builder per snapshot at a time, across processes
            with self.coordination.try_lock(f"snapshot:{r.id}", 600) as held:
                if not held:
                    continue
                try:
                    if self._get(r.id).status != SnapshotStatus.PENDING:
                        continue
                    # the tree the row names, whatever became of its source since (a draft moves on;
                    # building the draft as it is now under the row's root would be a wrong tree)
                    view = View(trees=self.objects.trees, project_id=r.project_id, kind=r.source_kind,
                                root=Digest(r.root), overlay={}, characters=None, world_settings=None,
                                limits=self.limits)
                    if self._build(r.id, view, None).status == SnapshotStatus.READY:
                        built += 1
                except E.DraftstoreError as exc:  # recorded on the row; the next one is still built
                    self._mark(r.id, SnapshotStatus.FAILED, error=str(exc)[:2000])
        return built

    def _build(self, snapshot_id: str, view: View, progress: Progress | None) -> Snapshot:
        try:
            bundle, files = self._bundle(view, progress)
            key = self.objects.raw.put(bundle)
            faults.point("snapshot.after_upload")
        except E.DraftstoreError as exc:
            self._mark(snapshot_id, SnapshotStatus.FAILED, error=str(exc)[:2000])
            raise
        self._mark(snapshot_id, SnapshotStatus.READY, bundle_key=key, files=files, size_bytes=len(bundle))
        return self._get(snapshot_id)

    def _bundle(self, view: View, progress: Progress | None) -> tuple[bytes, int]:
        """The tar + zstd bundle of the view's files (deterministic: same tree, same bytes)."""
        self.packing.prefetch(view.root)
        files = list(view.iter_files())
        out = io.BytesIO()
        with zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False) as z, \
                tarfile.open(fileobj=z, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for i, chunk in enumerate(_chunks(files)):
                contents = self.objects.pack_aware.get_many([st.digest for _, st in chunk])
                for path, st in chunk:
                    info = tarfile.TarInfo(path)
                    info.size, info.mode, info.mtime = st.size, 0o755 if st.executable else 0o644, 0
                    tar.addfile(info, io.BytesIO(contents[st.digest]))
                if progress:
                    progress(min((i + 1) * _CHUNK, len(files)), len(files))
        return out.getvalue(), len(files)

    # -- materialise ------------------------------------------------------------------------------
    def materialize(self, project_id: str, dest_dir: str | os.PathLike[str], state: str = "draft",
                    replace: bool = False, progress: Progress | None = None,
                    use_snapshot: bool = True) -> Materialized:
        dest = Path(dest_dir)
        view, kind, source_id = self._resolve(project_id, state)
        _prepare(dest, replace)
        try:
            return self._write(view, kind, source_id, dest, progress, use_snapshot)
        except BaseException:
            _clear_after_failure(dest)  # never a partial tree: the caller finds dest empty
            raise

    def _write(self, view: View, kind: str, source_id: str, dest: Path, progress: Progress | None,
               use_snapshot: bool) -> Materialized:
        snap = self._usable(view) if use_snapshot else None
        if snap is not None:
            # the bundle's GET runs beside the walk of the tree every member is checked against
            bundle = self.objects.beside(self.objects.raw.get, Digest(snap.bundle_key))
            # the packs holding the tree's nodes in parallel, not node by node; a tree that
            # cannot be read fails here, and says so: it is not the bundle's fault
            self.packing.prefetch(view.root, kinds={"tree"})
            expected = self.objects.trees.files(view.root)  # a snapshot is only used without an overlay
            try:
                written = self._extract(bundle.result(), expected, dest, progress)
                return Materialized("snapshot", *written, view.root, snap.id, kind, source_id,
                                    view.characters, view.world_settings)
            except (E.BlobNotFound, E.IntegrityError, E.InvalidInput, zstandard.ZstdError) as exc:
                self._mark(snap.id, SnapshotStatus.FAILED, error=f"unusable bundle: {exc}"[:2000])
                _prepare(dest, replace=True)
        written = self._rebuild(view, dest, progress)
        return Materialized("rebuild", *written, view.root, None, kind, source_id, view.characters,
                            view.world_settings)

    def _usable(self, view: View) -> Snapshot | None:
        """A ready snapshot of exactly this tree, if any (a draft's snapshots of other trees were
        marked stale when its tree changed: ``Sealing.apply``)."""
        if view.overlay:
            return None
        with self.db.statement(read_only=True) as conn:
            row = conn.execute(sa.select(SNAPSHOTS).where(SNAPSHOTS.c.project_id == view.project_id,
                                                          SNAPSHOTS.c.root == view.root, SNAPSHOTS.c.status == "ready",
                                                          SNAPSHOTS.c.bundle_key.is_not(None))
                               .order_by(SNAPSHOTS.c.created_at.desc()).limit(1)).first()
        return None if row is None else snapshot_record(row)

    def _extract(self, raw: bytes, expected: dict[str, Any], dest: Path, progress: Progress | None
                 ) -> tuple[int, int]:
        """Write the bundle's files. The bundle is content-addressed (its digest was
        verified as it was read) and was built from this very root; still, every
        member must be a regular file of the tree with its size and its digest (a row
        pointing at the wrong bundle must not give a wrong tree), no file twice, and
        every file of the tree must be in it, or ``IntegrityError`` is raised and the
        bundle is not used (never a wrong tree). Modes come from the tree, never from
        the bundle. ``expected``: the tree's files (path -> stat). Memory stays near one
        decompression window plus the largest file."""
        total = 0
        with DirectoryWriter(dest, expected) as writer:
            for path, data in _tar_members(raw, max((st.size for st in expected.values()), default=0)):
                st = expected.get(path)
                if st is None or data.nbytes != st.size:
                    raise E.IntegrityError(f"bundle member {path[:200]!r} is not a file of the tree")
                if sha256(data).hexdigest() != st.digest:  # a bundle of another tree, or tampered with
                    raise E.IntegrityError(f"bundle member {path[:200]!r} does not hold the tree's bytes")
                writer.write(path, data, st.executable)
                total += st.size
                if progress and writer.count % _CHUNK == 0:
                    progress(writer.count, len(expected))
        if writer.count != len(expected):
            raise E.IntegrityError(f"bundle holds {writer.count} of the tree's {len(expected)} files")
        if progress:
            progress(writer.count, len(expected))
        return writer.count, total

    def _rebuild(self, view: View, dest: Path, progress: Progress | None) -> tuple[int, int]:
        self.packing.prefetch(view.root)
        files = list(view.iter_files())
        total = 0
        with DirectoryWriter(dest, dict(files)) as writer:
            for chunk in _chunks(files):
                contents = self.objects.pack_aware.get_many([st.digest for _, st in chunk])
                for path, st in chunk:
                    writer.write(path, contents[st.digest], st.executable)
                    total += st.size
                if progress and writer.count < len(files):  # the last report comes once all are written
                    progress(writer.count, len(files))
        if progress:
            progress(len(files), len(files))
        return len(files), total


def _name_on_draft(conn: Any, kind: str, source_id: str, root: str, snapshot_id: str) -> None:
    """A ready snapshot of a draft becomes the draft's ``snapshot_id`` while the draft's tree
    is still the one it holds (a build that finishes after the draft moved on names nothing)."""
    if kind == "draft":
        conn.execute(DRAFTS.update().where(DRAFTS.c.id == source_id, DRAFTS.c.code_manifest_key == root)
                     .values(snapshot_id=snapshot_id))


def _project_exists(conn: Any, project_id: str) -> None:
    if conn.execute(sa.select(PROJECTS.c.id).where(PROJECTS.c.id == project_id)).first() is None:
        raise E.ProjectNotFound(f"no project {project_id!r}", project_id=project_id)


def _chunks(items: list[Any]) -> Iterator[list[Any]]:
    for i in range(0, len(items), _CHUNK):
        yield items[i:i + _CHUNK]


def _clear_after_failure(dest: Path) -> None:
    """Empty ``dest`` after a failed materialise; a failure to clear it leaves the first error to tell."""
    try:
        _prepare(dest, replace=True)
    except (OSError, E.DraftstoreError):
        pass


def _prepare(dest: Path, replace: bool) -> None:
    """An empty directory to write into; a non-empty one is cleared only with ``replace``."""
    if dest.exists() and not dest.is_dir():
        raise E.InvalidInput(f"{dest} exists and is not a directory", dest=str(dest))
    dest.mkdir(parents=True, exist_ok=True)
    entries = list(dest.iterdir())
    if entries and not replace:
        raise E.PathConflict(f"{dest} is not empty; nothing was written (replace=True, --replace in the "
                             "CLI, clears it first)", dest=str(dest))
    for entry in entries:  # links are removed, never followed
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


# -- reading a bundle ---------------------------------------------------------------------------
# A bundle is a POSIX tar (as ``_bundle`` writes it with tarfile's PAX format: a ustar
# header per file, preceded by a PAX header when the path is long or not ASCII), zstd
# compressed. ``_tar_members`` reads that format directly: ustar headers, PAX ``path``
# and ``size`` records, GNU long names. Anything else (links, directories, global or
# unknown extended headers, sparse files, base-256 numbers, a member cut short) raises
# ``IntegrityError``: the bundle is then not used and the tree is rebuilt from the blobs.
# Header checksums are not checked: the whole bundle was verified against its digest as
# it was read, and every member is checked against the tree.
_BLOCK = 512
_WINDOW = 1024 * 1024  # decompressed bytes read at a time (more when a member is larger)
_MAX_EXTENDED = 64 * 1024  # a PAX header or GNU long name of ours is a few hundred bytes
_REGULAR = (b"0", b"\0")
_USTAR, _GNU = b"ustar\x0000", b"ustar  \x00"  # magic and version: POSIX, GNU
_ZERO_BLOCK = bytes(_BLOCK)
_PAX_IGNORED = frozenset({"mtime", "atime", "ctime", "uid", "gid", "uname", "gname", "comment"})


class _Decompressed:
    """The decompressed bundle, read forward through one reused buffer (a fresh buffer
    per window would cost a page fault per 4 KiB of the tree)."""

    def __init__(self, raw: bytes) -> None:
        self._reader = zstandard.ZstdDecompressor().stream_reader(raw)
        self._buf = bytearray(_WINDOW)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # the bytes not taken yet: _buf[_start:_end]

    def take(self, n: int) -> memoryview:
        """The next ``n`` bytes (fewer only at the end of the data), valid until the
        next ``take``."""
        if self._end - self._start < n:
            self._fill(n)
        out = self._view[self._start:min(self._start + n, self._end)]
        self._start += out.nbytes
        return out

    def _fill(self, n: int) -> None:
        rest = self._end - self._start
        if n > len(self._buf):  # a member larger than the window: a buffer that holds it
            self._buf = bytearray(n)
            self._buf[:rest] = self._view[self._start:self._end]
            self._view = memoryview(self._buf)
        else:
            self._buf[:rest] = self._buf[self._start:self._end]
        self._start, self._end = 0, rest
        while self._end < n:
            got = self._reader.readinto(self._view[self._end:])
            if not got:
                break
            self._end += got


def _tar_members(raw: bytes, max_size: int) -> Iterator[tuple[str, memoryview]]:
    """(path, bytes) of each member of the zstd-compressed tar ``raw``, in order, up to
    its end-of-archive block (or the end of the data); the bytes are a view that is
    valid until the next member is read. Every member must be a regular
    file of at most ``max_size`` bytes (checked before its bytes are read); see the
    comment above for what else is refused (``IntegrityError``)."""
    data = _Decompressed(raw)
    pax: dict[str, str] | None = None  # the PAX header of the next member, if any
    long_name: str | None = None  # the GNU long name of the next member, if any
    while True:
        header = data.take(_BLOCK)
        if not header.nbytes:
            break  # the data ends without an end-of-archive block, as tar tolerates
        if header.nbytes < _BLOCK:
            raise E.IntegrityError("bundle ends inside a tar header")
        block = header.tobytes()
        if block == _ZERO_BLOCK:
            break  # end of archive
        magic = block[257:265]
        if magic not in (_USTAR, _GNU):
            raise E.IntegrityError("bundle member has no ustar header")
        kind = block[156:157]
        size = _octal(block[124:136])
        if kind == b"x" or kind == b"L":
            if size > _MAX_EXTENDED or (pax if kind == b"x" else long_name) is not None:
                raise E.IntegrityError("bundle has an unusual extended header")
            body = _take_padded(data, size)
            if kind == b"x":
                pax = _pax_records(body.tobytes())
            else:
                long_name = _text(body.tobytes().split(b"\0", 1)[0])
            continue
        if kind not in _REGULAR:
            raise E.IntegrityError(f"bundle member of type {kind!r} is not a regular file")
        pax = pax or {}
        if "path" in pax and long_name is not None:
            raise E.IntegrityError("bundle member has two long names")
        name = pax.get("path") or long_name
        if name is None:
            name = _text(block[:100].split(b"\0", 1)[0])
            prefix = block[345:500].split(b"\0", 1)[0] if magic == _USTAR else b""
            if prefix:
                name = _text(prefix) + "/" + name
        if "size" in pax:
            size = _pax_size(pax["size"])
        pax, long_name = None, None
        if size > max_size:
            raise E.IntegrityError(f"bundle member {name[:200]!r} is larger than any file of the tree")
        yield name, _take_padded(data, size)


def _take_padded(data: _Decompressed, size: int) -> memoryview:
    padded = -(-size // _BLOCK) * _BLOCK
    body = data.take(padded)
    if body.nbytes < padded:
        raise E.IntegrityError("bundle ends inside a member")
    return body[:size]


def _octal(field: bytes) -> int:
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if not digits or digits.strip(b"01234567"):
        raise E.IntegrityError(f"bundle header number {field!r} is not octal")
    return int(digits, 8)


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise E.IntegrityError("bundle member name is not UTF-8") from exc


def _pax_records(raw: bytes) -> dict[str, str]:
    """The records of a PAX extended header, each ``<length> <key>=<value>\\n`` (the
    length counts the whole record); only ``path`` and ``size`` are honoured, keys that
    say nothing about a file's bytes are ignored, any other one is refused."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(raw):
        space = raw.find(b" ", pos, pos + 21)
        if space <= pos or not raw[pos:space].isdigit():
            raise E.IntegrityError("bundle has a malformed PAX header")
        end = pos + int(raw[pos:space])
        key, eq, value = raw[space + 1:end - 1].partition(b"=")
        if end <= space + 1 or end > len(raw) or raw[end - 1] != 0x0A or not eq:
            raise E.IntegrityError("bundle has a malformed PAX header")
        name = _text(key)
        if name in ("path", "size") and value:
            out[name] = _text(value)
        elif name not in _PAX_IGNORED:
            raise E.IntegrityError(f"bundle has a PAX record {name[:50]!r} it cannot honour")
        pos = end
    return out


def _pax_size(value: str) -> int:
    if not (value.isascii() and value.isdigit()):
        raise E.IntegrityError(f"bundle has a PAX size {value[:50]!r}")
    return int(value)
