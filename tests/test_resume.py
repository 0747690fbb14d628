"""A backend continues an interrupted turn: the calls the dead turn left unfinished say so,
and one call answers everything needed to rebuild the model's context.

Every story runs on the embedded and on the real stack (``stack``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from service_fixtures import Service

from draftstore import Settings, Store, TurnConflict, TurnNotRunning
from draftstore.records import json_default


def new_project(store: Store) -> Any:
    return store.create_project("dragons", files={"main.py": "print(1)\n", "old.py": "old\n"},
                                characters={"hero": {"hp": 10}})


def calls_of(turn: Any) -> list[tuple[int, str, str]]:
    return [(c.seq, c.tool_name, str(c.status)) for c in turn.tool_calls]


# -- unfinished tool calls ---------------------------------------------------------------------
ENDINGS = {
    "interrupt": lambda s, p, t: s.interrupt_turn(t.id),
    "cancel": lambda s, p, t: s.cancel_turn(t.id),
    "fail": lambda s, p, t: s.fail_turn(t.id, "the model crashed"),
    "discard": lambda s, p, t: s.discard_draft(p.id),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_calls_a_turn_leaves_unfinished_end_interrupted_or_expired(store: Store, ending: str) -> None:
    p = new_project(store)
    t = store.start_turn(p.id, "look around")
    done = store.tool_started(t.id, "view_file", {"path": "main.py"})
    store.tool_completed(t.id, done.seq, "print(1)\n")
    running = store.tool_started(t.id, "search_code", {"q": "dragon"})
    waiting = store.tool_started(t.id, "delete_file", {"path": "main.py"}, needs_approval=True)

    ENDINGS[ending](store, p, t)

    ended = store.get_turn(t.id)
    assert calls_of(ended) == [(1, "view_file", "completed"), (2, "search_code", "interrupted"),
                               (3, "delete_file", "expired")]
    by_seq = {c.seq: c for c in ended.tool_calls}
    assert by_seq[2].started_at == running.started_at and by_seq[2].ended_at == ended.ended_at
    assert by_seq[3].ended_at == ended.ended_at and by_seq[3].approval is None  # no decision came
    # a worker that comes back late cannot finish them
    with pytest.raises(TurnNotRunning):
        store.tool_completed(t.id, 2, "late")
    with pytest.raises(TurnNotRunning):
        store.decide_tool_call(t.id, waiting.seq, approved=True)
    assert calls_of(store.get_turn(t.id)) == calls_of(ended)


KILLED_WORKER = textwrap.dedent("""
    import json, sys, time
    from draftstore import Settings, Store

    urls, project = json.loads(sys.argv[1]), sys.argv[2]
    store = Store.open(**urls, settings=Settings(heartbeat_ttl_s=float(sys.argv[3])))
    turn = store.continue_turn(project, "rename the hero")
    store.write_file(turn.id, "hero.py", "hero = 'Ayla'\\n")
    store.tool_started(turn.id, "run_tests", {"path": "tests/"})
    store.tool_started(turn.id, "delete_file", {"path": "old.py"}, needs_approval=True)
    print(json.dumps({"turn": turn.id}), flush=True)
    time.sleep(600)  # killed here, its calls unfinished
