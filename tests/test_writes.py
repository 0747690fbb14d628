"""Writes into a running turn's draft: files, batches, limits, JSON patches, views.

Every story runs on the embedded and on the real stack (``stack``).
"""

from __future__ import annotations

import threading

import pytest

from draftstore import (
    DraftBusy,
    InvalidInput,
    LimitExceeded,
    Limits,
    PatchInvalid,
    PathConflict,
    PathDenied,
    PathNotFound,
    PayloadTooLarge,
    Settings,
    Store,
    TurnNotRunning,
)
from draftstore.db.tables import DraftRow


def running_turn(store: Store, files=None, characters=None, world_settings=None):
    p = store.create_project(
        "demo",
        files={"main.py": "print(1)\n", "lib/util.py": "def f(): pass\n"} if files is None else files,
        characters={"hero": {"name": "Ada", "hp": 10}} if characters is None else characters,
        world_settings={"era": "steam", "magic": False} if world_settings is None else world_settings,
    )
    return p, store.start_turn(p.id, "edit")


def snapshot(store: Store, project_id: str):
    """Everything a write could change: revision, files with content, JSON state."""
    draft = store.get_draft(project_id)
    view = store.view(project_id)
    return (draft.revision, draft.file_count, {p: view.read_file(p) for p in view.list_files()},
            view.characters, view.world_settings)


# -- single writes ---------------------------------------------------------------------------
def test_a_write_is_visible_in_the_draft_view_before_the_turn_ends(store):
    p, t = running_turn(store)
    store.write_file(t.id, "hello.py", b"print('hi')\n")
    store.write_file(t.id, "main.py", "print(2)\n")  # str is stored as UTF-8
    view = store.view(p.id)
    assert view.kind == "draft" and view.draft_id == t.draft_id
    assert view.read_file("hello.py") == b"print('hi')\n"
    assert view.read_text("main.py") == "print(2)\n"
    assert view.list_files() == ["hello.py", "lib/util.py", "main.py"]
    # head is untouched until publish
    head = store.view_at(p.id, p.current_version_id)
    assert head.read_text("main.py") == "print(1)\n" and not head.exists("hello.py")


def test_writing_bumps_the_draft_revision_and_file_count(store):
    p, t = running_turn(store)
    before = store.get_draft(p.id)
    store.write_file(t.id, "new.py", "x")
    store.write_file(t.id, "main.py", "y")  # overwrite: count unchanged
    after = store.get_draft(p.id)
    assert after.revision >= before.revision + 2
    assert after.file_count == before.file_count + 1


def test_deleting_and_moving_files(store):
    p, t = running_turn(store)
    store.move_file(t.id, "lib/util.py", "pkg/tools.py")
    store.delete_file(t.id, "main.py")
    view = store.view(p.id)
    assert view.list_files() == ["pkg/tools.py"]
    assert view.read_text("pkg/tools.py") == "def f(): pass\n"
    assert not view.is_dir("lib")
    t = store.complete_turn(t.id, "moved")
    sealed = store.view(p.id)
    assert sealed.list_files() == ["pkg/tools.py"] and store.get_draft(p.id).file_count == 1


def test_deleting_a_missing_file_is_path_not_found(store):
    p, t = running_turn(store)
    before = snapshot(store, p.id)
    with pytest.raises(PathNotFound) as exc:
        store.delete_file(t.id, "nope.py")
    assert exc.value.code == "path.not_found"
    with pytest.raises(PathNotFound):
        store.delete_file(t.id, "lib")  # a directory is not a file
    with pytest.raises(PathNotFound):
        store.move_file(t.id, "ghost.py", "x.py")
    assert snapshot(store, p.id)[1:] == before[1:]


def test_a_file_cannot_sit_under_a_file(store):
    p, t = running_turn(store)
    before = snapshot(store, p.id)
    with pytest.raises(PathConflict) as exc:
        store.write_file(t.id, "main.py/inner.py", "x")
    assert exc.value.code == "path.conflict"
    with pytest.raises(PathConflict):
        store.apply_changes(t.id, {"a.py": b"1", "a.py/b.py": b"2"})  # within one batch
    assert snapshot(store, p.id)[1:] == before[1:]


