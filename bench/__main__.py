"""``python -m bench [--quick] [--only NAME[,NAME]] [--repeat N]`` (from the repo root).

Runs every scenario on the real stack (PostgreSQL, SeaweedFS/S3, Redis) and
prints, per scenario, exactly one line ``NAME ratio=R ours_ms=X baseline_ms=Y``
(R = ours / baseline) on stdout, then a summary table with each goal and
PASS / MISS ((PASS) / (MISS) on comparison rows: an alternative the product does not
ship, read against the same goal). Progress goes to stderr. See bench/README.md.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from draftstore.settings import Settings

from .env import BenchEnv, progress
from .projects import build_project
from .scenarios import ALIASES, FULL, GROUPS, NAMES, OPT_IN, QUICK, Context
from .timing import Result, freeze_set_up


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description="draftstore benchmarks on the real stack")
    p.add_argument("--quick", action="store_true", help="small sizes (10,000 vs 100 files, ~300 tool calls); < 60 s")
    p.add_argument("--only", default="", help="comma-separated scenario names (or a group: "
                   + ", ".join(ALIASES) + ", run only when named): " + ", ".join(NAMES))
    p.add_argument("--repeat", type=int, default=1, help="multiply the timed iterations by N (steadier medians)")
    p.add_argument("--lean-build", action="store_true",
                   help="pre-upload every blob one PUT each (the store's put_many) before create_project "
                        "(the old way; slower than create_project's packs, and skews cold_search)")
    args = p.parse_args(argv)
    wanted = [n.strip() for n in args.only.split(",") if n.strip()] or [n for n in NAMES if n not in OPT_IN]
    wanted = [m for n in wanted for m in ALIASES.get(n, (n,))]  # a group name stands for its rows
    unknown = [n for n in wanted if n not in NAMES]
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(NAMES)}")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    args.wanted = wanted
    return args


def summary(results: list[Result], quick: bool, elapsed: float) -> str:
    rows = [("scenario", "goal", "ratio", "ours_ms", "baseline_ms", "verdict", "ours / baseline")]
    for r in results:
        goal = "-" if r.verdict == "INFO" else f"<= {r.goal:g}"  # INFO: a ratio to read, no goal
        if r.skipped is not None:
            rows.append((r.name, goal, "-", "-", "-", "SKIP", r.skipped))
        else:
            rows.append((r.name, goal, f"{r.ratio:.2f}", f"{r.ours_ms:.3f}", f"{r.baseline_ms:.3f}",
                         r.verdict, f"{r.ours_what} / {r.baseline_what}"))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    lines = ["", f"== draftstore bench summary ({'quick' if quick else 'full'}, {elapsed:.0f}s) =="]
    for j, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:6], widths)) + "  " + row[6])
        if j == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 15)
    counts = {v: sum(r.verdict == v for r in results) for v in ("PASS", "MISS", "SKIP", "INFO")}
    compared = {v: sum(r.verdict == f"({v})" for r in results) for v in ("PASS", "MISS")}
    lines.append(f"{counts['PASS']} pass, {counts['MISS']} miss, {counts['SKIP']} skipped"
                 + (f", {counts['INFO']} information rows (no goal)" if counts["INFO"] else "")
                 + (f"; comparison rows (not shipped, not goals of the product): {compared['PASS']} within "
                    f"the goal, {compared['MISS']} over" if any(compared.values()) else ""))
    for r in results:
        for note in r.notes:
            lines.append(f"note {r.name}: {note}")
    if any(r.name == "read_cold" and r.skipped is None for r in results):
        lines.append("note read_cold: 'cold' = the file's blob is evicted from the in-process cache "
                     "(store.cache.discard(digest)) before each read; tree nodes may stay cached, as in any "
                     "running service; each read opens a new view (store.view).")
    lines.append("note: the write, publish, read and diff scenarios first load the tree nodes on the paths "
                 "they touch (untimed), so they measure steady state, not a directory's first touch.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = QUICK if args.quick else FULL
    t_start = time.perf_counter()
    results: list[Result] = []
    with BenchEnv() as env:
        store = env.open_store(migrate=True)
        preupload = args.lean_build
        # projects are built through a separate store with a cache big enough to
        # hold every pre-uploaded blob; the measuring store keeps default settings
        builder: list = []

        def build(name: str, files: dict[str, bytes]) -> str:
            if not builder:
                builder.append(_open_builder(env) if preupload else env.open_store())
            return build_project(builder[0], name, files, preupload)

        ctx = Context(env=env, store=store, sizes=sizes, repeat=args.repeat, build=build)
        freeze_set_up()
        wanted = set(args.wanted)
        for names, group in GROUPS:
            if not wanted.intersection(names):
                continue
            t0 = time.perf_counter()
            progress(f"running {', '.join(n for n in names if n in wanted)}")
            try:
                got = group(ctx, wanted)
            except Exception as exc:  # one broken scenario must not hide the others
                traceback.print_exc(file=sys.stderr)
                got = [Result(n, 0.0, skipped=f"error: {type(exc).__name__}: {exc}") for n in names]
            for r in got:
                if r.name in wanted:
                    print(r.line(), flush=True)
                    results.append(r)
            progress(f"  ({time.perf_counter() - t0:.1f}s)")
        for b in builder:
            b.close()
            env.stores.remove(b)
        print(summary(results, args.quick, time.perf_counter() - t_start), flush=True)
    progress(f"done in {time.perf_counter() - t_start:.1f}s")
    return 1 if any(r.skipped and r.skipped.startswith("error") for r in results) else 0


def _open_builder(env: BenchEnv):  # type: ignore[no-untyped-def]
    from draftstore import Store

    store = Store.open(env.database_url, env.blob_url, env.coord_url, settings=Settings(cache_bytes=1 << 30))
    env.stores.append(store)
    return store


if __name__ == "__main__":
    sys.exit(main())
