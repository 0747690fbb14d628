"""Sandbox snapshots and materialise, on both stacks.

``materialize`` writes the exact tree of a state (bytes, executable bits, nothing
outside the destination), from a ready snapshot of that very tree or rebuilt from
the blobs; a snapshot is a cache, never truth: missing, corrupt, stale or tampered
bundles, and deleting every snapshot, all still give the exact tree.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import stat
import struct
import tarfile
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import zstandard

from draftstore import (BlobNotFound, DraftBusy, InvalidInput, PathConflict, ProjectNotFound, Settings, StateNotFound, Store,
                        VersionNotFound)
from draftstore.blobs import DirectoryBlobStore, object_key
from draftstore.db.tables import DRAFTS, SNAPSHOTS
from draftstore.digest import Digest, digest_of


# =====================================================================================
# fixtures and helpers
# =====================================================================================
FILES: dict[str, bytes] = {
    "README.md": b"# game\n",
    "src/main.py": b"print('main')\n",
    "src/pkg/__init__.py": b"",
    "src/pkg/deep/er/module.py": b"X = 1\n" * 50,
    "bin/run.sh": b"#!/bin/sh\necho run\n",
    "bin/tool": b"\x7fELF\x00\x01binary tool",
    "assets/logo.png": b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4,
    "docs/\u00fcber caf\u00e9.txt": "unicode name \u00e4\u00f6\u00fc\n".encode(),
    "data/empty.txt": b"",
    "crlf.txt": b"one\r\ntwo\r\n",
}
EXECUTABLE = ["bin/run.sh", "bin/tool"]


def make_project(store: Store, name: str = "snap") -> Any:
    return store.create_project(name, files=FILES, executable=EXECUTABLE)


def tree_on_disk(dest: Path) -> dict[str, tuple[bytes, int]]:
    """Every regular file below ``dest``: relative path -> (bytes, permission bits); no links allowed."""
    out: dict[str, tuple[bytes, int]] = {}
    for dirpath, dirs, names in os.walk(dest):
        for name in dirs + names:
            assert not os.path.islink(os.path.join(dirpath, name)), f"a link in the materialised tree: {name}"
        for name in names:
            full = Path(dirpath) / name
            rel = full.relative_to(dest).as_posix()
            out[rel] = (full.read_bytes(), stat.S_IMODE(full.lstat().st_mode))
    return out


def expected_tree(files: dict[str, bytes], executable: set[str]) -> dict[str, tuple[bytes, int]]:
    return {p: (data, 0o755 if p in executable else 0o644) for p, data in files.items()}


def state_files(store: Store, project_id: str, view: Any = None) -> dict[str, tuple[bytes, int]]:
    view = view or store.view(project_id)
    return {p: (view.read_file(p), 0o755 if st.executable else 0o644) for p, st in view.iter_files()}


def snapshot(store: Store, project_id: str, snapshot_id: str) -> Any:
    return next(s for s in store.list_snapshots(project_id) if s.id == snapshot_id)


def corrupt_object(store: Store, request: pytest.FixtureRequest, digest: str, data: bytes) -> None:
    """Replace the stored bytes of object ``digest`` behind the store's back."""
    if isinstance(store.blobs, DirectoryBlobStore):
        path = store.blobs.root / object_key(Digest(digest))
        assert path.exists()
        path.write_bytes(data)
        return
    client = request.getfixturevalue("real_s3").client()
    try:
        key = store.blobs.prefix + object_key(Digest(digest))
        client.head_object(Bucket=store.blobs.bucket, Key=key)
        client.put_object(Bucket=store.blobs.bucket, Key=key, Body=data)
    finally:
        client.close()


def tar_of(members: list[tuple[str, bytes, int]], links: list[tuple[str, str]] = (),  # type: ignore[assignment]
           fmt: int = tarfile.PAX_FORMAT, pax: dict[str, dict[str, str]] | None = None,
           end: bool = True) -> bytes:
    """A tar of ``members`` (name, bytes, mode) then ``links`` (name, target), in ``fmt``;
    ``pax`` adds PAX records to named members; without ``end``, no end-of-archive blocks."""
    out = io.BytesIO()
    tar = tarfile.open(fileobj=out, mode="w", format=fmt)
    for name, data, mode in members:
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), mode
        info.pax_headers = dict((pax or {}).get(name, {}))
        tar.addfile(info, io.BytesIO(data))
    for name, target in links:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.SYMTYPE, target
        tar.addfile(info)
    if not end:
        return out.getvalue()
    tar.close()
    return out.getvalue()


def bundle(members: list[tuple[str, bytes, int]], links: list[tuple[str, str]] = (),  # type: ignore[assignment]
           **tar_options: Any) -> bytes:
    """A tar + zstd bundle in the format snapshots use (``tar_options``: see ``tar_of``)."""
    return zstandard.ZstdCompressor(level=3).compress(tar_of(members, links, **tar_options))


def use_bundle(store: Store, snapshot_id: str, raw: bytes) -> None:
    """Point a snapshot's row at the bundle ``raw`` (a bug, a bad restore, an older writer)."""
    key = store.blobs.put(raw)
    with store.engine.begin() as conn:
        conn.execute(SNAPSHOTS.update().where(SNAPSHOTS.c.id == snapshot_id)
                     .values(bundle_key=key, size_bytes=len(raw)))


