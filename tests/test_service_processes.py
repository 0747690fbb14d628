"""Two service processes on one stack: what is done through one, the other sees and honours.

Replicas behind a load balancer share nothing but the backends. Each story starts two
services (uvicorn subprocesses, ``service_factory``) on the same stack and sends each
request to one or the other: on the real stack one PostgreSQL database, one S3 prefix
and one Redis prefix; on the embedded one the same SQLite file and the SQLite
coordinator file beside it. The SSE client comes from tests/test_service_streams.py.
"""

from __future__ import annotations

import collections
import signal
import threading
import time
from typing import Any

import httpx

from draftstore import Store
from draftstore.blobs import open_blob_store
from draftstore.coord import Coordinator, open_coordinator
from draftstore.db.engine import create_db_engine
from draftstore.service.routes.streams import END_GRACE_S, IDLE_CHECK_S
from service_fixtures import Output, Service, in_background, kill_service
from test_service_streams import (b64, complete, delta, ends_with, keys, new_project, sse, start_turn, tool_call,
                                  wait_buffered)


def two(service_factory: Any) -> tuple[Service, Service, httpx.Client, httpx.Client]:
    a, b = service_factory(), service_factory()
    return a, b, a.client(), b.client()


def files(c: httpx.Client, project_id: str, at: str = "draft") -> dict[str, str]:
    r = c.get(f"/v1/projects/{project_id}/view/find", params={"at": at})
    assert r.status_code == 200, r.text
    out = {}
    for path in r.json()["paths"]:
        got = c.get(f"/v1/projects/{project_id}/view/files/{path}", params={"at": at})
        assert got.status_code == 200, got.text
        out[path] = got.text
    return out


def test_a_turn_started_through_one_process_is_driven_and_continued_through_the_other(service_factory):
    a, b, ca, cb = two(service_factory)
    p = new_project(ca)
    t = start_turn(ca, p, "add a dragon")
    seq = tool_call(cb, t, "write_file", finish=False)
    assert cb.put(f"/v1/turns/{t}/files/dragon.py", content=b"DRAGON = 1\n").status_code == 204
    assert ca.post(f"/v1/turns/{t}/tool-calls/{seq}/complete", json={"result": {"ok": True}}).status_code == 204
    for c in (ca, cb):
        assert c.post(f"/v1/turns/{t}/heartbeat").status_code == 204
    r = cb.patch(f"/v1/turns/{t}/characters", json={"patch": {"dragon": {"hp": 99}}})
    assert r.status_code == 200 and r.json()["dragon"] == {"hp": 99}
    assert ca.get(f"/v1/projects/{p}/view/files/dragon.py").text == "DRAGON = 1\n"  # B's write, read through A
    complete(ca, t)

    turn = cb.get(f"/v1/turns/{t}").json()
    assert turn["status"] == "completed"
    assert [(c["seq"], c["tool_name"], c["status"], c["result"]) for c in turn["tool_calls"]] == [
        (1, "write_file", "completed", {"ok": True})]

    t2 = start_turn(cb, p, "now make it breathe fire", cont=True)  # continued through the other process
    second = ca.get(f"/v1/turns/{t2}").json()
    assert second["continues_turn_id"] == t and second["start_root"] == turn["end_root"]
    assert ca.put(f"/v1/turns/{t2}/files/fire.py", content=b"FIRE = True\n").status_code == 204
    complete(cb, t2)
    r = ca.post(f"/v1/projects/{p}/publish", json={"summary": "dragon and fire"})
    assert r.status_code == 201 and r.json()["number"] == 2
    assert files(cb, p, "head") == {"main.py": "print(1)\n", "dragon.py": "DRAGON = 1\n", "fire.py": "FIRE = True\n"}
    assert cb.get(f"/v1/projects/{p}/view", params={"at": "head"}).json()["characters"] == {"dragon": {"hp": 99}}


