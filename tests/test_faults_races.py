"""Races through the real HTTP service, and the embedded default shared by two processes.

Every race runs against a uvicorn subprocess with two workers (``service_factory(workers=2)``),
so requests really run in two processes at once, on both stacks: the embedded default (one
SQLite file, the SQLite coordinator beside it, a blob directory) and the real one
(PostgreSQL, S3, Redis). Racers are threads, one httpx client each, released together by
a barrier; every wait is bounded. What is proved:

- writes: 8 writers x 200 PUTs on one running turn (each writer writes each of its 50
  paths four times, and reads every fifth write straight back) lose nothing: the draft
  names exactly the last acknowledged bytes of
  every path, and every file reads back byte-exact over HTTP from the turn's sealed end
  state once it completes;
- publishes: 10 simultaneous publishes of one draft make exactly one version; every loser
  gets the same typed refusal; head moves exactly once;
- publish racing writes: publishing needs a draft with no running turn (``draft.busy``),
  so the race is publishers hammering while turns end and start under concurrent batch
  writers. Every turn's end state holds exactly the batches acknowledged up to it, every
  version's tree is exactly the end state of the turn it was published from, and no
  version holds part of a batch;
- rollback racing publish: the head-move log is one unbroken chain (each move starts
  where the previous one ended), names only existing versions, ends at the project's
  head, and its times run in its order; version numbers are 1..n without duplicates, each
  publish's parent is the head it replaced; no publish fails on a database deadlock;
- two sweepers (two stores in threads, then two CLI processes) reap each dead turn exactly
  once: one end, one ``turn.interrupted`` event, its tool history compacted once;
- the embedded default used by the service and by CLI commands at once: every CLI run
  succeeds or refuses with a typed code, nothing anywhere says "database is locked" or
  prints a traceback, fsck finds no problem while the writes go on nor after them, and
  every acknowledged write is there.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from service_fixtures import Service, stack_env
from services import token as random_token

from draftstore import Settings, Store

Json = Any

RACE_TIMEOUT_S = 150  # no racer may take longer than this
RETRYABLE = {"draft.busy", "backend.unavailable", "lock.timeout"}
FORBIDDEN_TEXT = ("database is locked", "Traceback")


# -- helpers ------------------------------------------------------------------------------------
def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ok(r: httpx.Response, status: int = 200) -> Json:
    assert r.status_code == status, f"{r.request.method} {r.request.url} -> {r.status_code}: {r.text[:500]}"
    return None if status == 204 else r.json()


def code_of(r: httpx.Response) -> tuple[int, str]:
    """(status, error code) of an answer; a non-JSON or untyped error fails the test."""
    if r.status_code < 300:
        return r.status_code, "ok"
    body = r.json()
    assert set(body) == {"code", "message", "details", "retryable"}, body
    assert body["retryable"] is (body["code"] in RETRYABLE), body
    for text in FORBIDDEN_TEXT:
        assert text not in r.text, r.text
    return r.status_code, body["code"]


def walk(c: httpx.Client, url: str, **params: Any) -> list[Json]:
    """Every item of a paged list."""
    items: list[Json] = []
    cursor = None
    for _ in range(1000):
        page = ok(c.get(url, params={**params, "limit": 200, **({"cursor": cursor} if cursor else {})}))
        items += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            return items
    raise AssertionError(f"{url} never ran out of pages")


def new_project(c: httpx.Client, files: dict[str, bytes] | None = None) -> str:
    body = {"name": f"race-{random_token(3)}", "files": {p: b64(v) for p, v in
                                                         (files or {"main.py": b"print(1)\n"}).items()},
            "characters": {"hero": {"hp": 10}}, "world_settings": {}}
    return ok(c.post("/v1/projects", json=body), 201)["id"]


def start_turn(c: httpx.Client, project_id: str, message: str = "go") -> str:
    """Start a turn, waiting out a retryable refusal (bounded)."""
    deadline = time.monotonic() + 30
    while True:
        r = c.post(f"/v1/projects/{project_id}/turns", json={"user_message": message})
        if r.status_code == 201:
            return r.json()["id"]
        status, code = code_of(r)
        assert code in RETRYABLE and time.monotonic() < deadline, (status, code, r.text)
        time.sleep(0.05)


def complete(c: httpx.Client, turn_id: str) -> Json:
    return ok(c.post(f"/v1/turns/{turn_id}/complete", json={"assistant_message": "done"}))


def race(n: int, racer: Callable[[int], Any], timeout: float = RACE_TIMEOUT_S,
         stop: threading.Event | None = None) -> list[Any]:
    """Run ``racer(i)`` for i in 0..n-1 in threads released together; their results, in order.

    ``stop`` is set as soon as any racer fails, so racers that loop until it is set end too."""
    go = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[tuple[int, BaseException]] = []

    def run(i: int) -> None:
        try:
            go.wait(timeout=30)
            results[i] = racer(i)
        except BaseException as exc:  # reported below
            errors.append((i, exc))
            if stop is not None:
                stop.set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"racers still running after {timeout}s"
    if errors:
        raise AssertionError(f"{len(errors)} racers failed; first: racer {errors[0][0]}") from errors[0][1]
    return results


def drain(svc: Service) -> list[bytes]:
    """Keep reading the service's output (so a chatty service never blocks on a full pipe)."""
    out: list[bytes] = []

    def read() -> None:
        assert svc.proc.stdout is not None
        for line in svc.proc.stdout:
            out.append(line)

    threading.Thread(target=read, daemon=True).start()
    return out


