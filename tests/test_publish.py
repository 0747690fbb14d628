"""Publishing drafts, conflicts, rollback, discard, forks and the head-move log.

Every story runs on the embedded and on the real stack (``stack``).
"""

from __future__ import annotations

import threading

import pytest

from draftstore import (
    DraftBusy,
    DraftConflict,
    DraftNone,
    DraftstoreError,
    Store,
    TurnNotRunning,
    VersionNotFound,
)


def project_with_edit(store: Store, name: str = "demo", path: str = "feature.py", content: str = "v2\n"):
    """A project at version 1 with a completed (paused) draft that adds ``path``."""
    p = store.create_project(name, files={"main.py": "v1\n"}, characters={"hero": "Ada"})
    t = store.start_turn(p.id, f"add {path}")
    store.write_file(t.id, path, content)
    store.complete_turn(t.id, "done")
    return p, t


def edit_and_publish(store: Store, project_id: str, path: str, content: str, summary: str = ""):
    t = store.continue_turn(project_id, f"write {path}") if store.get_project(project_id).active_draft_id \
        else store.start_turn(project_id, f"write {path}")
    store.write_file(t.id, path, content)
    store.complete_turn(t.id, "ok")
    return store.publish(project_id, summary or f"write {path}")


# -- publish ---------------------------------------------------------------------------------
def test_publishing_a_draft_makes_a_new_head_version(store):
    p, t = project_with_edit(store)
    v1 = store.get_version(p.current_version_id)
    v2 = store.publish(p.id, "add feature", actor="admin@example")

    assert (v2.number, v2.parent_version_id, v2.summary) == (2, v1.id, "add feature")
    assert v2.created_by_turn_id == t.id and v2.created_by == "admin@example"
    assert v2.root == store.get_turn(t.id).end_root
    assert v2.file_count == 2 and v2.characters == {"hero": "Ada"}
    project = store.get_project(p.id)
    assert project.current_version_id == v2.id and project.active_draft_id is None
    view = store.view(p.id)
    assert view.kind == "version" and view.version_id == v2.id
    assert view.read_text("feature.py") == "v2\n"
    # the old version is intact
    assert not store.view_at(p.id, v1.id).exists("feature.py")


def test_publishing_with_no_draft_is_draft_none(store):
    p = store.create_project("demo", files={"a": "a"})
    with pytest.raises(DraftNone) as exc:
        store.publish(p.id)
    assert exc.value.code == "draft.none"
    assert len(store.list_versions(p.id)) == 1


def test_publishing_while_a_turn_runs_is_draft_busy(store):
    p = store.create_project("demo", files={"a": "a"})
    t = store.start_turn(p.id, "busy")
    store.write_file(t.id, "b", "b")
    with pytest.raises(DraftBusy) as exc:
        store.publish(p.id)
    assert exc.value.code == "draft.busy"
    assert len(store.list_versions(p.id)) == 1
    assert store.get_turn(t.id).status == "running"
    store.write_file(t.id, "c", "c")  # the turn goes on undisturbed
    store.interrupt_turn(t.id)
    assert store.publish(p.id).file_count == 3  # an interrupted draft may be published


def test_a_new_turn_after_publish_starts_a_fresh_draft_from_the_new_head(store):
    p, _ = project_with_edit(store)
    v2 = store.publish(p.id)
    t = store.start_turn(p.id, "next feature")
    draft = store.get_draft(p.id)
    assert draft.base_version_id == v2.id and t.start_root == v2.root
    assert t.continues_turn_id is None


# -- stale drafts ----------------------------------------------------------------------------
def test_publishing_a_draft_whose_base_was_rolled_away_is_a_conflict(store):
    p = store.create_project("demo", files={"main.py": "v1\n"})
    v1 = store.get_version(p.current_version_id)
    v2 = edit_and_publish(store, p.id, "two.py", "2\n")
    t = store.start_turn(p.id, "work on top of v2")  # draft based on v2
    store.write_file(t.id, "three.py", "3\n")
    store.complete_turn(t.id, "ok")
    store.rollback_to(p.id, v1.id)

    with pytest.raises(DraftConflict) as exc:
        store.publish(p.id, "stale")
    assert exc.value.code == "draft.conflict"
    assert exc.value.details["head_version_id"] == v1.id
    assert store.get_project(p.id).current_version_id == v1.id
    assert [v.number for v in store.list_versions(p.id)] == [1, 2]
    assert store.get_draft(p.id).status == "paused"  # the draft survives the refusal

    forced = store.publish(p.id, "forced", force=True)
    assert forced.number == 3 and forced.parent_version_id == v1.id
    assert store.get_project(p.id).current_version_id == forced.id
    assert store.view(p.id).list_files() == ["main.py", "three.py", "two.py"]
    assert v2.id in {v.id for v in store.list_versions(p.id)}


