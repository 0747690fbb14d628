"""Bulk growth of a PostgreSQL database: one project written through the Store, cloned N times in SQL.

The template project is written by the store's own code (``write_template``):
create, turns with tool calls and file writes, each turn ended (so its calls
are compacted into ``tool_calls_json`` and its writes sealed), then publish.
``clone`` copies every row of it ``count`` times with ``INSERT ... SELECT ...
CROSS JOIN generate_series``: each copy keeps every column value (the
compacted JSONB history, the tree roots and state digests, which name blobs
the template stored, the timestamps) and gets its own ids, derived as
``md5(salt || copy number || template id)``: 32 hex characters, as
``ids.new_id`` gives, and the same function for a key and for every column
that refers to it, so the copies' references stay inside the copy. The rows
are therefore the store's own rows, with new ids: ``check_copy`` reads one
back through the Store API and compares it with the template.

Used by ``bench/growth.py`` (10,000 copies of a 20-turn project) and by
``tests/test_growth_indexes.py`` (a few thousand, to EXPLAIN the hot statements).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import psycopg

from draftstore import Store

# per table: the columns holding an id of a row of the same project (rewritten per copy);
# every other column is copied as it is. Listed in foreign-key order.
ID_COLUMNS: dict[str, tuple[str, ...]] = {
    "project": ("id", "current_version_id", "active_draft_id"),
    "project_version": ("id", "project_id", "parent_version_id", "created_by_turn_id"),
    "project_draft": ("id", "project_id", "base_version_id", "last_turn_id", "published_version_id", "snapshot_id"),
    "draft_change": ("draft_id",),
    "project_turn": ("id", "project_id", "draft_id", "continues_turn_id", "base_version_id"),
    "tool_call": ("turn_id",),
    "head_move": ("project_id", "from_version_id", "to_version_id", "turn_id"),
}
# how each table's rows of one project are found
_OF_PROJECT = {
    "project": "t.id = %(pid)s",
    "project_version": "t.project_id = %(pid)s",
    "project_draft": "t.project_id = %(pid)s",
    "draft_change": "t.draft_id IN (SELECT id FROM project_draft WHERE project_id = %(pid)s)",
    "project_turn": "t.project_id = %(pid)s",
    "tool_call": "t.turn_id IN (SELECT id FROM project_turn WHERE project_id = %(pid)s)",
    "head_move": "t.project_id = %(pid)s",
}
_SKIP = {"head_move": ("id",)}  # a serial: the copy takes the next value

TOOLS = ("view_file", "search_code", "list_dir", "write_file", "view_file")


def libpq(url: str) -> str:
    """A SQLAlchemy URL (postgresql+psycopg://) as libpq takes it."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def write_template(store: Store, name: str, turns: int, calls: int, *, publish_every: int = 5,
                   running: bool = False) -> str:
    """A project written the store's way: ``turns`` turns of ``calls`` tool calls (small
    args and results, as an agent's reads and searches record), a file written every
    turn; every turn completed, the draft published every ``publish_every`` turns and
    after the last (so closed drafts and versions pile up as they do). ``running``: one more turn is
    left running with its calls recorded (rows in ``tool_call``) and a file written (a row
    in ``draft_change``). Returns the project id."""
    p = store.create_project(name, files={f"src/mod_{i}.py": f"# module {i}\nX = {i}\n".encode() for i in range(20)},
                             characters={"hero": {"hp": 10}}, world_settings={"era": "bronze"}, actor="bench")

    def record(tid: str, n: int, k: int) -> None:
        for c in range(calls):
            tool = TOOLS[c % len(TOOLS)]
            call = store.tool_started(tid, tool, {"path": f"src/mod_{c % 20}.py", "offset": 0, "limit": 200})
            store.tool_completed(tid, call.seq, {"ok": True, "bytes": 1024 + c,
                                                 "preview": f"def turn_{k}_{c}(path: str) -> int: ..."})
        store.write_file(tid, f"src/mod_{k % 20}.py", f"# module {k % 20}, turn {k}\nX = {k}\n".encode())

    for k in range(turns):
        t = store.start_turn(p.id, {"role": "user", "content": [{"type": "text", "text": f"step {k}: add a dragon"}]},
                             actor="worker-1")
        record(t.id, calls, k)
        store.complete_turn(t.id, f"done with step {k}")
        if (k + 1) % publish_every == 0 or k == turns - 1:
            store.publish(p.id, f"grown to step {k}", actor="admin")
    if running:
        t = store.start_turn(p.id, "keep going", actor="worker-1")
        record(t.id, calls, turns)
    return p.id


def _columns(conn: psycopg.Connection, table: str) -> list[str]:
    rows = conn.execute("SELECT column_name FROM information_schema.columns WHERE table_name = %s "
                        "AND table_schema = current_schema() ORDER BY ordinal_position", (table,)).fetchall()
    return [r[0] for r in rows if r[0] not in _SKIP.get(table, ())]