def start_service(service_factory: Callable[..., Service], **kwargs: Any) -> tuple[Service, list[bytes]]:
    svc = service_factory(workers=2, **kwargs)
    return svc, drain(svc)


def assert_quiet(svc: Service, output: list[bytes]) -> None:
    """Stop the service; nothing it printed is a traceback or a raw SQLite lock error."""
    svc.stop()
    time.sleep(0.2)
    text = b"".join(output).decode(errors="replace")
    for bad in FORBIDDEN_TEXT:
        assert bad not in text, f"the service printed {bad!r}:\n{text[-4000:]}"


def state_files(view: Any) -> dict[str, str]:
    """path -> digest of a state (from its tree and overlay: no blob reads)."""
    return {path: st.digest for path, st in view.iter_files()}


def read_all(svc: Service, project_id: str, paths: list[str], at: str, threads: int = 8) -> dict[str, bytes]:
    """Every file's bytes, read over HTTP by ``threads`` clients at once."""
    chunks = [paths[i::threads] for i in range(threads)]

    def reader(i: int) -> dict[str, bytes]:
        c = svc.client()
        got = {}
        for p in chunks[i]:
            r = c.get(f"/v1/projects/{project_id}/view/files/{p}", params={"at": at})
            assert r.status_code == 200, (p, r.status_code, r.text[:300])
            got[p] = r.content
        return got

    out: dict[str, bytes] = {}
    for part in race(threads, reader):
        out.update(part)
    return out


# -- 5a: concurrent writers lose nothing ---------------------------------------------------------------
WRITERS, WRITES_EACH, PATHS_EACH = 8, 200, 50


