"""Packs, on both stacks: a project's objects are stored a subtree at a time, not one per file.

- an import writes packs (a few objects, rows in ``pack`` / ``pack_object``), and every
  file reads back byte-exact, verified, through a cold store, by path and by digest;
- a corrupted pack is ``blob.checksum_mismatch``, never wrong bytes;
- a cold reader that searches or materialises the whole project makes a few GETs;
- publish + ``run_background`` packs the new version, writing packs for the changed
  subtrees only.

Pack rows are global to a database (keyed by tree and object digests) and the
background queue spans every project of it: the fixtures give every real-stack test its
own database, as its own S3 prefix.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import sqlalchemy as sa

from draftstore import ChecksumMismatch, Settings, Store
from draftstore import packing as packing_module
from draftstore.blobs import DirectoryBlobStore, ObjectCache, object_key
from draftstore.coord import MemoryCoordinator
from draftstore.db.engine import create_db_engine
from draftstore.db.tables import PACKS, PACK_OBJECTS, VERSIONS
from draftstore.digest import Digest, digest_of
from draftstore.errors import IntegrityError
from draftstore.packs import Pack, encode_pack, frame_locations
from draftstore.search import Planner

BIG = 1024 * 1024 + 4321  # over MAX_PACKED_FILE: stored on its own


# =====================================================================================
# fixtures: stores that count their object reads
# =====================================================================================
@pytest.fixture
def store_factory(store_factory: Callable[..., Store], stack: dict[str, str]) -> Iterator[Callable[..., Store]]:
    """The shared factory, plus the stack's URLs and a list of stores built by hand (closed after the test)."""
    opened: list[Store] = []
    store_factory.stack = stack  # type: ignore[attr-defined]
    store_factory.opened = opened  # type: ignore[attr-defined]
    yield store_factory
    for s in reversed(opened):
        s.close()


class CountingBlobStore(DirectoryBlobStore):
    """The directory backend, counting reads that reach the disk."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads = 0
        self._lock = threading.Lock()

    def _get_raw(self, key: str) -> bytes | None:
        with self._lock:
            self.reads += 1
        return super()._get_raw(key)

    def _has_raw(self, key: str) -> bool:
        with self._lock:
            self.reads += 1
        return super()._has_raw(key)


def cold_counting_store(store_factory: Any) -> tuple[Store, Callable[[], int]]:
    """A fresh store on the same data (empty caches) and a function giving how many
    object reads (GET or HEAD) it has sent to the backend so far."""
    stack = store_factory.stack
    if stack["blob_url"].startswith("file://"):
        settings = Settings()
        cache = ObjectCache(settings.cache_bytes)
        blobs = CountingBlobStore(stack["blob_url"][len("file://"):], cache=cache)
        s = Store(create_db_engine(stack["database_url"]), blobs, MemoryCoordinator(), settings=settings, cache=cache)
        store_factory.opened.append(s)
        return s, lambda: blobs.reads
    s = store_factory()
    calls = s.blobs.calls
    start = calls["get"] + calls["get_range"] + calls["head"]  # opening the store sends one GET
    return s, lambda: calls["get"] + calls["get_range"] + calls["head"] - start


def overwrite_object(store: Store, request: pytest.FixtureRequest, digest: str, data: bytes) -> None:
    """Replace the stored bytes of object ``digest`` behind the store's back."""
    if isinstance(store.blobs, DirectoryBlobStore):
        path = store.blobs.root / object_key(Digest(digest))
        assert path.exists()
        path.write_bytes(data)
        return
    s3 = request.getfixturevalue("real_s3")
    client = s3.client()
    try:
        key = store.blobs.prefix + object_key(Digest(digest))
        client.head_object(Bucket=store.blobs.bucket, Key=key)  # it is there
        client.put_object(Bucket=store.blobs.bucket, Key=key, Body=data)
    finally:
        client.close()


