"""The record shapes of the design, on both stacks.

- a turn's tool history: rows in ``tool_call`` while it runs, one ordered JSON
  array in ``project_turn.tool_calls_json`` once it ended (written by the very
  transaction that ends it, whatever ends it), identical through the API;
- messages, errors and partial responses are JSON values;
- documents are JSONB on PostgreSQL (JSON on SQLite): an admin can query them in SQL;
- who did what (actors) and which version a turn started from;
- statuses are StrEnums and a code state is named by its tree ``root``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from draftstore import InvalidInput, Settings, Store
from draftstore.db.tables import DRAFTS, TOOL_CALLS, TURNS
from draftstore.records import (
    DraftClosedReason,
    DraftStatus,
    HeadMoveReason,
    ToolCallStatus,
    TurnStatus,
)

STRUCTURED = {"role": "user", "content": [{"type": "text", "text": "hi"},
                                          {"type": "image", "url": "https://example.com/dragon.png"}]}


def new_project(store: Store, **kwargs):
    return store.create_project("shapes", files={"main.py": "print(1)\n"}, characters={"hero": {"hp": 10}},
                                world_settings={"era": "bronze", "magic": True}, **kwargs)


def rows_of(store: Store, turn_id: str) -> int:
    with store.engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(TOOL_CALLS)
                            .where(TOOL_CALLS.c.turn_id == turn_id)).scalar()


def compacted(store: Store, turn_id: str):
    with store.engine.connect() as conn:
        return conn.execute(sa.select(TURNS.c.tool_calls_json).where(TURNS.c.id == turn_id)).scalar_one()


# -- a turn's tool history: rows while it runs, one column once it ended -----------------------
def _complete(store, p, t):
    return store.complete_turn(t.id, "done")


def _interrupt(store, p, t):
    return store.interrupt_turn(t.id, partial_response={"text": "half"})


def _fail(store, p, t):
    return store.fail_turn(t.id, {"kind": "model_error"})


def _discard(store, p, t):
    store.discard_draft(p.id)
    return None


def _reap(store, p, t):
    # the real stack shares one database between tests: other tests' running turns (whose blobs live
    # under other prefixes) are kept alive in this store's coordinator, so the sweep reaps only ours
    with store.engine.connect() as conn:
        others = conn.execute(sa.select(TURNS.c.id).where(TURNS.c.status == "running",
                                                          TURNS.c.id != t.id)).scalars().all()
    for other in others:
        store.coord.beat(f"turn:{other}", 600)
    time.sleep(0.6)  # the heartbeat of start_turn (TTL 0.3 s) lapses: the worker is presumed dead
    assert store.sweep()["turns_reaped"] == 1
    return None


ENDINGS: dict[str, Callable] = {
    "completed": _complete,
    "interrupted": _interrupt,
    "failed": _fail,
    "rolled_back": _discard,
    "reaped": _reap,
}
STATUS_AFTER = {"completed": "completed", "interrupted": "interrupted", "failed": "failed",
                "rolled_back": "rolled_back", "reaped": "interrupted"}


def _record_history(store: Store, t) -> dict:
    """Four calls: offloaded args (completed), a structured failure, an offloaded
    result, and one still started when the turn ends."""
    big_args = {"path": "big.txt", "blob": "x" * (store.limits.inline_payload_bytes + 100)}
    view = store.tool_started(t.id, "view_file", big_args)
    store.tool_completed(t.id, view.seq, {"size": 3})
    tests = store.tool_started(t.id, "run_tests", {"suite": "all"})
    store.tool_failed(t.id, tests.seq, {"type": "Timeout", "after_s": 30})
    big_result = {"lines": [f"match {i}" for i in range(2_000)]}
    search = store.tool_started(t.id, "search_code", {"q": "match"})
    store.tool_completed(t.id, search.seq, big_result)
    store.tool_started(t.id, "slow_tool", {"n": 1})
    return {"big_args": big_args, "big_result": big_result}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_an_ended_turn_keeps_its_tool_history_on_its_row(store_factory, ending):
    store = store_factory(settings=Settings(heartbeat_ttl_s=0.3))
    p = new_project(store)
    t = store.start_turn(p.id, "look around")
    payloads = _record_history(store, t)

    # while the turn runs: four rows, no compacted column
    assert rows_of(store, t.id) == 4
    assert compacted(store, t.id) is None
    before = store.get_turn(t.id).tool_calls
    assert [(c.seq, c.tool_name, c.status) for c in before] == [
        (1, "view_file", "completed"), (2, "run_tests", "failed"),
        (3, "search_code", "completed"), (4, "slow_tool", "started")]
    assert before[0].args_offloaded and before[0].args is None and before[0].result == {"size": 3}
    assert before[1].error == {"type": "Timeout", "after_s": 30} and before[1].result is None
    assert before[2].result_offloaded and before[2].result is None and before[2].args == {"q": "match"}
    assert before[3].ended_at is None and before[3].args == {"n": 1}

    returned = ENDINGS[ending](store, p, t)

    # the ending transaction moved the history onto the row and deleted the rows
    assert rows_of(store, t.id) == 0
    column = compacted(store, t.id)
    assert isinstance(column, list) and [c["seq"] for c in column] == [1, 2, 3, 4]
    assert column[0]["args"] is None and column[0]["args_digest"] == before[0].args_digest  # offloaded
    assert column[1]["result"] == {"error": {"type": "Timeout", "after_s": 30}}
    assert column[2]["result"] is None and column[2]["result_digest"] == before[2].result_digest
    # the call still running ended with its turn: interrupted, at the turn's end
    ended = store.get_turn(t.id)
    assert column[3]["status"] == "interrupted" and column[3]["finished_at"] == ended.ended_at.isoformat()
    assert ended.status == STATUS_AFTER[ending]
    assert ended.tool_calls[:3] == before[:3]  # every field: seq, name, status, payloads, digests, previews, times
    assert ended.tool_calls[3] == dataclasses.replace(before[3], status="interrupted", ended_at=ended.ended_at)
    for old, new in zip(before[:3], ended.tool_calls):
        assert (new.seq, new.tool_name, new.status, new.args, new.result, new.error) == (
            old.seq, old.tool_name, old.status, old.args, old.result, old.error)
        assert (new.args_digest, new.args_preview, new.result_digest, new.result_preview) == (
            old.args_digest, old.args_preview, old.result_digest, old.result_preview)
        assert (new.started_at, new.ended_at) == (old.started_at, old.ended_at)
        assert new.started_at.tzinfo is not None
        assert isinstance(new.status, ToolCallStatus)
    if returned is not None:  # the record the ending call returned carries the same history
        assert returned.tool_calls == ended.tool_calls
    # offloaded payloads stay referenced by digest
    assert store.read_payload(ended.tool_calls[0].args_digest) == payloads["big_args"]
    assert store.read_payload(ended.tool_calls[2].result_digest) == payloads["big_result"]
    # another store instance reads the same history
    assert store_factory().get_turn(t.id).tool_calls == ended.tool_calls


def test_a_turn_without_tool_calls_ends_with_an_empty_history(store):
    p = new_project(store)
    t = store.start_turn(p.id, "just answer")
    assert compacted(store, t.id) is None and store.get_turn(t.id).tool_calls == ()
    done = store.complete_turn(t.id, "42")
    assert compacted(store, t.id) == []
    assert done.tool_calls == () and store.get_turn(t.id).tool_calls == ()


def test_list_turns_does_not_load_tool_calls(store):
    p = new_project(store)
    t1 = store.start_turn(p.id, "one")
    store.tool_started(t1.id, "a", {"i": 1})
    store.complete_turn(t1.id, "ok")
    t2 = store.continue_turn(p.id, "two")
    store.tool_started(t2.id, "b", {"i": 2})
    listed = store.list_turns(p.id)
    assert [x.id for x in listed] == [t1.id, t2.id]
    assert [x.tool_calls for x in listed] == [(), ()]
    assert len(store.get_turn(t1.id).tool_calls) == 1 and len(store.get_turn(t2.id).tool_calls) == 1


# -- messages are JSON values -------------------------------------------------------------------
def test_messages_are_json_values_and_round_trip_exactly(store):
    p = new_project(store)
    t1 = store.start_turn(p.id, "a plain string")
    assert t1.user_message == "a plain string"
    store.complete_turn(t1.id, {"role": "assistant", "content": [{"type": "text", "text": "done"}]})
    t2 = store.continue_turn(p.id, STRUCTURED)
    assert t2.user_message == STRUCTURED
    call = store.tool_started(t2.id, "run", {"cmd": "pytest"})
    store.tool_failed(t2.id, call.seq, "a string")
    failed = store.fail_turn(t2.id, {"kind": "model_error", "detail": [1, 2]})
    assert failed.error == {"kind": "model_error", "detail": [1, 2]}
    t3 = store.continue_turn(p.id, ["a", 1, None, True, {"k": 1.5}])
    store.complete_turn(t3.id, "plain answer")

    for turns in (store.list_turns(p.id), [store.get_turn(x.id) for x in (t1, t2, t3)]):
        a, b, c = turns
        assert a.user_message == "a plain string" and isinstance(a.user_message, str)
        assert a.assistant_message == {"role": "assistant", "content": [{"type": "text", "text": "done"}]}
        assert b.user_message == STRUCTURED and b.assistant_message is None
        assert b.error == {"kind": "model_error", "detail": [1, 2]}
        assert c.user_message == ["a", 1, None, True, {"k": 1.5}]
        assert c.assistant_message == "plain answer" and isinstance(c.assistant_message, str)
        assert a.error is None and c.error is None
    (only,) = store.get_turn(t2.id).tool_calls
    assert only.error == "a string" and isinstance(only.error, str) and only.status == "failed"


def test_a_missing_user_message_is_refused_and_creates_no_turn(store):
    p = new_project(store)
    with pytest.raises(InvalidInput) as exc:
        store.start_turn(p.id, None)
    assert type(exc.value) is InvalidInput and exc.value.code == "input.invalid"
    assert store.list_turns(p.id) == []
    assert store.get_project(p.id).active_draft_id is None  # no draft was derived either
    t = store.start_turn(p.id, "now with a message")
    store.complete_turn(t.id, "ok")
    with pytest.raises(InvalidInput) as exc:
        store.continue_turn(p.id, None)
    assert exc.value.code == "input.invalid"
    assert [x.id for x in store.list_turns(p.id)] == [t.id]
    t2 = store.continue_turn(p.id, "two")
    with pytest.raises(InvalidInput) as exc:
        store.complete_turn(t2.id, None)
    assert exc.value.code == "input.invalid"
    assert store.get_turn(t2.id).status == "running" and store.get_turn(t2.id).assistant_message is None


# -- JSONB on PostgreSQL, JSON on SQLite: documents are queryable in SQL --------------------------
class JsonSQL:
    """The same admin queries in each dialect's JSON functions (type names as PostgreSQL's)."""

    def __init__(self, store: Store) -> None:
        self.engine = store.engine
        self.pg = store.engine.dialect.name == "postgresql"

    def typeof(self, column: str, key: str | None = None) -> str:
        if self.pg:
            return f"jsonb_typeof({column}{'' if key is None else f'->{key!r}'})"
        t = f"json_type({column})" if key is None else f"json_type({column}, '$.{key}')"
        # SQLite's json_type says text/integer/real/true/false where PostgreSQL says string/number/boolean
        return (f"CASE {t} WHEN 'text' THEN 'string' WHEN 'integer' THEN 'number' WHEN 'real' THEN 'number' "
                f"WHEN 'true' THEN 'boolean' WHEN 'false' THEN 'boolean' ELSE {t} END")

    def field(self, column: str, *keys: str) -> str:
        if self.pg:
            return column + "".join(f"->'{k}'" for k in keys[:-1]) + f"->>'{keys[-1]}'"
        return f"json_extract({column}, '$.{'.'.join(keys)}')"

    def length(self, column: str) -> str:
        return f"jsonb_array_length({column})" if self.pg else f"json_array_length({column})"

    def row(self, sql: str, **params):
        with self.engine.connect() as conn:
            r = conn.execute(sa.text(sql), params).one()
        return tuple(r)

    def column_type(self, table: str, column: str) -> str:
        with self.engine.connect() as conn:
            if self.pg:
                return conn.execute(sa.text(
                    "SELECT data_type FROM information_schema.columns "
                    "WHERE table_schema = current_schema() AND table_name = :t AND column_name = :c"),
                    {"t": table, "c": column}).scalar_one()
            cols = conn.execute(sa.text(f"PRAGMA table_info({table})")).all()
            return next(c.type for c in cols if c.name == column).lower()


def test_json_documents_are_queryable_in_sql(store):
    q = JsonSQL(store)
    p = new_project(store)
    t1 = store.start_turn(p.id, STRUCTURED)
    call = store.tool_started(t1.id, "view_file", {"path": "main.py"})
    store.tool_completed(t1.id, call.seq, {"content": "print(1)\n"})
    store.tool_started(t1.id, "slow_tool", {"n": 1})
    store.interrupt_turn(t1.id, partial_response={"text": "I was about to", "tokens": 7})
    t2 = store.continue_turn(p.id, "go on")
    store.patch_characters(t2.id, {"villain": {"hp": 99}})
    store.complete_turn(t2.id, {"role": "assistant", "content": "done"})
    version = store.publish(p.id, "with a villain")

    # the columns are JSONB on PostgreSQL, JSON on SQLite
    expected = "jsonb" if q.pg else "json"
    for table, column in [("project_version", "characters_state_json"),
                          ("project_version", "worldsettings_state_json"),
                          ("project_draft", "characters_state_json"), ("project_draft", "partial_response_json"),
                          ("project_turn", "user_message_json"), ("project_turn", "assistant_message_json"),
                          ("project_turn", "error_json"), ("project_turn", "partial_response_json"),
                          ("project_turn", "tool_calls_json")]:
        assert q.column_type(table, column) == expected, (table, column)

    hp, villain_hp = q.field("characters_state_json", "hero", "hp"), q.field("characters_state_json", "villain", "hp")
    assert q.row(f"SELECT {q.typeof('characters_state_json')}, {hp}, {villain_hp} FROM project_version WHERE id = :id",
                 id=version.id) == ("object", "10" if q.pg else 10, "99" if q.pg else 99)
    first = store.list_versions(p.id)[0]
    assert q.row(f"SELECT {q.typeof('worldsettings_state_json')}, {q.field('worldsettings_state_json', 'era')}, "
                 f"{q.typeof('worldsettings_state_json', 'magic')} FROM project_version WHERE id = :id",
                 id=first.id) == ("object", "bronze", "boolean")

    assert q.row(f"SELECT {q.typeof('user_message_json')}, {q.field('user_message_json', 'role')}, "
                 f"{q.typeof('assistant_message_json')}, {q.length('tool_calls_json')}, "
                 f"{q.field('partial_response_json', 'text')} FROM project_turn WHERE id = :id", id=t1.id) == (
        "object", "user", None, 2, "I was about to")
    assert q.row(f"SELECT {q.typeof('user_message_json')}, {q.typeof('assistant_message_json')}, "
                 f"{q.field('assistant_message_json', 'content')}, {q.length('tool_calls_json')} "
                 "FROM project_turn WHERE id = :id", id=t2.id) == ("string", "object", "done", 0)
    # the compacted history is queryable call by call
    status_of_second = ("tool_calls_json->1->>'status'" if q.pg else "json_extract(tool_calls_json, '$[1].status')")
    name_of_first = ("tool_calls_json->0->>'tool_name'" if q.pg else "json_extract(tool_calls_json, '$[0].tool_name')")
    assert q.row(f"SELECT {name_of_first}, {status_of_second} FROM project_turn WHERE id = :id", id=t1.id) == (
        "view_file", "interrupted")
    # the published draft keeps its partial response as a document too
    assert q.row(f"SELECT {q.typeof('partial_response_json')}, {q.field('partial_response_json', 'tokens')} "
                 "FROM project_draft WHERE id = :id", id=t1.draft_id) == ("object", "7" if q.pg else 7)


def test_a_running_turn_has_no_compacted_history_in_sql(store):
    q = JsonSQL(store)
    p = new_project(store)
    t = store.start_turn(p.id, "hello")
    store.tool_started(t.id, "a", {"i": 1})
    assert q.row(f"SELECT tool_calls_json IS NULL, {q.typeof('user_message_json')} FROM project_turn "
                 "WHERE id = :id", id=t.id) == (True, "string")


# -- actors and base versions -------------------------------------------------------------------------
def test_actors_are_recorded_on_turns_versions_head_moves_and_closed_drafts(store):
    p = new_project(store, actor="zoe")
    v1 = p.current_version_id
    assert store.get_version(v1).created_by == "zoe"
    assert [(m.reason, m.actor, m.to_version_id) for m in store.head_moves(p.id)] == [("create", "zoe", v1)]

    t1 = store.start_turn(p.id, "one", actor="alice")
    assert t1.actor == "alice" and t1.base_version_id == v1
    store.complete_turn(t1.id, "ok")
    t2 = store.continue_turn(p.id, "two", actor="bob")
    assert t2.actor == "bob" and t2.base_version_id == v1
    discarded = store.discard_draft(p.id, actor="carol")
    assert discarded.id == t1.draft_id
    assert discarded.closed_by == "carol" and discarded.closed_reason == "discarded"
    assert isinstance(discarded.closed_reason, DraftClosedReason) and discarded.closed_at is not None
    assert [(x.actor, x.status) for x in store.list_turns(p.id)] == [("alice", "completed"), ("bob", "rolled_back")]

    t3 = store.start_turn(p.id, "three")  # no actor: anonymous
    assert t3.actor is None and t3.base_version_id == v1 and t3.draft_id != t1.draft_id
    store.write_file(t3.id, "three.py", "3\n")
    store.complete_turn(t3.id, "ok")
    v2 = store.publish(p.id, "three", actor="dave")
    assert v2.created_by == "dave" and store.get_version(v2.id).created_by == "dave"
    last = store.head_moves(p.id)[-1]
    assert (last.reason, last.actor, last.from_version_id, last.to_version_id, last.turn_id) == (
        "publish", "dave", v1, v2.id, t3.id)
    with store.engine.connect() as conn:
        closed = conn.execute(sa.select(DRAFTS.c.closed_by, DRAFTS.c.closed_reason, DRAFTS.c.published_version_id)
                              .where(DRAFTS.c.id == t3.draft_id)).one()
        first_draft = conn.execute(sa.select(DRAFTS.c.closed_by, DRAFTS.c.closed_reason)
                                   .where(DRAFTS.c.id == t1.draft_id)).one()
    assert tuple(closed) == ("dave", "published", v2.id)
    assert tuple(first_draft) == ("carol", "discarded")

    store.rollback_to(p.id, v1, actor="erin")
    last = store.head_moves(p.id)[-1]
    assert (last.reason, last.actor, last.from_version_id, last.to_version_id) == ("rollback", "erin", v2.id, v1)
    assert [m.actor for m in store.head_moves(p.id)] == ["zoe", "dave", "erin"]
    t4 = store.start_turn(p.id, "after the rollback", actor="frank")
    assert t4.base_version_id == v1 == store.get_project(p.id).current_version_id


def test_a_turn_continued_on_an_old_draft_keeps_the_drafts_base(store):
    p = new_project(store)
    v1 = p.current_version_id
    t1 = store.start_turn(p.id, "one")
    store.complete_turn(t1.id, "ok")
    v2 = store.publish(p.id, "v2")
    t2 = store.start_turn(p.id, "two")  # a new draft, based on v2
    store.complete_turn(t2.id, "ok")
    store.rollback_to(p.id, v1)  # head moves; the open draft keeps its base
    t3 = store.continue_turn(p.id, "three")
    assert t2.base_version_id == v2.id and t3.base_version_id == v2.id
    assert store.get_turn(t3.id).base_version_id == v2.id
    assert store.get_draft(p.id).base_version_id == v2.id != store.get_project(p.id).current_version_id


# -- StrEnums and roots -----------------------------------------------------------------------------
def test_statuses_are_str_enums_and_states_name_their_root(store):
    p = new_project(store)
    t = store.start_turn(p.id, "work")
    assert t.status == "running" and t.status is TurnStatus.RUNNING and isinstance(t.status, TurnStatus)
    call = store.tool_started(t.id, "view_file", {"path": "main.py"})
    assert call.status == "started" and isinstance(call.status, ToolCallStatus)
    draft = store.get_draft(p.id)
    assert draft.status == "running" and isinstance(draft.status, DraftStatus)
    store.write_file(t.id, "new.py", "new\n")
    done = store.complete_turn(t.id, "done")
    assert done.status == "completed" and isinstance(done.status, TurnStatus)
    assert json.dumps({"status": done.status}) == '{"status": "completed"}'  # serialises as a plain string
    assert store.get_turn(t.id).status == TurnStatus.COMPLETED and isinstance(store.get_turn(t.id).status,
                                                                               TurnStatus)
    assert all(isinstance(x.status, TurnStatus) for x in store.list_turns(p.id))

    paused = store.get_draft(p.id)
    assert paused.status == "paused" and isinstance(paused.status, DraftStatus)
    assert paused.root == done.end_root != done.start_root
    head = store.get_version(p.current_version_id)
    assert head.root == done.start_root
    version = store.publish(p.id, "new file")
    assert version.root == done.end_root == store.get_version(version.id).root
    assert version.file_count == 2
    moves = store.head_moves(p.id)
    assert [m.reason for m in moves] == ["create", "publish"]
    assert all(isinstance(m.reason, HeadMoveReason) for m in moves)
    assert store.view_at(p.id, version.id).read_text("new.py") == "new\n"


# -- JSON values come back as they went in, on both stacks --------------------------------------------
NUMBERS = {"big": 1.1e25, "huge": 1.5e300, "whole": 1e16, "tiny": 2.5e-300, "pi": 3.141592653589793,
           "int": 2**63, "neg": -7, "one": 1.0}
TEXTS = {"backslash_u": "C:\\u0000\\new", "emoji": "dragon \U0001F409", "separators": "a\u2028b\u2029c",
         "quote": "\"'\\", "control": "tab\there\r\n", "empty": ""}


def same_json(value, expected) -> bool:
    """Equal, and of the same JSON shape (a float stays a float: 1e16 is not 10000000000000000)."""
    return value == expected and json.dumps(value, sort_keys=True) == json.dumps(expected, sort_keys=True)


@pytest.mark.parametrize("values", [NUMBERS, TEXTS], ids=["numbers", "texts"])
def test_json_values_come_back_exactly_as_they_went_in(store, values):
    """Every place a JSON value is stored gives it back unchanged (listed together when some do not)."""
    p = store.create_project("values", files={"main.py": "x"}, characters={"stats": values},
                             world_settings=values)
    t = store.start_turn(p.id, {"ask": values})
    call = store.tool_started(t.id, "compute", values)
    store.tool_completed(t.id, call.seq, [values])
    running_call = store.get_turn(t.id).tool_calls[0]
    store.patch_characters(t.id, {"patched": values})
    done = store.complete_turn(t.id, values)
    ended = store.get_turn(t.id)
    v1 = store.get_version(p.current_version_id)
    places = {
        "version characters": (v1.characters, {"stats": values}),
        "version world settings": (v1.world_settings, values),
        "user message": (ended.user_message, {"ask": values}),
        "user message (list_turns)": (store.list_turns(p.id)[0].user_message, {"ask": values}),
        "assistant message": (ended.assistant_message, values),
        "assistant message (returned)": (done.assistant_message, values),
        "tool args while running": (running_call.args, values),
        "tool result while running": (running_call.result, [values]),
        "tool args after the end": (ended.tool_calls[0].args, values),
        "tool result after the end": (ended.tool_calls[0].result, [values]),
        "draft characters": (store.view(p.id).characters, {"stats": values, "patched": values}),
    }
    changed = {where: got for where, (got, want) in places.items() if not same_json(got, want)}
    assert sorted(changed) == []  # the places that changed a value


# -- SQL written against the design reads the rows by the design's names -------------------------------
def test_sql_written_against_the_design_reads_every_record_by_its_names(store):
    """An admin's report written from the design (not from draftstore's code) runs as it is."""
    q = JsonSQL(store)
    p = new_project(store)
    t = store.start_turn(p.id, "add a castle")
    view = store.tool_started(t.id, "view_file", {"path": "main.py"})
    store.tool_completed(t.id, view.seq, {"content": "print(1)\n"})
    tests = store.tool_started(t.id, "run_tests", {"suite": "all"})
    store.tool_failed(t.id, tests.seq, {"type": "Timeout", "after_s": 30})
    store.write_file(t.id, "castle.py", "CASTLE = True\n")
    store.complete_turn(t.id, "castle added")
    bundle = store.create_snapshot(p.id, "draft")
    external = store.record_snapshot(p.id, "head", "e2b:snap-42")
    head = store.get_version(p.current_version_id)

    assert q.row(f"SELECT code_manifest_key, {q.field('characters_state_json', 'hero', 'hp')}, "
                 f"{q.field('worldsettings_state_json', 'era')} FROM project_version WHERE id = :id",
                 id=head.id) == (head.root, "10" if q.pg else 10, "bronze")
    draft = store.get_draft(p.id)
    assert q.row(f"SELECT code_manifest_key, last_turn_id, snapshot_id, updated_at IS NOT NULL, "
                 f"{q.field('characters_state_json', 'hero', 'hp')}, {q.field('worldsettings_state_json', 'era')} "
                 "FROM project_draft WHERE id = :id", id=draft.id) == (
        draft.root, t.id, bundle.id, True, "10" if q.pg else 10, "bronze")
    assert q.row("SELECT bundle_key, e2b_snapshot_ref FROM sandbox_snapshot WHERE id = :id",
                 id=bundle.id) == (bundle.bundle_key, None)
    assert q.row("SELECT bundle_key, e2b_snapshot_ref FROM sandbox_snapshot WHERE id = :id",
                 id=external.id) == (None, "e2b:snap-42")

    (calls,) = q.row("SELECT tool_calls_json FROM project_turn WHERE id = :id", id=t.id)
    calls = calls if isinstance(calls, list) else json.loads(calls)
    design_keys = {"seq", "tool_name", "args", "status", "result", "started_at", "finished_at"}
    assert all(design_keys <= set(c) for c in calls)
    ok, failed = calls
    assert (ok["seq"], ok["tool_name"], ok["args"], ok["status"], ok["result"]) == (
        1, "view_file", {"path": "main.py"}, "completed", {"content": "print(1)\n"})
    assert (failed["seq"], failed["tool_name"], failed["status"]) == (2, "run_tests", "failed")
    assert failed["result"] == {"error": {"type": "Timeout", "after_s": 30}}
    assert ok["finished_at"] >= ok["started_at"] and failed["finished_at"] is not None
    # the failed call's error, queried in SQL at result.error
    error_type = ("tool_calls_json->1->'result'->'error'->>'type'" if q.pg
                  else "json_extract(tool_calls_json, '$[1].result.error.type')")
    assert q.row(f"SELECT {error_type} FROM project_turn WHERE id = :id", id=t.id) == ("Timeout",)
    # and the API still says it with its own words
    assert store.get_turn(t.id).tool_calls[1].error == {"type": "Timeout", "after_s": 30}


def test_every_change_to_a_draft_moves_its_updated_at(store):
    """An admin finds recently changed drafts by ``project_draft.updated_at``: every
    write, delete, move, patch, status change, snapshot, publish and discard moves it."""
    q = JsonSQL(store)
    p = new_project(store)
    t = store.start_turn(p.id, "one")
    draft_id = t.draft_id
    seen = [q.row("SELECT updated_at FROM project_draft WHERE id = :id", id=draft_id)[0]]
    assert seen[0] is not None

    def moved(what: str) -> None:
        (now,) = q.row("SELECT updated_at FROM project_draft WHERE id = :id", id=draft_id)
        assert now > seen[-1], what
        seen.append(now)

    assert store.get_draft(p.id).updated_at is not None  # the API shows it too
    store.write_file(t.id, "a.py", "a\n")
    moved("write")
    assert store.get_draft(p.id).updated_at > store.get_draft(p.id).created_at
    store.move_file(t.id, "a.py", "b.py")
    moved("move")
    store.delete_file(t.id, "b.py")
    moved("delete")
    store.patch_characters(t.id, {"villain": {"hp": 1}})
    moved("characters patch")
    store.patch_world_settings(t.id, {"era": "iron"})
    moved("world settings patch")
    store.interrupt_turn(t.id, partial_response={"text": "half"})
    moved("interrupted")
    t2 = store.continue_turn(p.id, "two")
    moved("running again")
    store.write_file(t2.id, "c.py", "c\n")
    moved("write")
    store.complete_turn(t2.id, "ok")
    moved("paused (sealed)")
    store.create_snapshot(p.id, "draft")
    moved("its snapshot named")
    store.publish(p.id, "published")
    moved("published")

    t3 = store.start_turn(p.id, "three")
    draft_id = t3.draft_id
    seen.append(q.row("SELECT updated_at FROM project_draft WHERE id = :id", id=draft_id)[0])
    store.discard_draft(p.id)
    moved("discarded")