def test_eight_writers_on_one_turn_lose_no_acknowledged_write(service_factory, stack):
    svc, output = start_service(service_factory)
    c = svc.client()
    pid = new_project(c)
    tid = start_turn(c, pid)

    def writer(i: int) -> tuple[dict[str, bytes], collections.Counter[str]]:
        rng = random.Random(1000 + i)
        wc = svc.client()
        latest: dict[str, bytes] = {}
        retried: collections.Counter[str] = collections.Counter()
        for j in range(WRITES_EACH):
            k = j % PATHS_EACH
            path = f"w{i}/d{k % 7}/f{k:03d}.bin"  # each path written four times
            data = f"writer {i} write {j}\n".encode() + rng.randbytes(rng.randint(0, 3000))
            for attempt in range(20):
                r = wc.put(f"/v1/turns/{tid}/files/{path}", content=data)
                if r.status_code == 204:
                    latest[path] = data
                    if j % 5 == 0:  # read your write at once (either worker process may answer)
                        got = wc.get(f"/v1/projects/{pid}/view/files/{path}")
                        assert got.status_code == 200 and got.content == data, (path, got.status_code)
                    break
                status, code = code_of(r)
                assert (status, code) == (409, "draft.busy"), (path, status, code)  # contention: typed, retryable
                retried[code] += 1
                time.sleep(0.05 * (attempt + 1))
            else:
                raise AssertionError(f"write {path} never acknowledged")
        return latest, retried

    results = race(WRITERS, writer)
    expected: dict[str, bytes] = {"main.py": b"print(1)\n"}
    retried: collections.Counter[str] = collections.Counter()
    for latest, r in results:
        expected.update(latest)
        retried += r
    assert len(expected) == 1 + WRITERS * PATHS_EACH

    # the draft (sealed tree + overlay): every path, naming exactly the acknowledged bytes; a sample read over HTTP
    found = ok(c.get(f"/v1/projects/{pid}/view/find", params={"limit": 10_000}))
    assert not found["truncated"] and sorted(found["paths"]) == sorted(expected)
    assert state_files(svc.store.view(pid)) == {p: sha(d) for p, d in expected.items()}
    sample = sorted(expected)[::9]
    assert read_all(svc, pid, sample, "draft") == {p: expected[p] for p in sample}

    # the sealed end state, once the turn completes: every file read back over HTTP, byte-exact
    ended = complete(c, tid)
    assert ended["status"] == "completed" and ended["end_root"]
    end_view = svc.store.view_at_turn(tid, "end")
    assert end_view.root == ended["end_root"] and not end_view.overlay
    assert state_files(end_view) == {p: sha(d) for p, d in expected.items()}
    assert read_all(svc, pid, sorted(expected), f"turn:{tid}:end") == expected
    print(f"5a[{stack['database_url'].split(':')[0]}]: {WRITERS * WRITES_EACH} writes acknowledged, "
          f"{len(expected) - 1} paths verified in draft and sealed end state, retries {dict(retried)}")
    assert_quiet(svc, output)


# -- 5b: racing publishes make one version ---------------------------------------------------------------
PUBLISHERS, PUBLISH_ROUNDS = 10, 3


def test_ten_simultaneous_publishes_of_one_draft_make_exactly_one_version(service_factory, stack):
    svc, output = start_service(service_factory)
    c = svc.client()
    pid = new_project(c)
    losers: collections.Counter[tuple[int, str]] = collections.Counter()
    for rnd in range(PUBLISH_ROUNDS):
        before = ok(c.get(f"/v1/projects/{pid}"))
        moves_before = walk(c, f"/v1/projects/{pid}/head-moves")
        tid = start_turn(c, pid)
        ok(c.put(f"/v1/turns/{tid}/files/round{rnd}.txt", content=f"round {rnd}\n".encode()), 204)
        complete(c, tid)

        def publisher(i: int) -> tuple[int, Json]:
            r = svc.client().post(f"/v1/projects/{pid}/publish", json={"summary": f"racer {i}", "actor": f"p{i}"})
            return (201, r.json()) if r.status_code == 201 else (code_of(r), r.json())

        results = race(PUBLISHERS, publisher)
        won = [body for status, body in results if status == 201]
        assert len(won) == 1, results
        lost = collections.Counter(status for status, _ in results if status != 201)
        assert sum(lost.values()) == PUBLISHERS - 1
        losers += lost
        # the loser finds the draft already closed by the winner: one typed refusal, never a 5xx
        assert set(lost) == {(404, "draft.none")}, lost

        version = won[0]
        assert version["number"] == rnd + 2 and version["parent_version_id"] == before["current_version_id"]
        after = ok(c.get(f"/v1/projects/{pid}"))
        assert after["current_version_id"] == version["id"] and after["active_draft_id"] is None
        moves = walk(c, f"/v1/projects/{pid}/head-moves")
        assert len(moves) == len(moves_before) + 1  # head moved exactly once
        assert (moves[-1]["reason"], moves[-1]["from_version_id"], moves[-1]["to_version_id"]) == (
            "publish", before["current_version_id"], version["id"])
        assert moves[-1]["actor"] == version["created_by"] and version["summary"] == f"racer {version['created_by'][1:]}"
        r = c.get(f"/v1/projects/{pid}/view/files/round{rnd}.txt", params={"at": "head"})
        assert r.status_code == 200 and r.content == f"round {rnd}\n".encode()

    versions = walk(c, f"/v1/projects/{pid}/versions")
    assert [v["number"] for v in versions] == list(range(1, PUBLISH_ROUNDS + 2))
    print(f"5b[{stack['database_url'].split(':')[0]}]: {PUBLISH_ROUNDS} rounds x {PUBLISHERS} publishers: "
          f"{PUBLISH_ROUNDS} won, refused {dict(losers)}")
    assert_quiet(svc, output)


