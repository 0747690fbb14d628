"""The scenarios. Each group measures ours and its baseline in the same run,
interleaved, and returns one ``Result`` per scenario line it owns.

Definitions (also in bench/README.md):

- write_1k: ``store.write_file(turn_id, path, 1 KiB)`` overwriting an existing
  file of a 10,000-file project with fresh random content, inside a running
  turn. Baseline: raw boto3 ``put_object`` of 1 KiB to the same SeaweedFS +
  one raw psycopg single-row ``UPDATE`` (autocommit) on a scratch table.
- write_scale: the same write in the big project (100,000 files; quick:
  10,000) over the same write in a 100-file project.
- publish_scale: with one changed file in the draft (``start_turn`` + one
  ``write_file``, untimed), the time of ``complete_turn`` (which seals) +
  ``publish``; big project over the 100-file project.
- publish_vs_git: that time on the 10,000-file project over
  ``git add <file> && git commit -q -m x`` of the same one-file change in a
  10,000-file git repository on disk (two subprocesses, timed end to end).
- toolcall_growth: one ``tool_started`` + ``tool_completed`` pair at call
  number ~1,000 of a turn (quick: ~300) over the pair at call number 1;
  each point is the median of a window of calls around it, over several turns.
- toolcall_vs_insert: the pair in the early window over two raw psycopg
  single-row INSERTs (autocommit) into a scratch table.
- read_warm: ``view.read_file(path)`` of a 1 KiB file whose tree nodes and
  blob are in the in-process cache, over a raw boto3 ``get_object`` of 1 KiB.
- read_cold: ``store.view(project_id).read_file(path)`` where the file's
  blob was evicted from the in-process cache just before
  (``store.cache.discard(digest)``, untimed) but tree nodes may be cached, as
  in any running service; over a raw boto3 GET + one raw psycopg PK SELECT.
- search_10k: ``view.search_code("NEEDLE_LITERAL", max_results=1000)`` over a
  10,000-file, ~10 MB draft, warm (one untimed run first), over
  ``grep -rn NEEDLE_LITERAL DIR`` of the same files on disk (the grep
  process timed end to end).
- diff_small: ``store.diff(a, b)`` of two consecutive versions that differ in
  one file, big project over the 100-file project.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftstore import Store
from draftstore.digest import digest_of
from draftstore.view import View

from .env import BenchEnv, progress
from .projects import NEEDLE, make_files, materialise, random_source
from .timing import Result, freeze_set_up, interleave, median_ms, timed

KIB = 1024


@dataclass
class Sizes:
    big: int  # the "big" side of the *_scale / diff scenarios
    iters: int  # timed iterations of cheap operations
    publish_iters: int
    calls: int  # toolcall_growth: the far point
    window: int  # toolcall_growth: calls timed around each point
    turns: int  # toolcall_growth: turns measured
    search_iters: int


QUICK = Sizes(big=10_000, iters=60, publish_iters=12, calls=300, window=20, turns=2, search_iters=5)
FULL = Sizes(big=100_000, iters=200, publish_iters=20, calls=1_000, window=40, turns=3, search_iters=10)


@dataclass
class Project:
    id: str
    files: dict[str, bytes]
    paths: list[str]
    write_pool: list[str]  # files the write scenarios may overwrite (never a needle file)


@dataclass
class Context:
    env: BenchEnv
    store: Store  # the measuring store: default settings, its own cache
    sizes: Sizes
    repeat: int
    build: Callable[[str, dict[str, bytes]], str]
    projects: dict[int, Project] = field(default_factory=dict)
    dirs: dict[str, Path] = field(default_factory=dict)
    publish_samples: dict[int, list[float]] = field(default_factory=dict)
    _warmed: set[int] = field(default_factory=set)

    def gets(self) -> int:
        """S3 GETs (whole or ranged) the measuring store has made so far (0 if not countable)."""
        calls = getattr(self.store.blobs, "calls", None)  # S3BlobStore counts its requests
        return calls["get"] + calls["get_range"] if calls is not None else 0

    def n(self, base: int) -> int:
        return base * self.repeat

    def project(self, n_files: int) -> Project:
        """The shared synthetic project of ``n_files`` files (built on first use)."""
        if n_files not in self.projects:
            # ~1 KiB files (the 10 MB search set); the 100,000-file project uses
            # ~512 B files to keep memory and upload time reasonable
            size = KIB if n_files <= 10_000 else 512
            files = make_files(n_files, size, seed=n_files, needles=20 if n_files == 10_000 else 0)
            pid = self.build(f"bench-{n_files}", files)
            paths = list(files)
            pool = [p for p in paths if NEEDLE.encode() not in files[p]]
            self.projects[n_files] = Project(pid, files, paths, random.Random(n_files).sample(pool, min(500, len(pool))))
            freeze_set_up()
        return self.projects[n_files]

    def warm_pool(self, n_files: int) -> Project:
        """Load the tree nodes on the paths of the project's write pool into the
        measuring store's cache (untimed), as a running service would have them:
        the scenarios measure steady state, not the first touch of a directory."""
        project = self.project(n_files)
        if n_files not in self._warmed:
            t0 = time.perf_counter()
            view = self.store.view(project.id)
            for p in project.write_pool:
                view.stat(p)
            self._warmed.add(n_files)
            progress(f"  warmed tree nodes of {len(project.write_pool)} pool paths of bench-{n_files} "
                     f"in {time.perf_counter() - t0:.1f}s")
        return project

    def files_on_disk(self, key: str, n_files: int) -> Path:
        if key not in self.dirs:
            t0 = time.perf_counter()
            self.dirs[key] = materialise(self.project(n_files).files, self.env.scratch_dir(key))
            os.sync()  # flush now, so write-back does not land in a later measurement
            progress(f"materialised {n_files:,} files for {key} in {time.perf_counter() - t0:.1f}s")
        return self.dirs[key]


# -- helpers --------------------------------------------------------------------------
def _running_turn(store: Store, pid: str, msg: str = "bench") -> str:
    """A running turn on the project's draft (created from head if needed)."""
    draft = store.get_project(pid).active_draft_id
    if draft is not None:
        d = store.get_draft(pid)
        if d.status == "running" and d.last_turn_id:
            return d.last_turn_id
    return store.start_turn(pid, msg).id


