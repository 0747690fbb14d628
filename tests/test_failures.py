"""When the blob store fails mid-write, nothing changes: a row never names a missing blob."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftstore import BackendUnavailable, Settings, Store
from draftstore.blobs import DirectoryBlobStore, ObjectCache
from draftstore.coord import MemoryCoordinator
from draftstore.db.engine import create_db_engine
from draftstore.db.migrate import upgrade


class FlakyBlobStore(DirectoryBlobStore):
    """The real directory backend, with uploads that can be switched to fail."""

    failing = False

    def _put_raw(self, key: str, data: bytes) -> None:
        if self.failing:
            raise BackendUnavailable("blob store unreachable (injected)")
        super()._put_raw(key, data)


@pytest.fixture
def flaky(tmp_path: Path):
    engine = create_db_engine(f"sqlite:///{tmp_path}/ds.db")
    upgrade(engine)
    cache = ObjectCache(0)  # every put reaches the backend
    blobs = FlakyBlobStore(tmp_path / "blobs", cache=cache)
    store = Store(engine, blobs, MemoryCoordinator(), settings=Settings(cache_bytes=0), cache=cache)
    yield store, blobs
    store.close()


def test_a_write_whose_upload_fails_changes_nothing(flaky) -> None:
    store, blobs = flaky
    p = store.create_project("p", files={"a.py": b"a = 1\n"})
    t = store.start_turn(p.id, "edit")
    before = store.get_draft(p.id)
    blobs.failing = True
    with pytest.raises(BackendUnavailable):
        store.write_file(t.id, "b.py", b"b = 2\n")
    with pytest.raises(BackendUnavailable):
        store.apply_changes(t.id, {"a.py": b"changed\n", "c.py": b"c\n"})
    after = store.get_draft(p.id)
    assert (after.revision, after.file_count) == (before.revision, before.file_count)
    view = store.view(p.id)
    assert view.list_files() == ["a.py"] and view.read_file("a.py") == b"a = 1\n"
    blobs.failing = False
    store.write_file(t.id, "b.py", b"b = 2\n")
    store.complete_turn(t.id, "ok")
    assert store.view(p.id).read_file("b.py") == b"b = 2\n"