# -- 5c: publishes racing turn ends and batch writes -------------------------------------------------------
BATCH_FILES, BATCH_WRITERS, TURNS_C = 12, 3, 8


def batch_files(w: int, k: int) -> dict[str, bytes]:
    """One batch: BATCH_FILES files in two directories, all naming the batch."""
    return {f"b{w}-{k:03d}/{'xy'[j % 2]}/f{j}.txt": f"batch {w}-{k} file {j}\n".encode() for j in range(BATCH_FILES)}


def batches_in(files: dict[str, str]) -> dict[str, int]:
    """batch name -> how many of its files a state holds, each checked byte-exact."""
    held: collections.Counter[str] = collections.Counter()
    for path, digest in files.items():
        if path == "main.py":
            continue
        name = path.split("/")[0]
        w, k = (int(x) for x in name[1:].split("-"))
        assert digest == sha(batch_files(w, k)[path]), f"{path} holds someone else's bytes"
        held[name] += 1
    return dict(held)


def test_publishes_racing_turn_ends_and_batch_writes_publish_whole_batches_only(service_factory, stack):
    svc, output = start_service(service_factory)
    c = svc.client()
    pid = new_project(c)
    lock = threading.Lock()
    current = {"turn": start_turn(c, pid)}
    stop = threading.Event()  # the controller is done (or a racer failed)
    acked: dict[str, str] = {}  # batch name -> the turn that acknowledged it
    refused: set[str] = set()
    turns: list[str] = [current["turn"]]
    outcomes: dict[str, collections.Counter[tuple[int, str]]] = collections.defaultdict(collections.Counter)

    def writer(w: int) -> None:
        wc = svc.client()
        k = 0
        while not stop.is_set():
            with lock:
                tid = current["turn"]
            name = f"b{w}-{k:03d}"
            r = wc.post(f"/v1/turns/{tid}/changes",
                        json={"changes": {p: b64(d) for p, d in batch_files(w, k).items()}})
            outcome = code_of(r)
            outcomes["write"][outcome] += 1
            if r.status_code == 204:
                with lock:
                    acked[name] = tid
            else:
                assert outcome in {(409, "turn.not_running"), (409, "draft.busy")}, (outcome, r.text)
                with lock:
                    refused.add(name)
                deadline = time.monotonic() + 30  # the turn ended: wait for the next one (or the end)
                while outcome[1] == "turn.not_running" and time.monotonic() < deadline and not stop.is_set():
                    with lock:
                        if current["turn"] != tid:
                            break
                    time.sleep(0.005)
            k += 1

    def publisher(_: int) -> None:
        pc = svc.client()
        while not stop.is_set():
            r = pc.post(f"/v1/projects/{pid}/publish", json={"summary": "racing"})
            outcome = code_of(r)
            outcomes["publish"][outcome] += 1
            assert outcome in {(201, "ok"), (409, "draft.busy"), (404, "draft.none")}, (outcome, r.text)

    def controller(_: int) -> None:
        cc = svc.client()
        rng = random.Random(7)
        try:
            for n in range(TURNS_C):
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and not stop.is_set():  # let some batches land in this turn
                    with lock:
                        if sum(1 for t in acked.values() if t == current["turn"]) >= 6:
                            break
                    time.sleep(0.01)
                complete(cc, current["turn"])
                time.sleep(rng.uniform(0, 0.05))  # the window in which a publish can win
                if n < TURNS_C - 1:
                    tid = start_turn(cc, pid, f"turn {n + 2}")
                    with lock:
                        current["turn"] = tid
                        turns.append(tid)
        finally:
            stop.set()

    racers = [writer] * BATCH_WRITERS + [publisher, publisher, controller]
    race(len(racers), lambda i: racers[i](i), stop=stop)
    last = ok(c.post(f"/v1/projects/{pid}/publish", json={"summary": "last"}), 201) if ok(
        c.get(f"/v1/projects/{pid}"))["active_draft_id"] else None

    store = svc.store
    # each turn's sealed end state: exactly the batches acknowledged up to it, each whole
    order = {t: n for n, t in enumerate(turns)}
    for tid in turns:
        held = batches_in(state_files(store.view_at_turn(tid, "end")))
        assert set(held.values()) <= {BATCH_FILES}, f"turn {tid} holds part of a batch: {held}"
        assert set(held) == {b for b, t in acked.items() if order[t] <= order[tid]}, tid
        assert not set(held) & refused
    # each version: the end state of the turn it was published from; whole batches only
    versions = walk(c, f"/v1/projects/{pid}/versions")
    assert [v["number"] for v in versions] == list(range(1, len(versions) + 1))
    end_roots = {t["id"]: t["end_root"] for t in walk(c, f"/v1/projects/{pid}/turns")}
    for v in versions[1:]:
        assert v["root"] == end_roots[v["created_by_turn_id"]], v
        held = batches_in(state_files(store.view_at(pid, v["id"])))
        assert set(held.values()) <= {BATCH_FILES}, f"version {v['number']} holds part of a batch: {held}"
    final = versions[-1]
    assert last is None or final["id"] == last["id"]
    assert set(batches_in(state_files(store.view_at(pid, final["id"])))) == set(acked)
    won = outcomes["publish"][(201, "ok")]
    assert won >= 1 and len(versions) == 1 + won + (last is not None)
    assert acked and len(turns) == TURNS_C
    print(f"5c[{stack['database_url'].split(':')[0]}]: {len(turns)} turns, {len(acked)} batches acknowledged, "
          f"{len(refused)} refused; writes {dict(outcomes['write'])}; publishes {dict(outcomes['publish'])}"
          f"{' + 1 final' if last else ''}; {len(versions) - 1} versions checked whole")
    assert_quiet(svc, output)