def test_a_file_cannot_replace_a_directory(store):
    p, t = running_turn(store)
    store.write_file(t.id, "new/deep/file.py", "x")  # an unsealed directory counts too
    before = snapshot(store, p.id)
    with pytest.raises(PathConflict):
        store.write_file(t.id, "lib", "I am a file now")
    with pytest.raises(PathConflict):
        store.write_file(t.id, "new/deep", "x")
    with pytest.raises(PathConflict):
        store.move_file(t.id, "main.py", "lib")
    assert snapshot(store, p.id)[1:] == before[1:]


def test_a_batch_may_replace_a_directory_by_a_file_by_deleting_its_contents(store):
    p, t = running_turn(store)
    store.apply_changes(t.id, {"lib/util.py": None, "lib": b"now a file"})
    view = store.view(p.id)
    assert view.read_text("lib") == "now a file" and not view.is_dir("lib")


# -- batches are atomic ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        {"../escape.py": b"x"},        # path.denied
        {"main.py/sub": b"x"},         # path.conflict
        {"missing.py": None},          # path.not_found
        {"lib": b"x"},                 # path.conflict (a directory)
    ],
    ids=["denied", "under-a-file", "delete-missing", "over-a-directory"],
)
def test_one_bad_path_in_a_batch_applies_nothing(store, bad):
    p, t = running_turn(store)
    before = snapshot(store, p.id)
    batch = {"good1.py": b"1", "main.py": b"overwritten", "lib/util.py": b"changed", **bad, "good2.py": b"2"}
    with pytest.raises((PathDenied, PathConflict, PathNotFound)):
        store.apply_changes(t.id, batch)
    assert snapshot(store, p.id)[1:] == before[1:]
    t = store.complete_turn(t.id, "nothing happened")
    assert t.end_root == t.start_root


def test_a_good_batch_applies_every_change(store):
    p, t = running_turn(store)
    store.apply_changes(t.id, {"a.py": b"a", "b/c.py": "c", "main.py": None, "lib/util.py": b"changed"})
    view = store.view(p.id)
    assert view.list_files() == ["a.py", "b/c.py", "lib/util.py"]
    assert view.read_text("lib/util.py") == "changed"


# -- limits ------------------------------------------------------------------------------------
def test_an_oversized_file_is_refused(store_factory):
    store = store_factory(settings=Settings(limits=Limits(max_file_bytes=1024)))
    p, t = running_turn(store)
    before = snapshot(store, p.id)
    store.write_file(t.id, "fits.bin", b"x" * 1024)
    with pytest.raises(PayloadTooLarge) as exc:
        store.write_file(t.id, "big.bin", b"x" * 1025)
    assert exc.value.code == "payload.too_large"
    with pytest.raises(PayloadTooLarge):
        store.apply_changes(t.id, {"ok.txt": b"small", "big.bin": b"x" * 4096})
    files = snapshot(store, p.id)[2]
    assert set(files) == set(before[2]) | {"fits.bin"}


def test_too_many_files_in_a_draft_is_refused(store_factory):
    store = store_factory(settings=Settings(limits=Limits(max_files_per_draft=4)))
    p, t = running_turn(store)  # 2 files
    store.apply_changes(t.id, {"c.py": b"c", "d.py": b"d"})
    before = snapshot(store, p.id)
    with pytest.raises(LimitExceeded) as exc:
        store.write_file(t.id, "e.py", b"e")
    assert exc.value.code == "limit.exceeded"
    store.write_file(t.id, "c.py", b"overwrite is fine")
    store.apply_changes(t.id, {"d.py": None, "e.py": b"swap is fine"})
    assert store.get_draft(p.id).file_count == 4
    assert before[1] == 4
    with pytest.raises(LimitExceeded):
        store.create_project("too big", files={f"{i}.py": b"" for i in range(5)})


def test_too_many_paths_in_one_batch_is_refused(store_factory):
    store = store_factory(settings=Settings(limits=Limits(max_batch_files=3)))
    p, t = running_turn(store)
    before = snapshot(store, p.id)
    with pytest.raises(LimitExceeded):
        store.apply_changes(t.id, {f"f{i}.py": b"x" for i in range(4)})
    assert snapshot(store, p.id)[1:] == before[1:]


# -- characters and world settings ------------------------------------------------------------
def test_characters_take_a_json_patch(store):
    p, t = running_turn(store)
    new = store.patch_characters(t.id, [
        {"op": "replace", "path": "/hero/hp", "value": 7},
        {"op": "add", "path": "/villain", "value": {"name": "Moriarty"}},
        {"op": "test", "path": "/hero/name", "value": "Ada"},
    ])
    assert new == {"hero": {"name": "Ada", "hp": 7}, "villain": {"name": "Moriarty"}}
    assert store.view(p.id).characters == new
    store.complete_turn(t.id, "patched")
    assert store.publish(p.id).characters == new


