"""A retried tool-call start records one call: the Idempotency-Key, on both stacks.

The fear: a start whose answer was lost (a replica killed, a connection reset)
is sent again, and the turn's history shows the call twice. With a key, the
retry gets the first call back and nothing new is recorded; a key reused for
another request is refused and changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

import pytest
import sqlalchemy as sa

from draftstore import IdempotencyConflict, InvalidInput, Store, TurnNotRunning


def running_turn(store: Store) -> Any:
    p = store.create_project("retries", files={"main.py": "print(1)\n"})
    return store.start_turn(p.id, "edit main.py")


def history(store: Store, turn_id: str) -> list[tuple[int, str, str]]:
    return [(c.seq, c.tool_name, c.status) for c in store.get_turn(turn_id).tool_calls]


def test_the_same_key_twice_records_one_call_and_answers_it_both_times(store):
    t = running_turn(store)
    first = store.tool_started(t.id, "view_file", {"path": "main.py"}, idempotency_key="agent-1:call-1")
    again = store.tool_started(t.id, "view_file", {"path": "main.py"}, idempotency_key="agent-1:call-1")
    assert (again.seq, again.tool_name, again.status, again.args) == (first.seq, "view_file", "started",
                                                                      {"path": "main.py"})
    assert history(store, t.id) == [(1, "view_file", "started")]
    # the next call, another key, takes the next seq
    assert store.tool_started(t.id, "view_file", {"path": "main.py"}, idempotency_key="agent-1:call-2").seq == 2


def test_a_retry_after_the_call_completed_answers_the_call_as_it_stands(store):
    t = running_turn(store)
    call = store.tool_started(t.id, "run_tests", {"k": "unit"}, idempotency_key="k-run")
    store.tool_completed(t.id, call.seq, {"passed": 3})
    again = store.tool_started(t.id, "run_tests", {"k": "unit"}, idempotency_key="k-run")
    assert (again.seq, again.status, again.result) == (call.seq, "completed", {"passed": 3})
    assert history(store, t.id) == [(1, "run_tests", "completed")]


def test_a_key_reused_for_another_request_is_a_typed_conflict_and_changes_nothing(store):
    t = running_turn(store)
    store.tool_started(t.id, "view_file", {"path": "main.py"}, idempotency_key="k")
    before = store.get_turn(t.id)
    for other in ({"tool_name": "view_file", "args": {"path": "other.py"}},
                  {"tool_name": "write_file", "args": {"path": "main.py"}},
                  {"tool_name": "view_file", "args": {"path": "main.py"}, "needs_approval": True}):
        with pytest.raises(IdempotencyConflict) as caught:
            store.tool_started(t.id, idempotency_key="k", **other)
        assert caught.value.code == "idempotency.conflict"
        assert caught.value.details["seq"] == 1
    assert store.get_turn(t.id).tool_calls == before.tool_calls


def test_a_retry_with_its_arguments_in_another_key_order_is_the_same_request(store):
    """A client that rebuilds its request on retry (or a proxy that re-serialises it)
    may send the keys in another order: the same arguments, so the same call."""
    t = running_turn(store)
    first = store.tool_started(t.id, "search_code", {"pattern": "def ", "path": "src", "limit": 5},
                               idempotency_key="reordered")
    again = store.tool_started(t.id, "search_code", {"limit": 5, "path": "src", "pattern": "def "},
                               idempotency_key="reordered")
    assert again.seq == first.seq
    with pytest.raises(IdempotencyConflict):
        store.tool_started(t.id, "search_code", {"limit": 6, "path": "src", "pattern": "def "},
                           idempotency_key="reordered")
    assert history(store, t.id) == [(1, "search_code", "started")]


def test_a_start_recorded_by_the_previous_release_is_still_recognised_on_retry(store):
    """During a rolling deploy a start recorded by a replica of the previous release
    (its digest was over the arguments as stored) is retried against an upgraded one:
    it is answered, not refused. The row holds what that release wrote."""
    t = running_turn(store)
    first = store.tool_started(t.id, "view_file", {"path": "main.py", "limit": 10}, idempotency_key="old")
    stored = sa.text("SELECT args_json, args_digest FROM tool_call WHERE turn_id = :t AND seq = :s")
    with store.database.tx() as conn:
        args_json, args_digest = conn.execute(stored, {"t": t.id, "s": first.seq}).one()
        earlier = hashlib.sha256(json.dumps(["view_file", args_json, args_digest, False]).encode()).hexdigest()
        conn.execute(sa.text("UPDATE tool_call SET request_digest = :d WHERE turn_id = :t AND seq = :s"),
                     {"d": earlier, "t": t.id, "s": first.seq})
    assert store.tool_started(t.id, "view_file", {"path": "main.py", "limit": 10}, idempotency_key="old").seq == 1
    with pytest.raises(IdempotencyConflict):
        store.tool_started(t.id, "view_file", {"path": "main.py", "limit": 11}, idempotency_key="old")
    assert history(store, t.id) == [(1, "view_file", "started")]


def test_a_big_offloaded_args_payload_is_recognised_on_retry(store):
    t = running_turn(store)
    big = {"blob": "x" * (store.limits.inline_payload_bytes + 10)}
    first = store.tool_started(t.id, "apply_patch", big, idempotency_key="big")
    assert first.args_digest is not None
    again = store.tool_started(t.id, "apply_patch", big, idempotency_key="big")
    assert (again.seq, again.args_digest) == (first.seq, first.args_digest)
    with pytest.raises(IdempotencyConflict):
        store.tool_started(t.id, "apply_patch", {"blob": "y" * len(big["blob"])}, idempotency_key="big")
    assert history(store, t.id) == [(1, "apply_patch", "started")]


def test_keys_belong_to_their_turn(store):
    p = store.create_project("two turns", files={"a.txt": "a"})
    t1 = store.start_turn(p.id, "one")
    assert store.tool_started(t1.id, "view_file", {"path": "a.txt"}, idempotency_key="call-1").seq == 1
    store.complete_turn(t1.id, "done")
    t2 = store.start_turn(p.id, "two")
    store.tool_started(t2.id, "list_dir", {}, idempotency_key="other")
    # the same key in another turn is another call, whatever its body
    assert store.tool_started(t2.id, "write_file", {"path": "b"}, idempotency_key="call-1").seq == 2
    assert history(store, t2.id) == [(1, "list_dir", "started"), (2, "write_file", "started")]


def test_a_retry_after_the_turn_ended_is_refused_and_records_nothing(store):
    t = running_turn(store)
    store.tool_started(t.id, "view_file", {"path": "main.py"}, idempotency_key="late")
    store.complete_turn(t.id, "done")
    with pytest.raises(TurnNotRunning):
        store.tool_started(t.id, "view_file", {"path": "main.py"}, idempotency_key="late")
    assert history(store, t.id) == [(1, "view_file", "interrupted")]


@pytest.mark.parametrize("key", ["", " padded", "tab\tkey", "é", "x" * 201, 7])
def test_a_malformed_key_is_invalid_input_and_records_nothing(store, key):
    t = running_turn(store)
    with pytest.raises(InvalidInput) as caught:
        store.tool_started(t.id, "view_file", {"path": "main.py"}, idempotency_key=key)
    assert caught.value.code == "input.invalid" and caught.value.details["field"] == "idempotency_key"
    assert history(store, t.id) == []


def test_concurrent_starts_with_one_key_record_one_call(store_factory):
    """Two stores (two processes' worth of engine and pool) and several threads each
    send the same start at once, round after round: one call per key."""
    stores = [store_factory(), store_factory()]
    t = running_turn(stores[0])
    rounds, threads_per_store = 8, 3
    answers: dict[int, list[int]] = {r: [] for r in range(rounds)}
    errors: list[BaseException] = []
    lock = threading.Lock()

    for r in range(rounds):
        barrier = threading.Barrier(len(stores) * threads_per_store)

        def start(s: Store, r: int = r, barrier: threading.Barrier = barrier) -> None:
            try:
                barrier.wait()
                call = s.tool_started(t.id, "search_code", {"q": f"round {r}"}, idempotency_key=f"round-{r}")
                with lock:
                    answers[r].append(call.seq)
            except BaseException as exc:  # reported below, with the round
                errors.append(exc)

        workers = [threading.Thread(target=start, args=(s,)) for s in stores for _ in range(threads_per_store)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert errors == []
    calls = stores[1].get_turn(t.id).tool_calls
    assert len(calls) == rounds
    assert sorted(c.args["q"] for c in calls) == sorted(f"round {r}" for r in range(rounds))
    for r in range(rounds):
        seqs = set(answers[r])
        assert len(answers[r]) == len(stores) * threads_per_store and len(seqs) == 1
        (seq,) = seqs
        assert calls[seq - 1].args == {"q": f"round {r}"}


# -- over HTTP: the Idempotency-Key header ------------------------------------------------------
def test_over_http_a_retried_start_with_its_key_gets_the_same_answer_and_records_nothing(service):
    from test_service_streams import new_project, start_turn

    c = service.client()
    t = start_turn(c, new_project(c))
    ask = {"tool_name": "view_file", "args": {"path": "main.py"}}
    first = c.post(f"/v1/turns/{t}/tool-calls", json=ask, headers={"Idempotency-Key": "a1"})
    again = c.post(f"/v1/turns/{t}/tool-calls", json=ask, headers={"Idempotency-Key": "a1"})
    assert (first.status_code, again.status_code) == (201, 201), (first.text, again.text)
    assert again.json()["seq"] == first.json()["seq"] == 1
    assert again.json()["started_at"] == first.json()["started_at"]

    other = c.post(f"/v1/turns/{t}/tool-calls", json={**ask, "args": {"path": "x.py"}},
                   headers={"Idempotency-Key": "a1"})
    assert other.status_code == 409 and other.json()["code"] == "idempotency.conflict", other.text
    bad = c.post(f"/v1/turns/{t}/tool-calls", json=ask, headers={"Idempotency-Key": "x" * 201})
    assert bad.status_code == 422 and bad.json()["code"] == "input.invalid", bad.text
    unkeyed = c.post(f"/v1/turns/{t}/tool-calls", json=ask)
    assert unkeyed.status_code == 201 and unkeyed.json()["seq"] == 2
    calls = c.get(f"/v1/turns/{t}/tool-calls").json()["items"]
    assert [(x["seq"], x["args"]) for x in calls] == [(1, {"path": "main.py"}), (2, {"path": "main.py"})]


def test_the_openapi_document_names_the_idempotency_key_header(service):
    doc = service.client().get("/openapi.json").json()
    params = doc["paths"]["/v1/turns/{turn_id}/tool-calls"]["post"]["parameters"]
    (header,) = [p for p in params if p["in"] == "header"]
    assert header["name"] == "Idempotency-Key" and header["required"] is False
    assert "idempotency.conflict" in header["description"]