# =====================================================================================
# helpers
# =====================================================================================
def project_files(n: int, seed: int = 0, root_files: int = 0, dir_files: int = 0) -> dict[str, bytes]:
    """``n`` small files in nested directories (100 per src/mNN, 10 per src/mNN/sN),
    ``root_files`` directly at the top, ``dir_files`` directly in src/, one file over
    MAX_PACKED_FILE and an executable script."""
    files = {f"src/m{i // 100:03d}/s{(i // 10) % 10}/f{i}.py": f"VALUE_{i} = {i * 7919 % 10007}  # seed {seed}\n"
             f"def fn_{i}():\n    return 'tag{i % 37}'\n".encode() for i in range(n)}
    for i in range(root_files):
        files[f"top{i}.txt"] = f"top file {i} seed {seed}\n".encode()
    for i in range(dir_files):
        files[f"src/direct{i}.txt"] = f"direct file {i} seed {seed}\n".encode()
    files["assets/big.bin"] = random.Random(seed).randbytes(BIG)
    files["bin/run.sh"] = f"#!/bin/sh\necho seed {seed}\n".encode()
    return files


def packs_in_store(store: Store) -> list[Any]:
    """Rows of the packs whose objects are in this store's blob backend."""
    digests = [str(d) for d in store.blobs.iter_digests()]
    rows: list[Any] = []
    with store.engine.connect() as conn:
        for i in range(0, len(digests), 500):
            rows += conn.execute(sa.select(PACKS).where(PACKS.c.digest.in_(digests[i:i + 500]))).all()
    return rows


def pack_objects(store: Store, packs: list[str]) -> list[Any]:
    rows: list[Any] = []
    with store.engine.connect() as conn:
        for i in range(0, len(packs), 500):
            rows += conn.execute(sa.select(PACK_OBJECTS).where(PACK_OBJECTS.c.pack.in_(packs[i:i + 500]))).all()
    return rows


# =====================================================================================
# import
# =====================================================================================
def test_import_writes_packs_not_one_object_per_file(store: Store, store_factory: Any) -> None:
    files = project_files(2_500)
    p = store.create_project("packed", files=files, executable=["bin/run.sh"])
    objects = set(store.blobs.iter_digests())
    assert len(objects) < len(files) // 20, f"{len(objects)} objects for {len(files)} files"

    rows = packs_in_store(store)
    assert rows and {r.kind for r in rows} <= {"tree", "files", "spine"}
    assert all(r.objects > 0 and r.bytes > 0 for r in rows)
    placed = pack_objects(store, [r.digest for r in rows])
    packed_digests = {r.digest for r in placed}
    small = {digest_of(data) for path, data in files.items() if len(data) <= packing_module.MAX_PACKED_FILE}
    assert small <= packed_digests  # every small file is in a pack
    big = digest_of(files["assets/big.bin"])
    assert big not in packed_digests and big in objects  # the large one is stored on its own
    # every tree, files and spine pack is an object of the store; tree/files packs carry an index
    assert {Digest(r.digest) for r in rows} <= objects
    assert all(r.search_index and Digest(r.search_index) in objects for r in rows if r.kind != "spine")
    # offsets are exact: each object sits where its row says, in a pack that decodes
    decoded = {r.digest: Pack.decode(r.digest, store.blobs.get(Digest(r.digest))) for r in rows}
    for r in placed:
        pack = decoded[r.pack]
        assert pack.objects[r.digest] == (r.offset, r.length)
        assert digest_of(pack.take(r.digest)) == r.digest
    assert sum(len(p.objects) for p in decoded.values()) == len(placed)

    # a fresh store (cold caches): every file byte-exact, modes kept
    cold = store_factory()
    view = cold.view(p.id)
    assert view.file_count() == len(files)
    assert view.list_files() and set(view.list_files()) == set(files)
    for path, data in files.items():
        assert view.read_file(path) == data, path
    assert view.stat("bin/run.sh").executable and not view.stat("src/m000/s0/f0.py").executable
    assert view.stat("assets/big.bin").size == BIG


