"""No row stays locked while the blob store works (``draftstore.deferred``): a
turn's start state is stored before its rows are locked; a transaction that
waits for an upload started before it gives up after ``LOCKED_WAIT_S``, rolls
back, and runs again once the upload is done; a write's checks read no tree node
from the blob store under the lock. Checked from another connection while the
blob store is at work, on both stacks: a slow S3 must not hold a project."""

from __future__ import annotations

import time
from typing import Any

import pytest

from draftstore import deferred
from draftstore.errors import BackendUnavailable, PathNotFound


def _rows_locked(stack: dict[str, str], project_id: str) -> bool:
    """Whether a transaction holds the project's row or its draft's (PostgreSQL: a row
    lock; SQLite: the database's write lock, which every write transaction takes)."""
    url = stack["database_url"]
    if url.startswith("sqlite"):
        import sqlite3
        conn = sqlite3.connect(url.split("sqlite:///", 1)[1], timeout=0, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError:  # database is locked
            return True
        finally:
            conn.close()
    import psycopg
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=False) as conn:
        try:
            conn.execute("SELECT id FROM project WHERE id = %s FOR UPDATE NOWAIT", (project_id,))
            conn.execute("SELECT id FROM project_draft WHERE project_id = %s FOR UPDATE NOWAIT", (project_id,))
            return False
        except psycopg.errors.LockNotAvailable:
            return True
        finally:
            conn.rollback()


def test_a_turn_stores_its_start_state_before_it_locks_a_row(store, stack, monkeypatch):
    # a blob-store request under a row lock would hold the project for as long as the
    # request and its retries take (tens of seconds with a struggling S3)
    pid = store.create_project("locks", files={"a.py": b"a\n"}, characters={"hero": {"hp": 1}}).id
    seen: list[bool] = []
    real_put = store.blobs.put

    def put(data, *args, **kwargs):
        if data.startswith(b'{"characters":'):  # a turn boundary's state object
            seen.append(_rows_locked(stack, pid))
        return real_put(data, *args, **kwargs)

    monkeypatch.setattr(store.blobs, "put", put)
    first = store.start_turn(pid, "derives the draft from head")
    store.complete_turn(first.id, "done")
    second = store.start_turn(pid, "continues on the draft")
    assert seen == [False, False]
    assert store.view_at_turn(second.id, "start").characters == {"hero": {"hp": 1}}


SLOW_S = 0.5  # how long each slowed upload takes; the transactions give up after 0.05 s


def _slowed(monkeypatch: Any, obj: Any, name: str, stack: dict[str, str], project_id: str,
            seen: list[bool], fail: bool = False) -> None:
    """``obj.name`` takes SLOW_S, and looks (from another connection) whether the rows are
    locked while it runs, after the waiting transaction has had ample time to give up:
    locked means held at each of three looks 50 ms apart, as a transaction waiting for
    the upload would hold them (on SQLite, where any write transaction of the database
    counts, a short one of other work at the instant of one look is not a held lock)."""
    real = getattr(obj, name)

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(SLOW_S * 0.6)
        looks = []
        for i in range(3):
            if i:
                time.sleep(0.05)
            looks.append(_rows_locked(stack, project_id))
        seen.append(all(looks))
        time.sleep(SLOW_S * 0.2)
        if fail:
            raise BackendUnavailable("the blob store gave up")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, slow)


@pytest.fixture(autouse=True)
def short_wait(monkeypatch: Any) -> None:
    monkeypatch.setattr(deferred, "LOCKED_WAIT_S", 0.05)


def test_a_write_whose_upload_is_slow_waits_for_it_with_nothing_locked(store, stack, monkeypatch):
    pid = store.create_project("slow-write", files={"a.py": b"a\n"}).id
    turn = store.start_turn(pid, "write")
    seen: list[bool] = []
    _slowed(monkeypatch, store.blobs, "put_many", stack, pid, seen)
    store.write_file(turn.id, "b.py", b"written slowly\n")
    assert seen == [False]
    assert store.view(pid).read_file("b.py") == b"written slowly\n"
    store.complete_turn(turn.id, "done")
    assert store.view_at_turn(turn.id, "end").read_file("b.py") == b"written slowly\n"


def test_a_write_whose_slow_upload_fails_changes_nothing(store, stack, monkeypatch):
    pid = store.create_project("slow-fail", files={"a.py": b"a\n"}).id
    turn = store.start_turn(pid, "write")
    seen: list[bool] = []
    _slowed(monkeypatch, store.blobs, "put_many", stack, pid, seen, fail=True)
    with pytest.raises(BackendUnavailable):
        store.write_file(turn.id, "b.py", b"never stored\n")
    assert seen == [False]
    with pytest.raises(PathNotFound):
        store.view(pid).read_file("b.py")
    monkeypatch.undo()
    store.write_file(turn.id, "b.py", b"stored on the retry\n")
    assert store.view(pid).read_file("b.py") == b"stored on the retry\n"


