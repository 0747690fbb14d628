"""Growth: the hot operations on a database grown to millions of tool calls, against an empty one.

Opt-in (``python -m bench --only growth``; ``--quick`` for a smoke run). Two
fresh PostgreSQL databases of the run, migrated, share the run's bucket and
Redis prefix:

- **big**: a template project written by the store (20 turns of 10 tool calls,
  a file written each turn, every turn completed, then published), cloned in
  SQL (``growth_load.clone``) to 10,000 projects, 200,000 turns, 2,000,000
  compacted tool calls (quick: 500 projects), then ``VACUUM ANALYZE``d. Three
  copies are read back through the Store API and compared with the template
  (``growth_load.check_copy``): a difference stops the run.
- **empty**: the same template project written by the store, alone.

Then, on one copy in big and on the template in empty, rounds interleaved
(which side goes first alternates): ``start_turn``; 5 ``tool_started`` +
``tool_completed`` pairs; 2 ``write_file`` of 1 KiB; ``complete_turn``;
``continue_turn`` (the new turn with its resume context); 2 pairs and
``complete_turn`` again; ``publish``; ``page_turns(limit=20,
newest_first=True)``. Each row is the big side's median over the empty
side's (goal <= 1.2).

Blob growth (notes of ``growth_start_turn``): on a third database and its own
key prefix, objects and bytes a typical turn (10 calls, 2 file writes, a
characters patch) and a publish add, and what ``gc`` (grace 0, turn
retention 0) takes back.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from draftstore import Settings, Store

from . import growth_load
from .env import progress
from .timing import Result, freeze_set_up, median_ms

OPS = ("start_turn", "tool_pair", "write_file", "complete_turn", "resume", "publish", "list_turns")
NAMES = tuple(f"growth_{op}" for op in OPS)
ALIAS = "growth"
GOAL = 1.2
WHAT = {
    "start_turn": "start_turn", "tool_pair": "tool_started + tool_completed", "write_file": "write_file 1 KiB",
    "complete_turn": "complete_turn (seal + compact)", "resume": "continue_turn with its resume context",
    "publish": "publish", "list_turns": "page_turns(limit=20, newest first)",
}


@dataclass
class GrowthSizes:
    projects: int
    turns: int  # per project
    calls: int  # per turn
    rounds: int


GROWTH_QUICK = GrowthSizes(projects=500, turns=20, calls=10, rounds=10)
GROWTH_FULL = GrowthSizes(projects=10_000, turns=20, calls=10, rounds=40)


class _Database:
    """A fresh database of the run (dropped by ``drop``)."""

    def __init__(self, env: Any, tag: str) -> None:
        self.admin = env.pg_admin_url
        self.name = f"{env.db_name}_{tag}"
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.name}"')
        self.url = env.database_url.rsplit("/", 1)[0] + "/" + self.name

    def drop(self) -> None:
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def _open(env: Any, db: _Database, prefix: str = "", settings: Settings | None = None) -> Store:
    blob_url = env.blob_url if not prefix else env.blob_url.replace("?", f"/{prefix}?", 1)
    store = Store.open(db.url, blob_url, env.coord_url, migrate=True, settings=settings)
    env.stores.append(store)
    return store


class _Round:
    """One round of the hot operations on one project, each timed on its own."""

    def __init__(self, store: Store, project_id: str, out: dict[str, list[float]]) -> None:
        self.store, self.pid, self.out = store, project_id, out
        self.k = 0

    def _t(self, op: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        r = fn()
        self.out.setdefault(op, []).append(time.perf_counter() - t0)
        return r

    def _pairs(self, turn_id: str, n: int) -> None:
        s = self.store
        for c in range(n):
            def pair(c: int = c) -> None:
                call = s.tool_started(turn_id, "view_file", {"path": f"src/mod_{c}.py", "offset": 0, "limit": 200})
                s.tool_completed(turn_id, call.seq, {"ok": True, "bytes": 1024, "preview": "def f(): ..."})
            self._t("tool_pair", pair)

    def run(self) -> None:
        s, t = self.store, self._t
        self.k += 1
        turn = t("start_turn", lambda: s.start_turn(self.pid, f"round {self.k}", actor="bench"))
        self._pairs(turn.id, 5)
        for i in range(2):
            body = os.urandom(512).hex().encode()
            t("write_file", lambda i=i, body=body: s.write_file(turn.id, f"src/round_{i}.py", body))
        t("complete_turn", lambda: s.complete_turn(turn.id, "done"))
        again = t("resume", lambda: s.continue_turn(self.pid, "go on", actor="bench"))
        assert again.context.turns, "a continued turn's context holds the turn it continues"
        self._pairs(again.id, 2)
        t("complete_turn", lambda: s.complete_turn(again.id, "done again"))
        t("publish", lambda: s.publish(self.pid, f"round {self.k}", actor="bench"))
        t("list_turns", lambda: s.page_turns(self.pid, limit=20, newest_first=True))


def _sizes(url: str) -> list[str]:
    with psycopg.connect(growth_load.libpq(url)) as conn:
        rows = conn.execute(
            "SELECT relname, n_live_tup, pg_total_relation_size(relid) FROM pg_stat_user_tables "
            "WHERE relname IN ('project','project_version','project_draft','project_turn','tool_call','head_move') "
            "ORDER BY pg_total_relation_size(relid) DESC").fetchall()
        db = conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]
        calls = conn.execute("SELECT sum(jsonb_array_length(tool_calls_json)) FROM project_turn").fetchone()[0]
    return [f"{name} {live:,} rows, {size / 2**20:,.1f} MiB" for name, live, size in rows] + [
        f"compacted tool calls {calls:,}; database {db / 2**20:,.0f} MiB"]


def _bucket_objects(env: Any, prefix: str) -> tuple[int, int]:
    n = size = 0
    for page in env.s3.get_paginator("list_objects_v2").paginate(Bucket=env.bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", ()):
            n += 1
            size += o["Size"]
    return n, size


def blob_growth(env: Any) -> list[str]:
    """Objects and bytes per typical turn and per publish, and what gc takes back (see the docstring)."""
    db = _Database(env, "blobs")
    prefix = f"blobgrowth-{secrets.token_hex(3)}"
    store: Store | None = None
    try:
        store = _open(env, db, prefix, Settings(gc_grace_s=0))
        p = store.create_project("blobs", files={f"src/pkg_{i // 50}/mod_{i}.py": os.urandom(512).hex().encode()
                                                 for i in range(200)}, actor="bench")
        n0, b0 = _bucket_objects(env, prefix)
        turns = 20
        for k in range(turns):
            t = store.start_turn(p.id, f"turn {k}")
            for c in range(10):
                call = store.tool_started(t.id, "view_file", {"path": f"src/pkg_0/mod_{c}.py"})
                store.tool_completed(t.id, call.seq, {"ok": True, "bytes": 1024})
            for i in (k % 200, (k * 7 + 3) % 200):
                store.write_file(t.id, f"src/pkg_{i // 50}/mod_{i}.py", os.urandom(512).hex().encode())
            store.patch_characters(t.id, {"hero": {"hp": k}})
            store.complete_turn(t.id, "done")
        n1, b1 = _bucket_objects(env, prefix)
        store.publish(p.id, "one version", actor="bench")
        n2, b2 = _bucket_objects(env, prefix)
        kept = store.gc(dry_run=False)
        n3, b3 = _bucket_objects(env, prefix)
        store.set_retention(p.id, turns_days=0)
        pruned = store.gc(dry_run=False)
        n4, b4 = _bucket_objects(env, prefix)
        return [
            f"blob growth: 200-file project {n0} objects / {b0 / 1024:.0f} KiB after create (packs)",
            (f"blob growth: per typical turn (10 calls, 2 x 1 KiB writes, 1 characters patch) "
             f"{(n1 - n0) / turns:.1f} objects, {(b1 - b0) / turns / 1024:.1f} KiB"),
            f"blob growth: publish of those {turns} turns' draft {n2 - n1} objects, {(b2 - b1) / 1024:.1f} KiB",
            (f"blob growth: gc (grace 0, default retention) swept {kept.objects_swept} objects / "
             f"{kept.bytes_swept / 1024:.1f} KiB -> {n3} objects, {b3 / 1024:.0f} KiB"),
            (f"blob growth: gc after turn retention 0 ({pruned.turns_pruned} turns pruned) swept "
             f"{pruned.objects_swept} objects / {pruned.bytes_swept / 1024:.1f} KiB -> {n4} objects, {b4 / 1024:.0f} KiB"),
        ]
    finally:
        if store is not None:
            store.close()
            env.stores.remove(store)
        db.drop()


def group(ctx: Any, wanted: set[str]) -> list[Result]:
    """The growth group (see the module docstring)."""
    from .scenarios import QUICK

    sizes = GROWTH_QUICK if ctx.sizes is QUICK else GROWTH_FULL
    env = ctx.env
    big, empty = _Database(env, "big"), _Database(env, "empty")
    stores: list[Store] = []
    notes: list[str] = []
    try:
        big_store, empty_store = _open(env, big), _open(env, empty)
        stores += [big_store, empty_store]
        t0 = time.perf_counter()
        template = growth_load.write_template(big_store, "growth", sizes.turns, sizes.calls)
        native = growth_load.write_template(empty_store, "growth", sizes.turns, sizes.calls)
        progress(f"  template project ({sizes.turns} turns x {sizes.calls} calls) written in each database "
                 f"in {time.perf_counter() - t0:.1f}s")
        salt = secrets.token_hex(2)
        t0 = time.perf_counter()
        copies = sizes.projects - 1  # with the template: sizes.projects projects
        inserted = growth_load.clone(big.url, template, copies, salt, progress=progress)
        load_s = time.perf_counter() - t0
        vacuum_s = growth_load.analyze(big.url)
        growth_load.analyze(empty.url)
        notes.append(f"load: {copies:,} copies in {load_s:.0f}s ({inserted['project_turn']:,} turns), "
                     f"VACUUM ANALYZE {vacuum_s:.0f}s")
        notes += [f"big database: {line}" for line in _sizes(big.url)]
        for g in (1, copies // 2, copies):
            diffs = growth_load.check_copy(big_store, template, salt, g)
            if diffs:
                raise RuntimeError(f"copy {g} does not read back like the template: {diffs[:3]}")
        notes.append("read back: copies 1, middle and last read through the Store API equal the template "
                     "(project, versions, head moves, turns with tool calls, files, characters)")
        measured = growth_load.copy_id(salt, copies // 2, template)
        samples: list[dict[str, list[float]]] = [{}, {}]
        rounds = [_Round(big_store, measured, samples[0]), _Round(empty_store, native, samples[1])]
        warm: list[dict[str, list[float]]] = [{}, {}]
        _Round(big_store, measured, warm[0]).run()
        _Round(empty_store, native, warm[1]).run()
        freeze_set_up()
        t0 = time.perf_counter()
        for i in range(ctx.n(sizes.rounds)):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for side in order:
                rounds[side].run()
        progress(f"  {ctx.n(sizes.rounds)} rounds per database, interleaved, in {time.perf_counter() - t0:.1f}s")
        t0 = time.perf_counter()
        notes += blob_growth(env)
        progress(f"  blob growth measured in {time.perf_counter() - t0:.1f}s")
    finally:
        for s in stores:
            s.close()
            env.stores.remove(s)
        big.drop()
        empty.drop()
    out: list[Result] = []
    for op in OPS:
        r = Result(f"growth_{op}", GOAL, median_ms(samples[0][op]), median_ms(samples[1][op]),
                   ours_what=f"{WHAT[op]}, {sizes.projects:,} projects / {sizes.projects * sizes.turns:,} turns",
                   baseline_what="the same, empty database")
        out.append(r)
    out[0].notes += notes
    return out