def test_an_import_whose_unit_fails_stops_every_unit_and_commits_no_row_after_it(store: Store) -> None:
    """Units are stored two at a time: the first failure ends the write; no unit starts or
    runs after it, and no pack row is committed for the failed unit or any later one."""
    files = project_files(4_100, seed=3)  # over MAX_PACK_FILES: one unit per src/mNNN
    real = store._packing._store_unit  # noqa: SLF001 - the unit of work under test
    order: list[str] = []
    running = [0]
    lock = threading.Lock()

    def store_unit(unit: Any, *args: Any) -> Any:
        with lock:
            order.append(unit.tree)
            running[0] += 1
            nth = len(order)
        try:
            if nth == 3:
                raise RuntimeError("the third unit fails")
            return real(unit, *args)
        finally:
            with lock:
                running[0] -= 1

    with mock.patch.object(store._packing, "_store_unit", store_unit), \
            pytest.raises(RuntimeError, match="third unit"):
        store.create_project("fails", files=files)
    assert running[0] == 0  # nothing of the write still runs
    started = list(order)
    assert 3 <= len(started) <= 4  # at most the unit beside the failed one had started
    committed = {r.tree for r in packs_in_store(store)}
    assert started[2] not in committed and (len(started) < 4 or started[3] not in committed)
    assert not any(p.name == "fails" for p in store.list_projects())
    # the store goes on: the same import succeeds and reads back whole
    p = store.create_project("again", files=files)
    assert store.view(p.id).read_file("src/m000/s0/f0.py") == files["src/m000/s0/f0.py"]


def test_packed_blobs_stay_addressable_by_digest(store: Store, store_factory: Any) -> None:
    files = project_files(300, seed=1)
    store.create_project("by-digest", files=files)
    for path in ("src/m000/s0/f0.py", "src/m002/s9/f299.py", "bin/run.sh", "assets/big.bin"):
        cold = store_factory()  # nothing cached: the object is found through pack_object
        d = digest_of(files[path])
        assert cold.trees.blobs.get(d) == files[path]
        assert cold.trees.blobs.has(d)
        assert cold.trees.blobs.get_many([d])[d] == files[path]
    cold = store_factory()
    wanted = [digest_of(files[p]) for p in sorted(files)[:50]]
    got = cold.trees.blobs.get_many(wanted)
    assert all(digest_of(got[d]) == d for d in wanted)


def test_a_tampered_pack_object_is_a_checksum_mismatch() -> None:
    objects = [(digest_of(b), b) for b in (b"alpha\n", b"beta beta\n", b"gamma\n" * 10)]
    raw, index = encode_pack(objects + objects[:1])  # a duplicate is stored once
    assert [d for d, _, _ in index] == [d for d, _ in objects]
    pack = Pack.decode(digest_of(raw), raw)
    for d, data in objects:
        assert pack.take(d) == data
    # flip one byte of the second object inside the decoded pack
    off, length = pack.objects[objects[1][0]]
    tampered = bytearray(pack.data)
    tampered[off + 2] ^= 0x20
    bad = Pack(pack.digest, dict(pack.objects), bytes(tampered))
    assert bad.take(objects[0][0]) == objects[0][1]
    with pytest.raises(ChecksumMismatch) as err:
        bad.take(objects[1][0])
    assert err.value.code == "blob.checksum_mismatch"
    # offsets shifted by one: every object is refused, none returned wrong
    shifted = Pack(pack.digest, {d: (o + 1, n) for d, (o, n) in pack.objects.items()}, pack.data + b"x")
    for d, _ in objects:
        with pytest.raises(ChecksumMismatch):
            shifted.take(d)


