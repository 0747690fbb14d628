"""Upgrading a 0001 database to the current schema keeps every row readable and usable.

A database written by the 0001 release (messages as text, JSON documents as
text, tool calls as rows for every turn, no actors) is filled with raw SQL in
that schema's shape, upgraded, and then read and used through the API: on
SQLite (a temp file) and on PostgreSQL (a scratch database of its own).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

from draftstore import IntegrityError, Store
from draftstore.blobs import DirectoryBlobStore
from draftstore.blobs.cache import ObjectCache
from draftstore.coord import MemoryCoordinator
from draftstore.db.engine import create_db_engine
from draftstore.db.migrate import SCHEMA_HEAD, current_revision, head_revision, scripts_head, upgrade
from draftstore.db.tables import DRAFTS, PROJECTS, TOOL_CALLS, TURNS, VERSIONS, utcnow
from draftstore.digest import EMPTY_TREE
from draftstore.trees import FileEntry, TreeReader

T0 = datetime(2026, 11, 1, 9, 0, 0, 123456, tzinfo=timezone.utc)


@contextmanager
def empty_postgres(real_postgres: Any) -> Iterator[str]:
    """A new, empty PostgreSQL database's URL for one test (the session's own database is
    migrated already); dropped afterwards."""
    import psycopg
    from services import _with_database, token

    name = f"draftstore_migrate_{token()}"
    with psycopg.connect(real_postgres.admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _with_database(real_postgres.admin_url, name, "postgresql+psycopg")
    finally:
        with psycopg.connect(real_postgres.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def ident(c: str) -> str:
    return c * 32


P, V1, V2, DR, OLD_DR = ident("1"), ident("2"), ident("3"), ident("4"), ident("5")
T1, T2, T3, T4 = ident("6"), ident("7"), ident("8"), ident("9")

BIG_ARGS = {"path": "big.txt", "blob": "z" * 10_000}


def build_tree(blobs: DirectoryBlobStore, files: dict[str, bytes]) -> str:
    """What the old release left in the blob store: file blobs and tree objects."""
    changes = {path: FileEntry(blobs.put(data), len(data)) for path, data in files.items()}
    root, _ = TreeReader(blobs, ObjectCache(1 << 20)).seal(EMPTY_TREE, changes)
    return str(root)


JSON = sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


def insert(conn: Any, table: str, **values: Any) -> None:
    """A raw INSERT in an old schema, by its column names (timestamps bound as
    timestamps, dicts and lists as JSON documents)."""
    binds = [sa.bindparam(k, type_=sa.DateTime(timezone=True)) for k, v in values.items() if isinstance(v, datetime)]
    binds += [sa.bindparam(k, type_=JSON) for k, v in values.items() if isinstance(v, (dict, list))]
    sql = f"INSERT INTO {table} ({', '.join(values)}) VALUES ({', '.join(':' + k for k in values)})"
    conn.execute(sa.text(sql).bindparams(*binds), values)


def fill_0001(engine: Any, blobs: DirectoryBlobStore) -> dict[str, Any]:
    """One project as the 0001 release wrote it: two versions, an open draft
    (and an older discarded one), four turns (completed with two tool calls,
    failed, interrupted, running with one call) and its head moves."""
    root1 = build_tree(blobs, {"main.py": b"print(1)\n"})
    root2 = build_tree(blobs, {"main.py": b"print(2)\n", "lib/util.py": b"def f(): pass\n"})
    big_digest = blobs.put(b'{"path":"big.txt","blob":"' + b"z" * 10_000 + b'"}')
    with engine.begin() as conn:
        insert(conn, "project", id=P, name="old game", current_version_id=V2, active_draft_id=DR, created_at=at(0))
        insert(conn, "project_version", id=V1, project_id=P, number=1, parent_version_id=None,
               code_manifest_key=root1, file_count=1, characters_json='{"hero": {"hp": 10}}',
               world_settings_json='{"era": "bronze"}', summary="initial content", created_by_turn_id=None,
               created_by="alice", created_at=at(0))
        insert(conn, "project_version", id=V2, project_id=P, number=2, parent_version_id=V1,
               code_manifest_key=root2, file_count=2, characters_json='{"hero": {"hp": 12}, "villain": {"hp": 7}}',
               world_settings_json='{"era": "iron", "magic": true}', summary="second", created_by_turn_id=None,
               created_by="bob", created_at=at(5))
        insert(conn, "project_draft", id=OLD_DR, project_id=P, base_version_id=V1, status="paused",
               code_manifest_key=root1, file_count=1, characters_json="{}", world_settings_json="{}", revision=3,
               last_turn_id=None, partial_response_json=None, status_changed_at=at(2), created_at=at(1),
               closed_at=at(3), closed_reason="discarded", published_version_id=None)
        insert(conn, "project_draft", id=DR, project_id=P, base_version_id=V2, status="running",
               code_manifest_key=root2, file_count=2, characters_json='{"hero": {"hp": 12}, "villain": {"hp": 7}}',
               world_settings_json='{"era": "iron", "magic": true}', revision=9, last_turn_id=T4,
               partial_response_json='{"text": "I was writing the castle"}', status_changed_at=at(30),
               created_at=at(10))
        common = dict(project_id=P, draft_id=DR, start_root=root2, start_state_digest=None)
        insert(conn, "project_turn", id=T1, number=1, continues_turn_id=None, status="completed",
               user_message="add a dragon", assistant_message="added the dragon", error=None,
               partial_response_json=None, end_root=root2, end_state_digest=None, started_at=at(11),
               ended_at=at(12), **common)
        insert(conn, "project_turn", id=T2, number=2, continues_turn_id=T1, status="failed",
               user_message="now a bridge", assistant_message=None, error="model crashed",
               partial_response_json=None, end_root=root2, end_state_digest=None, started_at=at(13),
               ended_at=at(14), **common)
        insert(conn, "project_turn", id=T3, number=3, continues_turn_id=T2, status="interrupted",
               user_message="now a castle", assistant_message=None, error=None,
               partial_response_json='{"text": "I was writing the castle"}', end_root=root2,
               end_state_digest=None, started_at=at(15), ended_at=at(16), **common)
        insert(conn, "project_turn", id=T4, number=4, continues_turn_id=T3, status="running",
               user_message="keep going", assistant_message=None, error=None, partial_response_json=None,
               end_root=None, end_state_digest=None, started_at=at(20), ended_at=None, **common)
        insert(conn, "tool_call", turn_id=T1, seq=1, tool_name="view_file", status="completed",
               args_json=None, args_digest=str(big_digest), args_preview='{"path":"big.txt","blob":"zzz',
               result_json='{"content": "print(2)\\n"}', result_digest=None, result_preview=None, error=None,
               started_at=at(11.1), ended_at=at(11.2))
        insert(conn, "tool_call", turn_id=T1, seq=2, tool_name="run_tests", status="failed",
               args_json='{"suite": "all"}', args_digest=None, args_preview=None, result_json=None,
               result_digest=None, result_preview=None, error="tests timed out", started_at=at(11.3),
               ended_at=at(11.4))
        insert(conn, "tool_call", turn_id=T4, seq=1, tool_name="view_file", status="started",
               args_json='{"path": "main.py"}', args_digest=None, args_preview=None, result_json=None,
               result_digest=None, result_preview=None, error=None, started_at=at(20.5), ended_at=None)
        insert(conn, "head_move", project_id=P, from_version_id=None, to_version_id=V1, reason="create",
               actor="alice", turn_id=None, at=at(0))
        insert(conn, "head_move", project_id=P, from_version_id=V1, to_version_id=V2, reason="publish",
               actor="bob", turn_id=None, at=at(5))
    return {"root1": root1, "root2": root2, "big_digest": str(big_digest)}


def tool_rows(engine: Any, turn_id: str) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(TOOL_CALLS)
                            .where(TOOL_CALLS.c.turn_id == turn_id)).scalar()


def compacted(engine: Any, turn_id: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(TURNS.c.tool_calls_json).where(TURNS.c.id == turn_id)).scalar_one()


def check_upgraded(store: Store, old: dict[str, Any]) -> None:
    """Everything the 0001 rows said reads back through the API, and work goes on."""
    engine = store.engine
    assert current_revision(engine) == head_revision()

    project = store.get_project(P)
    assert (project.name, project.current_version_id, project.active_draft_id) == ("old game", V2, DR)
    v1, v2 = store.list_versions(P)
    assert v1.characters == {"hero": {"hp": 10}} and isinstance(v1.characters, dict)
    assert v1.world_settings == {"era": "bronze"}
    assert v2.characters == {"hero": {"hp": 12}, "villain": {"hp": 7}}
    assert v2.world_settings == {"era": "iron", "magic": True}
    assert (v1.root, v2.root, v2.parent_version_id, v1.created_by, v2.created_by) == (
        old["root1"], old["root2"], V1, "alice", "bob")
    assert [(m.reason, m.actor, m.from_version_id, m.to_version_id) for m in store.head_moves(P)] == [
        ("create", "alice", None, V1), ("publish", "bob", V1, V2)]
    assert store.view_at(P, V1).read_text("main.py") == "print(1)\n"

    draft = store.get_draft(P)
    assert (draft.id, draft.base_version_id, draft.status, draft.revision, draft.last_turn_id) == (
        DR, V2, "running", 9, T4)
    assert draft.partial_response == {"text": "I was writing the castle"} and draft.closed_by is None
    view = store.view(P)
    assert view.list_files() == ["lib/util.py", "main.py"] and view.characters == v2.characters

    t1, t2, t3, t4 = store.list_turns(P)
    assert [(t.id, t.status) for t in (t1, t2, t3, t4)] == [
        (T1, "completed"), (T2, "failed"), (T3, "interrupted"), (T4, "running")]
    assert [t.user_message for t in (t1, t2, t3, t4)] == ["add a dragon", "now a bridge", "now a castle",
                                                          "keep going"]
    assert all(isinstance(t.user_message, str) for t in (t1, t2, t3, t4))
    assert (t1.assistant_message, t1.error) == ("added the dragon", None)
    assert (t2.assistant_message, t2.error) == (None, "model crashed")
    assert t3.partial_response == {"text": "I was writing the castle"} and t3.error is None
    assert all(t.base_version_id == V2 for t in (t1, t2, t3, t4))  # filled from their draft
    assert all(t.actor is None for t in (t1, t2, t3, t4))
    assert (t1.started_at, t1.ended_at, t4.ended_at) == (at(11), at(12), None)

    # ended turns: history compacted onto the row, rows gone
    assert tool_rows(engine, T1) == 0 and len(compacted(engine, T1)) == 2
    assert compacted(engine, T2) == [] and compacted(engine, T3) == []
    view_call, tests_call = store.get_turn(T1).tool_calls
    assert (view_call.seq, view_call.tool_name, view_call.status) == (1, "view_file", "completed")
    assert view_call.args is None and view_call.args_digest == old["big_digest"]
    assert view_call.args_preview == '{"path":"big.txt","blob":"zzz'
    assert store.read_payload(view_call.args_digest) == BIG_ARGS
    assert view_call.result == {"content": "print(2)\n"} and view_call.error is None
    assert (view_call.started_at, view_call.ended_at) == (at(11.1), at(11.2))
    assert (tests_call.seq, tests_call.tool_name, tests_call.status) == (2, "run_tests", "failed")
    assert tests_call.args == {"suite": "all"} and tests_call.result is None
    assert tests_call.error == "tests timed out" and (tests_call.started_at, tests_call.ended_at) == (
        at(11.3), at(11.4))
    assert store.get_turn(T2).tool_calls == () and store.get_turn(T3).tool_calls == ()

    # the running turn: its call is still a row, readable, and the turn goes on
    assert tool_rows(engine, T4) == 1 and compacted(engine, T4) is None
    (pending,) = store.get_turn(T4).tool_calls
    assert (pending.seq, pending.tool_name, pending.status, pending.args, pending.ended_at) == (
        1, "view_file", "started", {"path": "main.py"}, None)
    assert pending.started_at == at(20.5)

    store.tool_completed(T4, 1, {"content": "print(2)\n"})
    write = store.tool_started(T4, "write_file", {"path": "castle.py"})
    assert write.seq == 2
    store.write_file(T4, "castle.py", "CASTLE = True\n")
    store.tool_completed(T4, write.seq, {"ok": True})
    assert store.patch_characters(T4, {"knight": {"hp": 5}})["knight"] == {"hp": 5}
    done = store.complete_turn(T4, {"role": "assistant", "content": "castle built"})
    assert done.status == "completed" and done.assistant_message == {"role": "assistant", "content": "castle built"}
    assert [(c.seq, c.status) for c in done.tool_calls] == [(1, "completed"), (2, "completed")]
    assert tool_rows(engine, T4) == 0 and len(compacted(engine, T4)) == 2
    assert store.get_turn(T4).tool_calls == done.tool_calls

    v3 = store.publish(P, "castle", actor="carol")
    assert (v3.number, v3.parent_version_id, v3.created_by, v3.created_by_turn_id) == (3, V2, "carol", T4)
    assert v3.root == done.end_root
    assert v3.characters == {"hero": {"hp": 12}, "villain": {"hp": 7}, "knight": {"hp": 5}}
    assert store.head_moves(P)[-1].actor == "carol"
    head = store.view(P)
    assert head.list_files() == ["castle.py", "lib/util.py", "main.py"]
    assert head.read_text("castle.py") == "CASTLE = True\n" and head.read_text("main.py") == "print(2)\n"
    t5 = store.start_turn(P, "a new draft after the upgrade", actor="dave")
    assert (t5.number, t5.base_version_id, t5.actor) == (5, v3.id, "dave")
    store.complete_turn(t5.id, "ok")


def check_invariants_survive(store: Store) -> None:
    """The partial unique indexes are still there, and still partial."""
    engine = store.engine
    names = {ix["name"] for table in ("project_turn", "project_draft") for ix in sa.inspect(engine).get_indexes(table)}
    assert {"uq_turn_running", "uq_draft_open"} <= names
    now = utcnow()
    turn = dict(project_id=P, draft_id=DR, user_message_json="sneaky", started_at=now)
    with pytest.raises(sa.exc.IntegrityError):
        with engine.begin() as conn:
            conn.execute(TURNS.insert().values(id=ident("a"), number=10, status="running", **turn))
    draft = dict(project_id=P, base_version_id=V2, status="paused", code_manifest_key=str(EMPTY_TREE), file_count=0,
                 characters_json={}, world_settings_json={}, revision=0, status_changed_at=now, created_at=now)
    with pytest.raises(sa.exc.IntegrityError):
        with engine.begin() as conn:
            conn.execute(DRAFTS.insert().values(id=ident("b"), **draft))
    # partial: more ended turns and closed drafts of the project are fine
    with engine.begin() as conn:
        conn.execute(TURNS.insert().values(id=ident("c"), number=11, status="completed", ended_at=now, **turn))
        conn.execute(DRAFTS.insert().values(id=ident("d"), closed_at=now, closed_reason="discarded", **draft))
    with engine.begin() as conn:
        conn.execute(TURNS.delete().where(TURNS.c.id == ident("c")))
        conn.execute(DRAFTS.delete().where(DRAFTS.c.id == ident("d")))
    assert [t.status for t in store.list_turns(P)][-1] == "running"
    assert store.get_draft(P).id == DR


def migrate_and_check(url: str, tmp_path: Path, open_store: Callable[[str, Path], Store]) -> None:
    engine = create_db_engine(url)
    try:
        upgrade(engine, "0001")
        assert current_revision(engine) == "0001"
        blobs = DirectoryBlobStore(tmp_path / "blobs")
        try:
            old = fill_0001(engine, blobs)
        finally:
            blobs.close()
    finally:
        engine.dispose()
    store = open_store(url, tmp_path)
    try:
        check_invariants_survive(store)
        check_upgraded(store, old)
    finally:
        store.close()


def by_upgrade(url: str, tmp_path: Path) -> Store:
    """``draftstore db upgrade``, then a store on the engine."""
    engine = create_db_engine(url)
    try:
        upgrade(engine)
    except BaseException:
        engine.dispose()
        raise
    return Store(engine, DirectoryBlobStore(tmp_path / "blobs"), MemoryCoordinator())


def by_open(url: str, tmp_path: Path) -> Store:
    """``Store.open(..., migrate=True)`` upgrades on open."""
    return Store.open(database_url=url, blob_url=f"file://{tmp_path}/blobs", coord_url="memory://", migrate=True)


def by_open_embedded(url: str, tmp_path: Path) -> Store:
    """On SQLite, opening a store migrates without being asked."""
    return Store.open(database_url=url, blob_url=f"file://{tmp_path}/blobs", coord_url="memory://")


def test_the_schema_head_the_store_checks_is_the_head_of_the_migration_scripts():
    """Opening a store compares the database with ``SCHEMA_HEAD`` without reading the
    scripts: a new migration must move it, or every store would refuse (or accept) the
    wrong schema."""
    assert scripts_head() == SCHEMA_HEAD == head_revision()


def test_a_database_with_two_schema_heads_is_refused_typed(tmp_path):
    engine = create_db_engine(f"sqlite:///{tmp_path}/heads.db")
    try:
        upgrade(engine)
        with engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO alembic_version (version_num) VALUES ('9999')")
        with pytest.raises(IntegrityError) as caught:
            current_revision(engine)
        assert caught.value.details["heads"] == [SCHEMA_HEAD, "9999"]
    finally:
        engine.dispose()


@pytest.mark.parametrize("how", [by_upgrade, by_open, by_open_embedded], ids=lambda f: f.__name__)
def test_upgrading_a_0001_sqlite_database_keeps_its_data(tmp_path, how):
    migrate_and_check(f"sqlite:///{tmp_path}/old.db", tmp_path, how)


@pytest.mark.real
@pytest.mark.parametrize("how", [by_upgrade, by_open], ids=lambda f: f.__name__)
def test_upgrading_a_0001_postgres_database_keeps_its_data(real_postgres, tmp_path, how):
    with empty_postgres(real_postgres) as url:
        migrate_and_check(url, tmp_path, how)
        engine = sa.create_engine(url)
        try:
            with engine.connect() as conn:
                types = dict(conn.execute(sa.text(
                    "SELECT table_name || '.' || column_name, data_type FROM information_schema.columns "
                    "WHERE table_schema = 'public' AND column_name LIKE '%\\_json' ESCAPE '\\'")).all())
        finally:
            engine.dispose()
        # documents became JSONB; serialised tool payloads stay text (they are embedded as they are)
        assert {k: v for k, v in types.items() if not k.startswith("tool_call.")} == {
            f"{table}.{column}": "jsonb" for table, columns in {
                "project_version": ["characters_state_json", "worldsettings_state_json"],
                "project_draft": ["characters_state_json", "worldsettings_state_json", "partial_response_json"],
                "project_turn": ["user_message_json", "assistant_message_json", "error_json",
                                 "partial_response_json", "tool_calls_json"],
            }.items() for column in columns}
        assert {k: v for k, v in types.items() if k.startswith("tool_call.")} == {
            "tool_call.args_json": "text", "tool_call.result_json": "text", "tool_call.error_json": "text",
            "tool_call.approval_json": "text"}


# -- old values the new column types are stricter about -------------------------------------------------
# The 0001 release stored JSON as text and let a NUL inside a string through
# (as the escape \u0000, which a text column holds); JSONB cannot hold it.
def fill_0001_with_nul_documents(engine: Any) -> None:
    with engine.begin() as conn:
        insert(conn, "project", id=P, name="nul docs", current_version_id=V1, active_draft_id=None, created_at=at(0))
        insert(conn, "project_version", id=V1, project_id=P, number=1, parent_version_id=None,
               code_manifest_key=str(EMPTY_TREE), file_count=0, characters_json='{"hero": "a\\u0000b", "hp": 3}',
               world_settings_json='{"era": "bronze"}', summary="initial content", created_by_turn_id=None,
               created_by=None, created_at=at(0))


def fill_0001_with_a_nul_tool_payload(engine: Any) -> None:
    with engine.begin() as conn:
        insert(conn, "project", id=P, name="nul payload", current_version_id=None, active_draft_id=None,
               created_at=at(0))
        insert(conn, "project_draft", id=DR, project_id=P, base_version_id=None, status="paused",
               code_manifest_key=str(EMPTY_TREE), file_count=0, characters_json="{}", world_settings_json="{}",
               revision=1, last_turn_id=T1, partial_response_json=None, status_changed_at=at(2), created_at=at(1),
               closed_at=at(3), closed_reason="discarded", published_version_id=None)
        insert(conn, "project_turn", id=T1, project_id=P, draft_id=DR, number=1, continues_turn_id=None,
               status="completed", user_message="read it", assistant_message="read", error=None,
               partial_response_json=None, start_root=str(EMPTY_TREE), end_root=str(EMPTY_TREE),
               start_state_digest=None, end_state_digest=None, started_at=at(1), ended_at=at(2))
        insert(conn, "tool_call", turn_id=T1, seq=1, tool_name="read_raw", status="completed",
               args_json='{"x":"a\\u0000b"}', args_digest=None, args_preview=None, result_json='{"n":1}',
               result_digest=None, result_preview=None, error=None, started_at=at(1.1), ended_at=at(1.2))


def upgraded_store(url: str, tmp_path: Path, fill: Callable[[Any], None]) -> Store:
    engine = create_db_engine(url)
    upgrade(engine, "0001")
    fill(engine)
    try:
        upgrade(engine)
    except BaseException:
        engine.dispose()
        raise
    return Store(engine, DirectoryBlobStore(tmp_path / "blobs"), MemoryCoordinator())


def check_nul_documents(store: Store) -> None:
    (v1,) = store.list_versions(P)
    assert set(v1.characters) == {"hero", "hp"} and v1.characters["hp"] == 3
    assert isinstance(v1.characters["hero"], str)
    assert v1.world_settings == {"era": "bronze"}
    assert store.view(P).characters == v1.characters


def check_nul_tool_payload(store: Store) -> None:
    (turn,) = store.list_turns(P)
    assert (turn.id, turn.status, turn.user_message) == (T1, "completed", "read it")
    (call,) = store.get_turn(T1).tool_calls
    assert (call.seq, call.tool_name, call.status, call.result) == (1, "read_raw", "completed", {"n": 1})


def test_upgrading_a_0001_sqlite_database_keeps_documents_that_hold_a_nul(tmp_path):
    store = upgraded_store(f"sqlite:///{tmp_path}/old.db", tmp_path, fill_0001_with_nul_documents)
    try:
        check_nul_documents(store)
        assert store.list_versions(P)[0].characters["hero"] == "a\x00b"  # SQLite keeps the text as it was
    finally:
        store.close()


@pytest.mark.real
@pytest.mark.parametrize("case", ["documents", "tool_payload"])
def test_upgrading_a_0001_postgres_database_whose_json_holds_a_nul_completes(real_postgres, tmp_path, case):
    fill, check = {"documents": (fill_0001_with_nul_documents, check_nul_documents),
                   "tool_payload": (fill_0001_with_a_nul_tool_payload, check_nul_tool_payload)}[case]
    with empty_postgres(real_postgres) as url:
        store = upgraded_store(url, tmp_path, fill)
        try:
            check(store)
        finally:
            store.close()


# -- 0006 -> 0007: sandbox sessions ------------------------------------------------------------------------
def fill_0006(engine: Any) -> None:
    """A project as the 0006 release left it: head, an open draft naming its ready external snapshot."""
    empty = str(EMPTY_TREE)
    with engine.begin() as conn:
        insert(conn, "project", id=P, name="before sessions", current_version_id=V1, active_draft_id=DR,
               created_at=at(0))
        insert(conn, "project_version", id=V1, project_id=P, number=1, code_manifest_key=empty, file_count=0,
               characters_json={"hero": 1}, world_settings_json={}, summary="v1", created_at=at(0), pack_attempts=0)
        insert(conn, "project_draft", id=DR, project_id=P, base_version_id=V1, status="paused",
               code_manifest_key=empty, file_count=0, characters_json={"hero": 2}, world_settings_json={},
               revision=1, status_changed_at=at(1), created_at=at(1), snapshot_id=T1)
        insert(conn, "sandbox_snapshot", id=T1, project_id=P, source_kind="draft", source_id=DR, root=empty,
               status="ready", external_ref="provider-snap", files=0, size_bytes=0, created_at=at(2),
               finished_at=at(2))


def upgrade_0006_and_check(url: str, tmp_path: Path) -> None:
    engine = create_db_engine(url)
    try:
        upgrade(engine, "0006")
        fill_0006(engine)
        upgrade(engine)
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
    store = by_open(url, tmp_path)
    try:
        draft = store.get_draft(P)
        assert (draft.id, draft.snapshot_id, draft.revision) == (DR, T1, 1)
        assert store.get_project(P).current_version_id == V1
        best = store.best_snapshot(P, "draft")
        assert best is not None and (best.id, best.external_ref) == (T1, "provider-snap")
        assert store.page_sandboxes(P).items == []
        session = store.open_sandbox(P, "e2b", "sbx", snapshot_id=T1)
        assert (session.draft_id, session.snapshot_id, session.status) == (DR, T1, "starting")
        assert store.page_sandboxes(P).items == [session]
    finally:
        store.close()


def test_upgrading_a_0006_sqlite_database_keeps_its_data_and_adds_sandbox_sessions(tmp_path):
    upgrade_0006_and_check(f"sqlite:///{tmp_path}/old.db", tmp_path)


@pytest.mark.real
def test_upgrading_a_0006_postgres_database_keeps_its_data_and_adds_sandbox_sessions(real_postgres, tmp_path):
    with empty_postgres(real_postgres) as url:
        upgrade_0006_and_check(url, tmp_path)


# -- 0007 -> 0008: the design's names ----------------------------------------------------------------------
def fill_0007(engine: Any, blobs: DirectoryBlobStore) -> dict[str, Any]:
    """A project as the 0007 release left it: a version with characters, a paused draft,
    a completed turn whose history was compacted in 0007's keys (an offloaded args, a
    failed call, a call denied approval), and an external snapshot of the draft."""
    empty = str(EMPTY_TREE)
    big = str(blobs.put(b'{"path":"big.txt","blob":"' + b"z" * 10_000 + b'"}'))
    calls = [
        {"seq": 1, "tool_name": "view_file", "status": "completed", "args_digest": big,
         "args_preview": '{"path":"big.txt","blob":"zzz', "result": {"content": "x"}, "result_digest": None,
         "result_preview": None, "error": None, "approval": None,
         "started_at": at(11.1).isoformat(), "ended_at": at(11.2).isoformat()},
        {"seq": 2, "tool_name": "run_tests", "status": "failed", "args": {"suite": "all"}, "args_digest": None,
         "args_preview": None, "result_digest": None, "result_preview": None,
         "error": {"type": "Timeout", "after_s": 30}, "approval": None,
         "started_at": at(11.3).isoformat(), "ended_at": at(11.4).isoformat()},
        {"seq": 3, "tool_name": "rm_rf", "status": "denied", "args": {"path": "/"}, "args_digest": None,
         "args_preview": None, "result_digest": None, "result_preview": None, "error": None,
         "approval": {"approved": False, "reason": "no", "by": "zoe", "at": at(11.6).isoformat()},
         "started_at": at(11.5).isoformat(), "ended_at": at(11.6).isoformat()},
    ]
    with engine.begin() as conn:
        insert(conn, "project", id=P, name="before the design's names", current_version_id=V1, active_draft_id=DR,
               created_at=at(0))
        insert(conn, "project_version", id=V1, project_id=P, number=1, code_manifest_key=empty, file_count=0,
               characters_json={"hero": {"hp": 10}}, world_settings_json={"era": "bronze"}, summary="v1",
               created_at=at(0), pack_attempts=0)
        insert(conn, "project_draft", id=DR, project_id=P, base_version_id=V1, status="paused",
               code_manifest_key=empty, file_count=0, characters_json={"hero": {"hp": 12}},
               world_settings_json={"era": "iron"}, revision=4, last_turn_id=T1, status_changed_at=at(12),
               created_at=at(10), snapshot_id=T2)
        insert(conn, "project_draft", id=OLD_DR, project_id=P, base_version_id=V1, status="paused",
               code_manifest_key=empty, file_count=0, characters_json={}, world_settings_json={}, revision=1,
               status_changed_at=at(2), created_at=at(1), closed_at=at(3), closed_reason="discarded")
        insert(conn, "project_turn", id=T1, project_id=P, draft_id=DR, number=1, status="completed",
               user_message_json={"role": "user", "content": "add a castle"},
               assistant_message_json={"role": "assistant", "content": "done"}, tool_calls_json=calls,
               base_version_id=V1, start_root=empty, end_root=empty, started_at=at(11), ended_at=at(12))
        insert(conn, "sandbox_snapshot", id=T2, project_id=P, source_kind="draft", source_id=DR, root=empty,
               status="ready", external_ref="e2b:snap-7", files=0, size_bytes=0, created_at=at(13),
               finished_at=at(13))
    return {"big": big, "calls": calls}


def sql_row(engine: Any, sql: str, **params: Any) -> tuple[Any, ...]:
    with engine.connect() as conn:
        return tuple(conn.execute(sa.text(sql), params).one())


def as_json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def as_time(value: Any) -> datetime:
    value = datetime.fromisoformat(value) if isinstance(value, str) else value
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def filled_0007(engine: Any, tmp_path: Path) -> dict[str, Any]:
    """``engine``'s database migrated to 0007 and filled as that release left it."""
    upgrade(engine, "0007")
    blobs = DirectoryBlobStore(tmp_path / "blobs")
    try:
        return fill_0007(engine, blobs)
    finally:
        blobs.close()