# =====================================================================================
# materialise: the exact tree, and nothing else
# =====================================================================================
def test_materialize_writes_the_exact_tree_whatever_the_umask(store: Store, tmp_path: Path) -> None:
    p = make_project(store)
    want = expected_tree(FILES, set(EXECUTABLE))
    parent = tmp_path / "sandboxes"
    parent.mkdir()
    (parent / "neighbour.txt").write_bytes(b"keep me\n")
    before = sorted(os.listdir(parent))
    old = os.umask(0o077)
    try:
        out = store.materialize(p.id, parent / "dest", state="head")
        by_version = store.materialize(p.id, parent / "by-version", state=p.current_version_id)
        by_draft = store.materialize(p.id, parent / "by-draft", state="draft")  # no draft: head
    finally:
        os.umask(old)
    assert tree_on_disk(parent / "dest") == want
    assert tree_on_disk(parent / "by-version") == want
    assert tree_on_disk(parent / "by-draft") == want
    assert (by_version.source_kind, by_version.source_id) == ("version", p.current_version_id)
    assert (by_draft.source_kind, by_draft.source_id) == ("version", p.current_version_id)  # no draft: head
    assert sorted(os.listdir(parent)) == sorted(before + ["dest", "by-version", "by-draft"])
    assert (parent / "neighbour.txt").read_bytes() == b"keep me\n"
    assert out.path == "rebuild" and out.snapshot_id is None  # no snapshot exists yet
    assert (out.files, out.bytes) == (len(FILES), sum(map(len, FILES.values())))
    assert out.root == store.get_version(p.current_version_id).root

    # from a snapshot: the same tree, the same modes
    snap = store.create_snapshot(p.id, "head")
    old = os.umask(0o077)
    try:
        fast = store.materialize(p.id, parent / "fast", state="head")
    finally:
        os.umask(old)
    assert fast.path == "snapshot" and fast.snapshot_id == snap.id
    assert (fast.files, fast.bytes) == (out.files, out.bytes)
    assert tree_on_disk(parent / "fast") == want


def default_acl(owner: int, group: int, other: int) -> bytes:
    """The ``system.posix_acl_default`` value granting these permission bits (0-7)."""
    undefined = 0xFFFFFFFF
    entries = [(0x01, owner), (0x04, group), (0x20, other)]  # user::, group::, other::
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, undefined) for tag, perm in entries)


def test_materialize_writes_the_exact_modes_below_a_default_acl(store: Store, tmp_path: Path) -> None:
    """A default ACL on the destination stands in for the umask (here: nothing for group
    and others); the tree's modes still win, from a rebuild and from a snapshot."""
    p = make_project(store)
    parent = tmp_path / "acl"
    parent.mkdir()
    try:
        os.setxattr(parent, "system.posix_acl_default", default_acl(7, 0, 0))
    except (OSError, AttributeError) as exc:
        pytest.skip(f"no POSIX ACLs here: {exc}")
    probe = parent / "probe"
    probe.write_bytes(b"")
    assert stat.S_IMODE(probe.lstat().st_mode) == 0o600  # the ACL, not the umask, decides
    probe.unlink()
    want = expected_tree(FILES, set(EXECUTABLE))
    assert store.materialize(p.id, parent / "rebuilt", state="head").path == "rebuild"
    assert tree_on_disk(parent / "rebuilt") == want
    store.create_snapshot(p.id, "head")
    assert store.materialize(p.id, parent / "fast", state="head").path == "snapshot"
    assert tree_on_disk(parent / "fast") == want


def test_materialize_of_a_running_draft_includes_its_unsealed_writes(store: Store, tmp_path: Path) -> None:
    p = make_project(store)
    store.create_snapshot(p.id, "head")
    t = store.start_turn(p.id, "edit")
    store.write_file(t.id, "bin/new.sh", b"#!/bin/sh\nnew\n", executable=True)
    store.write_file(t.id, "src/main.py", b"print('changed')\n")
    store.apply_changes(t.id, {"bin/run.sh": b"#!/bin/sh\nrewritten, no longer executable\n", "README.md": None,
                               "tools/gen": b"#!/usr/bin/env python3\n"}, executable=["tools/gen"])
    out = store.materialize(p.id, tmp_path / "draft", state="draft")
    assert out.path == "rebuild"  # a running draft has no snapshot of its tree
    want = state_files(store, p.id)
    assert "README.md" not in want and want["bin/new.sh"][1] == 0o755 and want["tools/gen"][1] == 0o755
    assert want["bin/run.sh"][1] == 0o644 and want["src/main.py"][0] == b"print('changed')\n"
    assert tree_on_disk(tmp_path / "draft") == want
    assert (out.files, out.bytes) == (len(want), sum(len(d) for d, _ in want.values()))
    # head is untouched, and still served by its snapshot
    head = store.materialize(p.id, tmp_path / "head", state="head")
    assert head.path == "snapshot" and tree_on_disk(tmp_path / "head") == expected_tree(FILES, set(EXECUTABLE))