def test_a_pack_opens_only_the_frames_of_the_objects_taken_and_a_bad_frame_is_refused() -> None:
    rng = random.Random(5)
    objects = [(digest_of(b), b) for b in (rng.randbytes(40_000) for _ in range(6))]  # 40 KB: ~4 frames
    raw, index = encode_pack(objects)
    pack = Pack.decode(digest_of(raw), raw)
    frames = frame_locations(raw)
    assert len({loc.start for loc in frames.values()}) >= 3
    assert pack.frames_open == 0  # decoding reads the header only
    assert pack.take(objects[0][0]) == objects[0][1]
    assert pack.frames_open == 1
    assert pack.take(objects[-1][0]) == objects[-1][1]
    assert pack.frames_open == 2
    assert pack.data == b"".join(data for _, data in objects)  # every frame, in order

    # one byte of the last frame's stored bytes changed: the first object is still served,
    # an object of that frame is refused (never returned wrong)
    last = frames[objects[-1][0]]
    bad = bytearray(raw)
    bad[last.start + last.stored - 1000] ^= 0xFF  # inside the last object
    damaged = Pack.decode(digest_of(bytes(bad)), bytes(bad))
    assert damaged.take(objects[0][0]) == objects[0][1]
    with pytest.raises(IntegrityError):
        damaged.take(objects[-1][0])
    # a frame table that does not add up is refused when the pack is decoded
    with pytest.raises(IntegrityError):
        Pack.decode(digest_of(raw[:-1]), raw[:-1])


def test_a_corrupted_pack_in_the_store_is_refused_never_read_wrong(store: Store, store_factory: Any,
                                                                   request: pytest.FixtureRequest,
                                                                   tmp_path: Path) -> None:
    files = {f"lib/m{i}.py": f"x = {i}\n".encode() for i in range(40)}
    p = store.create_project("corrupt", files=files)
    placed = pack_objects(store, [r.digest for r in packs_in_store(store)])
    victim = digest_of(files["lib/m7.py"])
    row = next(r for r in placed if r.digest == victim)
    # rewrite the pack with one byte of lib/m7.py changed: a well-formed pack, wrong content
    pack = Pack.decode(row.pack, store.blobs.get(Digest(row.pack)))
    order = sorted(pack.objects, key=lambda d: pack.objects[d][0])
    data = bytearray(pack.data)
    data[row.offset] ^= 0x01
    raw, _ = encode_pack((d, bytes(data[o:o + n])) for d in order for o, n in [pack.objects[d]])
    assert raw != store.blobs.get(Digest(row.pack))
    overwrite_object(store, request, row.pack, raw)

    cold = store_factory()
    with pytest.raises(ChecksumMismatch) as err:
        cold.view(p.id).read_file("lib/m7.py")
    assert err.value.code == "blob.checksum_mismatch"
    with pytest.raises(ChecksumMismatch):
        store_factory().trees.blobs.get(victim)
    with pytest.raises(ChecksumMismatch):
        store_factory().view(p.id).search_code("x = ", max_results=1000)
    with pytest.raises(ChecksumMismatch):
        store_factory().materialize(p.id, tmp_path / "out", state="head")


def test_a_large_directory_whose_own_files_are_all_too_large_to_pack(store: Store, store_factory: Any) -> None:
    """Above MAX_PACK_FILES files, a directory's own files get a ``files`` pack; when every
    one of them is over MAX_PACKED_FILE that pack holds no object at all."""
    n = packing_module.MAX_PACK_FILES + 10
    files = {f"src/d{i // 100:03d}/f{i}.py": b"x = %d\n" % i for i in range(n)}
    files["huge.bin"] = random.Random(7).randbytes(packing_module.MAX_PACKED_FILE + 10)
    p = store.create_project("all-loose", files=files)
    cold = store_factory()
    assert cold.view(p.id).read_file("huge.bin") == files["huge.bin"]
    assert cold.view(p.id).file_count() == len(files)


def test_multi_part_packs_read_back_and_search(store: Store, store_factory: Any) -> None:
    files = {f"data/f{i:03d}.txt": (f"row {i} ".encode() * 400)[:3000] + b"\nend\n" for i in range(120)}
    with mock.patch.object(packing_module, "MAX_PACK_BYTES", 64 * 1024):
        p = store.create_project("parts", files=files)
    rows = packs_in_store(store)
    parts = sorted(r.part for r in rows if r.kind == "tree")
    assert parts == list(range(len(parts))) and len(parts) >= 5  # ~360 KB of files in 64 KiB parts
    cold = store_factory()
    view = cold.view(p.id)
    assert all(view.read_file(path) == data for path, data in files.items())
    res = view.search_code("row 117 ")
    assert {m.path for m in res} == {"data/f117.txt"}