def test_world_settings_take_a_merge_patch(store):
    p, t = running_turn(store, world_settings={"era": "steam", "magic": False, "map": {"w": 10, "h": 5}})
    new = store.patch_world_settings(t.id, {"magic": None, "map": {"h": 8}, "weather": "rain"})
    assert new == {"era": "steam", "map": {"w": 10, "h": 8}, "weather": "rain"}
    assert store.view(p.id).world_settings == new
    # the other document is untouched
    assert store.view(p.id).characters == {"hero": {"name": "Ada", "hp": 10}}


@pytest.mark.parametrize(
    "patch",
    [
        [{"op": "remove", "path": "/nobody"}],
        [{"op": "test", "path": "/hero/hp", "value": 999}],
        [{"op": "replace", "path": "/hero/hp", "value": 1}, {"op": "bogus", "path": "/x"}],
        [{"op": "add", "path": "/hero/hp"}],  # no value
        [{"op": "add", "path": "/x", "value": 1}, {"op": "move", "from": "/missing", "path": "/y"}],
        "not a patch",
        42,
    ],
    ids=["remove-missing", "test-fails", "bad-op-after-good", "no-value", "move-missing", "string", "number"],
)
def test_a_bad_patch_is_refused_and_changes_nothing(store, patch):
    p, t = running_turn(store)
    before = snapshot(store, p.id)
    with pytest.raises(PatchInvalid) as exc:
        store.patch_characters(t.id, patch)
    assert exc.value.code == "patch.invalid"
    with pytest.raises(PatchInvalid):
        store.patch_world_settings(t.id, patch)
    after = snapshot(store, p.id)
    assert after[1:] == before[1:]


def test_an_oversized_json_state_is_refused(store_factory):
    store = store_factory(settings=Settings(limits=Limits(max_json_state_bytes=200)))
    p, t = running_turn(store)
    before = snapshot(store, p.id)
    with pytest.raises(PayloadTooLarge):
        store.patch_characters(t.id, {"bio": "x" * 500})
    assert snapshot(store, p.id)[1:] == before[1:]


# -- concurrency -----------------------------------------------------------------------------------
def test_concurrent_writers_to_one_draft_lose_nothing(store):
    p, t = running_turn(store, files={}, characters={}, world_settings={})
    writers, per_writer = 4, 100
    barrier = threading.Barrier(writers)
    errors: list[BaseException] = []

    def write(w: int) -> None:
        try:
            barrier.wait()
            for i in range(per_writer):
                store.write_file(t.id, f"w{w}/f{i:03d}.txt", f"{w}:{i}")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []

    expected = {f"w{w}/f{i:03d}.txt": f"{w}:{i}".encode() for w in range(writers) for i in range(per_writer)}
    view = store.view(p.id)
    assert view.list_files() == sorted(expected)
    assert store.get_draft(p.id).file_count == len(expected) == 400
    assert {path: view.read_file(path) for path in expected} == expected

    store.complete_turn(t.id, "wrote 400 files")
    version = store.publish(p.id, "400 files")
    assert version.file_count == 400
    published = store.view(p.id)
    assert published.kind == "version" and published.version_id == version.id
    assert published.list_files() == sorted(expected)
    assert published.read_text("w3/f099.txt") == "3:99"


