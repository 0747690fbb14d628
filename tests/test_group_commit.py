"""Group commit of one-shot statements (``draftstore/db/groupcommit.py``), on PostgreSQL.

Concurrent tool-call records of one process share a transaction and its
commit. What must hold, each tested with a real group formed on purpose
(a slow statement holds the leader while the next group queues):

- the calls that queued run as one transaction (their rows share one xmin),
  and each caller gets its own answer, after the commit;
- a call the database refuses (turn ended, call unknown) gets its own typed
  error, and the rest of its group lands;
- a broken constraint rolls the group back, then each call runs alone: the
  others land exactly once;
- a connection killed under a group fails every call of that group (none of
  it committed), and the next calls work;
- a caller alone runs at once, in no group.

The embedded stack (SQLite) runs each statement alone; the turn suites run on
both stacks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from draftstore import Store
from draftstore import errors as E
from draftstore.db.groupcommit import GroupCommit
from draftstore.db.tables import TOOL_CALLS

pytestmark = pytest.mark.parametrize("stack", [pytest.param("real", marks=pytest.mark.real)], indirect=True)


def _group(store: Store) -> GroupCommit:
    return store.database.group_commit


def _wait_for(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


class Calls:
    """Runs callables on threads, each outcome (value or exception) kept in order."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.outcomes: list[Any] = []

    def start(self, fn: Callable[[], Any]) -> None:
        i = len(self.outcomes)
        self.outcomes.append(None)

        def run() -> None:
            try:
                self.outcomes[i] = fn()
            except BaseException as exc:  # noqa: BLE001 - the outcome under test
                self.outcomes[i] = exc

        th = threading.Thread(target=run, daemon=True)
        self.threads.append(th)
        th.start()

    def join(self) -> list[Any]:
        for th in self.threads:
            th.join(30)
            assert not th.is_alive(), "a call never returned"
        return self.outcomes


def _hold_leader(store: Store, calls: Calls, seconds: float) -> None:
    """Start a slow statement through the group committer and wait until it leads:
    calls made from now until it ends queue as the next group."""
    gc = _group(store)
    sleep = store.database.one_shot(sa.select(sa.func.pg_sleep(seconds)))
    calls.start(lambda: gc.run(sleep, {}))
    _wait_for("the slow statement to lead", lambda: gc._leading)


def _queued(store: Store, n: int) -> None:
    _wait_for(f"{n} calls to queue", lambda: len(_group(store)._waiting) == n)


def _projects_with_turns(store: Store, n: int) -> list[str]:
    turns = []
    for i in range(n):
        p = store.create_project(f"p{i}", files={"main.py": "print(1)\n"})
        turns.append(store.start_turn(p.id, f"turn {i}").id)
    return turns


def _xmins(store: Store, turn_ids: list[str]) -> dict[tuple[str, int], int]:
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(TOOL_CALLS.c.turn_id, TOOL_CALLS.c.seq, sa.literal_column("xmin::text::bigint"))
                            .where(TOOL_CALLS.c.turn_id.in_(turn_ids))).all()
    return {(r[0], r[1]): r[2] for r in rows}


def test_calls_queued_behind_a_running_group_commit_together_and_each_gets_its_answer(store):
    turns = _projects_with_turns(store, 4)
    gc = _group(store)
    groups = gc.groups
    calls = Calls()
    _hold_leader(store, calls, 0.3)
    for t in turns:
        calls.start(lambda t=t: store.tool_started(t, "view_file", {"path": "main.py"}))
    calls.start(lambda: store.tool_started(turns[0], "search_code", {"q": "print"}))  # a second call of one turn
    _queued(store, 5)
    outcomes = calls.join()[1:]

    assert all(not isinstance(o, BaseException) for o in outcomes), outcomes
    assert sorted((o.turn_id, o.seq) for o in outcomes) == sorted([(t, 1) for t in turns] + [(turns[0], 2)])
    assert gc.groups == groups + 1
    xmins = _xmins(store, turns)
    assert len(xmins) == 5 and len(set(xmins.values())) == 1, xmins  # one transaction
    for t in turns:  # and what the callers were told is what a reader sees
        assert [(c.seq, c.status) for c in store.get_turn(t).tool_calls] == [
            (o.seq, "started") for o in sorted(outcomes, key=lambda o: o.seq) if o.turn_id == t]
    assert [e.type for e in store.events(f"turn:{turns[0]}")] == ["turn.started", "tool.started", "tool.started"]