def upgrade_0007_and_check(url: str, tmp_path: Path) -> None:
    engine = create_db_engine(url)
    try:
        old = filled_0007(engine, tmp_path)
        upgrade(engine)
        assert current_revision(engine) == head_revision()

        # plain SQL by the design's names finds every value
        chars, world = sql_row(engine, "SELECT characters_state_json, worldsettings_state_json FROM project_version "
                                       "WHERE id = :id", id=V1)
        assert (as_json(chars), as_json(world)) == ({"hero": {"hp": 10}}, {"era": "bronze"})
        chars, world, updated = sql_row(engine, "SELECT characters_state_json, worldsettings_state_json, updated_at "
                                                "FROM project_draft WHERE id = :id", id=DR)
        assert (as_json(chars), as_json(world), as_time(updated)) == ({"hero": {"hp": 12}}, {"era": "iron"}, at(12))
        (closed_updated,) = sql_row(engine, "SELECT updated_at FROM project_draft WHERE id = :id", id=OLD_DR)
        assert as_time(closed_updated) == at(3)  # a closed draft last changed when it closed
        assert sql_row(engine, "SELECT e2b_snapshot_ref, bundle_key FROM sandbox_snapshot WHERE id = :id",
                       id=T2) == ("e2b:snap-7", None)
        (calls,) = sql_row(engine, "SELECT tool_calls_json FROM project_turn WHERE id = :id", id=T1)
        view, tests, denied = as_json(calls)
        for c in (view, tests, denied):
            assert {"seq", "tool_name", "args", "status", "result", "started_at", "finished_at"} <= set(c)
            assert "ended_at" not in c and "error" not in c
        assert (view["args"], view["args_digest"], view["result"], view["finished_at"]) == (
            None, old["big"], {"content": "x"}, at(11.2).isoformat())
        assert (tests["args"], tests["status"], tests["result"], tests["finished_at"]) == (
            {"suite": "all"}, "failed", {"error": {"type": "Timeout", "after_s": 30}}, at(11.4).isoformat())
        assert (denied["status"], denied["result"], denied["approval"]["by"]) == ("denied", None, "zoe")
    finally:
        engine.dispose()

    # the API reads the same values, and work goes on
    store = by_open(url, tmp_path)
    try:
        assert store.get_version(V1).characters == {"hero": {"hp": 10}}
        assert store.get_draft(P).snapshot_id == T2
        assert store.best_snapshot(P, "draft").external_ref == "e2b:snap-7"
        view, tests, denied = store.get_turn(T1).tool_calls
        assert (view.args, view.args_digest, view.result, view.error, view.ended_at) == (
            None, old["big"], {"content": "x"}, None, at(11.2))
        assert store.read_payload(view.args_digest) == BIG_ARGS
        assert (tests.args, tests.result, tests.error, tests.ended_at) == (
            {"suite": "all"}, None, {"type": "Timeout", "after_s": 30}, at(11.4))
        assert (denied.status, denied.result, denied.error, denied.approval["reason"]) == ("denied", None, None, "no")
        t2 = store.continue_turn(P, "go on")
        store.write_file(t2.id, "castle.py", "CASTLE = True\n")
        store.complete_turn(t2.id, "ok")
        assert store.publish(P, "castle").characters == {"hero": {"hp": 12}}
    finally:
        store.close()