def plant(dest: Path, outside: Path, tmp_path: Path) -> None:
    """Fill ``dest`` with stale files and links pointing outside it (one named like a tree directory)."""
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "old" / "dir").mkdir(parents=True)
    (dest / "old" / "dir" / "stale.txt").write_bytes(b"stale\n")
    (dest / "stale.txt").write_bytes(b"stale\n")
    (dest / "src").symlink_to(outside / "src", target_is_directory=True)  # the tree has a directory src/
    (dest / "README.md").symlink_to(outside / "precious.txt")  # the tree has a file README.md
    (dest / "link-to-dir").symlink_to(outside, target_is_directory=True)
    (dest / "dangling").symlink_to(tmp_path / "nowhere")


def test_materialize_refuses_a_non_empty_destination_and_replace_never_follows_links(store: Store,
                                                                                      tmp_path: Path) -> None:
    p = make_project(store)
    tmp_path = tmp_path / "work"  # (the embedded stack keeps its database in tmp_path itself)
    outside = tmp_path / "outside"
    (outside / "src").mkdir(parents=True)
    (outside / "precious.txt").write_bytes(b"precious\n")
    (outside / "src" / "main.py").write_bytes(b"outside main\n")
    dest = tmp_path / "dest"
    plant(dest, outside, tmp_path)
    listing = sorted(os.listdir(dest))

    with pytest.raises(PathConflict) as err:
        store.materialize(p.id, dest, state="head")
    assert err.value.code == "path.conflict"
    assert sorted(os.listdir(dest)) == listing and (dest / "stale.txt").read_bytes() == b"stale\n"

    for attempt in ("rebuild", "snapshot"):
        if attempt == "snapshot":
            store.create_snapshot(p.id, "head")
            plant(dest, outside, tmp_path)
        out = store.materialize(p.id, dest, state="head", replace=True)
        assert out.path == attempt
        assert tree_on_disk(dest) == expected_tree(FILES, set(EXECUTABLE))
        # the link targets outside are intact: removed, never followed
        assert sorted(os.listdir(outside)) == ["precious.txt", "src"]
        assert (outside / "precious.txt").read_bytes() == b"precious\n"
        assert sorted(os.listdir(outside / "src")) == ["main.py"]
        assert (outside / "src" / "main.py").read_bytes() == b"outside main\n"
        assert sorted(os.listdir(tmp_path)) == ["dest", "outside"]

    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"x")
    with pytest.raises(InvalidInput):
        store.materialize(p.id, a_file, state="head")
    assert a_file.read_bytes() == b"x"


def test_materialize_replace_never_writes_through_a_link_planted_mid_run(store: Store, tmp_path: Path,
                                                                        monkeypatch: Any) -> None:
    """Someone plants ``out/src -> elsewhere`` after ``--replace`` cleared ``out`` and before the
    tree is written (as a loop planting it would, at the worst moment): nothing lands in
    ``elsewhere``, the error is typed, and ``out`` is left empty."""
    from draftstore import snapshots

    p = make_project(store)
    work = tmp_path / "work"
    elsewhere, dest = work / "elsewhere", work / "out"
    elsewhere.mkdir(parents=True)
    dest.mkdir()
    (dest / "old.txt").write_bytes(b"old")
    real_prepare, planted = snapshots._prepare, []

    def prepare_then_plant(where: Path, replace: bool) -> None:
        real_prepare(where, replace)
        if not planted:
            planted.append(True)
            os.symlink(elsewhere, where / "src")

    monkeypatch.setattr(snapshots, "_prepare", prepare_then_plant)
    for attempt in ("rebuild", "snapshot"):
        if attempt == "snapshot":
            store.create_snapshot(p.id, "head")
            planted.clear()
        with pytest.raises(PathConflict) as err:
            store.materialize(p.id, dest, state="head", replace=True)
        assert err.value.details["path"].startswith("src")
        assert list(elsewhere.iterdir()) == []
        assert os.listdir(dest) == []  # a failed materialise leaves the target empty
    assert store.materialize(p.id, dest, state="head", replace=True).path == "snapshot"  # no link: it works
    assert tree_on_disk(dest) == expected_tree(FILES, set(EXECUTABLE))


def test_materialize_errors_name_what_is_missing(store: Store, tmp_path: Path) -> None:
    empty = store.create_project("empty")
    with pytest.raises(StateNotFound):
        store.materialize(empty.id, tmp_path / "e", state="draft")
    p = make_project(store)
    with pytest.raises(VersionNotFound):
        store.materialize(p.id, tmp_path / "v", state=empty.id)  # an id, but no version of p
    with pytest.raises(ProjectNotFound):
        store.materialize("0" * 32, tmp_path / "p", state="head")
    other = make_project(store, "other")
    with pytest.raises(VersionNotFound):
        store.materialize(p.id, tmp_path / "o", state=other.current_version_id)
    assert not (tmp_path / "v").exists() or not os.listdir(tmp_path / "v")