def test_writes_through_both_processes_at_once_land_in_one_draft(service_factory):
    a, b, ca, cb = two(service_factory)
    p = new_project(ca)
    t = start_turn(ca, p)
    errors: list[BaseException] = []
    go = threading.Barrier(2)

    def agent(svc: Service, name: str) -> None:
        c = svc.client()
        try:
            go.wait(timeout=30)
            for i in range(12):
                seq = tool_call(c, t, f"{name}_write", finish=False)
                r = c.put(f"/v1/turns/{t}/files/{name}/{i}.py", content=f"{name} = {i}\n".encode())
                assert r.status_code == 204, r.text
                r = c.patch(f"/v1/turns/{t}/world-settings", json={"patch": {f"{name}{i}": i}})
                assert r.status_code == 200, r.text
                r = c.post(f"/v1/turns/{t}/tool-calls/{seq}/complete", json={"result": {"path": f"{name}/{i}.py"}})
                assert r.status_code == 204, r.text
            r = c.post(f"/v1/turns/{t}/changes", json={"changes": {f"{name}/batch.py": b64(name), "main.py": None}
                                                      if name == "a" else {f"{name}/batch.py": b64(name)}})
            assert r.status_code == 204, r.text
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(svc, name), daemon=True) for svc, name in ((a, "a"), (b, "b"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)

    expected = {f"{n}/{i}.py": f"{n} = {i}\n" for n in "ab" for i in range(12)} | {"a/batch.py": "a", "b/batch.py": "b"}
    for c in (ca, cb):  # the one draft, whichever process is asked
        assert files(c, p) == expected
        assert c.get(f"/v1/projects/{p}/view").json()["world_settings"] == {f"{n}{i}": i for n in "ab"
                                                                            for i in range(12)}
    calls = cb.get(f"/v1/turns/{t}/tool-calls", params={"limit": 200}).json()["items"]
    assert [c["seq"] for c in calls] == list(range(1, 25))  # one sequence, no seq taken twice
    assert collections.Counter(c["tool_name"] for c in calls) == {"a_write": 12, "b_write": 12}
    assert {c["status"] for c in calls} == {"completed"}
    complete(cb, t)
    assert ca.post(f"/v1/projects/{p}/publish", json={"summary": "both"}).status_code == 201
    assert files(cb, p, "head") == expected


def test_an_interrupted_turns_late_writes_are_refused_through_either_process(service_factory):
    a, b, ca, cb = two(service_factory)
    p = new_project(ca)
    t = start_turn(ca, p)
    assert cb.put(f"/v1/turns/{t}/files/before.py", content=b"kept\n").status_code == 204
    seq = tool_call(cb, t, finish=False)
    r = ca.post(f"/v1/turns/{t}/interrupt", json={"partial_response": {"text": "stopped"}})
    assert r.status_code == 200 and r.json()["status"] == "interrupted"

    late = [("put", f"/v1/turns/{t}/files/late.py", {"content": b"late\n"}),
            ("delete", f"/v1/turns/{t}/files/before.py", {}),
            ("post", f"/v1/turns/{t}/changes", {"json": {"changes": {"late.py": b64("late")}}}),
            ("post", f"/v1/turns/{t}/move", {"json": {"src": "before.py", "dst": "moved.py"}}),
            ("patch", f"/v1/turns/{t}/characters", {"json": {"patch": {"late": True}}}),
            ("post", f"/v1/turns/{t}/tool-calls", {"json": {"tool_name": "late"}}),
            ("post", f"/v1/turns/{t}/tool-calls/{seq}/complete", {"json": {"result": "late"}}),
            ("post", f"/v1/turns/{t}/heartbeat", {}),
            ("post", f"/v1/turns/{t}/deltas", {"json": {"text": "late"}}),
            ("post", f"/v1/turns/{t}/complete", {"json": {"assistant_message": "late"}})]
    for c in (ca, cb):
        for method, path, kwargs in late:
            r = c.request(method, path, **kwargs)
            assert r.status_code == 409 and r.json()["code"] == "turn.not_running", (method, path, r.text)
            assert r.json()["details"]["status"] == "interrupted", (method, path)
    assert files(cb, p) == {"main.py": "print(1)\n", "before.py": "kept\n"}
    turn = ca.get(f"/v1/turns/{t}").json()
    assert turn["partial_response"] == {"text": "stopped"}
    # the call the interrupt left running is flagged, ended with its turn; the late completion changed nothing
    assert [(c["seq"], c["status"]) for c in turn["tool_calls"]] == [(1, "interrupted")]
    assert turn["tool_calls"][0]["ended_at"] == turn["ended_at"]


def test_a_turn_whose_text_streamed_through_one_process_takes_no_more_text_there_once_the_other_ended_it(
        service_factory):
    a, b, ca, cb = two(service_factory)
    p = new_project(ca)
    t = start_turn(ca, p)
    delta(cb, t, "B streams the assistant's text")
    r = ca.post(f"/v1/turns/{t}/interrupt")
    assert r.status_code == 200
    r = cb.post(f"/v1/turns/{t}/deltas", json={"text": "a late piece"})
    assert r.status_code == 409 and r.json()["code"] == "turn.not_running", r.text
    events = wait_buffered(ca, t, ends_with("turn.interrupted"))
    assert [e["data"]["text"] for e in events if e["type"] == "assistant.delta"] == ["B streams the assistant's text"]


def test_text_streamed_through_both_processes_is_all_in_the_partial_response_in_order(service_factory):
    """Deltas of one turn reach whichever replica (or worker) the balancer picks: the text the
    running turn shows, and the one an interrupt saves, hold every piece, in order."""
    a, b, ca, cb = two(service_factory)
    p = new_project(ca)
    t = start_turn(ca, p)
    pieces = [f"p{i:02d} " for i in range(40)]
    for i, piece in enumerate(pieces):
        if i == 20:
            time.sleep(1.2)  # the next deltas are due a refresh, in both processes
        delta((ca, cb)[i % 2], t, piece)
    # refreshed while running (at most once a second, by either process): the text so far, never a patchwork
    shown = (ca.get(f"/v1/turns/{t}").json()["partial_response"] or {}).get("text", "")
    assert shown.startswith("".join(pieces[:21])) and "".join(pieces).startswith(shown), shown
    r = cb.post(f"/v1/turns/{t}/interrupt")
    assert r.status_code == 200, r.text
    assert r.json()["partial_response"] == {"text": "".join(pieces)}
    for c in (ca, cb):
        assert c.get(f"/v1/turns/{t}").json()["partial_response"] == {"text": "".join(pieces)}
    # the next turn starts with no text left over
    t2 = start_turn(ca, p, cont=True)
    delta(cb, t2, "fresh")
    assert ca.post(f"/v1/turns/{t2}/interrupt").json()["partial_response"] == {"text": "fresh"}


def test_a_subscriber_on_one_process_sees_a_turn_driven_through_the_other(service_factory):
    a, b, ca, cb = two(service_factory)
    p = new_project(ca)
    t = start_turn(cb, p)
    wait_buffered(ca, t, ends_with("turn.started"))  # B's event, read through A
    project_stream = sse(a, f"/v1/projects/{p}/events?after=0")
    try:
        with sse(a, f"/v1/turns/{t}/events") as es:
            assert es.read_n(1)[0].json == {"turn_id": t, "project_id": p}
            seq = tool_call(cb, t, "edit")
            delta(cb, t, "dragons ")
            assert cb.put(f"/v1/turns/{t}/files/dragon.py", content=b"DRAGON = 2\n").status_code == 204
            delta(cb, t, "everywhere")
            first = es.read_n(5)
        # half-way, the client moves to the other process: the ids are the same buffer's
        with sse(b, f"/v1/turns/{t}/events", last_event_id=first[-1].last_event_id) as es:
            complete(cb, t)
            rest = es.read_to_end()
        got = first + rest
        assert keys(got) == [("tool.started", seq), ("tool.completed", seq), ("assistant.delta", None),
                             ("draft.changed", None), ("assistant.delta", None), ("turn.completed", None),
                             ("stream.end", None)]
        assert [e.json["text"] for e in got if e.type == "assistant.delta"] == ["dragons ", "everywhere"]
        assert got[3].json["paths"] == ["dragon.py"]
        assert [e.n for e in got[:-1]] == list(range(2, 8)) and len({e.epoch for e in got[:-1]}) == 1

        r = cb.post(f"/v1/projects/{p}/publish", json={"summary": "through B"})
        assert r.status_code == 201
        published = project_stream.read_n(1)[0]
        assert (published.type, published.json) == ("version.published", {"version_id": r.json()["id"], "number": 2})
    finally:
        project_stream.close()


def test_text_a_service_acknowledged_is_in_the_buffer_even_if_it_is_killed_at_once(service_factory):
    """A delta's 204 means it is in the buffer: deltas live nowhere else (no row per delta),
    so a worker killed right after acknowledging one must not take it along, and a turn
    ended through another process right after it must not end the stream before it."""
    svc = service_factory()
    c = svc.client()
    p = new_project(c)
    t = start_turn(c, p)
    texts = [f"piece {i} " for i in range(5)]
    for text in texts:
        delta(c, t, text)
    svc.proc.send_signal(signal.SIGKILL)  # at once: well inside any linger of the event publisher
    svc.proc.wait(timeout=10)
    buffered = svc.store.events(f"turn:{t}")
    assert [e.data["text"] for e in buffered if e.type == "assistant.delta"] == texts


class _HeldAppends:
    """A coordinator whose batched appends (the event publisher's) wait until ``released``
    is set: a process whose events are appended late. Everything else goes straight through."""

    def __init__(self, coord: Coordinator) -> None:
        self._coord = coord
        self.released = threading.Event()

    def append_many(self, events: Any) -> list[int]:
        self.released.wait(30)
        return self._coord.append_many(events)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coord, name)