def downgrade(engine: Any, revision: str) -> None:
    """``alembic downgrade`` on ``engine`` (SQLite's foreign keys off while tables are rebuilt, as in ``upgrade``)."""
    from alembic import command

    from draftstore.db.migrate import alembic_config

    cfg = alembic_config()
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            conn.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")
        with conn.begin():
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, revision)


def test_upgrading_a_0007_sqlite_database_keeps_every_value_under_the_designs_names(tmp_path):
    upgrade_0007_and_check(f"sqlite:///{tmp_path}/old.db", tmp_path)


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgres", marks=pytest.mark.real)])
def test_downgrading_0008_gives_back_the_0007_names_and_entries(request, tmp_path, database):
    if database == "sqlite":
        downgrade_0008_and_check(f"sqlite:///{tmp_path}/old.db", tmp_path)
    else:
        with empty_postgres(request.getfixturevalue("real_postgres")) as url:
            downgrade_0008_and_check(url, tmp_path)


def downgrade_0008_and_check(url: str, tmp_path: Path) -> None:
    engine = create_db_engine(url)
    try:
        old = filled_0007(engine, tmp_path)
        upgrade(engine, "0008")
        downgrade(engine, "0007")
        assert current_revision(engine) == "0007"
        chars, calls = sql_row(engine, "SELECT project_draft.characters_json, project_turn.tool_calls_json "
                                       "FROM project_draft JOIN project_turn "
                                       "ON project_turn.draft_id = project_draft.id WHERE project_turn.id = :id",
                                       id=T1)
        assert as_json(chars) == {"hero": {"hp": 12}} and as_json(calls) == old["calls"]
        assert sql_row(engine, "SELECT external_ref FROM sandbox_snapshot WHERE id = :id", id=T2) == ("e2b:snap-7",)
        names = {ix["name"] for ix in sa.inspect(engine).get_indexes("project_draft")}
        assert "uq_draft_open" in names
        upgrade(engine)  # and up again
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