def test_a_rebuild_that_fails_leaves_the_destination_empty(store: Store, store_factory: Any,
                                                           tmp_path: Path) -> None:
    """An object missing from the blob store fails the rebuild midway: what it wrote goes, so
    no caller ever finds a partial tree (and the error names the object)."""
    big = os.urandom(2 * 1024 * 1024)  # stored on its own, not in a pack
    files = {f"f/{i:04d}.txt": b"%d\n" % i for i in range(600)} | {"zz/big.bin": big}
    p = store.create_project("half", files=files)
    store.blobs.delete(digest_of(big))
    dest = tmp_path / "dest"
    with pytest.raises(BlobNotFound) as info:
        store_factory().materialize(p.id, dest, state="head")
    assert info.value.details["digest"] == digest_of(big)
    assert dest.is_dir() and os.listdir(dest) == []


def test_a_disk_failure_while_writing_from_a_snapshot_leaves_the_destination_empty(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot path too: a write that fails on the local disk (full, say) midway leaves no
    partial tree behind, and the error is the disk's (the snapshot is not blamed)."""
    from draftstore import dirwriter

    files = {f"f/{i:04d}.txt": b"%d\n" % i for i in range(600)}
    p = store.create_project("disk", files=files)
    snap = store.create_snapshot(p.id)
    write = dirwriter.DirectoryWriter.write
    calls = {"n": 0}

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 300:
            raise OSError(28, "No space left on device")
        return write(self, *args, **kwargs)

    monkeypatch.setattr(dirwriter.DirectoryWriter, "write", failing)
    dest = tmp_path / "dest"
    with pytest.raises(OSError):
        store.materialize(p.id, dest, state="head")
    assert dest.is_dir() and os.listdir(dest) == []
    assert snapshot(store, p.id, snap.id).status == "ready"


def test_materialize_reports_progress(store: Store, tmp_path: Path) -> None:
    files = {f"f/{i:04d}.txt": b"%d\n" % i for i in range(600)}
    p = store.create_project("progress", files=files)
    seen: list[tuple[int, int]] = []
    store.materialize(p.id, tmp_path / "a", state="head", progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1] == (600, 600) and all(t == 600 for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    store.create_snapshot(p.id)
    seen.clear()
    out = store.materialize(p.id, tmp_path / "b", state="head", progress=lambda d, t: seen.append((d, t)))
    assert out.path == "snapshot" and seen[-1] == (600, 600)


# =====================================================================================
# snapshots: rows and bundles
# =====================================================================================
def test_create_snapshot_of_head_a_version_and_a_draft(store: Store) -> None:
    p = make_project(store)
    v1 = store.get_version(p.current_version_id)
    snap = store.create_snapshot(p.id, "head")
    assert (snap.project_id, snap.source_kind, snap.source_id, snap.root) == (p.id, "version", v1.id, v1.root)
    assert snap.status == "ready" and snap.external_ref is None and snap.error is None
    assert snap.files == len(FILES)
    assert snap.finished_at is not None and snap.created_at <= snap.finished_at
    raw = store.blobs.get(Digest(snap.bundle_key))
    assert snap.size_bytes == len(raw) and digest_of(raw) == snap.bundle_key
    with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)) as z, tarfile.open(fileobj=z, mode="r|") as tar:
        members = {m.name: (tar.extractfile(m).read(), m.mode & 0o777) for m in tar if m.isreg()}  # type: ignore[union-attr]
    assert members == expected_tree(FILES, set(EXECUTABLE))
    # the same tree gives the same bundle (deterministic)
    again = store.create_snapshot(p.id, v1.id)
    assert again.bundle_key == snap.bundle_key and again.id != snap.id and again.source_id == v1.id

    # a draft: only once its writes are sealed
    t = store.start_turn(p.id, "edit")
    store.write_file(t.id, "src/new.py", b"NEW = 1\n")
    with pytest.raises(DraftBusy) as err:
        store.create_snapshot(p.id, "draft")
    assert err.value.code == "draft.busy"
    store.complete_turn(t.id, "done")
    draft = store.get_draft(p.id)
    ds = store.create_snapshot(p.id, "draft")
    assert (ds.source_kind, ds.source_id, ds.root, ds.status) == ("draft", draft.id, draft.root, "ready")
    assert ds.files == len(FILES) + 1
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(DRAFTS.c.snapshot_id).where(DRAFTS.c.id == draft.id)).scalar() == ds.id
    # head still means the version, not the draft
    assert store.create_snapshot(p.id, "head").root == v1.root

    listed = store.list_snapshots(p.id)
    assert [s.id for s in listed][:3] == [snap.id, again.id, ds.id] and len(listed) == 4
    assert all(s.project_id == p.id for s in listed)
    with pytest.raises(ProjectNotFound):
        store.list_snapshots("f" * 32)