# =====================================================================================
# cold readers
# =====================================================================================
def test_a_cold_reader_fetches_a_few_packs_not_one_object_per_file(store: Store, store_factory: Any,
                                                                   tmp_path: Path) -> None:
    files = project_files(2_500, seed=2)
    p = store.create_project("cold", files=files, executable=["bin/run.sh"])
    rows = packs_in_store(store)
    indexes = {r.search_index for r in rows if r.search_index}
    budget = len(rows) + len(indexes) + 1 + 3  # every pack, every index, the large file, a little slack

    # search the whole project (every file is a candidate)
    searcher, reads = cold_counting_store(store_factory)
    res = searcher.view(p.id).search_code("VALUE_", max_results=10_000)
    assert len(res) == 2_500 and not res.truncated
    assert reads() <= budget, f"{reads()} object reads to search {len(files)} files ({len(rows)} packs)"

    # a literal with trigrams: the index narrows it, so even fewer packs are fetched
    narrow, narrow_reads = cold_counting_store(store_factory)
    hit = narrow.view(p.id).search_code("VALUE_1234 =")
    assert [m.path for m in hit] == ["src/m012/s3/f1234.py"]
    assert narrow_reads() <= budget

    # materialise the whole project
    writer, writes_reads = cold_counting_store(store_factory)
    out = writer.materialize(p.id, tmp_path / "out", state="head")
    assert out.path == "rebuild" and out.files == len(files)
    assert writes_reads() <= budget, f"{writes_reads()} object reads to materialise {len(files)} files"
    for path in ("src/m024/s9/f2499.py", "assets/big.bin", "bin/run.sh"):
        assert (tmp_path / "out" / path).read_bytes() == files[path]


# =====================================================================================
# publish + background
# =====================================================================================
def _big_enough() -> int:
    """Files for a project that spans several pack roots whatever MAX_PACK_FILES is."""
    return max(2_500, 2 * packing_module.MAX_PACK_FILES + 500)


def test_publish_then_background_packs_only_the_changed_subtree(store: Store, store_factory: Any) -> None:
    n = _big_enough()
    files = project_files(n, seed=3)
    p = store.create_project("publish-packs", files=files)
    before = {r.digest for r in packs_in_store(store)}

    t = store.start_turn(p.id, "one change")
    store.write_file(t.id, "src/m003/s0/f302.py", b"CHANGED = True\n")
    store.complete_turn(t.id, "done")
    v2 = store.publish(p.id, "one file")
    with store.engine.connect() as conn:
        # not on publish
        assert conn.execute(sa.select(VERSIONS.c.packed_at).where(VERSIONS.c.id == v2.id)).scalar() is None
    done = store.run_background()
    assert done["versions_packed"] == 1
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(VERSIONS.c.packed_at).where(VERSIONS.c.id == v2.id)).scalar() is not None
    assert store.run_background()["versions_packed"] == 0

    after = packs_in_store(store)
    new = [r for r in after if r.digest not in before]
    assert 1 <= len(new) <= 4, [(r.kind, r.objects) for r in new]  # the changed subtree, the spine
    repacked = sum(r.objects for r in new)
    assert repacked < n // 10, f"{repacked} objects re-packed for a one-file change in {n} files"

    # the new version reads and searches from a cold store, through its packs
    cold = store_factory()
    view = cold.view_at(p.id, v2.id)
    assert view.read_file("src/m003/s0/f302.py") == b"CHANGED = True\n"
    assert view.read_file("src/m003/s0/f301.py") == files["src/m003/s0/f301.py"]
    assert [m.path for m in view.search_code("CHANGED = True")] == ["src/m003/s0/f302.py"]
    assert view.search_code("VALUE_302 =").matches == []
    covered, _ = cold._packing.covering(view.root)
    assert any(c.prefix == "src/m003/" for c in covered)


