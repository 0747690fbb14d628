"""draftstore behind PgBouncer in transaction pooling, as deployments with many replicas run it.

A PgBouncer of the tests' own (``PgBouncer`` in tests/services.py: Debian's 1.18,
``pool_mode = transaction``) sits in front of the test PostgreSQL, and the ``stack`` of
this module points the database URL at it with ``?pooler=transaction``; the schema is
migrated directly (each database is copied from the migrated template). Through it:

- the whole lifecycle (start a turn, tool calls, writes, patches, interrupt, continue,
  complete, publish, read back from a fresh store) with every hot statement run far
  beyond psycopg's prepare threshold of 5 on one connection, on a PgBouncer with one
  server connection shared by all clients: the failure a new user meets
  (``prepared statement "_pg3_0" already exists``) is gone, every pool of the store
  (transactions, one-statement autocommit, group commit) has prepared statements off,
  and no operation of it holds a transaction while it waits for another connection;
- the same lifecycle through the same PgBouncer without the declaration fails with
  ``backend.pooler`` naming the parameter, not with a bare driver error;
- ``draftstore db upgrade`` (and ``Store.open(migrate=True)``) through the pooler refuses
  with ``config.pooled_migration`` and changes nothing; run directly, it migrates, and
  the pooled store opens on the result;
- the kill -9 campaign (tests/test_faults_kill.py: workers killed at every fault point
  and at random moments), the server connection killed inside each kind of transaction
  (tests/test_faults_outages.py: a typed retryable error, no partial state), the
  two-process stories (tests/test_service_processes.py) and the group-commit stories
  (tests/test_group_commit.py: pipelined ``BEGIN`` ... ``COMMIT``), run once more here:
  their bodies are imported, and this module's ``stack`` routes them through the pooler.

Under ``DRAFTSTORE_REQUIRE_REAL=1`` a missing pgbouncer binary fails these tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from draftstore import ConfigInvalid, PooledMigration, PoolerUndeclared, Settings, Store
from draftstore.db.engine import create_db_engine
from draftstore.db.migrate import current_revision, head_revision
from services import PgBouncer, PostgresDatabase, RedisServer, S3Service, token

# the stories run again through the pooler (collected here, so this module's ``stack`` is theirs)
from test_faults_kill import (  # noqa: F401
    test_workers_killed_at_every_fault_point_and_at_random_moments_lose_nothing_acknowledged, zygote)
from test_faults_outages import (  # noqa: F401
    killer, opened, pg_db,
    test_pg_connection_killed_inside_each_transaction_leaves_no_partial_state_and_the_retry_succeeds)
from test_group_commit import (  # noqa: F401
    test_a_broken_constraint_rolls_the_group_back_and_each_call_then_runs_alone,
    test_calls_queued_behind_a_running_group_commit_together_and_each_gets_its_answer,
    test_many_threads_recording_at_once_lose_and_duplicate_nothing,
    test_two_processes_groups_on_the_same_turns_lock_them_in_one_order,
)
from test_service_processes import (  # noqa: F401
    test_a_turn_started_through_one_process_is_driven_and_continued_through_the_other,
    test_writes_through_both_processes_at_once_land_in_one_draft,
)

pytestmark = pytest.mark.real

ROUNDS = 4  # turns in the lifecycle
CALLS = 8  # tool calls and writes per turn: every hot statement runs ROUNDS * CALLS times, >> 5


# -- the pooler, and a stack through it -----------------------------------------------------------
@pytest.fixture(scope="session")
def real_pgbouncer() -> Iterator[PgBouncer]:
    """PgBouncer in transaction pooling in front of the test PostgreSQL (20 server connections a database)."""
    bouncer = PgBouncer.start()
    yield bouncer
    bouncer.stop()


@pytest.fixture(scope="module")
def narrow_pgbouncer() -> Iterator[PgBouncer]:
    """The same with ONE server connection a database: every client's transactions share it. A
    statement one client prepared is there when another prepares its own under the same name; an
    operation that held a transaction while it waited for a second connection would wait for
    itself (PgBouncer gives up after ``query_wait_timeout``)."""
    bouncer = PgBouncer.start(pool_size=1)
    yield bouncer
    bouncer.stop()


def fresh_database(request: pytest.FixtureRequest) -> PostgresDatabase:
    template: PostgresDatabase = request.getfixturevalue("real_pg_template")
    pg = PostgresDatabase.create(template=template.name)
    request.addfinalizer(pg.drop)
    return pg


def urls_through(request: pytest.FixtureRequest, database_url: str) -> dict[str, str]:
    s3: S3Service = request.getfixturevalue("real_s3")
    redis: RedisServer = request.getfixturevalue("real_redis")
    return {"database_url": database_url, "blob_url": s3.url(f"t-{token()}"), "coord_url": redis.url(token())}


@pytest.fixture
def stack(request: pytest.FixtureRequest, real_pgbouncer: PgBouncer) -> dict[str, str]:
    """The real stack with its database reached through PgBouncer, declared (``?pooler=transaction``)."""
    return urls_through(request, real_pgbouncer.url(fresh_database(request).name))


@pytest.fixture
def pg_store(pg_db: PostgresDatabase, real_pgbouncer: PgBouncer, real_s3: S3Service, real_redis: RedisServer,
             opened: Any) -> Store:
    """tests/test_faults_outages.py's store on its own database, reached through PgBouncer: the server
    connection killed under a transaction is PgBouncer's, which then drops its client."""
    return opened({"database_url": real_pgbouncer.url(pg_db.name), "blob_url": real_s3.url(f"t-{token()}"),
                   "coord_url": real_redis.url(token())})