def test_a_draft_is_publishable_again_once_head_is_back_at_its_base(store):
    p = store.create_project("demo", files={"main.py": "v1\n"})
    v1 = p.current_version_id
    v2 = edit_and_publish(store, p.id, "two.py", "2\n")
    t = store.start_turn(p.id, "on v2")
    store.complete_turn(t.id, "ok")
    store.rollback_to(p.id, v1)
    with pytest.raises(DraftConflict):
        store.publish(p.id)
    store.rollback_to(p.id, v2.id)
    v3 = store.publish(p.id, "not stale any more")
    assert v3.parent_version_id == v2.id


def test_two_racing_publishes_produce_exactly_one_version(store, store_factory):
    p, _ = project_with_edit(store)
    other = store_factory()
    barrier = threading.Barrier(2)
    results: list[object] = [None, None]

    def publish(i: int, s: Store) -> None:
        barrier.wait()
        try:
            results[i] = s.publish(p.id, f"racer {i}")
        except DraftstoreError as exc:
            results[i] = exc

    threads = [threading.Thread(target=publish, args=(i, s)) for i, s in enumerate([store, other])]
    for th in threads:
        th.start()
    for th in threads:
        th.join()

    winners = [r for r in results if not isinstance(r, DraftstoreError)]
    losers = [r for r in results if isinstance(r, DraftstoreError)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert losers[0].code in {"draft.busy", "draft.conflict", "draft.none"}
    versions = store.list_versions(p.id)
    assert [v.number for v in versions] == [1, 2]
    assert store.get_project(p.id).current_version_id == winners[0].id
    assert store.get_project(p.id).active_draft_id is None
    assert [(m.reason, m.to_version_id) for m in store.head_moves(p.id)][-1] == ("publish", winners[0].id)


# -- rollback ----------------------------------------------------------------------------------
def test_rolling_back_to_an_older_version_and_publishing_again(store):
    p = store.create_project("demo", files={"main.py": "v1\n"})
    v1 = store.get_version(p.current_version_id)
    v2 = edit_and_publish(store, p.id, "main.py", "v2\n")
    v3 = edit_and_publish(store, p.id, "main.py", "v3\n")

    project = store.rollback_to(p.id, v1.id, actor="admin")
    assert project.current_version_id == v1.id
    assert store.view(p.id).read_text("main.py") == "v1\n"
    # nothing was deleted: every version is still readable
    assert [v.id for v in store.list_versions(p.id)] == [v1.id, v2.id, v3.id]
    assert store.view_at(p.id, v3.id).read_text("main.py") == "v3\n"

    v4 = edit_and_publish(store, p.id, "main.py", "v4 on top of v1\n")
    assert v4.number == 4 and v4.parent_version_id == v1.id
    assert store.view(p.id).read_text("main.py") == "v4 on top of v1\n"

    moves = [(m.reason, m.from_version_id, m.to_version_id) for m in store.head_moves(p.id)]
    assert moves == [
        ("create", None, v1.id),
        ("publish", v1.id, v2.id),
        ("publish", v2.id, v3.id),
        ("rollback", v3.id, v1.id),
        ("publish", v1.id, v4.id),
    ]
    rollback = store.head_moves(p.id)[3]
    assert rollback.actor == "admin" and rollback.at is not None


def test_rollback_to_a_version_of_another_project_is_refused(store):
    a = store.create_project("a", files={"x": "x"})
    b = store.create_project("b", files={"y": "y"})
    with pytest.raises(VersionNotFound) as exc:
        store.rollback_to(a.id, b.current_version_id)
    assert exc.value.code == "version.not_found"
    with pytest.raises(VersionNotFound):
        store.rollback_to(a.id, "0" * 32)
    assert store.get_project(a.id).current_version_id == a.current_version_id
    assert len(store.head_moves(a.id)) == 1


def test_rolling_back_to_the_current_head_records_no_move(store):
    p = store.create_project("demo", files={"x": "x"})
    store.rollback_to(p.id, p.current_version_id)
    assert [m.reason for m in store.head_moves(p.id)] == ["create"]


def test_a_completed_turn_rolled_back_by_rollback_refuses_late_writes(store):
    p, t = project_with_edit(store)
    v2 = store.publish(p.id)
    store.rollback_to(p.id, p.current_version_id)
    with pytest.raises(TurnNotRunning):
        store.write_file(t.id, "late.py", "late\n")
    assert not store.view(p.id).exists("late.py")
    assert not store.view_at(p.id, v2.id).exists("late.py")


# -- discarding a draft ---------------------------------------------------------------------------
def test_discarding_a_draft_ends_its_running_turn_and_falls_back_to_head(store):
    p = store.create_project("demo", files={"main.py": "v1\n"})
    t1 = store.start_turn(p.id, "first")
    c = store.tool_started(t1.id, "write_file", {"path": "a.py"})
    store.write_file(t1.id, "a.py", "a\n")
    store.tool_completed(t1.id, c.seq, "ok")
    store.complete_turn(t1.id, "wrote a.py")
    t2 = store.continue_turn(p.id, "second")
    store.write_file(t2.id, "b.py", "b\n")

    draft = store.discard_draft(p.id, actor="admin")
    assert draft.closed_reason == "discarded" and draft.closed_at is not None

    assert store.get_turn(t2.id).status == "rolled_back"
    old = store.get_turn(t1.id)
    assert old.status == "completed" and old.assistant_message == "wrote a.py"
    assert [(x.tool_name, x.status) for x in old.tool_calls] == [("write_file", "completed")]
    assert [x.id for x in store.list_turns(p.id)] == [t1.id, t2.id]

    view = store.view(p.id)
    assert view.kind == "version" and view.version_id == p.current_version_id
    assert view.list_files() == ["main.py"]
    assert store.get_project(p.id).active_draft_id is None
    with pytest.raises(DraftNone):
        store.continue_turn(p.id, "continue the discarded draft?")
    with pytest.raises(DraftNone):
        store.discard_draft(p.id)
    with pytest.raises(TurnNotRunning):
        store.write_file(t2.id, "zombie.py", "boo\n")
    assert [v.number for v in store.list_versions(p.id)] == [1]
    # a new turn starts a fresh draft from head
    t3 = store.start_turn(p.id, "fresh start")
    assert store.get_draft(p.id).id != draft.id and store.view(p.id).list_files() == ["main.py"]
    assert t3.continues_turn_id is None


# -- forks -------------------------------------------------------------------------------------------
def test_an_old_version_can_be_forked_into_a_new_project(store):
    p = store.create_project("demo", files={"main.py": "v1\n"}, characters={"c": 1})
    v1 = store.get_version(p.current_version_id)
    edit_and_publish(store, p.id, "main.py", "v2\n")

    fork = store.fork_project(v1.id, "demo, the old way")
    assert fork.id != p.id and fork.forked_from_version_id == v1.id
    fv = store.get_version(fork.current_version_id)
    assert fv.number == 1 and fv.root == v1.root and fv.characters == {"c": 1}
    assert store.view(fork.id).read_text("main.py") == "v1\n"
    # the original is untouched and the two evolve apart
    edit_and_publish(store, fork.id, "fork.py", "only here\n")
    assert store.view(p.id).read_text("main.py") == "v2\n" and not store.view(p.id).exists("fork.py")
    assert [v.number for v in store.list_versions(p.id)] == [1, 2]


def test_a_draft_based_on_an_older_head_is_a_conflict_when_head_moves_forward(store):
    p = store.create_project("demo", files={"main.py": "v1\n"})
    v1 = p.current_version_id
    v2 = edit_and_publish(store, p.id, "two.py", "2\n")
    store.rollback_to(p.id, v1)
    t = store.start_turn(p.id, "work on v1 again")  # draft based on v1
    store.write_file(t.id, "alt.py", "alt\n")
    store.complete_turn(t.id, "ok")
    store.rollback_to(p.id, v2.id)  # someone moves head forward meanwhile
    with pytest.raises(DraftConflict):
        store.publish(p.id)
    assert store.get_project(p.id).current_version_id == v2.id
    forced = store.publish(p.id, force=True)
    assert forced.parent_version_id == v2.id
    # a forced publish takes the draft's state as it is: two.py was never in it
    assert store.view(p.id).list_files() == ["alt.py", "main.py"]


def test_forking_a_missing_version_is_refused(store):
    before = len(store.list_projects())
    with pytest.raises(VersionNotFound):
        store.fork_project("0" * 32, "nothing to fork")
    assert len(store.list_projects()) == before
