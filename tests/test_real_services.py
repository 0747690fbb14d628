"""The test stack itself: each flavour gives working, isolated store URLs."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest

from draftstore import Settings
from draftstore.blobs import open_blob_store
from draftstore.coord import open_coordinator


def _coord_url(stack: dict[str, str]) -> str:
    """The coordinator a store on this stack uses (embedded: the default, beside the database)."""
    return Settings(**stack).resolved_coord_url()


def test_the_stack_names_three_stores_that_open(stack: dict[str, str]) -> None:
    assert set(stack) <= {"database_url", "blob_url", "coord_url"} and "database_url" in stack
    coord_url = _coord_url(stack)
    assert coord_url.startswith("sqlite:///" if "coord_url" not in stack else ("redis://", "redis+cluster://"))
    blobs = open_blob_store(stack["blob_url"])
    coord = open_coordinator(coord_url)
    try:
        digest = blobs.put(b"stack check")
        assert blobs.get(digest) == b"stack check"
        assert coord.append("turn:stack", "ok") == 1
    finally:
        blobs.close()
        coord.close()


def test_each_test_gets_a_fresh_blob_and_coordinator_namespace(stack: dict[str, str]) -> None:
    # Same writes as the previous test: they would collide if state leaked.
    blobs = open_blob_store(stack["blob_url"])
    coord = open_coordinator(_coord_url(stack))
    try:
        assert list(blobs.iter_digests()) == []
        assert coord.read("turn:stack") == []
    finally:
        blobs.close()
        coord.close()


@pytest.mark.real
def test_the_real_database_is_a_fresh_postgresql_database(real_postgres) -> None:  # type: ignore[no-untyped-def]
    import psycopg

    assert real_postgres.url.startswith("postgresql+psycopg://")
    assert real_postgres.name.startswith("draftstore_test_")
    with psycopg.connect(real_postgres.libpq_url) as conn:
        name = conn.execute("select current_database()").fetchone()[0]
    # Only the database is ours to make; its schema comes from the Store's migrations.
    assert name == real_postgres.name


@pytest.mark.real
def test_real_urls_carry_a_per_session_redis_prefix(real_redis) -> None:  # type: ignore[no-untyped-def]
    query = parse_qs(urlsplit(real_redis.url("x")).query)
    assert query["prefix"] == [f"{real_redis.prefix}-x"]
    assert real_redis.prefix.startswith("dstest-")


@pytest.mark.real
def test_every_database_handed_to_the_dropper_is_gone_once_it_closes(real_pg_template) -> None:  # type: ignore[no-untyped-def]
    import psycopg

    from services import DatabaseDropper, PostgresDatabase

    dropper = DatabaseDropper(backlog=2)
    made = [PostgresDatabase.create(template=real_pg_template.name) for _ in range(5)]
    held = psycopg.connect(made[0].libpq_url)  # a leaked connection does not keep its database alive
    try:
        for db in made:
            dropper.drop_later(db)  # more than the backlog: the last ones wait for room, none is lost
        dropper.close()
    finally:
        held.close()
    with psycopg.connect(made[0].admin_url) as conn:
        left = conn.execute("select datname from pg_database where datname = any(%s)", ([d.name for d in made],)).fetchall()
    assert left == []