def test_an_event_another_process_appends_just_after_the_turn_ended_still_reaches_the_live_stream(service_factory):
    """Each process appends its own events a few milliseconds after emitting them, so a tool
    call recorded elsewhere just before the turn ended can land after the end event: a live
    stream must still send it before ``stream.end``, not end without it."""
    svc = service_factory()
    c = svc.client()
    p = new_project(c)
    t = start_turn(c, p)
    # another process's store on the same stack, whose queued appends wait until released
    s = svc.store.settings
    held = _HeldAppends(open_coordinator(s.resolved_coord_url()))
    elsewhere = Store(create_db_engine(s.resolved_database_url()), open_blob_store(s.resolved_blob_url()), held,
                      settings=s)
    try:
        seq = elsewhere.tool_started(t, "view_file", {"path": "main.py"}).seq  # committed; its event still queued
        # (a stream opened before the buffer exists is rebuilt from the database, tool call included)
        wait_buffered(c, t, ends_with("turn.started"))
        with sse(svc, f"/v1/turns/{t}/events") as es:
            assert es.read_n(1)[0].type == "turn.started"
            complete(c, t)  # the service appends turn.completed now
            wait_buffered(c, t, ends_with("turn.completed"))
            held.released.set()
            assert elsewhere.flush_events(timeout=10)  # the late append: after the end event
            rest = es.read_to_end()
    finally:
        held.released.set()
        elsewhere.close()
    assert keys(rest) == [("turn.completed", None), ("tool.started", seq), ("stream.end", None)]


