"""Workers killed for real (``kill -9`` of a subprocess) lose nothing they were told was stored,
and leave nothing half-done: a turn is either still running (and the recovery sweep ends it,
sealing its writes) or fully ended. Heartbeats are seen by every store on the same data.

Each story runs on the embedded stack (SQLite + blob directory + the SQLite coordinator
file, as a user gets it with nothing configured) and on the real one.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from draftstore import Settings, Store, TurnNotRunning
from draftstore.db.tables import DRAFT_CHANGES, TOOL_CALLS

HEARTBEAT_TTL_S = 1.0

WORKER = textwrap.dedent(
    """
    import json, sys
    from draftstore import Store, faults

    urls, project_id, action, pause_at = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    with Store.open(**urls) as store:
        if action == "publish":
            print(json.dumps({"ready": True}), flush=True)
            faults.arm(pause_at)
            store.publish(project_id, "killed midway")
            sys.exit(0)
        t = store.start_turn(project_id, "work that will be killed")
        call = store.tool_started(t.id, "write_file", {"path": "done.py"})
        store.write_file(t.id, "done.py", "done = True\\n")
        store.tool_completed(t.id, call.seq, {"ok": True})
        store.patch_characters(t.id, {"dragon": {"hp": 99}})
        print(json.dumps({"turn_id": t.id}), flush=True)
        faults.arm(pause_at)  # everything above was acknowledged; what follows is killed midway
        if action == "complete":
            store.complete_turn(t.id, "finished")
        elif action == "write":
            store.write_file(t.id, "unacknowledged.py", "never acknowledged\\n")
    """
)


class Worker:
    """A worker subprocess whose stdout and stderr lines are read on threads,
    so a test waits for a line with a deadline and never hangs on a stuck worker."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.out: queue.Queue[str] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        self.stderr_seen: list[str] = []
        for stream, q in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, q=q: [q.put(line) for line in s], daemon=True).start()

    def _line(self, q: queue.Queue[str], timeout: float) -> str:
        try:
            line = q.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            self.proc.wait(timeout=30)
            time.sleep(0.2)  # let the reader threads take what the worker wrote last
            rest = list(self.stderr_seen)
            while not self.err.empty():
                rest.append(self.err.get_nowait())
            rest = "".join(rest)
            pytest.fail(f"worker gave no line within {timeout}s (exit {self.proc.poll()}):\n{rest}")
        if q is self.err:
            self.stderr_seen.append(line)
        return line

    def json_line(self, timeout: float = 60) -> Any:
        return json.loads(self._line(self.out, timeout))

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def kill_when_paused(self, point: str, timeout: float = 60) -> None:
        """Wait until the worker says it reached ``point``, then kill -9 it."""
        deadline = time.monotonic() + timeout
        while not any(f"paused at {point}" in line for line in self.stderr_seen):
            self._line(self.err, max(0.1, deadline - time.monotonic()))
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(timeout=30) == -signal.SIGKILL

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def _worker(stack: dict[str, str], project_id: str, action: str, pause_at: str) -> tuple[Worker, Any]:
    """Start a worker that pauses at ``pause_at`` once armed; returns it with the JSON line it printed."""
    env = dict(os.environ, DRAFTSTORE_HEARTBEAT_TTL_S=str(HEARTBEAT_TTL_S))
    worker = Worker([WORKER, json.dumps(stack), project_id, action, pause_at], env)
    try:
        return worker, worker.json_line()
    except BaseException:
        worker.close()
        raise


def _sweep_until_reaped(store: Store, turn_id: str) -> None:
    deadline = time.monotonic() + 30
    while store.get_turn(turn_id).status == "running":
        assert time.monotonic() < deadline, "the sweep never reaped the dead worker's turn"
        time.sleep(0.2)
        store.sweep()


def _new_project(store: Store) -> Any:
    return store.create_project("crash", files={"main.py": "print(1)\n"}, characters={"hero": {"hp": 10}})


def test_a_worker_killed_while_ending_its_turn_leaves_it_running_and_the_sweep_seals_it(store_factory, stack):
    store = store_factory(settings=Settings(heartbeat_ttl_s=HEARTBEAT_TTL_S))
    p = _new_project(store)
    worker, out = _worker(stack, p.id, "complete", "turn.end.before_commit")
    worker.kill_when_paused("turn.end.before_commit")
    t = out["turn_id"]

    # killed inside the ending transaction: nothing of the end happened
    turn = store.get_turn(t)
    assert turn.status == "running" and turn.end_root is None and turn.assistant_message is None
    assert [(c.seq, c.status) for c in turn.tool_calls] == [(1, "completed")]
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(TOOL_CALLS)
                            .where(TOOL_CALLS.c.turn_id == t)).scalar() == 1
    assert store.view(p.id).read_text("done.py") == "done = True\n"  # acknowledged before the kill

    _sweep_until_reaped(store, t)
    turn = store.get_turn(t)
    assert turn.status == "interrupted" and turn.end_root == store.get_draft(p.id).root
    assert [(c.seq, c.status, c.result) for c in turn.tool_calls] == [(1, "completed", {"ok": True})]
    with store.engine.connect() as conn:  # sealed: the overlay is folded, the history compacted
        assert conn.execute(sa.select(sa.func.count()).select_from(DRAFT_CHANGES)
                            .where(DRAFT_CHANGES.c.draft_id == turn.draft_id)).scalar() == 0
        assert conn.execute(sa.select(sa.func.count()).select_from(TOOL_CALLS)
                            .where(TOOL_CALLS.c.turn_id == t)).scalar() == 0
    end = store.view_at_turn(t, "end")
    assert end.read_text("done.py") == "done = True\n" and end.characters["dragon"] == {"hp": 99}
    nxt = store.continue_turn(p.id, "pick up where the dead worker stopped")
    assert nxt.continues_turn_id == t and nxt.start_root == turn.end_root