def test_concurrent_json_patches_are_serialised(store):
    p, t = running_turn(store, characters={"counter": []})
    barrier = threading.Barrier(4)

    def append(w: int) -> None:
        barrier.wait()
        for i in range(10):
            store.patch_characters(t.id, [{"op": "add", "path": "/counter/-", "value": f"{w}.{i}"}])

    threads = [threading.Thread(target=append, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    got = store.view(p.id).characters["counter"]
    assert sorted(got) == sorted(f"{w}.{i}" for w in range(4) for i in range(10))


# -- views -----------------------------------------------------------------------------------------
def test_a_project_with_no_version_and_no_draft_has_an_empty_view(store):
    p = store.create_project("blank")
    assert p.current_version_id is None
    view = store.view(p.id)
    assert view.kind == "empty" and view.list_files() == []
    assert view.characters == {} and view.world_settings == {}
    with pytest.raises(PathNotFound):
        view.read_file("anything.py")


def test_the_first_turn_of_a_blank_project_writes_into_a_draft(store):
    p = store.create_project("blank")
    t = store.start_turn(p.id, "start from scratch")
    assert t.start_root is not None
    store.write_file(t.id, "README.md", "# hi\n")
    view = store.view(p.id)
    assert view.kind == "draft" and view.version_id is None and view.list_files() == ["README.md"]
    store.complete_turn(t.id, "ok")
    v = store.publish(p.id, "first")
    assert v.number == 1 and v.parent_version_id is None
    assert store.view(p.id).read_text("README.md") == "# hi\n"


def test_a_pinned_view_does_not_change_when_a_writer_writes_afterwards(store, store_factory):
    p, t = running_turn(store)
    store.write_file(t.id, "before.py", "before\n")
    pinned = store.view(p.id)
    files_then = pinned.list_files()

    writer = store_factory()
    writer.write_file(t.id, "after.py", "after\n")
    writer.write_file(t.id, "before.py", "changed\n")
    writer.delete_file(t.id, "main.py")
    writer.complete_turn(t.id, "sealed")  # sealing moves the draft's root too

    assert pinned.list_files() == files_then
    assert pinned.read_text("before.py") == "before\n"
    assert pinned.read_text("main.py") == "print(1)\n"
    assert not pinned.exists("after.py")
    fresh = store.view(p.id)
    assert fresh.read_text("before.py") == "changed\n" and fresh.exists("after.py") and not fresh.exists("main.py")


def test_a_view_shows_the_draft_while_one_exists_and_head_otherwise(store):
    p, t = running_turn(store)
    assert store.view(p.id).kind == "draft"
    store.complete_turn(t.id, "nothing")
    assert store.view(p.id).kind == "draft"  # a paused draft is still the newest state
    v = store.publish(p.id)
    view = store.view(p.id)
    assert view.kind == "version" and view.version_id == v.id and view.draft_id is None


def test_every_write_acknowledged_before_the_turn_ends_is_in_its_end_root(store):
    p, t = running_turn(store, files={}, characters={}, world_settings={})
    acknowledged: list[str] = []
    refused: list[str] = []
    started = threading.Event()

    def write() -> None:
        for i in range(10_000):
            path = f"f{i:05d}.txt"
            try:
                store.write_file(t.id, path, path)
            except TurnNotRunning:
                refused.append(path)
                return
            acknowledged.append(path)
            if i == 20:
                started.set()

    th = threading.Thread(target=write)
    th.start()
    assert started.wait(30)
    ended = store.complete_turn(t.id, "stop")
    th.join()

    assert refused and len(acknowledged) > 20
    view = store.view(p.id)
    assert view.root == ended.end_root == store.get_draft(p.id).root
    assert view.list_files() == acknowledged
    assert store.publish(p.id).file_count == len(acknowledged)


def test_once_a_directory_is_emptied_a_file_may_take_its_name(store):
    p, t = running_turn(store)
    store.delete_file(t.id, "lib/util.py")
    store.write_file(t.id, "lib", "a file now\n")
    store.write_file(t.id, "tmp/x.py", "x")
    store.delete_file(t.id, "tmp/x.py")
    store.write_file(t.id, "tmp", "also a file\n")
    view = store.view(p.id)
    assert view.list_files() == ["lib", "main.py", "tmp"]
    ended = store.complete_turn(t.id, "dirs became files")
    sealed = store.view(p.id)
    assert sealed.root == ended.end_root
    assert sealed.list_files() == ["lib", "main.py", "tmp"]
    assert sealed.read_text("lib") == "a file now\n" and not sealed.is_dir("lib")
    assert store.publish(p.id).file_count == 3


def test_discarding_a_draft_that_is_being_published_is_refused(store):
    p, t = running_turn(store)
    store.complete_turn(t.id, "ok")
    with store.engine.begin() as conn:
        conn.execute(DraftRow.__table__.update().where(DraftRow.__table__.c.id == t.draft_id)
                     .values(status="publishing"))
    with pytest.raises(DraftBusy):
        store.discard_draft(p.id)
    assert store.get_project(p.id).active_draft_id == t.draft_id


def test_move_file_refuses_to_replace_a_file_unless_overwrite(store):
    p, t = running_turn(store)
    store.write_file(t.id, "other.py", "O = 1\n")
    before = snapshot(store, p.id)
    with pytest.raises(PathConflict) as exc:
        store.move_file(t.id, "other.py", "main.py")
    assert exc.value.code == "path.conflict" and exc.value.details["path"] == "main.py"
    with pytest.raises(InvalidInput):
        store.move_file(t.id, "other.py", "main.py", overwrite="yes")
    assert snapshot(store, p.id)[1:] == before[1:]
    store.move_file(t.id, "other.py", "main.py", overwrite=True)
    view = store.view(p.id)
    assert view.read_text("main.py") == "O = 1\n" and not view.exists("other.py")


# -- a patch's work is bounded ---------------------------------------------------------------------
def doubling_patch(copies: int) -> list:
    """About 1.3 KB that asks for 2^copies elements: each copy appends /z to itself."""
    return [{"op": "add", "path": "/z", "value": ["x"]}] + [{"op": "copy", "from": "/z", "path": "/z/-"}] * copies


def test_a_patch_that_doubles_the_document_is_refused_before_it_grows(store_factory):
    import tracemalloc

    limit = 64 * 1024
    store = store_factory(settings=Settings(limits=Limits(max_json_state_bytes=limit)))
    p, t = running_turn(store)
    before = snapshot(store, p.id)
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLarge) as exc:
            store.patch_characters(t.id, doubling_patch(30))
        with pytest.raises(PayloadTooLarge):
            store.patch_world_settings(t.id, doubling_patch(30))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert exc.value.code == "payload.too_large"
    # the document never grew far past its limit while the patch ran (Python objects
    # take some tens of times their JSON text)
    assert peak < 64 * limit
    assert snapshot(store, p.id)[1:] == before[1:]
    # the turn goes on: a legal copy still works
    assert store.patch_characters(t.id, doubling_patch(2))["z"] == ["x", ["x"], ["x", ["x"]]]
    new = store.patch_characters(t.id, [{"op": "copy", "from": "/hero", "path": "/twin"}])
    assert new["twin"] == new["hero"] == {"name": "Ada", "hp": 10}


def test_a_patch_of_too_many_operations_is_refused(store):
    from draftstore.patches import MAX_PATCH_OPS

    p, t = running_turn(store, characters={"n": 0})
    before = snapshot(store, p.id)
    with pytest.raises(PatchInvalid) as exc:
        store.patch_characters(t.id, [{"op": "replace", "path": "/n", "value": i} for i in range(MAX_PATCH_OPS + 1)])
    assert exc.value.details["limit"] == MAX_PATCH_OPS
    assert snapshot(store, p.id)[1:] == before[1:]
    assert store.patch_characters(t.id, [{"op": "replace", "path": "/n", "value": i} for i in range(100)]) == {"n": 99}


def test_a_patch_that_copies_too_much_is_refused_even_if_the_result_fits(store_factory):
    store = store_factory(settings=Settings(limits=Limits(max_json_state_bytes=2000)))
    p, t = running_turn(store, characters={"big": "x" * 600})
    before = snapshot(store, p.id)
    # each step copies 600 bytes in and takes them out again: the result stays small, the work does not
    churn = [{"op": "copy", "from": "/big", "path": "/tmp"}, {"op": "remove", "path": "/tmp"}] * 20
    with pytest.raises(PatchInvalid) as exc:
        store.patch_characters(t.id, churn)
    assert exc.value.code == "patch.invalid" and "more than 8000 bytes" in str(exc.value)
    assert snapshot(store, p.id)[1:] == before[1:]
    assert store.patch_characters(t.id, churn[:4]) == {"big": "x" * 600}


def test_the_doubling_patch_over_http_is_413_and_the_agent_goes_on(service):
    """The same 1.3 KB patch an agent could send through REST (MCP calls the same store method)."""
    c = service.client()
    pid = c.post("/v1/projects", json={"name": "doubling", "characters": {"hero": {"hp": 1}}}).json()["id"]
    tid = c.post(f"/v1/projects/{pid}/turns", json={"user_message": "x"}).json()["id"]
    for doc in ("characters", "world-settings"):
        r = c.patch(f"/v1/turns/{tid}/{doc}", json={"patch": doubling_patch(30)})
        assert r.status_code == 413 and r.json()["code"] == "payload.too_large", r.text
    assert service.store.view(pid).characters == {"hero": {"hp": 1}}
    assert service.store.view(pid).world_settings == {}
    r = c.patch(f"/v1/turns/{tid}/characters", json={"patch": [{"op": "copy", "from": "/hero", "path": "/twin"}]})
    assert r.status_code == 200 and r.json() == {"hero": {"hp": 1}, "twin": {"hp": 1}}, r.text