""")


def test_a_worker_killed_mid_calls_leaves_them_interrupted_and_expired_and_the_continue_flags_them(
        store_factory: Any, stack: dict[str, str]) -> None:
    ttl = 1.0
    store = store_factory(settings=Settings(heartbeat_ttl_s=ttl))
    p = new_project(store)
    first = store.start_turn(p.id, "add a hero")
    store.complete_turn(first.id, "added")

    worker = subprocess.Popen([sys.executable, "-c", KILLED_WORKER, json.dumps(stack), p.id, str(ttl)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        line = worker.stdout.readline()  # type: ignore[union-attr]
        assert line, worker.stderr.read()  # type: ignore[union-attr]
        dead = json.loads(line)["turn"]
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
    assert worker.returncode == -signal.SIGKILL

    # the sweep reaps the turn once its heartbeat lapsed
    deadline = time.monotonic() + 60
    while store.get_turn(dead, tool_calls=False).status == "running":
        assert time.monotonic() < deadline, "the sweep never reaped the dead worker's turn"
        time.sleep(0.2)
        store.sweep()
    turn = store.get_turn(dead)
    assert (turn.status, turn.end_reason) == ("interrupted", "heartbeat_lapsed")
    assert calls_of(turn) == [(1, "run_tests", "interrupted"), (2, "delete_file", "expired")]
    assert all(c.ended_at == turn.ended_at for c in turn.tool_calls)

    # the next worker continues with one call: the context flags both calls
    again = store.continue_turn(p.id, "go on")
    ctx = again.context
    assert ctx is not None and again.continues_turn_id == dead
    assert [(t.id, t.status, t.end_reason) for t in ctx.turns] == [
        (first.id, "completed", "completed"), (dead, "interrupted", "heartbeat_lapsed")]
    flagged = [(c.tool_name, c.status, c.unfinished, c.ended_at is not None) for c in ctx.turns[1].tool_calls]
    assert flagged == [("run_tests", "interrupted", True, True), ("delete_file", "expired", True, True)]
    assert ctx.changes.added == ("hero.py",) and ctx.changes.deleted == ()


# -- the resume context ------------------------------------------------------------------------
def test_a_continue_of_a_continue_shows_the_whole_chain_in_order(store: Store) -> None:
    p = new_project(store)
    t1 = store.start_turn(p.id, "add a dragon")
    c = store.tool_started(t1.id, "write_file", {"path": "dragon.py"})
    store.write_file(t1.id, "dragon.py", "dragon = 1\n")
    store.tool_completed(t1.id, c.seq, {"ok": True})
    store.interrupt_turn(t1.id, partial_response={"text": "I added the dra"})
    t2 = store.continue_turn(p.id, "go on")
    store.delete_file(t2.id, "old.py")
    f = store.tool_started(t2.id, "run_tests", {})
    store.tool_failed(t2.id, f.seq, "2 failed")
    store.fail_turn(t2.id, "the model gave up")
    t3 = store.continue_turn(p.id, "try again")
    store.write_file(t3.id, "main.py", "print(2)\n")
    store.patch_characters(t3.id, {"dragon": {"hp": 99}})
    store.complete_turn(t3.id, "done: the dragon lives")

    t4 = store.continue_turn(p.id, "and now the hero")
    ctx = t4.context
    assert ctx is not None and ctx == store.resume_context(t4.id)
    assert (ctx.turn_id, ctx.draft_id, ctx.truncated, ctx.cursor) == (t4.id, t4.draft_id, False, None)
    assert [(t.number, t.continues_turn_id, t.status, t.end_reason) for t in ctx.turns] == [
        (1, None, "interrupted", "interrupted"), (2, t1.id, "failed", "failed"), (3, t2.id, "completed", "completed")]
    one, two, three = ctx.turns
    assert (one.user_message, one.partial_response, one.assistant_message) == (
        "add a dragon", {"text": "I added the dra"}, None)
    assert [(c.tool_name, c.args, c.result, c.unfinished) for c in one.tool_calls] == [
        ("write_file", {"path": "dragon.py"}, {"ok": True}, False)]
    assert (two.error, [(c.status, c.error) for c in two.tool_calls]) == ("the model gave up", [("failed", "2 failed")])
    assert three.assistant_message == "done: the dragon lives" and three.tool_calls == ()
    assert (ctx.changes.added, ctx.changes.modified, ctx.changes.deleted) == (("dragon.py",), ("main.py",), ("old.py",))
    assert (ctx.changes.characters_changed, ctx.changes.world_settings_changed) == (True, False)

    # the first turn of a draft has nothing before it
    assert store.resume_context(t1.id).turns == ()


def test_offloaded_args_come_as_digest_and_preview_and_read_whole_by_digest(store: Store) -> None:
    p = new_project(store)
    t1 = store.start_turn(p.id, "read the big file")
    big = {"content": "x" * (store.limits.inline_payload_bytes + 10)}
    store.tool_started(t1.id, "write_file", big)
    store.interrupt_turn(t1.id)
    call = store.continue_turn(p.id, "go on").context.turns[0].tool_calls[0]  # type: ignore[union-attr]
    assert call.args is None and call.args_digest is not None and call.args_preview
    assert store.read_payload(call.args_digest) == big


def test_a_long_draft_pages_its_context_and_the_cursor_covers_every_turn_once(store: Store) -> None:
    p = new_project(store)
    ids = []
    for i in range(7):
        t = (store.continue_turn if i else store.start_turn)(p.id, f"step {i}")
        c = store.tool_started(t.id, "write_file", {"path": f"f{i}.py", "text": "y" * 3000})
        store.tool_completed(t.id, c.seq, "ok")
        store.complete_turn(t.id, f"did step {i}")
        ids.append(t.id)
    last = store.continue_turn(p.id, "the end")

    def walk(**bounds: int) -> list[list[str]]:
        pages, cursor = [], None
        while True:
            ctx = store.resume_context(last.id, cursor=cursor, **bounds)
            pages.append([t.id for t in ctx.turns])
            if not ctx.truncated:
                assert ctx.cursor is None
                return pages
            assert ctx.cursor is not None
            cursor = ctx.cursor

    by_count = walk(max_turns=3)
    assert [len(x) for x in by_count] == [3, 3, 1] and [i for page in by_count for i in page] == ids
    by_size = walk(max_bytes=5000)  # a turn is a little over 3,000 bytes: one a page
    assert [len(x) for x in by_size] == [1] * 7 and [i for page in by_size for i in page] == ids
    one = store.resume_context(last.id, max_bytes=5000)
    assert len(json.dumps(one.turns, default=json_default)) <= 5000

    # the default bound comes from the settings
    assert store.settings.resume_max_turns >= 7 and not store.resume_context(last.id).truncated


def test_continuing_from_a_turn_the_draft_does_not_hold_or_a_running_one_is_a_conflict(store: Store) -> None:
    p = new_project(store)
    t1 = store.start_turn(p.id, "one")
    store.complete_turn(t1.id, "done")
    store.discard_draft(p.id)  # t1's draft is gone: a new draft
    t2 = store.start_turn(p.id, "two")
    before = store.list_turns(p.id)

    with pytest.raises(TurnConflict) as info:  # a running turn
        store.continue_turn(p.id, "three", from_turn_id=t2.id)
    assert info.value.code == "turn.conflict"
    store.interrupt_turn(t2.id)
    before = store.list_turns(p.id)
    for other in (t1.id, "0" * 32):  # another draft's turn; no turn at all
        with pytest.raises(TurnConflict):
            store.continue_turn(p.id, "three", from_turn_id=other)
    assert store.list_turns(p.id) == before  # nothing changed
    t3 = store.continue_turn(p.id, "three", from_turn_id=t2.id)
    assert t3.continues_turn_id == t2.id and [t.id for t in t3.context.turns] == [t2.id]  # type: ignore[union-attr]



def test_turns_reverted_out_of_the_draft_leave_the_context_and_cannot_be_continued(store: Store) -> None:
    p = new_project(store)
    t1 = store.start_turn(p.id, "add a dragon")
    store.write_file(t1.id, "dragon.py", "dragon = 1\n")
    store.complete_turn(t1.id, "added")
    t2 = store.continue_turn(p.id, "make it breathe fire")
    store.write_file(t2.id, "fire.py", "fire = 1\n")
    store.complete_turn(t2.id, "it does")
    store.revert_draft(p.id, t2.id)  # t2 undone: the draft is back at its start

    with pytest.raises(TurnConflict):
        store.continue_turn(p.id, "go on", from_turn_id=t2.id)
    t3 = store.continue_turn(p.id, "a gentler dragon", from_turn_id=t1.id)
    ctx = t3.context
    assert ctx is not None and [t.id for t in ctx.turns] == [t1.id]
    assert ctx.changes.added == ("dragon.py",)


# -- over HTTP ---------------------------------------------------------------------------------
def test_a_backend_continues_over_http_and_gets_the_context_in_the_same_answer(service: Service) -> None:
    c = service.client()
    p = service.store.create_project("dragons", files={"main.py": "print(1)\n"})
    t1 = c.post(f"/v1/projects/{p.id}/turns", json={"user_message": "add a dragon"}).json()
    assert "context" not in t1  # a plain start answers as it always did
    c.post(f"/v1/turns/{t1['id']}/tool-calls", json={"tool_name": "run_tests", "args": {}})
    c.post(f"/v1/turns/{t1['id']}/interrupt", json={"partial_response": {"text": "half"}})

    r = c.post(f"/v1/projects/{p.id}/turns", json={"user_message": "go on", "continue": True,
                                                    "from_turn_id": t1["id"]})
    assert r.status_code == 201, r.text
    t2 = r.json()
    assert t2["continues_turn_id"] == t1["id"] and t2["status"] == "running"
    turns = t2["context"]["turns"]
    assert [(t["id"], t["partial_response"]) for t in turns] == [(t1["id"], {"text": "half"})]
    assert [(x["status"], x["unfinished"]) for x in turns[0]["tool_calls"]] == [("interrupted", True)]
    assert c.get(f"/v1/turns/{t2['id']}/resume-context").json() == t2["context"]
    # an offloaded arg comes as digest and preview; the payload route answers it whole
    big = {"content": "x" * (service.store.limits.inline_payload_bytes + 10)}
    seq = c.post(f"/v1/turns/{t2['id']}/tool-calls", json={"tool_name": "write_file", "args": big}).json()["seq"]
    listed = c.get(f"/v1/turns/{t2['id']}/tool-calls").json()["items"][0]
    assert listed["args"] is None and listed["args_digest"] is not None
    whole = c.get(f"/v1/turns/{t2['id']}/tool-calls/{seq}/payload", params={"part": "args"})
    assert whole.status_code == 200 and whole.json() == {"seq": seq, "part": "args", "value": big}
    r = c.get(f"/v1/turns/{t2['id']}/tool-calls/{seq + 1}/payload")
    assert (r.status_code, r.json()["code"]) == (404, "toolcall.not_found")
    paged = c.get(f"/v1/turns/{t2['id']}/resume-context", params={"max_turns": 1}).json()
    assert (paged["truncated"], paged["cursor"]) == (False, None)

    # a running turn named: 409 turn.conflict; a token scoped to another project: refused
    r = c.post(f"/v1/projects/{p.id}/turns", json={"user_message": "x", "continue": True, "from_turn_id": t2["id"]})
    assert (r.status_code, r.json()["code"]) == (409, "turn.conflict")
    other = service.store.create_project("other")
    scoped = service.client(service.token("agent", project_id=other.id))
    assert scoped.get(f"/v1/turns/{t2['id']}/resume-context").status_code in (403, 404)
    assert service.client(service.token("observer")).get(
        f"/v1/turns/{t2['id']}/resume-context").status_code == 403


# -- where a person reads them -------------------------------------------------------------------
def test_the_cli_timeline_shows_interrupted_and_expired_calls_as_such(tmp_path: Any) -> None:
    home = tmp_path / "store"
    with Store.open(settings=Settings(home=home)) as store:
        p = new_project(store)
        t = store.start_turn(p.id, "look around")
        store.tool_started(t.id, "run_tests", {})
        store.tool_started(t.id, "delete_file", {"path": "old.py"}, needs_approval=True)
        store.interrupt_turn(t.id)
    env = {"DRAFTSTORE_HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": "200",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "draftstore.cli", "turn", t.id], capture_output=True, text=True,
                         env=env, cwd=home, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    tests_line = next(line for line in lines if "run_tests" in line)
    delete_line = next(line for line in lines if "delete_file" in line)
    assert "interrupted" in tests_line and "never finished" in tests_line
    assert "expired" in delete_line and "no decision" in delete_line