def test_a_large_directorys_own_files_are_not_repacked_when_a_subdirectory_changes(store: Store) -> None:
    """Only changed subtrees get new packs: the files directly in a large directory did not change."""
    n = _big_enough()
    files = project_files(n, seed=4, root_files=300, dir_files=300)
    p = store.create_project("files-packs", files=files)
    before = {r.digest for r in packs_in_store(store)}
    t = store.start_turn(p.id, "one change")
    store.write_file(t.id, "src/m001/s0/f100.py", b"CHANGED = 1\n")
    store.complete_turn(t.id, "done")
    store.publish(p.id, "one file")
    store.run_background()
    new = [r for r in packs_in_store(store) if r.digest not in before]
    unchanged_direct = {digest_of(data) for path, data in files.items()
                        if path.startswith("top") or path.startswith("src/direct")}
    repacked = {r.digest for r in pack_objects(store, [r.digest for r in new])} & unchanged_direct
    assert not repacked, (f"{len(repacked)} unchanged files re-packed "
                          f"(new packs: {[(r.kind, r.objects) for r in new]})")


def test_background_packing_is_not_blocked_by_one_unpackable_version(store: Store, store_factory: Any) -> None:
    """A version whose packs cannot be written (an object lost) must not stop every later one."""
    broken = store.create_project("broken", files={"a.py": b"broken = 1\n"})
    t = store.start_turn(broken.id, "x")
    store.write_file(t.id, "lost.py", b"this blob will be lost\n")
    store.complete_turn(t.id, "ok")
    store.publish(broken.id, "v2")
    store.blobs.delete(digest_of(b"this blob will be lost\n"))
    store.cache.clear()

    fine = store.create_project("fine", files={"a.py": b"fine = 1\n"})
    t = store.start_turn(fine.id, "x")
    store.write_file(t.id, "b.py", b"fine = 2\n")
    store.complete_turn(t.id, "ok")
    v = store.publish(fine.id, "v2")

    worker = store_factory()
    for _ in range(3):
        try:
            worker.run_background()
        except Exception:  # noqa: BLE001 - what matters is whether the healthy version gets packed
            pass
    with worker.engine.connect() as conn:
        packed_at = conn.execute(sa.select(VERSIONS.c.packed_at).where(VERSIONS.c.id == v.id)).scalar()
    assert packed_at is not None, "a healthy version was never packed behind an unpackable one"


def test_two_background_workers_at_once_pack_each_version_once(store: Store, store_factory: Any) -> None:
    files = project_files(1_200, seed=5)
    p = store.create_project("race", files=files)
    t = store.start_turn(p.id, "x")
    store.apply_changes(t.id, {f"src/m00{i}/s0/f{i * 100}.py": b"RACE = %d\n" % i for i in range(5)})
    store.complete_turn(t.id, "ok")
    v2 = store.publish(p.id, "v2")
    workers = [store_factory(), store_factory()]
    barrier = threading.Barrier(len(workers))
    results: list[Any] = [None] * len(workers)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = workers[i].run_background()
        except BaseException as exc:  # noqa: BLE001
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(workers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert all(isinstance(r, dict) for r in results), results
    assert sum(r["versions_packed"] for r in results) == 1
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(VERSIONS.c.packed_at).where(VERSIONS.c.id == v2.id)).scalar() is not None
    cold = store_factory()
    view = cold.view_at(p.id, v2.id)
    assert view.read_file("src/m003/s0/f300.py") == b"RACE = 3\n"
    assert [m.path for m in view.search_code("RACE = 4")] == ["src/m004/s0/f400.py"]
    digests = [r.digest for r in packs_in_store(store)]
    assert len(digests) == len(set(digests))
    assert hashlib.sha256(view.read_file("assets/big.bin")).hexdigest() == digest_of(files["assets/big.bin"])