# -- 5d: rollback racing publish ----------------------------------------------------------------------
TURNS_D = 10


def test_rollbacks_racing_publishes_keep_one_consistent_head_history(service_factory, stack):
    svc, output = start_service(service_factory)
    c = svc.client()
    pid = new_project(c)
    stop = threading.Event()
    outcomes: dict[str, collections.Counter[tuple[int, str]]] = collections.defaultdict(collections.Counter)
    olock = threading.Lock()

    def count(kind: str, outcome: tuple[int, str]) -> None:
        with olock:
            outcomes[kind][outcome] += 1

    def driver(_: int) -> None:
        dc = svc.client()
        try:
            for n in range(TURNS_D):
                tid = start_turn(dc, pid, f"turn {n}")
                ok(dc.put(f"/v1/turns/{tid}/files/t{n}.txt", content=f"turn {n}\n".encode()), 204)
                complete(dc, tid)
                deadline = time.monotonic() + 30  # until some publisher made it a version
                while ok(dc.get(f"/v1/projects/{pid}"))["active_draft_id"] is not None and not stop.is_set():
                    assert time.monotonic() < deadline, "no publish won within 30s"
                    time.sleep(0.01)
        finally:
            stop.set()

    def publisher(i: int) -> None:
        pc = svc.client()
        rng = random.Random(i)
        while not stop.is_set():
            r = pc.post(f"/v1/projects/{pid}/publish", json={"summary": "race", "force": rng.random() < 0.5})
            outcome = code_of(r)
            count("publish", outcome)
            assert outcome in {(201, "ok"), (409, "draft.busy"), (404, "draft.none"), (409, "draft.conflict")}, \
                (outcome, r.text)
            time.sleep(0.005)

    def roller(i: int) -> None:
        rc = svc.client()
        rng = random.Random(100 + i)
        while not stop.is_set():
            versions = ok(rc.get(f"/v1/projects/{pid}/versions", params={"limit": 200}))["items"]
            r = rc.post(f"/v1/projects/{pid}/rollback", json={"version_id": rng.choice(versions)["id"]})
            outcome = code_of(r)
            count("rollback", outcome)
            assert outcome == (200, "ok"), (outcome, r.text)
            time.sleep(0.01)

    racers = [driver, publisher, publisher, roller, roller]
    race(len(racers), lambda i: racers[i](i), stop=stop)

    project = ok(c.get(f"/v1/projects/{pid}"))
    versions = walk(c, f"/v1/projects/{pid}/versions")
    moves = walk(c, f"/v1/projects/{pid}/head-moves")
    by_id = {v["id"]: v for v in versions}
    numbers = [v["number"] for v in versions]
    assert len(by_id) == len(versions) and numbers == list(range(1, len(versions) + 1))  # no duplicate numbers
    assert len(versions) == 1 + TURNS_D == 1 + outcomes["publish"][(201, "ok")]
    assert moves[0]["reason"] == "create" and moves[0]["from_version_id"] is None
    for prev, move in zip(moves, moves[1:]):
        assert move["from_version_id"] == prev["to_version_id"], (prev, move)  # one unbroken chain
        assert move["to_version_id"] in by_id and move["from_version_id"] in by_id
        assert move["id"] > prev["id"]
    assert project["current_version_id"] == moves[-1]["to_version_id"]
    publishes = [m for m in moves if m["reason"] == "publish"]
    assert sorted(m["to_version_id"] for m in publishes) == sorted(v["id"] for v in versions[1:])  # one each
    for m in publishes:  # a version's parent is the head it replaced
        assert by_id[m["to_version_id"]]["parent_version_id"] == m["from_version_id"]
    rollbacks = [m for m in moves if m["reason"] == "rollback"]
    assert len(rollbacks) <= outcomes["rollback"][(200, "ok")] and len(moves) == 1 + len(publishes) + len(rollbacks)
    # "when" agrees with the order of the log: a move that waited for the project's lock is stamped
    # after the move it waited for (it is stamped before the wait: publishing.py / projects.py take
    # ``now = utcnow()`` before opening the transaction)
    backwards = [(prev["id"], prev["at"], move["id"], move["at"]) for prev, move in zip(moves, moves[1:])
                 if datetime.fromisoformat(move["at"]) < datetime.fromisoformat(prev["at"])]
    assert not backwards, f"head moves whose time runs backwards against the log order: {backwards}"
    print(f"5d[{stack['database_url'].split(':')[0]}]: {len(versions)} versions, {len(moves)} head moves "
          f"({len(publishes)} publish, {len(rollbacks)} rollback); publishes {dict(outcomes['publish'])}; "
          f"rollbacks {dict(outcomes['rollback'])}")
    assert_quiet(svc, output)