def test_record_snapshot_keeps_an_external_ref_and_materialize_does_not_use_it(store: Store, tmp_path: Path) -> None:
    p = make_project(store)
    ext = store.record_snapshot(p.id, "head", "sbx-provider/snap-42")
    assert (ext.status, ext.external_ref, ext.bundle_key, ext.source_kind) == ("ready", "sbx-provider/snap-42", None,
                                                                              "version")
    assert ext.root == store.get_version(p.current_version_id).root
    assert [s.id for s in store.list_snapshots(p.id)] == [ext.id]
    out = store.materialize(p.id, tmp_path / "m", state="head")
    assert out.path == "rebuild" and tree_on_disk(tmp_path / "m") == expected_tree(FILES, set(EXECUTABLE))
    t = store.start_turn(p.id, "edit")
    store.write_file(t.id, "x.py", b"x\n")
    with pytest.raises(DraftBusy):
        store.record_snapshot(p.id, "draft", "sbx/draft")
    store.complete_turn(t.id, "ok")
    d = store.record_snapshot(p.id, "draft", "sbx/draft")
    assert d.source_kind == "draft" and d.source_id == store.get_draft(p.id).id
    with pytest.raises(InvalidInput):
        store.record_snapshot(p.id, "head", "bad\x00ref")


# =====================================================================================
# a snapshot is a cache: missing, corrupt, stale and tampered bundles fall back
# =====================================================================================
def rebuilt_by_a_fresh_store(store: Store, store_factory: Any, project_id: str, snapshot_id: str,
                             dest: Path) -> Any:
    """Materialise head with a fresh store (nothing cached): it must be rebuilt from the blobs,
    exactly; returns the snapshot's row as that store sees it afterwards."""
    store.cache.clear()
    fresh = store_factory()
    out = fresh.materialize(project_id, dest, state="head")
    assert out.path == "rebuild"
    assert tree_on_disk(dest) == expected_tree(FILES, set(EXECUTABLE))
    return snapshot(fresh, project_id, snapshot_id)


def test_a_missing_bundle_falls_back_to_a_rebuild_and_marks_the_snapshot_failed(store: Store, store_factory: Any,
                                                                                tmp_path: Path) -> None:
    p = make_project(store)
    snap = store.create_snapshot(p.id, "head")
    store.blobs.delete(Digest(snap.bundle_key))
    failed = rebuilt_by_a_fresh_store(store, store_factory, p.id, snap.id, tmp_path / "m")
    assert failed.status == "failed" and failed.error
    # a failed snapshot is never tried again
    again = store_factory().materialize(p.id, tmp_path / "again", state="head")
    assert again.path == "rebuild" and tree_on_disk(tmp_path / "again") == expected_tree(FILES, set(EXECUTABLE))


def test_a_corrupt_bundle_falls_back_to_a_rebuild_and_marks_the_snapshot_failed(store: Store, store_factory: Any,
                                                                                request: pytest.FixtureRequest,
                                                                                tmp_path: Path) -> None:
    p = make_project(store)
    snap = store.create_snapshot(p.id, "head")
    corrupt_object(store, request, snap.bundle_key, b"not a bundle at all" * 100)
    assert rebuilt_by_a_fresh_store(store, store_factory, p.id, snap.id, tmp_path / "m").status == "failed"