def _end_turn(store: Store, turn_id: str) -> None:
    store.complete_turn(turn_id, "done")


def _flush_draft(store: Store, pid: str) -> None:
    """Publish whatever the project's draft holds, so the next version differs only by what follows."""
    project = store.get_project(pid)
    if project.active_draft_id is None:
        return
    d = store.get_draft(pid)
    if d.status == "running" and d.last_turn_id:
        _end_turn(store, d.last_turn_id)
    store.publish(pid, "bench: flush")


class _Writer:
    """Overwrites existing files of one project with fresh 1 KiB contents."""

    def __init__(self, store: Store, project: Project) -> None:
        self.store, self.project = store, project
        self.turn = _running_turn(store, project.id)
        self._i = 0
        self._next: tuple[str, bytes] | None = None

    def prepare(self) -> None:
        pool = self.project.write_pool
        self._next = (pool[self._i % len(pool)], random_source(KIB))
        self._i += 1

    def write(self) -> None:
        assert self._next is not None
        self.store.write_file(self.turn, *self._next)

    def close(self) -> None:
        _end_turn(self.store, self.turn)


class _RawWrite:
    """Baseline of a write: boto3 PUT of 1 KiB + one psycopg UPDATE (autocommit)."""

    def __init__(self, env: BenchEnv) -> None:
        self.env = env
        self._i = 0
        self._data = b""

    def prepare(self) -> None:
        self._i += 1
        self._data = random_source(KIB)

    def run(self) -> None:
        self.env.s3.put_object(Bucket=self.env.bucket, Key=f"bench-raw/w/{self._i}", Body=self._data)
        assert self.env.pg is not None
        self.env.pg.execute("UPDATE bench_scratch SET body = %s::jsonb WHERE id = %s",
                            ('{"v": %d}' % self._i, 1 + self._i % 1000))