# -- the lifecycle ----------------------------------------------------------------------------------
def lifecycle(store: Store) -> dict[str, Any]:
    """Turns of tool calls and writes, an interrupt and a continue, a publish; returns what was stored."""
    p = store.create_project("pooled", files={"main.py": b"print(1)\n"}, characters={}, world_settings={})
    files: dict[str, bytes] = {"main.py": b"print(1)\n"}
    calls = 0
    t = store.start_turn(p.id, "add dragons", actor="worker-1")
    for r in range(ROUNDS):
        for i in range(CALLS):
            call = store.tool_started(t.id, "write_file", {"path": f"r{r}/d{i}.py"})
            data = f"DRAGON = {r * CALLS + i}\n".encode()
            store.write_file(t.id, f"r{r}/d{i}.py", data)
            files[f"r{r}/d{i}.py"] = data
            store.tool_completed(t.id, call.seq, {"ok": i})
            store.heartbeat(t.id)
            calls += 1
        store.patch_characters(t.id, {f"dragon{r}": {"hp": r}})
        if r % 2 == 0:
            store.interrupt_turn(t.id, partial_response={"text": f"round {r}"})
        else:
            store.complete_turn(t.id, f"round {r} done")
        t = store.continue_turn(p.id, "go on", actor=f"worker-{r + 2}")
    store.complete_turn(t.id, "done")
    version = store.publish(p.id, "dragons", actor="admin")
    return {"project": p.id, "version": version.id, "files": files, "calls": calls}


def assert_read_back(store: Store, done: dict[str, Any]) -> None:
    p = done["project"]
    assert store.get_project(p).current_version_id == done["version"]
    view = store.view_at(p, done["version"])
    assert {path: view.read_file(path) for path in view.list_files()} == done["files"]
    assert view.characters == {f"dragon{r}": {"hp": r} for r in range(ROUNDS)}
    turns = store.list_turns(p)
    recorded = [(c.tool_name, c.status, c.result) for t in turns for c in store.get_turn(t.id).tool_calls]
    assert len(recorded) == done["calls"]
    assert all(status == "completed" for _, status, _ in recorded), recorded
    assert [t.status for t in turns].count("interrupted") == (ROUNDS + 1) // 2


def prepare_thresholds(store: Store) -> list[Any]:
    """psycopg's ``prepare_threshold`` on a live connection of each of the store's pools."""
    b = store.database
    seen = []
    for engine in (b.engine, b.autocommit):
        conn = engine.raw_connection()
        try:
            seen.append(conn.driver_connection.prepare_threshold)
        finally:
            conn.close()
    seen.append(b.group_commit._connection().driver_connection.prepare_threshold)
    return seen