def _select_list(table: str, columns: list[str]) -> str:
    out = []
    for c in columns:
        if c in ID_COLUMNS[table]:
            out.append(f"md5(%(salt)s || g::text || t.{c})")  # NULL stays NULL
        elif table == "project" and c == "name":
            out.append("t.name || '-' || g::text")
        else:
            out.append(f"t.{c}")
    return ", ".join(out)


def clone(database_url: str, template_id: str, count: int, salt: str, *, batch: int = 500,
          progress: Callable[[str], None] | None = None) -> dict[str, int]:
    """Copy every row of project ``template_id`` ``count`` times (see the module docstring),
    ``batch`` copies per transaction. Returns the rows inserted per table. Copy ``g`` (1-based)
    of the template is the project ``copy_id(salt, g, template_id)``."""
    inserted = dict.fromkeys(ID_COLUMNS, 0)
    with psycopg.connect(libpq(database_url), autocommit=False) as conn:
        statements = []
        for table in ID_COLUMNS:
            cols = _columns(conn, table)
            sql = (f"INSERT INTO {table} ({', '.join(cols)}) SELECT {_select_list(table, cols)} "
                   f"FROM {table} t CROSS JOIN generate_series(%(lo)s::int, %(hi)s::int) g WHERE {_OF_PROJECT[table]}")
            statements.append((table, sql))
        t0 = time.perf_counter()
        for lo in range(1, count + 1, batch):
            hi = min(count, lo + batch - 1)
            params = {"pid": template_id, "salt": salt, "lo": lo, "hi": hi}
            for table, sql in statements:
                inserted[table] += conn.execute(sql, params).rowcount
            conn.commit()
            if progress is not None:
                rate = hi / max(1e-9, time.perf_counter() - t0)
                progress(f"  cloned {hi:,}/{count:,} projects ({inserted['project_turn']:,} turns) "
                         f"in {time.perf_counter() - t0:.0f}s, {rate:,.0f} projects/s")
    return inserted


def copy_id(salt: str, g: int, template_id: str) -> str:
    """The id copy ``g`` gives the template's row ``template_id`` (the SQL's md5, in Python)."""
    import hashlib

    return hashlib.md5(f"{salt}{g}{template_id}".encode()).hexdigest()


def analyze(database_url: str) -> float:
    """VACUUM ANALYZE the database (what autovacuum does to a grown one in time); seconds taken."""
    t0 = time.perf_counter()
    with psycopg.connect(libpq(database_url), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    return time.perf_counter() - t0


def check_copy(store: Store, template_id: str, salt: str, g: int) -> list[str]:
    """Read copy ``g`` of the template back through the Store API and compare it with the
    template read the same way: every field equal once ids are mapped. Returns the
    differences (empty: the copy reads like the native project)."""
    def m(x: Any) -> Any:
        return None if x is None else copy_id(salt, g, x)

    diffs: list[str] = []

    def same(what: str, native: Any, copy: Any) -> None:
        if native != copy:
            diffs.append(f"{what}: native {native!r} != copy {copy!r}")

    pid = m(template_id)
    src, dst = store.get_project(template_id), store.get_project(pid)
    same("project", dataclasses.replace(src, id=pid, name=f"{src.name}-{g}", current_version_id=m(src.current_version_id),
                                        active_draft_id=m(src.active_draft_id)), dst)
    for a, b in zip(store.list_versions(template_id), store.list_versions(pid), strict=True):
        same(f"version {a.number}", dataclasses.replace(a, id=m(a.id), project_id=pid,
                                                        parent_version_id=m(a.parent_version_id),
                                                        created_by_turn_id=m(a.created_by_turn_id)), b)
    for a, b in zip(store.head_moves(template_id), store.head_moves(pid), strict=True):
        same("head move", dataclasses.replace(a, id=b.id, project_id=pid, from_version_id=m(a.from_version_id),
                                              to_version_id=m(a.to_version_id), turn_id=m(a.turn_id)), b)
    for a, b in zip(store.list_turns(template_id), store.list_turns(pid), strict=True):
        full_a, full_b = store.get_turn(a.id), store.get_turn(b.id)
        calls = tuple(dataclasses.replace(c, turn_id=b.id) for c in full_a.tool_calls)
        same(f"turn {a.number}", dataclasses.replace(full_a, id=b.id, project_id=pid, draft_id=m(a.draft_id),
                                                     continues_turn_id=m(a.continues_turn_id),
                                                     base_version_id=m(a.base_version_id), tool_calls=calls), full_b)
    va, vb = store.view(template_id), store.view(pid)
    same("files", {p: va.read_file(p) for p in va.list_files()}, {p: vb.read_file(p) for p in vb.list_files()})
    same("characters", va.characters, vb.characters)
    return diffs
