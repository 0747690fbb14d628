"""Turns: boundaries, tool-call history, continuation, late writes, recovery.

Every story runs on the embedded and on the real stack (``stack``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import sqlalchemy as sa

from draftstore import (
    DraftBusy,
    DraftNone,
    DraftstoreError,
    Settings,
    Store,
    ToolCallAlreadyFinished,
    ToolCallNotFound,
    ToolCallNotStarted,
    TurnAlreadyRunning,
    TurnNotRunning,
)
from draftstore.db.tables import DRAFTS, TURNS, utcnow


def new_project(store: Store, **files: str):
    return store.create_project("demo", files=files or {"main.py": "print(1)\n"}, characters={"hero": {"hp": 10}})


# -- a turn's boundaries and history --------------------------------------------------------
def test_a_turn_keeps_its_messages_and_tool_calls_in_order(store):
    p = new_project(store)
    t = store.start_turn(p.id, "add a greeting")
    assert t.status == "running" and t.number == 1 and t.user_message == "add a greeting"

    first = store.tool_started(t.id, "view_file", {"path": "main.py"})
    store.tool_completed(t.id, first.seq, {"content": "print(1)\n"})
    second = store.tool_started(t.id, "write_file", {"path": "hello.py"})
    store.tool_failed(t.id, second.seq, "disk on fire")
    third = store.tool_started(t.id, "search_code", {"q": "print"})
    done = store.complete_turn(t.id, "added hello.py")

    assert [first.seq, second.seq, third.seq] == [1, 2, 3]
    assert done.status == "completed" and done.assistant_message == "added hello.py"
    assert done.ended_at is not None and done.ended_at >= done.started_at
    calls = done.tool_calls
    assert [(c.seq, c.tool_name, c.status) for c in calls] == [
        (1, "view_file", "completed"),
        (2, "write_file", "failed"),
        (3, "search_code", "interrupted"),  # still running when the turn ended: it ended with it
    ]
    assert calls[0].args == {"path": "main.py"} and calls[0].result == {"content": "print(1)\n"}
    assert calls[1].error == "disk on fire" and calls[1].ended_at is not None
    assert calls[2].ended_at == done.ended_at


def test_tool_seq_numbers_restart_for_every_turn(store):
    p = new_project(store)
    t1 = store.start_turn(p.id, "one")
    assert [store.tool_started(t1.id, "a").seq for _ in range(3)] == [1, 2, 3]
    store.complete_turn(t1.id, "ok")
    t2 = store.continue_turn(p.id, "two")
    assert store.tool_started(t2.id, "b").seq == 1


def test_big_tool_args_and_results_are_offloaded_with_a_preview(store):
    p = new_project(store)
    t = store.start_turn(p.id, "read a big file")
    big_args = {"path": "big.txt", "blob": "a" * 20_000}
    big_result = {"lines": [f"line {i}" for i in range(3_000)]}
    call = store.tool_started(t.id, "view_file", big_args)
    store.tool_completed(t.id, call.seq, big_result)
    small = store.tool_started(t.id, "stat", {"path": "x"})
    store.tool_completed(t.id, small.seq, {"size": 3})

    big, tiny = store.get_turn(t.id).tool_calls
    assert big.args_offloaded and big.result_offloaded
    assert big.args is None and big.result is None
    limit = store.limits.payload_preview_chars
    assert 0 < len(big.args_preview) <= limit and json.dumps(big_args, separators=(",", ":")).startswith(
        big.args_preview
    )
    assert 0 < len(big.result_preview) <= limit
    assert store.read_payload(big.args_digest) == big_args
    assert store.read_payload(big.result_digest) == big_result
    assert not tiny.args_offloaded and tiny.args == {"path": "x"} and tiny.result == {"size": 3}


def test_completing_a_tool_call_twice_is_refused(store):
    p = new_project(store)
    t = store.start_turn(p.id, "x")
    call = store.tool_started(t.id, "view_file", {"path": "main.py"})
    store.tool_completed(t.id, call.seq, "first")
    with pytest.raises(ToolCallAlreadyFinished) as exc:
        store.tool_completed(t.id, call.seq, "second")
    assert exc.value.code == "toolcall.already_finished"
    assert isinstance(exc.value, ToolCallNotStarted)  # callers that caught the older, wider error still do
    with pytest.raises(ToolCallAlreadyFinished):
        store.tool_failed(t.id, call.seq, "too late")
    with pytest.raises(ToolCallNotFound) as missing:
        store.tool_completed(t.id, 99, "never started")
    assert missing.value.code == "toolcall.not_found"
    (only,) = store.get_turn(t.id).tool_calls
    assert only.status == "completed" and only.result == "first"


def test_a_call_on_a_missing_or_ended_turn_is_refused_the_same_way_whatever_the_call(store):
    p = new_project(store)
    ended = store.start_turn(p.id, "x").id
    store.complete_turn(ended, "done")
    missing = "0" * 32
    calls = {
        "append_delta": lambda t: store.append_delta(t, "more text"),
        "tool_started": lambda t: store.tool_started(t, "view_file", {"path": "main.py"}),
        "write_file": lambda t: store.write_file(t, "new.py", "x = 1\n"),
        "heartbeat": lambda t: store.heartbeat(t),
        "complete_turn": lambda t: store.complete_turn(t, "done"),
    }
    for name, call in calls.items():
        with pytest.raises(DraftstoreError) as gone:
            call(missing)
        assert (gone.value.code, gone.value.details) == ("turn.not_found", {"turn_id": missing}), name
        assert gone.value.message == f"no turn {missing!r}", name
        with pytest.raises(TurnNotRunning) as over:
            call(ended)
        assert over.value.details == {"turn_id": ended, "status": "completed"}, name
        assert over.value.message.startswith(f"turn {ended} is completed; "), name
    assert store.view(p.id).file("new.py") is None and store.get_turn(ended).tool_calls == ()


def test_each_turn_records_its_start_and_end_root(store):
    p = new_project(store)
    head = store.get_version(p.current_version_id)
    t1 = store.start_turn(p.id, "one")
    assert t1.start_root == head.root and t1.end_root is None
    store.write_file(t1.id, "a.py", "a = 1\n")
    t1 = store.complete_turn(t1.id, "wrote a.py")
    draft = store.get_draft(p.id)
    assert t1.end_root == draft.root != head.root

    t2 = store.continue_turn(p.id, "two")
    assert t2.start_root == t1.end_root
    assert t2.continues_turn_id == t1.id and t2.number == 2
    store.delete_file(t2.id, "a.py")
    t2 = store.interrupt_turn(t2.id)
    assert t2.end_root == store.get_draft(p.id).root == head.root

    version = store.publish(p.id, "nothing changed in the end")
    assert version.root == t2.end_root


def test_a_turn_without_writes_ends_at_its_start_root(store):
    p = new_project(store)
    t = store.start_turn(p.id, "just look")
    t = store.complete_turn(t.id, "looked")
    assert t.end_root == t.start_root == store.get_version(p.current_version_id).root


# -- one running turn per project -------------------------------------------------------------
def test_starting_a_turn_while_another_runs_is_refused(store, store_factory):
    p = new_project(store)
    t = store.start_turn(p.id, "first")
    with pytest.raises(TurnAlreadyRunning) as exc:
        store.start_turn(p.id, "second")
    assert exc.value.code == "turn.already_running"
    with pytest.raises(TurnAlreadyRunning):
        store_factory().continue_turn(p.id, "from another instance")
    assert [x.id for x in store.list_turns(p.id)] == [t.id]
    assert store.get_turn(t.id).status == "running"


def test_continuing_a_project_without_a_draft_is_refused(store):
    p = new_project(store)
    with pytest.raises(DraftNone) as exc:
        store.continue_turn(p.id, "continue what?")
    assert exc.value.code == "draft.none"
    assert store.list_turns(p.id) == []
    assert store.get_project(p.id).active_draft_id is None


def test_continuing_after_the_draft_was_published_is_refused(store):
    p = new_project(store)
    t = store.start_turn(p.id, "one")
    store.complete_turn(t.id, "ok")
    store.publish(p.id)
    with pytest.raises(DraftNone):
        store.continue_turn(p.id, "again")


# -- continuation by another worker ------------------------------------------------------------
def test_an_interrupted_turn_can_be_continued_by_a_new_store_instance(store, store_factory):
    p = new_project(store)
    t1 = store.start_turn(p.id, "write two files")
    c = store.tool_started(t1.id, "write_file", {"path": "one.py"})
    store.write_file(t1.id, "one.py", "one = 1\n")
    store.tool_completed(t1.id, c.seq, "ok")
    store.tool_started(t1.id, "write_file", {"path": "two.py"})  # the worker dies here
    store.interrupt_turn(t1.id, partial_response={"text": "I wrote one.py and"})

    other = store_factory()
    t2 = other.continue_turn(p.id, "go on")
    assert t2.continues_turn_id == t1.id and t2.draft_id == t1.draft_id
    assert other.view(p.id).read_text("one.py") == "one = 1\n"
    other.write_file(t2.id, "two.py", "two = 2\n")
    other.complete_turn(t2.id, "wrote both")

    old = other.get_turn(t1.id)
    assert old.status == "interrupted" and old.user_message == "write two files"
    assert old.partial_response == {"text": "I wrote one.py and"}
    # the call left running when the turn was interrupted ended with it
    assert [(x.seq, x.status) for x in old.tool_calls] == [(1, "completed"), (2, "interrupted")]
    assert store.get_draft(p.id).partial_response == {"text": "I wrote one.py and"}
    assert store.view(p.id).list_files() == ["main.py", "one.py", "two.py"]


CONTINUE_IN_ANOTHER_PROCESS = textwrap.dedent(
    """
    import json, sys
    from draftstore import Store

    urls, project_id, old_turn_id = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    with Store.open(**urls) as store:
        old = store.get_turn(old_turn_id)
        t = store.continue_turn(project_id, "please finish")
        seen = store.view(project_id).read_text("one.py")
        call = store.tool_started(t.id, "write_file", {"path": "two.py"})
        store.write_file(t.id, "two.py", "two = 2\\n")
        store.tool_completed(t.id, call.seq, {"ok": True})
        done = store.complete_turn(t.id, "finished in process " + str(__import__("os").getpid()))
    print(json.dumps({
        "turn_id": done.id,
        "continues": done.continues_turn_id,
        "seen": seen,
        "old_calls": [[c.seq, c.tool_name, c.status] for c in old.tool_calls],
        "old_user_message": old.user_message,
        "pid": __import__("os").getpid(),
    }))
    """
)


def test_an_interrupted_turn_can_be_continued_by_another_os_process(store, stack):
    p = new_project(store)
    t1 = store.start_turn(p.id, "write two files")
    c = store.tool_started(t1.id, "write_file", {"path": "one.py"})
    store.write_file(t1.id, "one.py", "one = 1\n")
    store.tool_completed(t1.id, c.seq, {"ok": True})
    store.interrupt_turn(t1.id, partial_response={"text": "half done"})

    proc = subprocess.run(
        [sys.executable, "-c", CONTINUE_IN_ANOTHER_PROCESS, json.dumps(stack), p.id, t1.id],
        capture_output=True, text=True, timeout=120, env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["pid"] != os.getpid()
    assert out["continues"] == t1.id and out["seen"] == "one = 1\n"
    assert out["old_calls"] == [[1, "write_file", "completed"]]
    assert out["old_user_message"] == "write two files"

    turns = store.list_turns(p.id)
    assert [(x.id, x.status) for x in turns] == [(t1.id, "interrupted"), (out["turn_id"], "completed")]
    old, new = store.get_turn(t1.id), store.get_turn(out["turn_id"])
    assert old.partial_response == {"text": "half done"}
    assert [(x.tool_name, x.status, x.result) for x in old.tool_calls] == [("write_file", "completed", {"ok": True})]
    assert new.assistant_message.startswith("finished in process")
    assert [(x.seq, x.status) for x in new.tool_calls] == [(1, "completed")]
    view = store.view(p.id)
    assert view.list_files() == ["main.py", "one.py", "two.py"] and view.read_text("two.py") == "two = 2\n"
    assert new.end_root == store.get_draft(p.id).root


# -- a late write from a worker presumed dead is refused ------------------------------------------
def _end_by_interrupt(store, p, t):
    store.interrupt_turn(t.id)


def _end_by_complete(store, p, t):
    store.complete_turn(t.id, "done")


def _end_by_failure(store, p, t):
    store.fail_turn(t.id, "model crashed")


def _end_by_discard(store, p, t):
    store.discard_draft(p.id)


ENDINGS = {
    "interrupted": _end_by_interrupt,
    "completed": _end_by_complete,
    "failed": _end_by_failure,
    "rolled_back": _end_by_discard,
}

LATE_WRITES = {
    "write_file": lambda s, t, seq: s.write_file(t.id, "late.py", "late = True\n"),
    "overwrite_file": lambda s, t, seq: s.write_file(t.id, "main.py", "corrupted\n"),
    "delete_file": lambda s, t, seq: s.delete_file(t.id, "main.py"),
    "move_file": lambda s, t, seq: s.move_file(t.id, "main.py", "moved.py"),
    "apply_changes": lambda s, t, seq: s.apply_changes(t.id, {"late.py": b"x", "main.py": None}),
    "patch_characters": lambda s, t, seq: s.patch_characters(t.id, {"hero": {"hp": 0}}),
    "patch_world_settings": lambda s, t, seq: s.patch_world_settings(t.id, [{"op": "add", "path": "/x", "value": 1}]),
    "tool_started": lambda s, t, seq: s.tool_started(t.id, "view_file", {"path": "main.py"}),
    "tool_completed": lambda s, t, seq: s.tool_completed(t.id, seq, "late result"),
    "tool_failed": lambda s, t, seq: s.tool_failed(t.id, seq, "late error"),
}


def _state(store, p, t):
    turn = store.get_turn(t.id)
    view = store.view(p.id)
    files = {path: view.read_file(path) for path in view.list_files()}
    draft_rev = store.get_draft(p.id).revision if store.get_project(p.id).active_draft_id else None
    return (turn.status, turn.end_root, [(c.seq, c.status, c.result, c.error) for c in turn.tool_calls],
            files, view.characters, view.world_settings, draft_rev)


@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.parametrize("late_write", list(LATE_WRITES))
def test_a_late_write_from_an_ended_turn_is_refused_and_changes_nothing(store, late_write, ending):
    p = new_project(store)
    t = store.start_turn(p.id, "work")
    store.write_file(t.id, "kept.py", "kept = 1\n")
    pending = store.tool_started(t.id, "slow_tool", {"n": 1})
    ENDINGS[ending](store, p, t)
    before = _state(store, p, t)
    assert before[0] == ending

    with pytest.raises(TurnNotRunning) as exc:
        LATE_WRITES[late_write](store, t, pending.seq)
    assert exc.value.code == "turn.not_running"
    assert exc.value.details["status"] == ending
    assert _state(store, p, t) == before


def test_a_late_write_from_the_previous_turn_cannot_touch_the_continued_draft(store, store_factory):
    p = new_project(store)
    t1 = store.start_turn(p.id, "one")
    store.interrupt_turn(t1.id)
    t2 = store_factory().continue_turn(p.id, "two")  # same draft, new turn
    with pytest.raises(TurnNotRunning):
        store.write_file(t1.id, "zombie.py", "boo\n")
    store.write_file(t2.id, "alive.py", "ok\n")
    assert store.view(p.id).list_files() == ["alive.py", "main.py"]


# -- the database itself enforces the invariants ---------------------------------------------
def test_the_database_refuses_a_second_open_draft_for_a_project(store):
    p = new_project(store)
    t = store.start_turn(p.id, "creates the draft")
    draft = store.get_draft(p.id)
    now = utcnow()
    row = dict(project_id=p.id, base_version_id=p.current_version_id, status="paused",
               code_manifest_key=draft.root, file_count=1, characters_json="{}",
               world_settings_json="{}", revision=0, status_changed_at=now, created_at=now)
    with pytest.raises(sa.exc.IntegrityError):
        with store.engine.begin() as conn:
            conn.execute(DRAFTS.insert().values(id="f" * 32, **row))
    # a closed draft of the same project is fine: the index is partial
    with store.engine.begin() as conn:
        conn.execute(DRAFTS.insert().values(id="e" * 32, closed_at=now, closed_reason="discarded", **row))
    assert store.get_draft(p.id).id == draft.id
    assert store.get_turn(t.id).status == "running"


def test_the_database_refuses_a_second_running_turn_for_a_project(store):
    p = new_project(store)
    t = store.start_turn(p.id, "running")
    with pytest.raises(sa.exc.IntegrityError):
        with store.engine.begin() as conn:
            conn.execute(TURNS.insert().values(
                id="d" * 32, project_id=p.id, draft_id=t.draft_id, number=2, status="running",
                user_message_json="sneaky", started_at=utcnow(),
            ))
    assert [x.id for x in store.list_turns(p.id)] == [t.id]


# -- recovery sweep -------------------------------------------------------------------------------
def test_the_sweep_interrupts_a_turn_whose_heartbeat_lapsed(store_factory):
    fast = Settings(heartbeat_ttl_s=0.5)
    worker = store_factory(settings=fast)
    sweeper = store_factory(settings=fast)  # opened first: opening may take a while
    p = new_project(worker)
    dead = worker.start_turn(p.id, "the worker will die")
    worker.write_file(dead.id, "half.py", "half = True\n")

    # within the TTL the turn is alive: the sweep leaves it alone
    # (the real stack shares one database between tests: look only at what is ours)
    worker.heartbeat(dead.id)  # a live worker beats; a slow machine must not make it look dead
    sweeper.sweep()
    assert worker.get_turn(dead.id).status == "running"
    time.sleep(0.6)
    counts = sweeper.sweep()

    assert counts["turns_reaped"] >= 1
    turn = sweeper.get_turn(dead.id)
    assert turn.status == "interrupted"
    assert turn.end_root == sweeper.get_draft(p.id).root
    assert sweeper.view(p.id).read_text("half.py") == "half = True\n"
    with pytest.raises(TurnNotRunning):
        worker.write_file(dead.id, "late.py", "no\n")
    assert sweeper.continue_turn(p.id, "pick up").continues_turn_id == dead.id


def test_the_sweep_leaves_a_turn_with_a_fresh_heartbeat_alone(store_factory):
    # a TTL several beats long: a loaded machine must not make a live worker look dead
    s = store_factory(settings=Settings(heartbeat_ttl_s=1.0))
    p = new_project(s)
    t = s.start_turn(p.id, "alive")
    deadline = time.monotonic() + 1.5  # the turn grows older than the TTL while it beats
    while time.monotonic() < deadline:
        time.sleep(0.1)
        s.heartbeat(t.id)
    s.sweep()
    assert s.get_turn(t.id).status == "running"
    s.write_file(t.id, "still.py", "alive\n")


def test_the_sweep_releases_a_draft_stuck_in_publishing(store_factory):
    s = store_factory(settings=Settings(publishing_stuck_s=60))
    p = new_project(s)
    t = s.start_turn(p.id, "work")
    s.write_file(t.id, "new.py", "new\n")
    s.complete_turn(t.id, "done")
    draft = s.get_draft(p.id)
    with s.engine.begin() as conn:  # a publisher died midway
        conn.execute(DRAFTS.update().where(DRAFTS.c.id == draft.id).values(
            status="publishing", status_changed_at=utcnow() - timedelta(minutes=10)))
    assert s.get_draft(p.id).status == "publishing"

    counts = s.sweep()
    assert counts["publishing_released"] >= 1
    released = s.get_draft(p.id)
    assert released.id == draft.id and released.status == "interrupted" and released.closed_at is None
    version = s.publish(p.id, "after recovery")
    assert version.number == 2 and s.view(p.id).read_text("new.py") == "new\n"


def test_the_sweep_leaves_a_recent_publish_alone(store_factory):
    s = store_factory(settings=Settings(publishing_stuck_s=60))
    p = new_project(s)
    t = s.start_turn(p.id, "work")
    s.complete_turn(t.id, "done")
    draft = s.get_draft(p.id)
    with s.engine.begin() as conn:
        conn.execute(DRAFTS.update().where(DRAFTS.c.id == draft.id)
                     .values(status="publishing", status_changed_at=utcnow()))
    s.sweep()
    assert s.get_draft(p.id).status == "publishing"


# -- schema -----------------------------------------------------------------------------------------
@pytest.mark.real
def test_opening_an_unmigrated_postgres_database_is_refused(real_postgres, tmp_path):
    from draftstore import SchemaOutdated

    import psycopg

    from services import _with_database, token

    name = f"draftstore_scratch_{token()}"
    with psycopg.connect(real_postgres.admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        url = _with_database(real_postgres.admin_url, name, "postgresql+psycopg")
        with pytest.raises(SchemaOutdated) as exc:
            Store.open(database_url=url, blob_url=f"file://{tmp_path}/blobs", coord_url="memory://")
        assert exc.value.code == "schema.outdated"
        engine = sa.create_engine(url)
        try:
            with engine.connect() as conn:
                tables = conn.execute(sa.text(
                    "select count(*) from information_schema.tables where table_schema = 'public'"
                )).scalar()
        finally:
            engine.dispose()
        assert tables == 0  # refusing to open created nothing
    finally:
        with psycopg.connect(real_postgres.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- races between workers ------------------------------------------------------------------------
def test_racing_turn_starts_let_exactly_one_turn_run(store, store_factory):
    p = new_project(store)
    stores = [store] + [store_factory() for _ in range(3)]
    barrier = threading.Barrier(len(stores))
    results: list[object] = [None] * len(stores)

    def start(i: int) -> None:
        barrier.wait()
        try:
            results[i] = stores[i].start_turn(p.id, f"racer {i}")
        except DraftstoreError as exc:
            results[i] = exc

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(stores))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    winners = [r for r in results if not isinstance(r, DraftstoreError)]
    assert len(winners) == 1, results
    assert {r.code for r in results if isinstance(r, DraftstoreError)} == {"turn.already_running"}
    turns = store.list_turns(p.id)
    assert [(t.id, t.status) for t in turns] == [(winners[0].id, "running")]
    assert store.get_draft(p.id).id == winners[0].draft_id


def test_concurrent_tool_calls_of_one_turn_get_distinct_consecutive_seqs(store):
    p = new_project(store)
    t = store.start_turn(p.id, "parallel tools")
    barrier = threading.Barrier(4)
    seqs: list[int] = []
    errors: list[BaseException] = []

    def record(w: int) -> None:
        try:
            barrier.wait()
            for i in range(10):
                call = store.tool_started(t.id, f"tool{w}", {"i": i})
                store.tool_completed(t.id, call.seq, i)
                seqs.append(call.seq)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=record, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert sorted(seqs) == list(range(1, 41))
    calls = store.get_turn(t.id).tool_calls
    assert [c.seq for c in calls] == list(range(1, 41)) and all(c.status == "completed" for c in calls)


def test_a_turn_cannot_start_while_its_draft_is_being_published(store):
    p = new_project(store)
    t = store.start_turn(p.id, "one")
    store.complete_turn(t.id, "ok")
    with store.engine.begin() as conn:
        conn.execute(DRAFTS.update().where(DRAFTS.c.id == t.draft_id).values(status="publishing"))
    with pytest.raises(DraftBusy) as exc:
        store.continue_turn(p.id, "two")
    assert exc.value.code == "draft.busy"
    assert [x.id for x in store.list_turns(p.id)] == [t.id]


# -- events ------------------------------------------------------------------------------------------
def test_a_turns_events_can_be_replayed_in_order(store):
    p = new_project(store)
    t = store.start_turn(p.id, "evented")
    call = store.tool_started(t.id, "view_file", {"path": "main.py"})
    store.tool_completed(t.id, call.seq, "print(1)")
    store.write_file(t.id, "a.py", "a")
    store.complete_turn(t.id, "done")
    events = store.events(f"turn:{t.id}")
    types = [e.type for e in events]
    assert types == ["turn.started", "tool.started", "tool.completed", "draft.changed", "turn.completed"]
    ids = [e.id for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert [e.type for e in store.events(f"turn:{t.id}", after=ids[2])] == types[3:]


def test_the_event_buffer_of_an_ended_turn_expires_after_its_ttl(store_factory):
    s = store_factory(settings=Settings(event_ttl_s=0.5))
    p = new_project(s)
    live = s.start_turn(p.id, "ends")
    s.tool_started(live.id, "view_file", {"path": "main.py"})
    s.complete_turn(live.id, "done")
    assert [e.type for e in s.events(f"turn:{live.id}")] == ["turn.started", "tool.started", "turn.completed"]
    running = s.continue_turn(p.id, "still running")
    s.tool_started(running.id, "view_file", {"path": "main.py"})
    time.sleep(1.0)
    # the ended turn's buffer is gone (its events are all in the database); a running turn's stays
    assert s.events(f"turn:{live.id}") == []
    assert [e.type for e in s.events(f"turn:{running.id}")] == ["turn.started", "tool.started"]
    assert [e.type for e in s.events(f"project:{p.id}")][:2] == ["turn.started", "turn.completed"]


def test_an_end_state_changed_after_it_was_prepared_is_stored_as_it_ends(store, store_factory, monkeypatch):
    # the end state's object is uploaded before the ending transaction, from the draft as
    # read then; a patch that lands between is caught under the lock and stored there
    pid = store.create_project("race", files={"a.py": b"a\n"}, characters={"hero": {"hp": 1}}).id
    turn = store.start_turn(pid, "patch")
    store.patch_characters(turn.id, {"hero": {"hp": 2}})
    other = store_factory()
    turns = store._turns
    real_upload = turns._upload_end_state

    def upload_then_patch(row):
        prepared = real_upload(row)
        other.patch_characters(turn.id, {"hero": {"hp": 3}})  # lands before the end's transaction
        return prepared

    monkeypatch.setattr(turns, "_upload_end_state", upload_then_patch)
    ended = store.complete_turn(turn.id, "done")
    assert ended.status == "completed"
    for s in (store, store_factory()):  # a fresh store reads the object from the blob store
        assert s.view_at_turn(turn.id, "end").characters == {"hero": {"hp": 3}}
        assert s.view_at_turn(turn.id, "start").characters == {"hero": {"hp": 1}}


def test_a_start_state_changed_after_it_was_read_is_stored_as_the_turn_starts(store, store_factory, monkeypatch):
    # the start state is read and stored before the rows are locked; if the draft changed
    # between (a discard, a publish), the state under the lock differs and is stored there.
    # Here the read is made stale by hand: the project's state under the lock (hp 1) has
    # never been a turn's boundary, so its object exists only if the begin stores it
    from draftstore.turns import state_blob

    pid = store.create_project("race-start", files={"a.py": b"a\n"}, characters={"hero": {"hp": 1}}).id
    real = store._turns._running_and_start_state
    monkeypatch.setattr(store._turns, "_running_and_start_state",
                        lambda conn, project: (real(conn, project)[0], state_blob({"hero": {"hp": 0}}, {})))
    started = store.start_turn(pid, "starts on head")
    for s in (store, store_factory()):  # a fresh store reads the object from the blob store
        assert s.view_at_turn(started.id, "start").characters == {"hero": {"hp": 1}}