def test_completions_queued_together_each_finish_their_own_call(store):
    turns = _projects_with_turns(store, 3)
    started = [store.tool_started(t, "view_file", {"path": "main.py"}) for t in turns]
    calls = Calls()
    _hold_leader(store, calls, 0.3)
    calls.start(lambda: store.tool_completed(turns[0], started[0].seq, {"content": "print(1)\n"}))
    calls.start(lambda: store.tool_failed(turns[1], started[1].seq, {"message": "no such file"}))
    calls.start(lambda: store.tool_completed(turns[2], started[2].seq, "ok"))
    _queued(store, 3)
    assert calls.join()[1:] == [None, None, None]
    got = [store.get_turn(t).tool_calls[0] for t in turns]
    assert [(c.status, c.result, c.error) for c in got] == [
        ("completed", {"content": "print(1)\n"}, None), ("failed", None, {"message": "no such file"}),
        ("completed", "ok", None)]


def test_a_refused_call_gets_its_own_error_and_the_rest_of_its_group_lands(store):
    live, ended = _projects_with_turns(store, 2)
    store.complete_turn(ended, "done")
    done = store.tool_started(live, "view_file", {"path": "main.py"})
    store.tool_completed(live, done.seq, "x")
    calls = Calls()
    _hold_leader(store, calls, 0.3)
    calls.start(lambda: store.tool_started(ended, "view_file", {}))       # turn ended
    calls.start(lambda: store.tool_completed(live, 99, "x"))             # no such call
    calls.start(lambda: store.tool_completed(live, done.seq, "again"))   # already finished
    calls.start(lambda: store.tool_started(live, "find_files", {"glob": "*.py"}))
    _queued(store, 4)
    not_running, not_found, finished, ok = calls.join()[1:]

    assert isinstance(not_running, E.TurnNotRunning) and not_running.code == "turn.not_running"
    assert isinstance(not_found, E.ToolCallNotFound) and not_found.code == "toolcall.not_found"
    assert isinstance(finished, E.ToolCallAlreadyFinished)
    assert ok.seq == 2
    history = store.get_turn(live).tool_calls
    assert [(c.seq, c.tool_name, c.status, c.result) for c in history] == [
        (1, "view_file", "completed", "x"), (2, "find_files", "started", None)]
    assert store.get_turn(ended).tool_calls == ()


def test_a_broken_constraint_rolls_the_group_back_and_each_call_then_runs_alone(store):
    t1, t2 = _projects_with_turns(store, 2)
    first = store.tool_started(t1, "view_file", {})
    gc = _group(store)
    groups = gc.groups
    # a row that already exists: its insert breaks the primary key (turn_id, seq)
    duplicate = store.database.one_shot(TOOL_CALLS.insert().values(
        turn_id=sa.bindparam("p_turn_id"), seq=sa.bindparam("p_seq"), tool_name="dup", status="started",
        started_at=sa.func.now()))
    calls = Calls()
    _hold_leader(store, calls, 0.3)
    calls.start(lambda: store.tool_started(t2, "view_file", {}))
    calls.start(lambda: gc.run(duplicate, {"p_turn_id": t1, "p_seq": first.seq}))
    calls.start(lambda: store.tool_completed(t1, first.seq, "done"))
    _queued(store, 3)
    started, broken, completed = calls.join()[1:]

    assert gc.groups == groups + 1 and gc.reruns == 1
    assert isinstance(broken, sa.exc.IntegrityError), broken
    assert started.seq == 1 and completed is None
    assert [(c.seq, c.status) for c in store.get_turn(t2).tool_calls] == [(1, "started")]  # landed once
    assert [(c.seq, c.tool_name, c.status) for c in store.get_turn(t1).tool_calls] == [(1, "view_file", "completed")]
    # the pool's connections are usable after the rollback
    assert [store.tool_started(t2, "view_file", {}).seq for _ in range(3)] == [2, 3, 4]


def test_two_processes_groups_on_the_same_turns_lock_them_in_one_order(store, store_factory):
    other = store_factory()  # another process's store: its own engine and group committer
    a, b = _projects_with_turns(store, 2)
    first, second = Calls(), Calls()
    _hold_leader(store, first, 0.3)
    _hold_leader(other, second, 0.3)
    # the same two turns, queued in opposite orders: taken in arrival order, each group
    # would lock one turn's next seq and wait for the other's
    first.start(lambda: store.tool_started(a, "view_file", {}))
    second.start(lambda: other.tool_started(b, "view_file", {}))
    _queued(store, 1)
    _queued(other, 1)
    first.start(lambda: store.tool_started(b, "view_file", {}))
    second.start(lambda: other.tool_started(a, "view_file", {}))
    _queued(store, 2)
    _queued(other, 2)
    outcomes = first.join()[1:] + second.join()[1:]

    assert all(not isinstance(o, BaseException) for o in outcomes), outcomes
    # the second group to reach a turn took a seq the first had taken: that group was rolled
    # back and its records rerun alone; but no deadlock had to be broken
    assert _group(store).deadlocks == 0 and _group(other).deadlocks == 0
    for t in (a, b):
        assert sorted(o.seq for o in outcomes if o.turn_id == t) == [1, 2]
        assert [c.seq for c in store.get_turn(t).tool_calls] == [1, 2]