def test_a_multi_part_subtree_stays_fully_searchable_after_a_change_in_its_first_part(store: Store,
                                                                                       store_factory: Any) -> None:
    """A later part whose files did not change has the same bytes (and digest) as the old
    version's part; the new version's subtree must still cover it, or its files go unsearched."""
    size = packing_module.MAX_PACKED_FILE - 100  # as large as a packed file gets
    count = packing_module.MAX_PACK_BYTES // size + 2  # two parts at least
    lines_per = size // 32

    def text(i: int, tag: str) -> bytes:
        body = b"".join(b"%s line %08d of file %03d\n" % (tag.encode(), n, i) for n in range(lines_per))
        return body[:size]

    files = {f"data/f{i:03d}.txt": text(i, f"MARK{i:03d}") for i in range(count)}
    files["README.md"] = b"readme\n"
    p = store.create_project("parts-change", files=files)
    last = f"data/f{count - 1:03d}.txt"
    assert [m.path for m in store.view(p.id).search_code(f"MARK{count - 1:03d} line 00000007")] == [last]

    t = store.start_turn(p.id, "change the first file")
    store.write_file(t.id, "data/f000.txt", text(0, "EDIT000"))
    store.complete_turn(t.id, "ok")
    v2 = store.publish(p.id, "v2")
    store.run_background()
    cold = store_factory()
    view = cold.view_at(p.id, v2.id)
    v1_parts = [r for r in packs_in_store(cold) if r.tree == store.get_version(p.current_version_id).root]
    parts = [r for r in packs_in_store(cold) if r.tree == view.root]
    assert len(v1_parts) >= 2
    oracle = cold.view_at(p.id, v2.id)
    oracle._search = Planner()  # noqa: SLF001 - no indexes: every file is read
    assert [m.path for m in oracle.search_code(f"MARK{count - 1:03d} line 00000007")] == [last]
    hit = view.search_code(f"MARK{count - 1:03d} line 00000007")
    assert [m.path for m in hit] == [last], f"packs covering the new root: {[(r.kind, r.part) for r in parts]}"
    assert [m.path for m in view.search_code("EDIT000 line 00000001")] == ["data/f000.txt"]
    assert sorted(r.part for r in parts) == sorted(r.part for r in v1_parts)


# =====================================================================================
# a spine row's cover: a cold search of a whole tree reads no tree node
# =====================================================================================
def _grep(files: dict[str, bytes], needle: bytes) -> list[tuple[str, int]]:
    return sorted((path, n) for path, data in files.items() if b"\x00" not in data[:8192]
                  for n, line in enumerate(data.split(b"\n"), 1) if needle in line)