def test_a_live_stream_ends_even_when_the_process_that_ended_the_turn_was_killed_before_telling_the_buffer(
        service_factory):
    """A process appends a turn's end event just after committing the end: killed (``kill -9``)
    between the two, the end is in the database and never reaches the buffer. A stream
    following the turn through another process must not wait for it for ever: once idle for
    ``IDLE_CHECK_S`` it finds the turn ended, and sends the history rebuilt, then ends."""
    reader = service_factory()
    ender = service_factory(env={"DRAFTSTORE_PAUSE_AT": "turn.end.after_commit"})
    c, e = reader.client(), ender.client()
    p = new_project(c)
    t = start_turn(c, p)
    seq = tool_call(c, t)
    wait_buffered(c, t, ends_with("tool.completed"))
    output = Output(ender.proc)
    with sse(reader, f"/v1/turns/{t}/events") as es:
        assert keys(es.read_n(3)) == [("turn.started", None), ("tool.started", seq), ("tool.completed", seq)]
        thread, reply = in_background(lambda: e.post(f"/v1/turns/{t}/complete", json={"assistant_message": "done"}))
        output.wait_for("paused at turn.end.after_commit")
        killed_at = time.monotonic()
        kill_service(ender.proc)
        thread.join(timeout=30)
        assert "error" in reply, reply  # the end committed, and nobody was told
        assert reader.store.get_turn(t, tool_calls=False).status == "completed"
        rest = es.read_to_end(timeout=IDLE_CHECK_S + END_GRACE_S + 15)
        ended_after = time.monotonic() - killed_at
    assert rest[0].type == "stream.rebuilt", [x.type for x in rest]
    assert keys(rest[1:]) == [("turn.started", None), ("tool.started", seq), ("tool.completed", seq),
                              ("turn.completed", None), ("stream.end", None)], keys(rest)
    assert ended_after < IDLE_CHECK_S + END_GRACE_S + 10, ended_after
    # the buffer itself still lacks the end: a client connecting now gets the stream ended after the grace
    with sse(reader, f"/v1/turns/{t}/events") as again:
        assert [x.type for x in again.read_to_end()][-1] == "stream.end"
