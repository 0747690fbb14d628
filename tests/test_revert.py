"""Undo to a turn boundary: an admin reverts a draft of several turns to a turn's start.

Every story runs on the embedded and on the real stack (``stack``): the Store
API, the HTTP route and the ``draftstore revert`` command.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from draftstore import DraftBusy, Store, TurnConflict, TurnNotFound
from service_fixtures import stack_env


def state_of(store: Store, project_id: str) -> dict[str, Any]:
    """What an agent reads of the draft now: every file's bytes, characters, world settings,
    and the canonical JSON of the two documents (what a turn boundary records)."""
    view = store.view(project_id)
    files = {path: view.read_file(path) for path in view.list_files()}
    return {"files": files, "characters": view.characters, "world_settings": view.world_settings,
            "json": json.dumps([view.characters, view.world_settings], sort_keys=True)}


def three_turns(store: Store) -> tuple[Any, list[Any], dict[str, Any]]:
    """A project whose draft has three completed turns, each changing files, characters and
    world settings. Returns the project, the turns, and the state read when turn 2 started."""
    p = store.create_project("saga", files={"main.py": b"print('v1')\n", "lore/intro.md": b"Once.\n"},
                             characters={"hero": {"name": "Ada", "hp": 10}}, world_settings={"era": "bronze"})
    turns, at_turn_2 = [], {}
    for n in (1, 2, 3):
        t = store.start_turn(p.id, f"turn {n}") if n == 1 else store.continue_turn(p.id, f"turn {n}")
        if n == 2:
            at_turn_2 = state_of(store, p.id)
        store.write_file(t.id, "main.py", f"print('turn {n}')\n")
        store.write_file(t.id, f"chapter{n}.md", f"Chapter {n}\n")
        if n == 3:
            store.delete_file(t.id, "lore/intro.md")
        store.patch_characters(t.id, [{"op": "replace", "path": "/hero/hp", "value": 10 + n},
                                      {"op": "add", "path": f"/npc{n}", "value": {"n": n}}])
        store.patch_world_settings(t.id, {"era": f"age {n}", f"place{n}": "forest"})
        store.complete_turn(t.id, f"did turn {n}")
        turns.append(t)
    return p, turns, at_turn_2


def snapshot_rows(store: Store, project_id: str) -> tuple[Any, ...]:
    """Everything a refused revert must leave as it was."""
    draft = store.get_draft(project_id)
    return (draft, [(t.id, t.status, t.reverted_at, t.reverted_by) for t in store.list_turns(project_id)],
            store.head_moves(project_id), state_of(store, project_id))


# -- the Store API -------------------------------------------------------------------------------
def test_reverting_to_turn_2_restores_its_start_state_and_marks_turns_2_and_3_reverted(store: Store) -> None:
    p, (t1, t2, t3), at_turn_2 = three_turns(store)
    assert state_of(store, p.id) != at_turn_2

    draft = store.revert_draft(p.id, t2.id, actor="alice@example")

    assert state_of(store, p.id) == at_turn_2  # files byte for byte, characters and world settings
    assert draft.root == store.get_turn(t2.id).start_root and draft.file_count == len(at_turn_2["files"])
    assert draft.status == "paused" and draft.last_turn_id == t1.id
    turns = {t.id: t for t in store.list_turns(p.id)}
    assert turns[t1.id].reverted_at is None and turns[t1.id].reverted_by is None
    for t in (t2, t3):
        assert turns[t.id].reverted_by == "alice@example" and turns[t.id].reverted_at is not None
        assert turns[t.id].status == "completed"  # the record stays: only marked
    assert turns[t2.id].reverted_at == turns[t3.id].reverted_at  # one revert, one moment
    assert store.get_turn(t3.id).assistant_message == "did turn 3"  # history still readable
    # the revert is in the log, with who and which turn; head did not move
    move = store.head_moves(p.id)[-1]
    assert (move.reason, move.turn_id, move.actor) == ("revert", t2.id, "alice@example")
    assert move.from_version_id == move.to_version_id == p.current_version_id
    assert move.at == turns[t2.id].reverted_at


def test_the_projects_rebuilt_history_carries_the_revert_as_its_stream_did(store: Store) -> None:
    p, (t1, t2, t3), _ = three_turns(store)
    store.revert_draft(p.id, t2.id, actor="alice@example")

    live = [(e.type, e.data) for e in store.events(f"project:{p.id}") if e.type == "draft.reverted"]
    rebuilt = [e for e in store.durable_project_events(p.id) if e[0] == "draft.reverted"]
    assert live == rebuilt == [("draft.reverted", {"draft_id": store.get_draft(p.id).id, "to_turn_id": t2.id,
                                                   "reverted": [t2.id, t3.id]})]


def test_after_a_revert_a_new_turn_continues_from_turn_1_and_publishes(store: Store) -> None:
    p, (t1, t2, _), at_turn_2 = three_turns(store)
    store.revert_draft(p.id, t2.id, actor="alice")

    t4 = store.continue_turn(p.id, "a different turn 2")
    assert t4.continues_turn_id == t1.id and t4.start_root == store.get_turn(t2.id).start_root
    store.write_file(t4.id, "epilogue.md", "The end.\n")
    store.patch_characters(t4.id, {"villain": "Smaug"})
    store.complete_turn(t4.id, "done")
    v = store.publish(p.id, "after the revert")

    assert v.created_by_turn_id == t4.id
    published = store.view_at(p.id, v.id)
    assert sorted(published.list_files()) == sorted([*at_turn_2["files"], "epilogue.md"])
    assert published.read_file("main.py") == at_turn_2["files"]["main.py"] == b"print('turn 1')\n"
    assert published.characters == {**at_turn_2["characters"], "villain": "Smaug"}
    assert published.world_settings == at_turn_2["world_settings"]
    assert store.get_turn(t4.id).reverted_at is None


def test_a_revert_is_refused_while_a_turn_runs_and_changes_nothing(store: Store) -> None:
    p, (_, t2, _), _ = three_turns(store)
    running = store.continue_turn(p.id, "turn 4")
    store.write_file(running.id, "wip.py", "x = 1\n")
    before = snapshot_rows(store, p.id)

    with pytest.raises(DraftBusy) as caught:
        store.revert_draft(p.id, t2.id, actor="alice")
    assert caught.value.code == "draft.busy"
    assert snapshot_rows(store, p.id) == before
    store.write_file(running.id, "wip.py", "x = 2\n")  # the running turn goes on unharmed


def test_a_revert_to_another_projects_turn_or_an_unknown_turn_is_not_found_and_changes_nothing(
        store: Store) -> None:
    p, _, _ = three_turns(store)
    other, (other_turn, _, _), _ = three_turns(store)
    before, other_before = snapshot_rows(store, p.id), snapshot_rows(store, other.id)

    for turn_id in (other_turn.id, "0" * 32):
        with pytest.raises(TurnNotFound) as caught:
            store.revert_draft(p.id, turn_id, actor="alice")
        assert caught.value.code == "turn.not_found"
    assert snapshot_rows(store, p.id) == before and snapshot_rows(store, other.id) == other_before


def test_a_revert_to_a_turn_of_an_earlier_draft_or_one_reverted_already_is_a_conflict(store: Store) -> None:
    p, (t1, t2, t3), _ = three_turns(store)
    store.publish(p.id, "three turns")  # t1..t3's draft is closed
    t4 = store.start_turn(p.id, "new draft")
    store.write_file(t4.id, "a.md", "a\n")
    store.complete_turn(t4.id, "ok")
    t5 = store.continue_turn(p.id, "more")
    store.complete_turn(t5.id, "ok")
    store.revert_draft(p.id, t5.id, actor="alice")
    before = snapshot_rows(store, p.id)

    for turn_id in (t2.id, t5.id):  # an earlier draft's turn; a turn reverted already
        with pytest.raises(TurnConflict) as caught:
            store.revert_draft(p.id, turn_id, actor="alice")
        assert caught.value.code == "turn.conflict"
    assert snapshot_rows(store, p.id) == before
    # the draft's own standing turn is still a boundary
    assert store.revert_draft(p.id, t4.id).root == store.get_turn(t4.id).start_root


# -- HTTP ----------------------------------------------------------------------------------------
def test_an_admin_reverts_over_http_and_the_turns_show_it(service: Any) -> None:
    store = service.store
    p, (t1, t2, _), at_turn_2 = three_turns(store)
    agent = service.client(token=service.token("agent"))
    r = agent.post(f"/v1/projects/{p.id}/draft/revert", json={"to_turn_id": t2.id})
    assert r.status_code == 403 and r.json()["code"] == "auth.forbidden"

    admin = service.client()
    r = admin.post(f"/v1/projects/{p.id}/draft/revert", json={"to_turn_id": t2.id, "actor": "ops"})
    assert r.status_code == 200, r.text
    assert r.json()["last_turn_id"] == t1.id and r.json()["root"] == store.get_turn(t2.id).start_root
    assert state_of(store, p.id) == at_turn_2
    shown = admin.get(f"/v1/turns/{t2.id}").json()
    assert shown["reverted_by"] == "ops" and shown["reverted_at"]
    assert admin.get(f"/v1/turns/{t1.id}").json()["reverted_at"] is None
    moves = admin.get(f"/v1/projects/{p.id}/head-moves?order=newest&limit=1").json()["items"]
    assert (moves[0]["reason"], moves[0]["turn_id"], moves[0]["actor"]) == ("revert", t2.id, "ops")
    observer = service.client(token=service.token("observer"))
    seen = observer.get(f"/v1/projects/{p.id}/head-moves").json()["items"]
    assert seen and "revert" not in [m["reason"] for m in seen]  # an observer never learns of the draft
    again = admin.post(f"/v1/projects/{p.id}/draft/revert", json={"to_turn_id": t2.id})
    assert again.status_code == 409 and again.json()["code"] == "turn.conflict"


# -- the command line ----------------------------------------------------------------------------
def _cli(stack: dict[str, str], home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**stack_env(stack), "DRAFTSTORE_HOME": str(home), "COLUMNS": "250", "USER": "carol"}
    return subprocess.run([sys.executable, "-m", "draftstore.cli", *args], capture_output=True, text=True,
                          env=env, cwd=home, timeout=120)


def test_draftstore_revert_takes_id_prefixes_and_the_log_shows_the_revert(
        store: Store, stack: dict[str, str], tmp_path: Path) -> None:
    p, (_, t2, t3), at_turn_2 = three_turns(store)

    done = _cli(stack, tmp_path, "revert", p.id[:10], "--to-turn", t2.id[:10])
    assert done.returncode == 0, done.stderr
    assert f"back at the start of turn 2 {t2.id}" in done.stdout
    assert state_of(store, p.id) == at_turn_2
    assert store.get_turn(t3.id).reverted_by == "carol"

    log = _cli(stack, tmp_path, "log", p.id)
    assert log.returncode == 0, log.stderr
    assert re.search(rf"revert +draft +start of turn {t2.id} +carol", log.stdout), log.stdout
    assert "completed (reverted)" in log.stdout
    as_json = json.loads(_cli(stack, tmp_path, "log", p.id, "--json").stdout)
    assert as_json["head_moves"][-1]["reason"] == "revert"
    assert [t["reverted_by"] for t in as_json["turns"]] == [None, "carol", "carol"]

    t4 = store.continue_turn(p.id, "turn 4")
    store.write_file(t4.id, "later.md", "later\n")
    store.complete_turn(t4.id, "ok")
    draft = json.loads(_cli(stack, tmp_path, "revert", p.id, "--to-turn", t4.id, "--json").stdout)
    assert (draft["root"], draft["last_turn_id"]) == (store.get_turn(t4.id).start_root, t4.continues_turn_id)
    assert state_of(store, p.id) == at_turn_2

    refused = _cli(stack, tmp_path, "revert", p.id, "--to-turn", t2.id, "--json")
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0 and "[turn.conflict]" in refused.stderr