def _spine(store: Store, root: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(sa.select(PACKS).where(PACKS.c.tree == root, PACKS.c.kind == "spine")).one()


def test_a_spine_row_names_every_pack_of_its_tree_and_a_cold_search_reads_no_tree_node(
        store: Store, store_factory: Any) -> None:
    files = project_files(400, seed=11, root_files=3, dir_files=4)
    with mock.patch.object(packing_module, "MAX_PACK_FILES", 50):
        p = store.create_project("cover", files=files)
    root = store.get_version(p.current_version_id).root
    spine = _spine(store, root)
    cover = json.loads(spine.cover)
    # src/mNNN (100 files) is too large for one pack: its ten sN directories are pack roots;
    # the top and src/ have files of their own (files packs)
    assert sorted(prefix for prefix, _, _ in cover) == sorted(
        ["", "src/", "assets/", "bin/"] + [f"src/m{i:03d}/s{j}/" for i in range(4) for j in range(10)])
    assert {kind for prefix, _, kind in cover if prefix in ("", "src/")} == {"files"}
    with store.engine.connect() as conn:
        packed = {(r.tree, r.kind) for r in conn.execute(sa.select(PACKS.c.tree, PACKS.c.kind)).all()}
    assert all((tree, kind) in packed for _, tree, kind in cover)

    needle = b"'tag7'"
    cold = store_factory()
    res = cold.view(p.id).search_code(needle.decode(), max_results=10_000)
    assert [(m.path, m.line_number) for m in res] == _grep(files, needle)
    assert spine.digest not in cold.cached_packs()  # the spine was never fetched
    assert spine.search_index  # (that search read the tree summary: the packs' indexes are checked below)

    # a row the cover names is gone (or the cover is from before covers were recorded):
    # the search walks the spine instead, and finds the same (through the packs' indexes:
    # the spine row names no tree summary, as before summaries were written)
    with store.engine.begin() as conn:
        conn.execute(sa.update(PACKS).where(PACKS.c.tree == root, PACKS.c.kind == "spine").values(cover=None,
                                                                                          search_index=None))
    walked = store_factory()
    assert [(m.path, m.line_number) for m in walked.view(p.id).search_code(needle.decode(), max_results=10_000)
            ] == _grep(files, needle)
    assert spine.digest in walked.cached_packs()
    with store.engine.begin() as conn:
        conn.execute(sa.update(PACKS).where(PACKS.c.tree == root, PACKS.c.kind == "spine").values(cover=spine.cover))
        # the pack root holding f377, one of the matches: a cover trusted without its rows would miss it
        gone = next(entry for entry in cover if entry[0] == "src/m003/s7/")
        assert any(path.startswith(gone[0]) for path, _ in _grep(files, needle))
        conn.execute(sa.delete(PACKS).where(PACKS.c.tree == gone[1], PACKS.c.kind == gone[2]))
    partial = store_factory()
    assert [(m.path, m.line_number) for m in partial.view(p.id).search_code(needle.decode(), max_results=10_000)
            ] == _grep(files, needle)


def test_background_packs_an_open_drafts_sealed_tree_so_a_cold_search_of_the_draft_uses_indexes(
        store: Store, store_factory: Any) -> None:
    files = project_files(400, seed=12, root_files=2)
    with mock.patch.object(packing_module, "MAX_PACK_FILES", 50):
        p = store.create_project("draft-packs", files=files)
        small = store.create_project("small-draft", files={f"f{i}.py": b"x = %d\n" % i for i in range(20)})
        before = {r.digest for r in packs_in_store(store)}
        t = store.start_turn(p.id, "change one file")
        files["src/m002/s3/f233.py"] = b"DRAFT_ONLY_MARKER = 1\n"
        store.write_file(t.id, "src/m002/s3/f233.py", files["src/m002/s3/f233.py"])
        store.complete_turn(t.id, "done")  # sealed into the draft's tree
        ts = store.start_turn(small.id, "change a small tree")
        store.write_file(ts.id, "f3.py", b"x = 'changed'\n")
        store.complete_turn(ts.id, "done")  # one pack: left to publish, not repacked at every turn's end
        root = store.get_draft(p.id).root
        assert root != store.get_version(p.current_version_id).root
        with store.engine.connect() as conn:
            assert conn.execute(sa.select(PACKS).where(PACKS.c.tree == root)).first() is None

        done = store.run_background()
        assert done["drafts_packed"] == 1 and done["versions_packed"] == 0  # the large draft's tree only
        with store.engine.connect() as conn:
            small_root = store.get_draft(small.id).root
            assert conn.execute(sa.select(PACKS).where(PACKS.c.tree == small_root)).first() is None
        assert store.run_background()["drafts_packed"] == 0  # done once
        new = [r for r in packs_in_store(store) if r.digest not in before]
        # the changed directory's pack (the files of src/m002/s3) and the new spine, nothing else
        assert sorted(r.kind for r in new) == ["spine", "tree"], new
        assert json.loads(_spine(store, root).cover)

        cold = store_factory()
        res = cold.view(p.id).search_code("DRAFT_ONLY_MARKER", max_results=100)
        assert [(m.path, m.line_number) for m in res] == [("src/m002/s3/f233.py", 1)]
        assert res.files_searched == 1  # the index named the one candidate
        assert [(m.path, m.line_number) for m in cold.view(p.id).search_code("'tag5'", max_results=10_000)
                ] == _grep(files, b"'tag5'")

        store.publish(p.id)  # the version's tree is the draft's: its packs are there already
        assert store.run_background()["versions_packed"] == 1
        assert {r.digest for r in packs_in_store(store)} == before | {r.digest for r in new}
