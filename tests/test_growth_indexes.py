"""A grown database keeps the hot statements on indexes: no sequential scan of a big table.

The database is grown the way ``bench/growth.py`` grows it (a project written
by the store, cloned in SQL: ``bench/growth_load.py``) to tens of thousands of
rows, then ANALYZEd, so the planner has the statistics of a grown deployment.
Every statement the hot operations send (start, tool-call records, writes,
end, continue with its resume context, publish, reads and lists) is captured
at the driver (``psycopg.Cursor.execute``, which both SQLAlchemy and the
one-shot/group-commit path use) and EXPLAINed with its own parameters; a
``Seq Scan`` node on one of the big tables fails the test with the statement.
Real PostgreSQL only: SQLite's planner is not the one that runs in production.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from draftstore import Store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import growth_load

pytestmark = pytest.mark.parametrize("stack", [pytest.param("real", marks=pytest.mark.real)], indirect=True)

BIG = {"project", "project_version", "project_draft", "project_turn", "tool_call", "head_move"}
ENDED_COPIES = 3_000  # x 10 turns = 30,000 ended turns (5 compacted calls each), 15,000 closed drafts
RUNNING_COPIES = 2_000  # x 12 tool_call rows of a running turn = 24,000 rows


def seq_scans(plan: Any) -> list[str]:
    """The big tables a plan (EXPLAIN (FORMAT JSON) output) reads by sequential scan."""
    found: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        if node.get("Node Type") == "Seq Scan" and node.get("Relation Name") in BIG:
            found.append(node["Relation Name"])
        for child in node.get("Plans", ()):
            walk(child)

    for entry in plan:
        walk(entry["Plan"])
    return found


@pytest.fixture
def grown(stack: dict[str, str], store: Store) -> Iterator[tuple[Store, str, str]]:
    """(store, a completed copy's project id, a copy with a running turn's project id)."""
    ended = growth_load.write_template(store, "ended", turns=10, calls=5, publish_every=2)
    running = growth_load.write_template(store, "running", turns=2, calls=12, running=True)
    growth_load.clone(stack["database_url"], ended, ENDED_COPIES, "e")
    growth_load.clone(stack["database_url"], running, RUNNING_COPIES, "r")
    growth_load.analyze(stack["database_url"])
    yield store, growth_load.copy_id("e", ENDED_COPIES // 2, ended), growth_load.copy_id("r", RUNNING_COPIES // 2,
                                                                                           running)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Every (SQL, parameters) sent through psycopg while the test runs."""
    seen: list[tuple[str, Any]] = []
    execute = psycopg.Cursor.execute

    def recording(self: Any, query: Any, params: Any = None, **kw: Any) -> Any:
        if isinstance(query, str):
            seen.append((query, params))
        return execute(self, query, params, **kw)

    monkeypatch.setattr(psycopg.Cursor, "execute", recording)
    return seen


def hot_operations(store: Store, ended: str, running: str) -> None:
    """What agents, backends and admins do all day, on a grown database."""
    turn_id = store.list_turns(running)[-1].id  # the copy's running turn, with its tool_call rows
    call = store.tool_started(turn_id, "view_file", {"path": "src/mod_1.py"})
    store.tool_completed(turn_id, call.seq, {"ok": True})
    store.get_turn(turn_id)
    store.page_tool_calls(turn_id, limit=5)
    store.write_file(turn_id, "src/new.py", b"x = 1\n")
    store.view(running).read_file("src/new.py")
    store.complete_turn(turn_id, "done")

    t = store.start_turn(ended, "add a dragon")
    call = store.tool_started(t.id, "search_code", {"q": "dragon"})
    store.tool_failed(t.id, call.seq, {"type": "Timeout"})
    store.heartbeat(t.id)
    store.write_file(t.id, "dragon.py", b"DRAGON = 1\n")
    store.patch_characters(t.id, {"dragon": {"hp": 99}})
    store.interrupt_turn(t.id)
    again = store.continue_turn(ended, "go on")
    store.resume_context(again.id, max_turns=2)
    store.complete_turn(again.id, "done")
    store.publish(ended, "dragon")
    store.page_turns(ended, limit=20, newest_first=True)
    store.list_turns(ended)
    store.list_versions(ended)
    store.page_head_moves(ended, limit=20)
    store.get_project(ended)
    store.view(ended).read_file("dragon.py")
    # and what every replica runs in the background, every few seconds
    store.sweep()
    store.run_background(limit=2)


def test_the_hot_statements_of_a_grown_database_use_indexes(
        grown: tuple[Store, str, str], captured: list[tuple[str, Any]], stack: dict[str, str]) -> None:
    store, ended, running = grown
    captured.clear()  # the load's own statements are not the hot path
    hot_operations(store, ended, running)
    statements = [(sql, params) for sql, params in captured
                  if sql.lstrip().split(None, 1)[0].upper() in ("SELECT", "INSERT", "UPDATE", "DELETE", "WITH")]
    assert len(statements) > 40, "the hot operations' statements were captured"
    scans: dict[str, list[str]] = {}
    with psycopg.connect(growth_load.libpq(stack["database_url"]), autocommit=True) as conn:
        for sql, params in statements:
            plan = conn.execute("EXPLAIN (FORMAT JSON) " + sql, params).fetchone()[0]
            tables = seq_scans(plan if isinstance(plan, list) else json.loads(plan))
            if tables:
                scans.setdefault(" ".join(sql.split()), tables)
    assert not scans, "sequential scans of big tables:\n" + "\n".join(
        f"{tables}: {sql}" for sql, tables in scans.items())


def test_the_check_sees_a_sequential_scan(stack: dict[str, str], store: Store) -> None:
    # the walk finds a Seq Scan where one happens (no index on actor), so the test above can fail
    with psycopg.connect(growth_load.libpq(stack["database_url"]), autocommit=True) as conn:
        plan = conn.execute("EXPLAIN (FORMAT JSON) SELECT id FROM project_turn WHERE actor = %s",
                            ("worker-1",)).fetchone()[0]
    assert seq_scans(plan) == ["project_turn"]


def test_a_grown_copy_reads_back_like_the_project_it_copies(stack: dict[str, str], store: Store) -> None:
    native = growth_load.write_template(store, "ended", turns=4, calls=5, publish_every=2)
    growth_load.clone(stack["database_url"], native, 10, "e")
    assert growth_load.check_copy(store, native, "e", 7) == []
    # and a copy that differs is caught: one compacted call's result changed in SQL
    copy = growth_load.copy_id("e", 7, native)
    with psycopg.connect(growth_load.libpq(stack["database_url"]), autocommit=True) as conn:
        conn.execute("UPDATE project_turn SET tool_calls_json = jsonb_set(tool_calls_json, '{0,result,bytes}', '1') "
                     "WHERE project_id = %s AND number = 3", (copy,))
    diffs = growth_load.check_copy(store, native, "e", 7)
    assert len(diffs) == 1 and diffs[0].startswith("turn 3")
