"""Shared fixtures: every backend Protocol is tested on its embedded and its real flavour.

Fixtures for everyone:

- ``blob_store``  — params ``embedded`` (DirectoryBlobStore in tmp_path) and
  ``real`` (S3BlobStore on SeaweedFS/S3, fresh key prefix per test).
- ``coordinator`` — params ``memory`` (MemoryCoordinator), ``sqlite``
  (SqliteCoordinator in tmp_path), ``real`` (RedisCoordinator, fresh key
  prefix per test) and ``cluster`` (RedisCoordinator on a Redis Cluster of 3
  masters and 3 replicas started for the session, fresh key prefix per test).
- ``module_stack`` — the same, shared by the tests of one module that ask for it
  (``shared_service`` in tests/service_fixtures.py): tests on it make their own
  projects and tokens and look only at those.
- ``cluster_stack`` — the real stack with its coordinator on the session's Redis
  Cluster (tests/test_redis_cluster.py runs chosen stories on it as ``stack``).
- ``stack``       — params ``embedded`` and ``real``; a dict of the URLs
  ``Store.open`` takes. The embedded one is what a user gets with nothing
  configured: a SQLite database, a blob directory and (no ``coord_url``) the
  SQLite coordinator file beside the database. The real one gets a fresh
  PostgreSQL database per test (copied from a migrated template, dropped
  in the background after the test: ``pg_dropper``), its own S3 key prefix
  and its own Redis prefix: one test's rows never name another test's
  objects.
- session-scoped building blocks: ``real_postgres``, ``real_redis``, ``real_s3``,
  ``real_redis_cluster`` (see tests/services.py for where each server comes from).

Real params carry ``pytest.mark.real``: ``pytest -m "not real"`` runs the
embedded half only. With ``DRAFTSTORE_REQUIRE_REAL=1`` a real test never
skips: an unreachable service, or any skip of a ``real`` test, is a failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from alone import pytest_configure, pytest_runtest_protocol, pytest_unconfigure  # noqa: F401
from services import DatabaseDropper, LocalRedisCluster, PostgresDatabase, RedisServer, S3Service, token
from services import pytest_runtest_makereport  # noqa: F401  (a real test never skips in CI)

FLAVOURS = ["embedded", pytest.param("real", marks=pytest.mark.real)]


# -- the real services, once per session ------------------------------------------------
@pytest.fixture(scope="session")
def real_postgres() -> Iterator[PostgresDatabase]:
    """A fresh PostgreSQL database for this session (schema: the Store's migrations)."""
    db = PostgresDatabase.create()
    yield db
    db.drop()


@pytest.fixture(scope="session")
def real_pg_template() -> Iterator[PostgresDatabase]:
    """A migrated database that per-test databases are copied from."""
    db = PostgresDatabase.migrated_template()
    yield db
    db.drop()


@pytest.fixture(scope="session")
def pg_dropper() -> Iterator[DatabaseDropper]:
    """Drops per-test databases off the tests' path (all of them by the end of the session)."""
    dropper = DatabaseDropper()
    yield dropper
    dropper.close()


@pytest.fixture(scope="session")
def real_redis() -> Iterator[RedisServer]:
    """The Redis server, with a random key prefix for this session."""
    server = RedisServer.connect()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def real_redis_cluster() -> Iterator[LocalRedisCluster]:
    """A Redis Cluster (3 masters, 1 replica each) started for this session and stopped after it."""
    cluster = LocalRedisCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def real_s3() -> Iterator[S3Service]:
    """An S3 endpoint (external, or a SeaweedFS started here) with a fresh bucket."""
    svc = S3Service.start_or_connect()
    yield svc
    svc.stop()


# -- one backend of each kind, both flavours --------------------------------------------
@pytest.fixture(params=FLAVOURS)
def blob_store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    """A fresh, empty blob store (in-process cache off, so every read hits the backend)."""
    if request.param == "embedded":
        from draftstore.blobs import DirectoryBlobStore

        store: Any = DirectoryBlobStore(tmp_path / "blobs")
    else:
        s3: S3Service = request.getfixturevalue("real_s3")
        store = s3.open_store(f"t-{token()}")
    yield store
    store.close()


@pytest.fixture(params=["memory", "sqlite", pytest.param("real", marks=pytest.mark.real),
                        pytest.param("cluster", marks=pytest.mark.real)])
def coordinator(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    """A fresh coordinator with no locks, events or heartbeats (max_events=10,000).

    ``memory`` (MemoryCoordinator) and ``sqlite`` (SqliteCoordinator on a file
    in tmp_path) are the embedded flavours; ``real`` is RedisCoordinator with a
    fresh key prefix, ``cluster`` the same on the session's Redis Cluster.
    """
    if request.param == "memory":
        from draftstore.coord import MemoryCoordinator

        coord: Any = MemoryCoordinator()
    elif request.param == "sqlite":
        from draftstore.coord import SqliteCoordinator

        coord = SqliteCoordinator(tmp_path / "coord" / "coord.db")
    elif request.param == "real":
        from draftstore.coord.redis import RedisCoordinator

        server: RedisServer = request.getfixturevalue("real_redis")
        coord = RedisCoordinator.from_url(server.url(token()))
    else:
        from draftstore.coord.redis import RedisCoordinator

        cluster: LocalRedisCluster = request.getfixturevalue("real_redis_cluster")
        coord = RedisCoordinator.from_url(cluster.url(f"dstest-{token()}"))
    yield coord
    coord.close()


@pytest.fixture(params=FLAVOURS)
def stack(request: pytest.FixtureRequest, tmp_path: Any) -> dict[str, str]:
    """URLs of the three stores, isolated per test."""
    if request.param == "embedded":
        return {
            "database_url": f"sqlite:///{tmp_path}/ds.db",
            "blob_url": f"file://{tmp_path}/blobs",
        }
    server: RedisServer = request.getfixturevalue("real_redis")
    return _real_stack(request, server.url(token()))


@pytest.fixture(scope="module", params=FLAVOURS)
def module_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``stack``, once per module and flavour."""
    if request.param == "embedded":
        home = tmp_path_factory.mktemp("module-stack")
        return {"database_url": f"sqlite:///{home}/ds.db", "blob_url": f"file://{home}/blobs"}
    server: RedisServer = request.getfixturevalue("real_redis")
    return _real_stack(request, server.url(token()))


def _real_stack(request: pytest.FixtureRequest, coord_url: str) -> dict[str, str]:
    """The real stack's URLs: a fresh database copied from the template (dropped in the
    background after the test), a fresh S3 prefix, and ``coord_url``."""
    template: PostgresDatabase = request.getfixturevalue("real_pg_template")
    s3: S3Service = request.getfixturevalue("real_s3")
    dropper: DatabaseDropper = request.getfixturevalue("pg_dropper")
    pg = PostgresDatabase.create(template=template.name)
    request.addfinalizer(lambda: dropper.drop_later(pg))
    return {"database_url": pg.url, "blob_url": s3.url(f"t-{token()}"), "coord_url": coord_url}


@pytest.fixture
def cluster_stack(request: pytest.FixtureRequest) -> dict[str, str]:
    """The real stack's URLs with the coordinator on the session's Redis Cluster."""
    cluster: LocalRedisCluster = request.getfixturevalue("real_redis_cluster")
    return _real_stack(request, cluster.url(f"dstest-{token()}"))


# =======================================================================================
# Store fixtures (owned by the Store's author): add `store` built from `stack` below.
# =======================================================================================
from store_fixtures import shared_store, store, store_factory  # noqa: E402,F401
from service_fixtures import service, service_factory, shared_service, shared_service_per_test  # noqa: E402,F401