@pytest.mark.parametrize("ending", ["complete", "discard"])
def test_a_turn_end_whose_tree_upload_is_slow_waits_for_it_with_nothing_locked(store, stack, monkeypatch, ending):
    pid = store.create_project("slow-end", files={"a.py": b"a\n"}, characters={"hero": {"hp": 1}}).id
    turn = store.start_turn(pid, "write then end")
    store.write_file(turn.id, "src/b.py", b"b\n")
    store.patch_characters(turn.id, {"hero": {"hp": 2}})  # the end state is a new object too
    seen: list[bool] = []
    _slowed(monkeypatch, store.trees, "store", stack, pid, seen)  # the seal's tree objects
    if ending == "complete":
        ended = store.complete_turn(turn.id, "done")
        assert ended.status == "completed"
        end = store.view_at_turn(turn.id, "end")
        assert end.read_file("src/b.py") == b"b\n" and end.characters == {"hero": {"hp": 2}}
    else:
        store.discard_draft(pid)
        assert store.get_turn(turn.id).status == "rolled_back"
        assert store.get_project(pid).active_draft_id is None
    assert seen == [False]


def test_a_write_reads_the_tree_nodes_it_checks_with_nothing_locked(store, stack, store_factory, monkeypatch):
    pid = store.create_project("cold-nodes", files={"src/pkg/a.py": b"a\n", "docs/x.md": b"x\n"}).id
    cold = store_factory()  # a fresh store: no tree node in memory
    turn = cold.start_turn(pid, "write")
    cold.cache.clear()
    seen: list[bool] = []
    real_get = cold.trees.blobs.get

    def get(digest: Any) -> Any:
        seen.append(_rows_locked(stack, pid))
        return real_get(digest)

    monkeypatch.setattr(cold.trees.blobs, "get", get)
    cold.write_file(turn.id, "src/pkg/b.py", b"b\n")  # checked against src/ and src/pkg/ (and the root)
    with pytest.raises(Exception) as info:
        cold.write_file(turn.id, "docs/x.md/y.md", b"y\n")  # a file cannot hold a file: refused
    assert getattr(info.value, "code", None) == "path.conflict"
    assert seen and not any(seen)
    assert cold.view(pid).read_file("src/pkg/b.py") == b"b\n"


def test_a_write_with_no_tree_cache_at_all_still_lands(stack, monkeypatch):
    # a store whose cache holds nothing cannot keep a node read before the lock: past a
    # few deferrals the write reads its nodes under the lock, as it always could
    from draftstore import Settings, Store

    with Store.open(**stack, settings=Settings(cache_bytes=0), migrate=True) as s:
        pid = s.create_project("no-cache", files={"src/pkg/a.py": b"a\n"}).id
        turn = s.start_turn(pid, "write")
        s.write_file(turn.id, "src/pkg/b.py", b"b\n")
        s.complete_turn(turn.id, "done")
        assert s.view(pid).read_file("src/pkg/b.py") == b"b\n"


def test_a_turn_end_whose_fold_went_stale_folds_again_and_waits_for_it_with_nothing_locked(
        store, stack, store_factory, monkeypatch):
    # a write lands between the end's prepared fold and its lock: the end folds again under
    # the lock; that fold's slow upload is waited for with nothing locked, and kept for the
    # next attempt, so the end root holds both writes
    pid = store.create_project("stale-fold", files={"a.py": b"a\n"}).id
    turn = store.start_turn(pid, "two writes")
    store.write_file(turn.id, "one.py", b"1\n")
    other = store_factory()
    sealing = store._turns.sealing
    real_prepare = sealing.prepare_turn

    def prepare_then_write(turn_id: str, **kwargs: Any) -> Any:
        fold = real_prepare(turn_id, **kwargs)
        fold.settle()  # its own upload done: only the fold made again is slow
        other.write_file(turn_id, "two.py", b"2\n")  # lands before the end locks the draft
        seen_calls.append("prepared")
        _slowed(monkeypatch, store.trees, "store", stack, pid, seen)
        return fold

    seen: list[bool] = []
    seen_calls: list[str] = []
    monkeypatch.setattr(sealing, "prepare_turn", prepare_then_write)
    store.complete_turn(turn.id, "done")
    assert seen_calls == ["prepared"] and seen == [False]
    end = store.view_at_turn(turn.id, "end")
    assert end.read_file("one.py") == b"1\n" and end.read_file("two.py") == b"2\n"