def test_a_connection_killed_under_a_group_fails_all_of_it_and_nothing_of_it_lands(store):
    t1, t2 = _projects_with_turns(store, 2)
    gc = _group(store)
    groups = gc.groups
    marker = store.database.one_shot(sa.select(sa.func.pg_sleep(sa.literal_column("1.5")),
                                                sa.literal_column("'group-under-test'")))
    calls = Calls()
    _hold_leader(store, calls, 0.3)
    calls.start(lambda: store.tool_started(t1, "view_file", {}))
    calls.start(lambda: gc.run(marker, {}))
    calls.start(lambda: store.tool_started(t2, "view_file", {}))
    _queued(store, 3)
    _wait_for("the group to run", lambda: gc.groups == groups + 1)
    with store.database.autocommit.connect() as admin:  # pg_stat_activity read afresh by each statement
        _wait_for("its statement to reach the database", lambda: admin.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%group-under-test%' "
            "AND pid <> pg_backend_pid()")).scalar() == 1)
        killed = admin.execute(sa.text(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
            "WHERE query LIKE '%group-under-test%' AND pid <> pg_backend_pid()")).scalar()
    assert killed == 1
    first, sleeper, second = calls.join()[1:]

    assert isinstance(first, E.BackendUnavailable) and first.code == "backend.unavailable", first
    assert isinstance(second, E.BackendUnavailable), second
    assert isinstance(sleeper, sa.exc.OperationalError), sleeper
    assert store.get_turn(t1).tool_calls == () and store.get_turn(t2).tool_calls == ()
    # the next calls get a live connection and number from 1: nothing of the group was committed
    assert store.tool_started(t1, "view_file", {}).seq == 1
    assert store.tool_started(t2, "view_file", {}).seq == 1


def test_a_caller_alone_runs_at_once_in_no_group(store):
    (t,) = _projects_with_turns(store, 1)
    gc = _group(store)
    groups = gc.groups
    for i in range(5):
        call = store.tool_started(t, "view_file", {"i": i})
        store.tool_completed(t, call.seq, i)
    assert gc.groups == groups
    assert [(c.seq, c.result) for c in store.get_turn(t).tool_calls] == [(i + 1, i) for i in range(5)]


def test_with_group_commit_off_queued_calls_run_each_alone(store_factory):
    from draftstore import Settings

    store = store_factory(settings=Settings(group_commit=False))
    turns = _projects_with_turns(store, 3)
    gc = _group(store)
    assert not gc.grouped
    barrier = threading.Barrier(3)
    calls = Calls()
    for t in turns:
        calls.start(lambda t=t: (barrier.wait(), store.tool_started(t, "view_file", {}))[1])
    assert [o.seq for o in calls.join()] == [1, 1, 1]
    assert gc.groups == 0
    xmins = _xmins(store, turns)
    assert len(set(xmins.values())) == 3, xmins  # a transaction each


def test_many_threads_recording_at_once_lose_and_duplicate_nothing(store):
    turns = _projects_with_turns(store, 4)
    barrier = threading.Barrier(12)
    seqs: dict[str, list[int]] = {t: [] for t in turns}
    lock = threading.Lock()

    def agent(w: int) -> None:
        t = turns[w % len(turns)]  # three threads per turn
        barrier.wait()
        for i in range(15):
            call = store.tool_started(t, f"tool{w}", {"i": i})
            store.tool_completed(t, call.seq, {"w": w, "i": i})
            with lock:
                seqs[t].append(call.seq)

    calls = Calls()
    for w in range(12):
        calls.start(lambda w=w: agent(w))
    assert calls.join() == [None] * 12  # no agent raised
    for t in turns:
        assert sorted(seqs[t]) == list(range(1, 46))
        calls = store.get_turn(t).tool_calls
        assert [c.seq for c in calls] == list(range(1, 46)) and {c.status for c in calls} == {"completed"}
        assert sorted((c.result["w"], c.result["i"]) for c in calls) == sorted(
            (w, i) for w in range(12) if turns[w % len(turns)] == t for i in range(15))
