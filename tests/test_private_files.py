"""The embedded store's files are its owner's only: the database, the coordinator file beside
it and the blob directory are created 0600 / 0700 even under the usual umask 022, since they
hold every draft, message and token hash of the store."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from draftstore.settings import Settings
from draftstore.store import Store


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_embedded_store_is_created_readable_by_its_owner_only(tmp_path: Path, umask_022: None) -> None:
    home = tmp_path / "work" / ".draftstore"
    with Store.open(settings=Settings(home=home), migrate=True) as store:
        project = store.create_project("secrets")
        turn = store.start_turn(project.id, "write a secret")
        store.write_file(turn.id, "key.txt", b"hunter2\n")
        store.complete_turn(turn.id, "done")
    assert mode(home) == 0o700
    db = home / "draftstore.db"
    created = sorted(p.name for p in home.iterdir())
    assert mode(db) == 0o600 and mode(Path(f"{db}.coord")) == 0o600, created
    for sidecar in home.glob("draftstore.db*"):  # -wal, -shm: SQLite gives them the database's mode
        assert mode(sidecar) == 0o600, sidecar.name
    blobs = home / "blobs"
    assert mode(blobs) == 0o700
    objects = [p for p in blobs.rglob("*") if p.is_file()]
    assert objects and all(mode(p) == 0o600 for p in objects)


def test_an_existing_directory_keeps_the_mode_its_owner_gave_it(tmp_path: Path, umask_022: None) -> None:
    home = tmp_path / "shared"
    home.mkdir(mode=0o750)
    with Store.open(settings=Settings(home=home), migrate=True):
        pass
    assert mode(home) == 0o750  # the owner's choice stands; the files inside are still 0600
    assert mode(home / "draftstore.db") == 0o600