# -- 1, 2: writes ---------------------------------------------------------------------
def writes(ctx: Context, wanted: set[str]) -> list[Result]:
    out: list[Result] = []
    s, n = ctx.sizes, ctx.n(ctx.sizes.iters)
    if "write_1k" in wanted:
        w = _Writer(ctx.store, ctx.warm_pool(10_000))
        raw = _RawWrite(ctx.env)
        g0 = ctx.gets()
        ours, base = interleave([w.write, raw.run], n, warmup=20, prepare=[w.prepare, raw.prepare])
        w.close()
        out.append(Result("write_1k", 1.5, median_ms(ours), median_ms(base),
                          ours_what="store.write_file 1 KiB, 10k-file project",
                          baseline_what="boto3 PUT 1 KiB + psycopg UPDATE",
                          notes=[f"S3 GETs by the store during {n + 20} writes: {ctx.gets() - g0}"]))
    if "write_scale" in wanted:
        big, small = _Writer(ctx.store, ctx.warm_pool(s.big)), _Writer(ctx.store, ctx.warm_pool(100))
        g0 = ctx.gets()
        b, sm = interleave([big.write, small.write], n, warmup=20, prepare=[big.prepare, small.prepare])
        big.close()
        small.close()
        out.append(Result("write_scale", 1.3, median_ms(b), median_ms(sm),
                          ours_what=f"write_file in {s.big:,}-file project",
                          baseline_what="write_file in 100-file project",
                          notes=[f"S3 GETs by the store during {2 * (n + 20)} writes: {ctx.gets() - g0}"]))
    return out


# -- 3: publish -----------------------------------------------------------------------
class _Publisher:
    """Per iteration: start_turn + one write (untimed), then complete_turn + publish (timed)."""

    def __init__(self, ctx: Context, n_files: int) -> None:
        self.ctx, self.n_files = ctx, n_files
        self.store, self.project = ctx.store, ctx.warm_pool(n_files)
        _flush_draft(self.store, self.project.id)
        self._i = 0

    def once(self) -> float:
        store, project = self.store, self.project
        turn = store.start_turn(project.id, "bench publish").id
        store.write_file(turn, project.write_pool[self._i % len(project.write_pool)], random_source(KIB))
        self._i += 1
        t = timed(lambda: (store.complete_turn(turn, "done"), store.publish(project.id, "bench")))
        return t


def _publish_samples(ctx: Context, sides: list[int], iters: int) -> list[list[float]]:
    """Publish timings for each project size in ``sides``, alternating iteration by iteration."""
    pubs = [_Publisher(ctx, n) for n in sides]
    for p in pubs:  # two warm-ups each
        p.once()
        p.once()
    out: list[list[float]] = [[] for _ in sides]
    for _ in range(iters):
        for k, p in enumerate(pubs):
            out[k].append(p.once())
    for n, samples in zip(sides, out):
        ctx.publish_samples.setdefault(n, []).extend(samples)
    return out