@pytest.mark.real
def test_upgrading_a_0007_postgres_database_keeps_every_value_under_the_designs_names(real_postgres, tmp_path):
    with empty_postgres(real_postgres) as url:
        upgrade_0007_and_check(url, tmp_path)


# -- 0008 -> 0009: turns that can be reverted ----------------------------------------------------------
def fill_0008(engine: Any, start_state: str) -> None:
    """A draft of two completed turns as the 0008 release left them (no revert columns yet)."""
    empty = str(EMPTY_TREE)
    with engine.begin() as conn:
        conn.execute(PROJECTS.insert().values(id=P, name="before reverts", current_version_id=V1,
                                              active_draft_id=DR, created_at=at(0)))
        conn.execute(VERSIONS.insert().values(id=V1, project_id=P, number=1, code_manifest_key=empty, file_count=0,
                                              characters_json={"hero": 1}, world_settings_json={}, summary="v1",
                                              created_at=at(0)))
        conn.execute(DRAFTS.insert().values(id=DR, project_id=P, base_version_id=V1, status="paused",
                                            code_manifest_key=empty, file_count=0, characters_json={"hero": 3},
                                            world_settings_json={}, revision=4, last_turn_id=T2,
                                            status_changed_at=at(3), created_at=at(1)))
        for n, (tid, before) in enumerate([(T1, None), (T2, T1)], start=1):
            conn.execute(TURNS.insert().values(
                id=tid, project_id=P, draft_id=DR, number=n, continues_turn_id=before, base_version_id=V1,
                status="completed", user_message_json=f"turn {n}", assistant_message_json="ok", start_root=empty,
                end_root=empty, start_state_digest=start_state, end_state_digest=start_state, started_at=at(n),
                ended_at=at(n + 0.5)))