# -- 5e: two sweepers reap a dead turn once -----------------------------------------------------------
TTL_S, DEAD_TURNS = 1.0, 3


def dead_turns(c: httpx.Client, projects: list[str], tag: str) -> list[str]:
    """One turn per project with three tool calls (completed, failed, unfinished), whose worker then dies."""
    out = []
    for pid in projects:
        tid = start_turn(c, pid, tag)
        for n, end in enumerate(("complete", "fail", None)):
            call = ok(c.post(f"/v1/turns/{tid}/tool-calls", json={"tool_name": f"{tag}{n}", "args": {"n": n}}), 201)
            if end == "complete":
                ok(c.post(f"/v1/turns/{tid}/tool-calls/{call['seq']}/complete", json={"result": {"n": n}}), 204)
            elif end == "fail":
                ok(c.post(f"/v1/turns/{tid}/tool-calls/{call['seq']}/fail", json={"error": "boom"}), 204)
        ok(c.put(f"/v1/turns/{tid}/files/{tag}.txt", content=tag.encode()), 204)
        out.append(tid)
    return out


def assert_reaped_once(svc: Service, c: httpx.Client, tid: str, tag: str) -> None:
    turn = ok(c.get(f"/v1/turns/{tid}"))
    assert (turn["status"], turn["end_reason"]) == ("interrupted", "heartbeat_lapsed"), turn
    assert [(t["seq"], t["tool_name"], t["status"]) for t in turn["tool_calls"]] == [
        (1, f"{tag}0", "completed"), (2, f"{tag}1", "failed"), (3, f"{tag}2", "interrupted")]  # left running: flagged
    with svc.store.engine.connect() as conn:  # compacted once: the rows are gone, the column holds three
        rows = conn.execute(sa.text("SELECT count(*) FROM tool_call WHERE turn_id = :t"), {"t": tid}).scalar()
        compacted = conn.execute(sa.text("SELECT tool_calls_json FROM project_turn WHERE id = :t"), {"t": tid}).scalar()
    compacted = compacted if isinstance(compacted, list) else json.loads(compacted)
    assert rows == 0 and [x["seq"] for x in compacted] == [1, 2, 3]
    events = ok(c.get(f"/v1/turns/{tid}/events", params={"limit": 1000}, headers={"accept": "application/json"}))
    ends = [e["type"] for e in events["events"] if e["type"].startswith("turn.") and e["type"] != "turn.started"]
    assert ends == ["turn.interrupted"], events
    assert svc.store.view_at_turn(tid, "end").read_file(f"{tag}.txt") == tag.encode()