def test_a_write_killed_before_its_commit_is_absent_and_names_no_missing_blob(store_factory, stack):
    store = store_factory(settings=Settings(heartbeat_ttl_s=HEARTBEAT_TTL_S))
    p = _new_project(store)
    worker, out = _worker(stack, p.id, "write", "write.before_commit")
    worker.kill_when_paused("write.before_commit")
    t = out["turn_id"]

    view = store.view(p.id)
    assert view.list_files() == ["done.py", "main.py"]  # the acknowledged write, not the killed one
    for path in view.list_files():
        view.read_file(path)  # every file the state names is in the blob store, verified
    _sweep_until_reaped(store, t)
    assert store.view_at_turn(t, "end").list_files() == ["done.py", "main.py"]
    nxt = store.continue_turn(p.id, "again")
    store.write_file(nxt.id, "unacknowledged.py", "written by the next worker\n")
    store.complete_turn(nxt.id, "done")
    assert store.publish(p.id, "after the crash").number == 2


def test_a_publisher_killed_before_its_commit_leaves_the_draft_open_and_publishable(store_factory, stack):
    store = store_factory()
    p = _new_project(store)
    t = store.start_turn(p.id, "work")
    store.write_file(t.id, "new.py", "new = 1\n")
    store.complete_turn(t.id, "done")
    before = store.get_draft(p.id)

    worker, _ = _worker(stack, p.id, "publish", "publish.before_commit")
    worker.kill_when_paused("publish.before_commit")

    after = store.get_draft(p.id)
    assert (after.id, after.status, after.root, after.revision) == (before.id, "paused", before.root, before.revision)
    assert [v.number for v in store.list_versions(p.id)] == [1]
    assert store.get_project(p.id).current_version_id == p.current_version_id
    version = store.publish(p.id, "second try")
    assert version.number == 2 and store.view(p.id).read_text("new.py") == "new = 1\n"


# -- heartbeats are shared by every store on the same data ------------------------------------
BEATING_WORKER = textwrap.dedent(
    """
    import json, sys, time
    from draftstore import Settings, Store, TurnNotRunning

    urls, project_id, seconds = json.loads(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    with Store.open(**urls, settings=Settings(heartbeat_ttl_s=float(sys.argv[4]))) as store:
        t = store.start_turn(project_id, "a long turn with a live worker")
        print(json.dumps({"turn_id": t.id}), flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            store.heartbeat(t.id)
            time.sleep(0.1)
        print(json.dumps({"alive_to_the_end": store.get_turn(t.id).status}), flush=True)
        sys.stdin.readline()  # wait until the test has interrupted the turn
        try:
            store.heartbeat(t.id)
            print(json.dumps({"heartbeat": "accepted"}), flush=True)
        except TurnNotRunning as exc:
            print(json.dumps({"heartbeat": exc.code}), flush=True)
    """
)


def test_a_sweeper_in_another_process_never_reaps_a_turn_whose_worker_beats(store_factory, stack):
    ttl = 1.0  # ten beats long: a loaded machine must not make the live worker look dead
    sweeper = store_factory(settings=Settings(heartbeat_ttl_s=ttl))
    p = _new_project(sweeper)
    worker = Worker([BEATING_WORKER, json.dumps(stack), p.id, "3.5", str(ttl)])
    try:
        t = worker.json_line()["turn_id"]
        # the turn grows older than the TTL many times over while its worker beats elsewhere
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            sweeper.sweep()
            assert sweeper.get_turn(t).status == "running"
            time.sleep(0.1)
        assert worker.json_line() == {"alive_to_the_end": "running"}

        # the worker has stopped beating: once the TTL has passed, the sweep reaps it
        time.sleep(ttl + 0.2)
        assert sweeper.sweep()["turns_reaped"] >= 1
        assert sweeper.get_turn(t).status == "interrupted"
        worker.send("go")
        # and the worker learns it was interrupted from its next heartbeat
        assert worker.json_line() == {"heartbeat": "turn.not_running"}
        assert worker.proc.wait(timeout=30) == 0
    finally:
        worker.close()


def test_a_second_store_on_the_same_data_sees_the_first_ones_heartbeats(store_factory):
    ttl = 1.0
    worker, sweeper = store_factory(settings=Settings(heartbeat_ttl_s=ttl)), store_factory(
        settings=Settings(heartbeat_ttl_s=ttl))
    p = _new_project(worker)
    t = worker.start_turn(p.id, "beating in this process")
    deadline = time.monotonic() + 1.6
    while time.monotonic() < deadline:
        time.sleep(0.1)
        worker.heartbeat(t.id)
        sweeper.sweep()
    assert sweeper.get_turn(t.id).status == "running"  # older than the TTL, beating, alive
    worker.write_file(t.id, "still.py", "alive\n")


def test_a_heartbeat_for_an_ended_turn_says_turn_not_running(store):
    p = _new_project(store)
    t = store.start_turn(p.id, "x")
    store.heartbeat(t.id)
    store.interrupt_turn(t.id)
    with pytest.raises(TurnNotRunning) as exc:
        store.heartbeat(t.id)
    assert exc.value.code == "turn.not_running" and exc.value.details["status"] == "interrupted"
