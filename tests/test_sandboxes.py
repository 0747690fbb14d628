"""Sandbox sessions and the best snapshot of a state, on both stacks.

A backend that runs agents in sandboxes records each one (provider, its id there,
the state and turn it serves, the snapshot it was restored from), beats while it
lives and closes it; a sandbox whose heartbeat lapsed is found ``lost`` by the
recovery sweep. To restore a sandbox fast it asks for the best snapshot of the
exact state: an external one first, else a bundle, never one of another tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from service_fixtures import Service

from draftstore import (
    InvalidInput,
    ProjectNotFound,
    SandboxConflict,
    SandboxNotFound,
    Settings,
    SnapshotNotFound,
    Store,
    TurnNotFound,
    VersionNotFound,
)


def new_project(store: Store, files: dict[str, str] | None = None) -> Any:
    return store.create_project("sandboxed", files=files or {"main.py": "print(1)\n", "lib/util.py": "X = 1\n"})


def paused_draft(store: Store, project_id: str, path: str = "lib/util.py", text: str = "X = 2\n") -> Any:
    """A turn that wrote ``path`` and completed: the draft waits, its writes sealed."""
    turn = store.start_turn(project_id, "change it")
    store.write_file(turn.id, path, text)
    return store.complete_turn(turn.id, "changed")


def every_session(store: Store, project_id: str, status: str | None = None) -> list[Any]:
    items, cursor = [], None
    while True:
        page = store.page_sandboxes(project_id, status, cursor, limit=2)
        items += page.items
        if (cursor := page.next_cursor) is None:
            return items


def until(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll ``check`` until it holds (a condition, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.05)
    return value


# -- the life of a session -----------------------------------------------------------------------------
def test_an_agent_opens_a_sandbox_on_the_draft_beats_and_closes_it(store: Store) -> None:
    p = new_project(store)
    turn = paused_draft(store, p.id)
    draft = store.get_draft(p.id)
    snap = store.create_snapshot(p.id, "draft")

    opened = store.open_sandbox(p.id, "e2b", "sbx-abc", turn_id=turn.id, snapshot_id=snap.id)
    assert (opened.project_id, opened.draft_id, opened.version_id, opened.turn_id) == (p.id, draft.id, None, turn.id)
    assert (opened.provider, opened.external_id, opened.snapshot_id, opened.status) == (
        "e2b", "sbx-abc", snap.id, "starting")
    assert opened.created_at == opened.updated_at == opened.last_seen_at

    ready = store.sandbox_heartbeat(opened.id, "ready")
    assert ready.status == "ready" and ready.last_seen_at >= opened.last_seen_at
    beat = store.sandbox_heartbeat(opened.id)  # alive, status unchanged
    assert beat.status == "ready" and beat.last_seen_at >= ready.last_seen_at
    paused = store.sandbox_heartbeat(opened.id, "paused")
    assert store.get_sandbox(opened.id) == paused
    assert store.get_sandbox(opened.id, project_id=p.id) == paused

    closed = store.close_sandbox(opened.id)
    assert closed.status == "closed" and closed.created_at == opened.created_at
    assert store.close_sandbox(opened.id) == closed  # a retried close changes nothing
    assert store.get_sandbox(opened.id) == closed


def test_a_sandbox_opened_on_a_version_names_the_version(store: Store) -> None:
    p = new_project(store)
    on_head = store.open_sandbox(p.id, "docker", "c-1", state="head", status="ready")
    assert (on_head.version_id, on_head.draft_id, on_head.status) == (p.current_version_id, None, "ready")
    paused_draft(store, p.id)
    v2 = store.publish(p.id, "v2")
    on_v1 = store.open_sandbox(p.id, "docker", "c-2", state=p.current_version_id)
    assert on_v1.version_id == p.current_version_id and on_v1.draft_id is None
    # with no draft, "draft" is what the agent sees: head
    assert store.open_sandbox(p.id, "local", "here").version_id == v2.id


def test_a_projects_sessions_list_oldest_first_in_pages_and_filter_by_status(store: Store) -> None:
    p, other = new_project(store), new_project(store)
    made = [store.open_sandbox(p.id, "local", f"sbx-{i}", state="head") for i in range(5)]
    store.open_sandbox(other.id, "local", "elsewhere", state="head")
    store.sandbox_heartbeat(made[1].id, "ready")
    store.sandbox_heartbeat(made[3].id, "ready")
    store.close_sandbox(made[4].id)

    assert [s.id for s in every_session(store, p.id)] == [s.id for s in made]
    assert [s.id for s in every_session(store, p.id, "ready")] == [made[1].id, made[3].id]
    assert [s.id for s in every_session(store, p.id, "starting")] == [made[0].id, made[2].id]
    assert [s.id for s in every_session(store, p.id, "closed")] == [made[4].id]
    assert every_session(store, p.id, "lost") == []
    with pytest.raises(InvalidInput):
        store.page_sandboxes(p.id, "running")
    with pytest.raises(InvalidInput):
        store.page_sandboxes(p.id, cursor="not-a-cursor")
    with pytest.raises(ProjectNotFound):
        store.page_sandboxes("f" * 32)


# -- what is refused, typed, and changes nothing -------------------------------------------------------
def test_closed_and_lost_are_final_and_every_illegal_change_is_typed_and_changes_nothing(store: Store) -> None:
    p, other = new_project(store), new_project(store)
    closed = store.close_sandbox(store.open_sandbox(p.id, "e2b", "a").id)
    lost = store.sandbox_heartbeat(store.open_sandbox(p.id, "e2b", "b").id, "lost")  # its provider lost it
    ready = store.sandbox_heartbeat(store.open_sandbox(p.id, "e2b", "c").id, "ready")
    before = {s.id: s for s in every_session(store, p.id)}

    refused: list[tuple[Callable[[], Any], type[Exception], str]] = [
        (lambda: store.sandbox_heartbeat(closed.id), SandboxConflict, "sandbox.conflict"),
        (lambda: store.sandbox_heartbeat(closed.id, "ready"), SandboxConflict, "sandbox.conflict"),
        (lambda: store.sandbox_heartbeat(lost.id), SandboxConflict, "sandbox.conflict"),
        (lambda: store.sandbox_heartbeat(lost.id, "ready"), SandboxConflict, "sandbox.conflict"),
        (lambda: store.close_sandbox(lost.id), SandboxConflict, "sandbox.conflict"),
        (lambda: store.sandbox_heartbeat(ready.id, "starting"), SandboxConflict, "sandbox.conflict"),
        (lambda: store.sandbox_heartbeat(ready.id, "running"), InvalidInput, "input.invalid"),
        (lambda: store.sandbox_heartbeat(ready.id, 1), InvalidInput, "input.invalid"),  # type: ignore[arg-type]
        (lambda: store.sandbox_heartbeat("f" * 32), SandboxNotFound, "sandbox.not_found"),
        (lambda: store.sandbox_heartbeat("../etc"), SandboxNotFound, "sandbox.not_found"),
        (lambda: store.sandbox_heartbeat(ready.id, "paused", project_id=other.id), SandboxNotFound,
         "sandbox.not_found"),
        (lambda: store.close_sandbox(ready.id, project_id=other.id), SandboxNotFound, "sandbox.not_found"),
        (lambda: store.get_sandbox(ready.id, project_id=other.id), SandboxNotFound, "sandbox.not_found"),
    ]
    for call, error, code in refused:
        with pytest.raises(error) as caught:
            call()
        assert caught.value.code == code
    assert {s.id: s for s in every_session(store, p.id)} == before


def test_opening_a_sandbox_with_bad_input_is_typed_and_records_nothing(store: Store) -> None:
    p, other = new_project(store), new_project(store)
    theirs = store.start_turn(other.id, "theirs")
    their_snapshot = store.record_snapshot(other.id, "head", "snap-x")
    refused: list[tuple[dict[str, Any], type[Exception]]] = [
        ({"provider": "", "external_id": "x"}, InvalidInput),
        ({"provider": "p" * 65, "external_id": "x"}, InvalidInput),
        ({"provider": "e2b", "external_id": ""}, InvalidInput),
        ({"provider": "e2b", "external_id": "x\x00y"}, InvalidInput),
        ({"provider": "e2b", "external_id": "x", "status": "closed"}, InvalidInput),
        ({"provider": "e2b", "external_id": "x", "status": "lost"}, InvalidInput),
        ({"provider": "e2b", "external_id": "x", "turn_id": theirs.id}, TurnNotFound),
        ({"provider": "e2b", "external_id": "x", "snapshot_id": their_snapshot.id}, SnapshotNotFound),
        ({"provider": "e2b", "external_id": "x", "snapshot_id": "nope"}, SnapshotNotFound),
        ({"provider": "e2b", "external_id": "x", "state": other.current_version_id}, VersionNotFound),
    ]
    for kwargs, error in refused:
        with pytest.raises(error):
            store.open_sandbox(p.id, **kwargs)
    with pytest.raises(ProjectNotFound):
        store.open_sandbox("f" * 32, "e2b", "x")
    assert every_session(store, p.id) == []


# -- the recovery sweep ----------------------------------------------------------------------------------
def test_a_sandbox_whose_heartbeat_lapsed_is_lost_when_the_sweep_runs(store_factory: Callable[..., Store]) -> None:
    patient = store_factory()  # the default: sessions are lost after minutes unseen
    hasty = store_factory(settings=Settings.load(sandbox_heartbeat_ttl_s=0.2))
    p = new_project(patient)
    silent = patient.open_sandbox(p.id, "e2b", "silent", status="ready")
    paused = patient.open_sandbox(p.id, "e2b", "paused", status="paused")
    closed = patient.close_sandbox(patient.open_sandbox(p.id, "e2b", "closed").id)

    assert patient.sweep()["sandboxes_lost"] == 0  # seen a moment ago: open
    assert {s.status for s in every_session(patient, p.id)} == {"ready", "paused", "closed"}

    # no heartbeat: a sweep that allows a fifth of a second finds them lost, once that has passed
    until(lambda: hasty.sweep()["sandboxes_lost"] and patient.get_sandbox(silent.id).status == "lost",
          "the silent sandbox is lost")
    until(lambda: hasty.sweep() is not None and patient.get_sandbox(paused.id).status == "lost",
          "the paused sandbox is lost")
    assert patient.get_sandbox(closed.id) == closed  # a final status is never rewritten
    # its owner learns it on its next heartbeat
    with pytest.raises(SandboxConflict):
        patient.sandbox_heartbeat(silent.id, "ready")
    assert patient.get_sandbox(silent.id).status == "lost"


# -- the best snapshot of a state ----------------------------------------------------------------------
def test_the_best_snapshot_is_of_the_states_own_tree_and_an_external_one_comes_first(store: Store) -> None:
    p = new_project(store, {"main.py": "print('v1')\n"})
    v1 = store.get_version(p.current_version_id)
    paused_draft(store, p.id, "main.py", "print('v2')\n")
    v2 = store.publish(p.id, "v2")
    assert v1.root != v2.root
    assert store.best_snapshot(p.id, "head") is None and store.best_snapshot(p.id, v1.id) is None

    bundle_v1 = store.create_snapshot(p.id, v1.id)
    bundle_v2 = store.create_snapshot(p.id, "head")
    assert store.best_snapshot(p.id, v1.id).id == bundle_v1.id  # type: ignore[union-attr]
    assert store.best_snapshot(p.id, "head").id == bundle_v2.id  # type: ignore[union-attr]

    external_v1 = store.record_snapshot(p.id, v1.id, "provider-snap-v1")
    newer_bundle_v1 = store.create_snapshot(p.id, v1.id)
    best = store.best_snapshot(p.id, v1.id)
    assert best is not None and best.id == external_v1.id  # external first, even before a newer bundle
    assert (best.root, best.external_ref) == (v1.root, "provider-snap-v1")
    # v2 never gets v1's snapshots, however they rank
    best = store.best_snapshot(p.id, v2.id)
    assert best is not None and best.id == bundle_v2.id and best.root == v2.root
    assert newer_bundle_v1.root == v1.root


def test_the_best_snapshot_of_a_draft_is_of_its_current_tree_only(store: Store) -> None:
    p = new_project(store)
    paused_draft(store, p.id)
    snap = store.create_snapshot(p.id, "draft")
    assert store.best_snapshot(p.id, "draft") == snap
    turn = store.start_turn(p.id, "more")
    store.write_file(turn.id, "new.txt", "new\n")
    assert store.best_snapshot(p.id, "draft") is None  # unsealed writes: no snapshot holds them
    store.complete_turn(turn.id, "done")
    assert store.best_snapshot(p.id, "draft") is None  # the draft's tree moved on: that snapshot is stale
    with pytest.raises(VersionNotFound):
        store.best_snapshot(p.id, "f" * 32)
    with pytest.raises(ProjectNotFound):
        store.best_snapshot("f" * 32, "head")


def test_the_draft_names_its_latest_ready_snapshot_until_its_tree_moves_on(store: Store) -> None:
    p = new_project(store)
    paused_draft(store, p.id)
    assert store.get_draft(p.id).snapshot_id is None
    bundle = store.create_snapshot(p.id, "draft")
    assert store.get_draft(p.id).snapshot_id == bundle.id
    external = store.record_snapshot(p.id, "draft", "provider-snap")
    assert store.get_draft(p.id).snapshot_id == external.id
    store.create_snapshot(p.id, "head")  # a snapshot of head is not the draft's
    assert store.get_draft(p.id).snapshot_id == external.id
    paused_draft(store, p.id, "lib/util.py", "X = 3\n")
    assert store.get_draft(p.id).snapshot_id is None  # neither restores the draft any more


# -- over HTTP -------------------------------------------------------------------------------------------
def test_a_sandbox_session_over_http(service: Service) -> None:
    store = service.store
    p = new_project(store)
    turn = paused_draft(store, p.id)
    c = service.client()
    base = f"/v1/projects/{p.id}/sandbox-sessions"

    r = c.post(base, json={"provider": "e2b", "external_id": "sbx-1", "turn_id": turn.id})
    assert r.status_code == 201, r.text
    session = r.json()
    assert (session["status"], session["draft_id"], session["turn_id"]) == (
        "starting", store.get_draft(p.id).id, turn.id)
    sid = session["id"]
    r = c.post(f"{base}/{sid}/heartbeat", json={"status": "ready"})
    assert r.status_code == 200 and r.json()["status"] == "ready", r.text
    assert c.post(f"{base}/{sid}/heartbeat").json()["status"] == "ready"  # no body: alive, nothing else
    got = c.get(f"{base}/{sid}").json()
    assert (got["id"], got["status"], got["provider"], got["external_id"]) == (sid, "ready", "e2b", "sbx-1")
    page = c.get(base, params={"status": "ready"}).json()
    assert [s["id"] for s in page["items"]] == [sid] and page["next_cursor"] is None
    assert c.get(base, params={"status": "starting"}).json()["items"] == []
    assert c.get(base, params={"status": "running"}).status_code == 422

    assert c.post(f"{base}/{sid}/close").json()["status"] == "closed"
    r = c.post(f"{base}/{sid}/heartbeat", json={"status": "ready"})
    assert (r.status_code, r.json()["code"]) == (409, "sandbox.conflict")
    assert c.get(f"{base}/{sid}").json()["status"] == "closed"
    r = c.get(f"{base}/{'f' * 32}")
    assert (r.status_code, r.json()["code"]) == (404, "sandbox.not_found")

    r = c.get(f"/v1/projects/{p.id}/snapshots/best", params={"state": "head"})
    assert (r.status_code, r.json()["code"]) == (404, "snapshot.not_found")
    made = store.record_snapshot(p.id, "head", "provider-snap")
    r = c.get(f"/v1/projects/{p.id}/snapshots/best", params={"state": "head"})
    assert r.status_code == 200 and r.json()["id"] == made.id and r.json()["external_ref"] == "provider-snap"


def test_the_database_itself_holds_a_session_to_exactly_one_state(store: Store) -> None:
    """Whatever writes the table: a session on both the draft and a version, or on neither, is refused."""
    import sqlalchemy as sa

    from draftstore.db.tables import SANDBOX_SESSIONS, utcnow

    p = new_project(store)
    paused_draft(store, p.id)
    draft_id, version_id = store.get_draft(p.id).id, p.current_version_id
    now = utcnow()
    for draft, version in ((draft_id, version_id), (None, None)):
        with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:
            conn.execute(SANDBOX_SESSIONS.insert().values(id="e" * 32, project_id=p.id, draft_id=draft,
                                                          version_id=version, provider="raw", external_id="x",
                                                          status="ready", created_at=now, updated_at=now,
                                                          last_seen_at=now))
    assert every_session(store, p.id) == []