def test_two_sweepers_at_once_reap_each_dead_turn_exactly_once(service_factory, stack, tmp_path):
    svc, output = start_service(service_factory, env={"DRAFTSTORE_HEARTBEAT_TTL_S": str(TTL_S)})
    c = svc.client()
    projects = [new_project(c) for _ in range(DEAD_TURNS + 1)]
    fast = Settings(heartbeat_ttl_s=TTL_S)
    sweepers = [Store.open(**stack, settings=fast) for _ in range(2)]  # two replicas
    try:
        # a live turn, beaten through the service the whole time: never reaped
        live = start_turn(c, projects[-1], "alive")
        beating = threading.Event()

        def beat() -> None:
            bc = svc.client()
            while not beating.wait(0.15):
                ok(bc.post(f"/v1/turns/{live}/heartbeat"), 204)

        beater = threading.Thread(target=beat, daemon=True)
        beater.start()

        # round 1: two stores in threads
        dead = dead_turns(c, projects[:-1], "one")
        time.sleep(TTL_S * 1.6)
        counts = race(2, lambda i: sweepers[i].sweep())
        assert sum(x["turns_reaped"] for x in counts) == DEAD_TURNS, counts
        assert all(x["turns_failed"] == 0 for x in counts), counts
        for s in sweepers:
            assert s.flush_events()
        for tid in dead:
            assert_reaped_once(svc, c, tid, "one")

        # round 2: two CLI processes, on the same dead turns' next turns
        dead2 = dead_turns(c, projects[:-1], "two")
        env = {**stack_env(stack), "DRAFTSTORE_HEARTBEAT_TTL_S": str(TTL_S), "COLUMNS": "200"}
        time.sleep(TTL_S * 1.6)
        procs = [subprocess.Popen([sys.executable, "-m", "draftstore.cli", "sweep"], env=env, cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        reaped = 0
        for p, (out, errtext) in zip(procs, outs):
            assert p.returncode == 0, (out, errtext)
            assert not any(bad in out + errtext for bad in FORBIDDEN_TEXT), (out, errtext)
            reaped += int(re.search(r"(\d+) turns interrupted", out).group(1))
        assert reaped == DEAD_TURNS, outs
        for tid in dead2:
            assert_reaped_once(svc, c, tid, "two")
        beating.set()
        beater.join(timeout=10)
        assert ok(c.get(f"/v1/turns/{live}"))["status"] == "running"
        print(f"5e[{stack['database_url'].split(':')[0]}]: threads reaped {[x['turns_reaped'] for x in counts]}, "
              f"CLI processes reaped {reaped} of {DEAD_TURNS}; live turn untouched")
    finally:
        for s in sweepers:
            s.close()
    assert_quiet(svc, output)


# -- 6: the embedded default shared by the service and the CLI -------------------------------------------
CLI_WRITERS, CLI_MAX_WRITES = 4, 3000


def cli(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "draftstore.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_the_cli_and_the_service_share_the_embedded_default_without_lock_errors(service_factory, stack, tmp_path):
    svc, output = start_service(service_factory)
    c = svc.client()
    env = {**stack_env(stack), "COLUMNS": "200"}
    pid = new_project(c)
    other = new_project(c)  # the CLI publishes and rolls back this one while the service writes to pid
    tid = start_turn(c, pid)
    other_turn = start_turn(c, other, "for the cli to publish")
    ok(c.put(f"/v1/turns/{other_turn}/files/cli.txt", content=b"published by the CLI\n"), 204)
    complete(c, other_turn)
    first = ok(c.get(f"/v1/projects/{other}"))["current_version_id"]
    src = tmp_path / "import-me"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (src / "README").write_text("hi\n")
    chains = [  # two CLI processes at a time beside the service, each chain in order
        [("publish", other, "-m", "from the cli"), ("fsck", "--quick"), ("rollback", other, first),
         ("gc", "--apply"), ("fsck", "--quick")],
        [("log", pid), ("sweep",), ("import", str(src)), ("publish", pid, "-m", "refused: a turn runs"),
         ("export", pid, str(tmp_path / "x")), ("fsck", "--quick")]]
    cli_done = [threading.Event() for _ in chains]
    runs: list[list[tuple[tuple[str, ...], subprocess.CompletedProcess[str]]]] = [[] for _ in chains]

    def writer(i: int) -> tuple[dict[str, bytes], collections.Counter[str]]:
        wc = svc.client()
        latest: dict[str, bytes] = {}
        busy: collections.Counter[str] = collections.Counter()
        for j in range(CLI_MAX_WRITES):  # until the CLI has run every command
            if all(e.is_set() for e in cli_done) and j >= 20:
                break
            path, data = f"s{i}/f{j:04d}.txt", f"writer {i} write {j}\n".encode() * (j % 5 + 1)
            for attempt in range(40):
                r = wc.put(f"/v1/turns/{tid}/files/{path}", content=data)
                if r.status_code == 204:
                    latest[path] = data
                    break
                status, code = code_of(r)
                assert (status, code) == (409, "draft.busy"), (status, code, r.text)
                busy[code] += 1
                time.sleep(0.05)
            else:
                raise AssertionError(f"{path} never acknowledged")
        return latest, busy

    def cli_runs(n: int) -> None:
        try:
            for args in chains[n]:
                runs[n].append((args, cli(env, tmp_path, *args)))
        finally:
            cli_done[n].set()

    def racer(i: int) -> Any:
        return writer(i) if i < CLI_WRITERS else cli_runs(i - CLI_WRITERS)

    results = race(CLI_WRITERS + len(chains), racer)[:CLI_WRITERS]
    expected = {"main.py": b"print(1)\n"}
    busy: collections.Counter[str] = collections.Counter()
    for latest, b in results:
        expected.update(latest)
        busy += b

    outcomes: collections.Counter[str] = collections.Counter()
    assert [[args for args, _ in chain] for chain in runs] == chains
    for args, run in (x for chain in runs for x in chain):
        text = run.stdout + run.stderr
        for bad in FORBIDDEN_TEXT:
            assert bad not in text, (args, text)
        if args[0] == "fsck":  # no problem may be reported while writes go on
            assert run.returncode == 0, f"fsck {args[1:]} reported problems on a live store:\n{run.stdout}"
            outcomes["fsck clean"] += 1
        elif args[:2] == ("publish", pid):  # a turn runs on pid: refused, typed
            assert run.returncode == 2 and "[draft.busy]" in run.stderr, (args, text)
            outcomes["publish refused draft.busy"] += 1
        elif run.returncode == 0:
            outcomes[f"{args[0]} ok"] += 1
        else:  # contention may only ever surface as draft.busy
            assert run.returncode == 2 and "[draft.busy]" in run.stderr, (args, run.returncode, text)
            outcomes[f"{args[0]} draft.busy"] += 1
    versions = walk(c, f"/v1/projects/{other}/versions")
    assert [v["summary"] for v in versions] == ["initial content", "from the cli"]
    assert ok(c.get(f"/v1/projects/{other}"))["current_version_id"] == first  # the CLI rolled it back

    # every acknowledged write is there, byte-exact; the store is consistent
    assert state_files(svc.store.view(pid)) == {p: sha(d) for p, d in expected.items()}
    complete(c, tid)
    end = svc.store.view_at_turn(tid, "end")
    assert {p: end.read_file(p) for p in expected} == expected
    assert_quiet(svc, output)
    check = cli(env, tmp_path, "fsck")
    assert check.returncode == 0 and "0 problems" in check.stdout, check.stdout + check.stderr
    print(f"6: {len(expected) - 1} writes acknowledged and verified (busy retries {dict(busy)}); "
          f"{sum(map(len, runs))} CLI runs: {dict(outcomes)}; fsck clean")