def test_the_whole_lifecycle_runs_through_pgbouncer_in_transaction_pooling_far_beyond_the_prepare_threshold(
        request, narrow_pgbouncer):
    urls = urls_through(request, narrow_pgbouncer.url(fresh_database(request).name))
    with Store.open(**urls) as store:
        assert prepare_thresholds(store) == [None, None, None]  # transactions, autocommit, group commit
        done = lifecycle(store)
        assert_read_back(store, done)
    with Store.open(**urls) as fresh:  # nothing cached: everything comes back through the pooler
        assert_read_back(fresh, done)


def test_the_same_lifecycle_through_an_undeclared_pooler_fails_with_backend_pooler_naming_the_parameter(
        request, narrow_pgbouncer):
    urls = urls_through(request, narrow_pgbouncer.undeclared_url(fresh_database(request).name))
    with Store.open(**urls) as store:
        assert prepare_thresholds(store) == [5, 5, 5]  # a direct connection keeps psycopg's prepared statements
        with pytest.raises(PoolerUndeclared) as caught:
            lifecycle(store)
    err = caught.value
    assert err.code == "backend.pooler"
    assert "?pooler=transaction" in err.message and "DRAFTSTORE_DATABASE_URL" in err.message
    assert "_pg3_" in str(err.__cause__), err.__cause__  # chained to the driver's error


def test_a_direct_connection_keeps_prepared_statements_and_the_lifecycle_works(request):
    """The declaration is needed only through the pooler: directly, psycopg prepares as before."""
    with Store.open(**urls_through(request, fresh_database(request).url)) as store:
        assert prepare_thresholds(store) == [5, 5, 5]
        assert_read_back(store, lifecycle(store))


# -- migrations go to PostgreSQL directly ---------------------------------------------------------------
def cli(env_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTSTORE_")}
    env["DRAFTSTORE_DATABASE_URL"] = env_url
    return subprocess.run([sys.executable, "-m", "draftstore.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_db_upgrade_through_the_pooler_is_refused_and_changes_nothing_then_runs_directly(real_pgbouncer, request):
    empty = PostgresDatabase.create()
    request.addfinalizer(empty.drop)
    pooled = real_pgbouncer.url(empty.name)

    refused = cli(pooled, "db", "upgrade")
    assert refused.returncode == 4, refused  # a DRAFTSTORE_* setting or URL is wrong for this command
    line = refused.stderr.strip()
    assert line.startswith("error [config.pooled_migration] migrations go to PostgreSQL directly"), line
    assert "without ?pooler=" in line and "nothing was changed" in line, line
    with pytest.raises(PooledMigration) as caught:
        Store.open(database_url=pooled, blob_url=f"file://{request.getfixturevalue('tmp_path')}/b",
                   coord_url="memory://", migrate=True)
    assert caught.value.code == "config.pooled_migration" and caught.value.details["head"] == head_revision()
    direct = create_db_engine(empty.url)
    try:
        assert current_revision(direct) is None
        with direct.connect() as conn:  # not a table was created
            assert conn.execute(sa.text("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")).scalar() == 0
    finally:
        direct.dispose()

    done = cli(empty.url, "db", "upgrade")
    assert done.returncode == 0, done.stderr
    assert cli(pooled, "db", "upgrade").returncode == 0  # at head: nothing to run, nothing refused
    current = cli(pooled, "db", "current", "--json")
    assert current.returncode == 0, current.stderr
    assert json.loads(current.stdout) == {"database": head_revision(), "code_needs": head_revision(), "current": True}
    with Store.open(**urls_through(request, pooled)) as store:  # the pooled store opens on the result
        assert_read_back(store, lifecycle(store))


@pytest.mark.parametrize("url", [
    "postgresql://postgres@127.0.0.1:1/db?pooler=session",
    "postgresql://postgres@127.0.0.1:1/db?pooler=transaction&pooler=transaction",
    "sqlite:///{tmp}/ds.db?pooler=transaction",
])
def test_an_unknown_pooler_mode_is_config_invalid_before_any_connection(url, tmp_path):
    with pytest.raises(ConfigInvalid) as caught:
        Store.open(database_url=url.format(tmp=tmp_path), blob_url=f"file://{tmp_path}/b", coord_url="memory://",
                   settings=Settings())
    assert caught.value.code == "config.invalid" and "pooler" in caught.value.message
    assert not (tmp_path / "ds.db").exists()