def upgrade_0008_and_check(url: str, tmp_path: Path) -> None:
    from draftstore.digest import digest_of
    from draftstore.turns import state_blob

    start = state_blob({"hero": 1}, {})
    engine = create_db_engine(url)
    try:
        upgrade(engine, "0008")
        fill_0008(engine, str(digest_of(start)))
        upgrade(engine)
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
    store = by_open(url, tmp_path)
    try:
        store.blobs.put(start)  # the start state object the 0008 release stored with the turn
        turns = store.list_turns(P)
        assert [(t.id, t.status, t.reverted_at, t.reverted_by) for t in turns] == [
            (T1, "completed", None, None), (T2, "completed", None, None)]
        draft = store.revert_draft(P, T2, actor="alice")
        assert (draft.revision, draft.last_turn_id) == (5, T1)
        assert store.view(P).characters == {"hero": 1}
        assert [t.reverted_by for t in store.list_turns(P)] == [None, "alice"]
    finally:
        store.close()


def test_upgrading_a_0008_sqlite_database_keeps_its_turns_standing_and_lets_a_revert_mark_them(tmp_path):
    upgrade_0008_and_check(f"sqlite:///{tmp_path}/old.db", tmp_path)


@pytest.mark.real
def test_upgrading_a_0008_postgres_database_keeps_its_turns_standing_and_lets_a_revert_mark_them(
        real_postgres, tmp_path):
    with empty_postgres(real_postgres) as url:
        upgrade_0008_and_check(url, tmp_path)