class _Git:
    """A 10,000-file git repository on disk; one-file change + add + commit."""

    def __init__(self, ctx: Context) -> None:
        self.dir = ctx.files_on_disk("git-10k", 10_000)
        self.pool = ctx.project(10_000).write_pool
        self.env = {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.invalid",
                    "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.invalid",
                    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
        t0 = time.perf_counter()
        self._git("init", "-q")
        self._git("add", "-A")
        self._git("commit", "-q", "-m", "initial")
        progress(f"git repo of 10,000 files initialised in {time.perf_counter() - t0:.1f}s")
        self._i = 0
        self._path = ""

    def _git(self, *args: str) -> None:
        subprocess.run(["git", *args], cwd=self.dir, env=self.env, check=True, stdout=subprocess.DEVNULL)

    def prepare(self) -> None:
        self._path = self.pool[self._i % len(self.pool)]
        self._i += 1
        (self.dir / self._path).write_bytes(random_source(KIB))

    def commit(self) -> None:
        self._git("add", self._path)
        self._git("commit", "-q", "-m", "x")


def publishing(ctx: Context, wanted: set[str]) -> list[Result]:
    out: list[Result] = []
    s, n = ctx.sizes, ctx.n(ctx.sizes.publish_iters)
    if "publish_scale" in wanted:
        big, small = _publish_samples(ctx, [s.big, 100], n)
        out.append(Result("publish_scale", 1.5, median_ms(big), median_ms(small),
                          ours_what=f"complete_turn+publish, {s.big:,} files",
                          baseline_what="complete_turn+publish, 100 files"))
    if "publish_vs_git" in wanted:
        # ours first, then git: not interleaved, because git's writes to disk
        # (and writing the 10,000 files out) would slow PostgreSQL's commit
        # fsyncs, charging git's I/O to ours
        ours = list(ctx.publish_samples.get(10_000, []))
        if len(ours) < n:
            ours += _publish_samples(ctx, [10_000], n - len(ours))[0]
        git = _Git(ctx)
        base: list[float] = []
        for i in range(n + 2):
            git.prepare()
            t = timed(git.commit)
            if i >= 2:  # two warm-ups
                base.append(t)
        out.append(Result("publish_vs_git", 0.5, median_ms(ours), median_ms(base),
                          ours_what="complete_turn+publish, 10k files",
                          baseline_what="git add <file> && git commit, 10k-file repo"))
    return out


# -- 4: tool calls --------------------------------------------------------------------
def toolcalls(ctx: Context, wanted: set[str]) -> list[Result]:
    s, store, env = ctx.sizes, ctx.store, ctx.env
    project = ctx.project(100)
    assert env.pg is not None
    pg = env.pg
    args = {"path": "pkg_00/mod_00/file_001.py", "offset": 0, "limit": 200}
    result = {"ok": True, "bytes": 1024, "preview": "def agent_turn(path: str) -> int: ..."}
    early: list[float] = []
    late: list[float] = []
    raw: list[float] = []
    k = [0]

    def raw_pair() -> None:
        k[0] += 1
        for _ in range(2):
            pg.execute("INSERT INTO bench_insert (turn_id, seq, tool_name, status, args_json, started_at) "
                       "VALUES (%s, %s, %s, 'started', %s, now())", ("t", k[0], "read_file", '{"path": "x"}'))

    # warm-up turn (untimed): compiled-statement caches, pools, the Redis script
    _flush_draft(store, project.id)
    warm = store.start_turn(project.id, "bench tool calls warm-up").id
    for _ in range(10):
        store.tool_completed(warm, store.tool_started(warm, "read_file", args).seq, result)
        raw_pair()
    _end_turn(store, warm)
    for _t in range(ctx.n(s.turns)):
        _flush_draft(store, project.id)
        turn = store.start_turn(project.id, "bench tool calls").id

        def pair() -> None:
            seq = store.tool_started(turn, "read_file", args).seq
            store.tool_completed(turn, seq, result)

        for _ in range(s.window):  # calls 1 .. window
            early.append(timed(pair))
            raw.append(timed(raw_pair))
        far_start = s.calls - s.window // 2
        t0 = time.perf_counter()
        for _ in range(s.window, far_start - 1):
            pair()
        progress(f"  filled turn to call {far_start - 1} in {time.perf_counter() - t0:.1f}s")
        for _ in range(s.window):  # calls around s.calls
            late.append(timed(pair))
            raw.append(timed(raw_pair))
        _end_turn(store, turn)
    out = []
    if "toolcall_growth" in wanted:
        out.append(Result("toolcall_growth", 1.5, median_ms(late), median_ms(early),
                          ours_what=f"tool_started+tool_completed at call ~{s.calls:,}",
                          baseline_what="the same pair at calls 1..%d" % s.window))
    if "toolcall_vs_insert" in wanted:
        out.append(Result("toolcall_vs_insert", 1.5, median_ms(early), median_ms(raw),
                          ours_what="tool_started+tool_completed (calls 1..%d)" % s.window,
                          baseline_what="2 psycopg INSERTs (autocommit)"))
    return out


# -- 5: reads -------------------------------------------------------------------------
def reads(ctx: Context, wanted: set[str]) -> list[Result]:
    store, env, n = ctx.store, ctx.env, ctx.n(ctx.sizes.iters) * 2
    project = ctx.warm_pool(10_000)
    # the agent reads through the draft: make sure there is one (with a small overlay)
    turn = _running_turn(store, project.id)
    store.write_file(turn, project.write_pool[0], random_source(KIB))
    paths = [p for p in project.write_pool[1:51]]
    raw_keys = [f"bench-raw/r/{i}" for i in range(len(paths))]
    for key in raw_keys:
        env.s3.put_object(Bucket=env.bucket, Key=key, Body=random_source(KIB))
    assert env.pg is not None
    pg = env.pg
    out: list[Result] = []
    i = [0]

    def nxt() -> None:
        i[0] += 1

    if "read_warm" in wanted:
        view = store.view(project.id)
        for p in paths:
            view.read_file(p)
        ours, base = interleave(
            [lambda: view.read_file(paths[i[0] % len(paths)]),
             lambda: env.s3.get_object(Bucket=env.bucket, Key=raw_keys[i[0] % len(raw_keys)])["Body"].read()],
            n, warmup=10, block=10, prepare=[nxt, nxt])
        out.append(Result("read_warm", 0.5, median_ms(ours), median_ms(base),
                          ours_what="view.read_file 1 KiB, warm cache", baseline_what="boto3 GET 1 KiB"))
    if "read_cold" in wanted:
        digests = {p: store.view(project.id).stat(p).digest for p in paths}
        cur = [paths[0]]

        def evict() -> None:
            i[0] += 1
            cur[0] = paths[i[0] % len(paths)]
            store.cache.discard(digests[cur[0]])  # only the blob; tree nodes stay cached

        def raw_cold() -> None:
            env.s3.get_object(Bucket=env.bucket, Key=raw_keys[i[0] % len(raw_keys)])["Body"].read()
            pg.execute("SELECT body FROM bench_scratch WHERE id = %s", (1 + i[0] % 1000,)).fetchone()

        ours, base = interleave([lambda: store.view(project.id).read_file(cur[0]), raw_cold], n // 2,
                                warmup=10, block=5, prepare=[evict, nxt])
        out.append(Result("read_cold", 1.5, median_ms(ours), median_ms(base),
                          ours_what="store.view(pid).read_file 1 KiB, blob evicted (tree nodes cached)",
                          baseline_what="boto3 GET 1 KiB + psycopg PK SELECT"))
    _end_turn(store, turn)
    return out


# -- 6: search ------------------------------------------------------------------------
def search(ctx: Context, wanted: set[str]) -> list[Result]:
    if not hasattr(View, "search_code"):
        return [Result("search_10k", 2.0, skipped="search_code not available")]
    store, project = ctx.store, ctx.project(10_000)
    root = ctx.files_on_disk("grep-10k", 10_000)
    turn = _running_turn(store, project.id)  # search the draft
    view = store.view(project.id)
    max_results = 1000
    seeded = ""
    if ctx.sizes is QUICK:
        # quick: put the known contents into the cache instead of fetching 10,000
        # blobs one by one (~40 s here); the warm-up run fetches whatever differs
        for data in project.files.values():
            store.cache.add(digest_of(data), data)
        seeded = ", cache pre-seeded with the build contents"
    t0 = time.perf_counter()
    found = view.search_code(NEEDLE, max_results=max_results)  # warm-up: loads every blob into the cache
    first = time.perf_counter() - t0
    progress(f"search_code warm-up took {first:.2f}s{seeded}, {len(found)} matches")

    def grep() -> None:
        subprocess.run(["grep", "-rn", NEEDLE, str(root)], stdout=subprocess.DEVNULL, check=True)

    grep()
    ours, base = interleave([lambda: view.search_code(NEEDLE, max_results=max_results), grep],
                            ctx.n(ctx.sizes.search_iters), warmup=1, block=1)
    grep_lines = subprocess.run(["grep", "-rn", NEEDLE, str(root)], capture_output=True).stdout.count(b"\n")
    _end_turn(store, turn)
    mb = sum(len(v) for v in project.files.values()) / 1e6
    r = Result("search_10k", 2.0, median_ms(ours), median_ms(base),
               ours_what=f"view.search_code literal, 10k files / {mb:.1f} MB draft, warm",
               baseline_what="grep -rn over the same files on disk")
    r.notes.append(f"matches: ours {len(found)}, grep {grep_lines}; first (warm-up) search_code {first:.2f}s"
                   + (seeded or " from a cold blob cache (one GET per file)"))
    return [r]


# -- 7: diff --------------------------------------------------------------------------
def _one_file_versions(ctx: Context, n_files: int) -> tuple[View, View]:
    """Two consecutive versions of the project that differ in exactly one file."""
    store, project = ctx.store, ctx.warm_pool(n_files)
    _flush_draft(store, project.id)
    before = store.get_project(project.id).current_version_id
    turn = store.start_turn(project.id, "bench diff").id
    store.write_file(turn, project.write_pool[-1], random_source(KIB))
    store.complete_turn(turn, "done")
    after = store.publish(project.id, "bench diff").id
    assert before is not None
    return store.view_at(project.id, before), store.view_at(project.id, after)


def diffs(ctx: Context, wanted: set[str]) -> list[Result]:
    if not hasattr(Store, "diff"):
        return [Result("diff_small", 1.5, skipped="Store.diff not available")]
    s, store = ctx.sizes, ctx.store
    a_big, b_big = _one_file_versions(ctx, s.big)
    a_small, b_small = _one_file_versions(ctx, 100)
    d = store.diff(a_big, b_big)
    big, small = interleave([lambda: store.diff(a_big, b_big), lambda: store.diff(a_small, b_small)],
                            ctx.n(ctx.sizes.iters), warmup=3, block=5)
    r = Result("diff_small", 1.5, median_ms(big), median_ms(small),
               ours_what=f"store.diff, one changed file, {s.big:,} files",
               baseline_what="store.diff, one changed file, 100 files")
    files = getattr(d, "files", None)
    if files is not None:
        r.notes.append(f"big diff: {len(files)} file(s), {getattr(d, 'nodes_visited', '?')} tree nodes visited")
    return [r]


# name -> group; a group runs once if any of its names is wanted
GROUPS: list[tuple[tuple[str, ...], Callable[[Context, set[str]], list[Result]]]] = [
    (("write_1k", "write_scale"), writes),
    (("publish_scale", "publish_vs_git"), publishing),
    (("toolcall_growth", "toolcall_vs_insert"), toolcalls),
    (("read_warm", "read_cold"), reads),
    (("search_10k",), search),
    (("diff_small",), diffs),
]
from . import cold  # noqa: E402  (cold reads, real source, snapshots, imports)

GROUPS.append((cold.NAMES, cold.group))

# the HTTP service under load (bench/http_ops.py); ``--only http_ops`` selects all of its rows
from . import http_ops  # noqa: E402

GROUPS.append((http_ops.NAMES, http_ops.group))
# the hot operations on a database grown to millions of tool calls (bench/growth.py)
from . import growth  # noqa: E402

GROUPS.append((growth.NAMES, growth.group))
ALIASES: dict[str, tuple[str, ...]] = {http_ops.ALIAS: http_ops.NAMES, growth.ALIAS: growth.NAMES}
# run only when named (--only): http_ops starts service processes of its own and takes ~1-2 minutes;
# growth loads a database of millions of rows (~2-4 minutes)
OPT_IN: frozenset[str] = frozenset(http_ops.NAMES) | frozenset(growth.NAMES)
NAMES = [name for names, _ in GROUPS for name in names]