def test_a_bundle_whose_bytes_differ_from_its_digest_is_not_used_even_if_its_files_are_right(
        store: Store, store_factory: Any, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The object under the bundle's key is replaced by another bundle of the very same
    files (other tar headers): only the digest check on the read can tell."""
    p = make_project(store)
    snap = store.create_snapshot(p.id, "head")
    good = [(path, data, 0o755 if path in EXECUTABLE else 0o644) for path, data in sorted(FILES.items())]
    other = bundle(good, pax={"README.md": {"comment": "same files, other bytes"}})
    assert digest_of(other) != snap.bundle_key
    corrupt_object(store, request, snap.bundle_key, other)
    failed = rebuilt_by_a_fresh_store(store, store_factory, p.id, snap.id, tmp_path / "m")
    assert failed.status == "failed" and "checksum" in failed.error


def test_a_stale_draft_snapshot_falls_back_to_a_rebuild_and_is_marked_stale(store: Store, tmp_path: Path) -> None:
    p = make_project(store)
    t = store.start_turn(p.id, "first")
    store.write_file(t.id, "a.py", b"A = 1\n")
    store.complete_turn(t.id, "ok")
    snap = store.create_snapshot(p.id, "draft")
    first = store.materialize(p.id, tmp_path / "first", state="draft")
    assert first.path == "snapshot" and first.snapshot_id == snap.id

    t = store.continue_turn(p.id, "second")
    store.write_file(t.id, "a.py", b"A = 2\n")
    store.delete_file(t.id, "README.md")
    store.complete_turn(t.id, "ok")
    out = store.materialize(p.id, tmp_path / "second", state="draft")
    assert out.path == "rebuild"
    assert tree_on_disk(tmp_path / "second") == state_files(store, p.id)
    assert tree_on_disk(tmp_path / "second")["a.py"][0] == b"A = 2\n"
    assert "README.md" not in tree_on_disk(tmp_path / "second")
    assert snapshot(store, p.id, snap.id).status == "stale"
    # head was never the draft: its materialise is untouched
    head = store.materialize(p.id, tmp_path / "head", state="head")
    assert tree_on_disk(tmp_path / "head") == expected_tree(FILES, set(EXECUTABLE)) and head.path == "rebuild"


def test_every_snapshot_of_a_draft_goes_stale_once_the_draft_moves_on(store: Store, tmp_path: Path) -> None:
    """Stale as soon as the draft's tree changes, every earlier snapshot of it, without a
    materialise first; a snapshot of a tree the draft holds again is not."""
    p = make_project(store)
    t = store.start_turn(p.id, "first")
    store.write_file(t.id, "a.py", b"A = 1\n")
    store.complete_turn(t.id, "ok")
    a = store.create_snapshot(p.id, "draft")
    t = store.continue_turn(p.id, "second")
    store.write_file(t.id, "a.py", b"A = 2\n")
    store.complete_turn(t.id, "ok")
    assert snapshot(store, p.id, a.id).status == "stale"
    b = store.create_snapshot(p.id, "draft")
    t = store.continue_turn(p.id, "no change")
    store.complete_turn(t.id, "ok")
    assert snapshot(store, p.id, b.id).status == "ready"  # the same tree: still its snapshot
    t = store.continue_turn(p.id, "back to the first")
    store.write_file(t.id, "a.py", b"A = 1\n")
    store.complete_turn(t.id, "ok")
    assert {s.id: s.status for s in store.list_snapshots(p.id)} == {a.id: "stale", b.id: "stale"}
    head = store.create_snapshot(p.id, "head")
    t = store.continue_turn(p.id, "third")
    store.write_file(t.id, "a.py", b"A = 3\n")
    store.complete_turn(t.id, "ok")
    assert snapshot(store, p.id, head.id).status == "ready"  # a version never moves on
    out = store.materialize(p.id, tmp_path / "draft", state="draft")
    assert out.path == "rebuild" and tree_on_disk(tmp_path / "draft")["a.py"][0] == b"A = 3\n"


@pytest.mark.parametrize("tamper", ["duplicate-instead-of-missing", "wrong-content", "same-size-wrong-content",
                                    "extra-member", "symlink",
                                    "empty-file-as-link", "escaping-path", "fewer-files", "mode-flipped", "truncated-member",
                                    "truncated-header", "directory-member", "hardlink", "unknown-pax-record",
                                    "global-pax-header", "not-zstd-framed-tar"])
def test_a_bundle_that_does_not_match_its_tree_is_never_used(store: Store, tmp_path: Path, tamper: str) -> None:
    """Rows can point at the wrong bundle (a bug, a bad restore): materialise checks every member."""
    p = make_project(store)
    snap = store.create_snapshot(p.id, "head")
    good = [(path, data, 0o755 if path in EXECUTABLE else 0o644) for path, data in sorted(FILES.items())]
    links: list[tuple[str, str]] = []
    raw: bytes | None = None
    if tamper == "duplicate-instead-of-missing":
        members = [m for m in good if m[0] != "src/main.py"] + [good[0]]
    elif tamper == "wrong-content":
        members = [(n, d + b"#" if n == "src/main.py" else d, m) for n, d, m in good]
    elif tamper == "same-size-wrong-content":  # names and sizes right: only the bytes tell
        members = [(n, d.replace(b"main", b"evil") if n == "src/main.py" else d, m) for n, d, m in good]
        assert members != good
    elif tamper == "extra-member":
        members = good + [("src/extra.py", b"EXTRA\n", 0o644)]
    elif tamper == "symlink":
        members = [m for m in good if m[0] != "README.md"]
        links = [("README.md", "/etc/passwd")]
    elif tamper == "empty-file-as-link":  # a link has no bytes, as the empty file: still not a file
        members = [m for m in good if m[0] != "data/empty.txt"]
        links = [("data/empty.txt", "/etc/passwd")]
    elif tamper == "escaping-path":
        members = good + [("../escaped.txt", b"out\n", 0o644)]
    elif tamper == "fewer-files":
        members = good[:-1]
    elif tamper == "truncated-member":  # the last member's bytes are cut short, no end-of-archive blocks
        last = good[-1]
        assert len(last[1]) > 100
        raw = zstandard.ZstdCompressor().compress(tar_of(good, end=False)[:-(512 - len(last[1]) % 512) - 100])
    elif tamper == "truncated-header":  # every file, then half a header
        raw = zstandard.ZstdCompressor().compress(tar_of(good, end=False) + tar_of([good[0]], end=False)[:256])
    elif tamper == "directory-member":
        info = tarfile.TarInfo("src")
        info.type = tarfile.DIRTYPE
        body = io.BytesIO()
        with tarfile.open(fileobj=body, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(info)
        raw = zstandard.ZstdCompressor().compress(body.getvalue()[:512] + tar_of(good))
    elif tamper == "hardlink":  # README.md as a hard link to another member
        body = io.BytesIO()
        with tarfile.open(fileobj=body, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, data, mode in good:
                info = tarfile.TarInfo(name)
                if name == "README.md":
                    info.type, info.linkname = tarfile.LNKTYPE, "crlf.txt"
                    tar.addfile(info)
                else:
                    info.size, info.mode = len(data), mode
                    tar.addfile(info, io.BytesIO(data))
        raw = zstandard.ZstdCompressor().compress(body.getvalue())
    elif tamper == "unknown-pax-record":  # a record that could change what a file is: not honoured, not used
        members = good
        raw = bundle(good, pax={"src/main.py": {"GNU.sparse.map": "0,1"}})
    elif tamper == "global-pax-header":
        body = io.BytesIO()
        with tarfile.open(fileobj=body, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"path": "x"}) as tar:
            pass
        raw = zstandard.ZstdCompressor().compress(body.getvalue()[:1024] + tar_of(good))
    elif tamper == "not-zstd-framed-tar":  # a plain tar, not compressed
        raw = tar_of(good)
    else:  # the bytes are right but an executable is not marked so (the tree says what a mode is)
        members = [(n, d, 0o644) for n, d, _ in good]
    use_bundle(store, snap.id, raw if raw is not None else bundle(members, links))
    out = store.materialize(p.id, tmp_path / "dest", state="head")
    assert tree_on_disk(tmp_path / "dest") == expected_tree(FILES, set(EXECUTABLE)), out
    assert not (tmp_path / "escaped.txt").exists()
    if tamper != "mode-flipped":
        assert out.path == "rebuild" and snapshot(store, p.id, snap.id).status == "failed"
    else:
        assert out.path == "snapshot"


LONG_PATH = "/".join(f"nested-directory-{i:02d}" for i in range(6)) + "/a-file-with-a-rather-long-name.txt"


@pytest.mark.parametrize("dialect", ["ours", "pax-size-record", "gnu-long-names", "ustar-prefix"])
def test_a_bundle_with_long_and_non_ascii_paths_is_read_exactly(store: Store, tmp_path: Path, dialect: str) -> None:
    """Paths over 100 bytes and non-ASCII names, as tarfile's PAX format writes them (our
    bundles), with a PAX size record, as GNU tar's long names, and split into a ustar
    prefix: the snapshot gives the exact tree, never a cut or misread path."""
    files = {**FILES, LONG_PATH: b"long\n" * 40, "\u00e9t\u00e9/" + "x" * 120 + ".txt": b"accented and long\n"}
    p = store.create_project("long", files=files, executable=EXECUTABLE)
    assert len(LONG_PATH) > 100 and len(LONG_PATH.rpartition("/")[0]) <= 155
    snap = store.create_snapshot(p.id, "head")
    members = [(path, data, 0o755 if path in EXECUTABLE else 0o644) for path, data in sorted(files.items())]
    if dialect == "pax-size-record":  # the ustar size field says 0, the PAX record holds the size
        tar = bytearray(tar_of(members, pax={LONG_PATH: {"size": str(len(files[LONG_PATH]))}}))
        with tarfile.open(fileobj=io.BytesIO(bytes(tar)), mode="r:") as reading:
            header = reading.getmember(LONG_PATH).offset_data - 512
        tar[header + 124:header + 136] = b"00000000000\0"
        tar[header + 148:header + 156] = b" " * 8
        tar[header + 148:header + 156] = b"%06o\0 " % sum(tar[header:header + 512])
        with tarfile.open(fileobj=io.BytesIO(bytes(tar)), mode="r:") as reading:  # still a valid tar
            assert reading.getmember(LONG_PATH).size == len(files[LONG_PATH])
        use_bundle(store, snap.id, zstandard.ZstdCompressor().compress(bytes(tar)))
    elif dialect == "gnu-long-names":
        use_bundle(store, snap.id, bundle(members, fmt=tarfile.GNU_FORMAT))
    elif dialect == "ustar-prefix":  # ustar cannot hold the 120-character name: the tree has it only here
        members = [m for m in members if not m[0].startswith("\u00e9t\u00e9/")]
        files = {k: v for k, v in files.items() if not k.startswith("\u00e9t\u00e9/")}
        p = store.create_project("ustar", files=files, executable=EXECUTABLE)
        snap = store.create_snapshot(p.id, "head")
        use_bundle(store, snap.id, bundle(members, fmt=tarfile.USTAR_FORMAT))
    out = store.materialize(p.id, tmp_path / "dest", state="head")
    assert out.path == "snapshot" and out.snapshot_id == snap.id
    assert tree_on_disk(tmp_path / "dest") == expected_tree(files, set(EXECUTABLE))
    assert (out.files, out.bytes) == (len(files), sum(map(len, files.values())))


def test_a_bundle_larger_than_the_read_window_is_read_exactly(store: Store, tmp_path: Path) -> None:
    """A bundle is decompressed a window at a time: files cut by a window's end, and a
    file larger than a window, come out whole."""
    rng = random.Random(7)
    files = {f"many/{i:03d}.bin": rng.randbytes(rng.randrange(1, 9000)) for i in range(400)}
    files["big/one.bin"] = rng.randbytes(2 * 1024 * 1024 + 12345)
    files["big/two.bin"] = rng.randbytes(1024 * 1024 + 1)
    p = store.create_project("large", files=files, executable=["many/007.bin"])
    assert sum(map(len, files.values())) > 4 * 1024 * 1024
    snap = store.create_snapshot(p.id, "head")
    out = store.materialize(p.id, tmp_path / "dest", state="head")
    assert out.path == "snapshot" and out.snapshot_id == snap.id
    assert tree_on_disk(tmp_path / "dest") == expected_tree(files, {"many/007.bin"})


def test_snapshots_are_never_truth(store: Store, store_factory: Any, tmp_path: Path) -> None:
    p = make_project(store)
    v1 = p.current_version_id
    store.create_snapshot(p.id, "head")
    t = store.start_turn(p.id, "edit")
    store.write_file(t.id, "src/main.py", b"print('v2')\n")
    store.complete_turn(t.id, "ok")
    store.create_snapshot(p.id, "draft")
    v2 = store.publish(p.id, "v2").id
    store.create_snapshot(p.id, "head")
    t = store.start_turn(p.id, "edit again")
    store.write_file(t.id, "bin/more.sh", b"#!/bin/sh\n", executable=True)
    store.complete_turn(t.id, "ok")
    store.create_snapshot(p.id, "draft")
    snaps = store.list_snapshots(p.id)
    assert len(snaps) == 4 and all(s.status == "ready" for s in snaps)
    want = {state: state_files(store, p.id, view) for state, view in (
        (v1, store.view_at(p.id, v1)), (v2, store.view_at(p.id, v2)), ("head", store.view_at(p.id, v2)),
        ("draft", store.view(p.id)))}
    assert want["draft"]["bin/more.sh"][1] == 0o755 and want[v1] != want[v2]

    for s in snaps:
        store.blobs.delete(Digest(s.bundle_key))
    with store.engine.begin() as conn:
        conn.execute(SNAPSHOTS.delete().where(SNAPSHOTS.c.project_id == p.id))
    store.cache.clear()
    fresh = store_factory()
    assert fresh.list_snapshots(p.id) == []
    for i, (state, tree) in enumerate(want.items()):
        out = fresh.materialize(p.id, tmp_path / f"m{i}", state=state)
        assert out.path == "rebuild" and tree_on_disk(tmp_path / f"m{i}") == tree, state
    # and a new snapshot can be taken again
    again = fresh.create_snapshot(p.id, "draft")
    assert again.status == "ready"
    assert fresh.materialize(p.id, tmp_path / "again", state="draft").path == "snapshot"
    assert tree_on_disk(tmp_path / "again") == want["draft"]


# =====================================================================================
# publish schedules a snapshot; the background builds it
# =====================================================================================
def test_publish_schedules_a_snapshot_built_in_the_background(store_factory: Any, tmp_path: Path) -> None:
    store = store_factory(settings=Settings(snapshot_on_publish=True))
    p = make_project(store)
    assert store.list_snapshots(p.id) == []  # import does not snapshot
    t = store.start_turn(p.id, "edit")
    store.write_file(t.id, "src/feature.py", b"FEATURE = 1\n")
    store.complete_turn(t.id, "ok")
    objects_before = set(store.blobs.iter_digests())
    v2 = store.publish(p.id, "feature")
    [pending] = store.list_snapshots(p.id)
    assert (pending.status, pending.source_kind, pending.source_id, pending.root) == ("pending", "version", v2.id,
                                                                                      v2.root)
    assert pending.bundle_key is None and pending.finished_at is None
    # publish built nothing: no bundle was written on its path
    assert not any(d not in objects_before and store.blobs.get(d)[:4] == b"\x28\xb5\x2f\xfd"
                   for d in set(store.blobs.iter_digests()))

    # another process runs the background work
    worker = store_factory()
    done = worker.run_background()
    assert done["snapshots_built"] == 1
    built = snapshot(worker, p.id, pending.id)
    assert built.status == "ready" and built.files == len(FILES) + 1 and built.bundle_key
    assert worker.run_background()["snapshots_built"] == 0
    out = worker.materialize(p.id, tmp_path / "m", state="head")
    assert out.path == "snapshot" and out.snapshot_id == pending.id
    assert tree_on_disk(tmp_path / "m") == state_files(worker, p.id)


def test_publish_never_fails_because_of_a_snapshot(store_factory: Any, tmp_path: Path) -> None:
    store = store_factory(settings=Settings(snapshot_on_publish=True))
    p = make_project(store)
    t = store.start_turn(p.id, "edit")
    store.write_file(t.id, "src/lost.py", b"this blob is lost before the snapshot is built\n")
    store.complete_turn(t.id, "ok")
    v2 = store.publish(p.id, "v2")
    assert store.get_project(p.id).current_version_id == v2.id
    # the snapshot cannot be built (an object it needs is gone): it fails, on its own row
    store.blobs.delete(digest_of(b"this blob is lost before the snapshot is built\n"))
    store.cache.clear()
    worker = store_factory()
    worker.run_background()  # the packing of v2 needs the same blob: it fails too, on its own (test_packs.py)
    [snap] = worker.list_snapshots(p.id)
    assert snap.status == "failed" and "blob.not_found" in snap.error, snap
    # head is published and unaffected; a later publish with snapshots works
    t = worker.start_turn(p.id, "next")
    worker.write_file(t.id, "src/lost.py", b"restored\n")
    worker.complete_turn(t.id, "ok")
    v3 = worker.publish(p.id, "v3")
    assert worker.get_project(p.id).current_version_id == v3.id