# -- 0009 -> 0010: tool-call starts with an idempotency key ---------------------------------------------
def upgrade_0009_and_check(url: str, tmp_path: Path) -> None:
    """A running turn with two recorded calls (no key columns yet) upgrades; its calls keep their
    seqs, and keyed starts work on it at once (one call per key)."""
    empty = str(EMPTY_TREE)
    engine = create_db_engine(url)
    try:
        upgrade(engine, "0009")
        with engine.begin() as conn:
            conn.execute(PROJECTS.insert().values(id=P, name="before keys", current_version_id=V1,
                                                  active_draft_id=DR, created_at=at(0)))
            conn.execute(VERSIONS.insert().values(id=V1, project_id=P, number=1, code_manifest_key=empty,
                                                  file_count=0, characters_json={}, world_settings_json={},
                                                  summary="v1", created_at=at(0)))
            conn.execute(DRAFTS.insert().values(id=DR, project_id=P, base_version_id=V1, status="running",
                                                code_manifest_key=empty, file_count=0, characters_json={},
                                                world_settings_json={}, revision=1, last_turn_id=T1,
                                                status_changed_at=at(1), created_at=at(1)))
            conn.execute(TURNS.insert().values(id=T1, project_id=P, draft_id=DR, number=1, base_version_id=V1,
                                               status="running", user_message_json="go", start_root=empty,
                                               started_at=at(1)))
            for seq in (1, 2):
                conn.execute(sa.text("INSERT INTO tool_call (turn_id, seq, tool_name, status, args_json, started_at)"
                                     " VALUES (:t, :s, 'view_file', 'started', :a, :at)"),
                             {"t": T1, "s": seq, "a": json.dumps({"n": seq}), "at": at(1 + seq / 10)})
        upgrade(engine)
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
    store = by_open(url, tmp_path)
    try:
        assert [(c.seq, c.args) for c in store.get_turn(T1).tool_calls] == [(1, {"n": 1}), (2, {"n": 2})]
        first = store.tool_started(T1, "view_file", {"n": 3}, idempotency_key="k3")
        again = store.tool_started(T1, "view_file", {"n": 3}, idempotency_key="k3")
        assert first.seq == again.seq == 3
        assert store.complete_turn(T1, "done").tool_calls[-1].seq == 3
    finally:
        store.close()


def test_upgrading_a_0009_sqlite_database_keeps_running_calls_and_takes_keyed_starts(tmp_path):
    upgrade_0009_and_check(f"sqlite:///{tmp_path}/old.db", tmp_path)


@pytest.mark.real
def test_upgrading_a_0009_postgres_database_keeps_running_calls_and_takes_keyed_starts(real_postgres, tmp_path):
    with empty_postgres(real_postgres) as url:
        upgrade_0009_and_check(url, tmp_path)
