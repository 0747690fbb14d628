"""``python -m bench.toolcall_bloat [--turns N] [--workers W] [--calls C] [--every M]``: does the
tool-call table bloat under a long run?

The ``tool_call`` table is insert-then-delete: a call is a row while its turn
runs, and the transaction that ends the turn compacts the rows into
``project_turn.tool_calls_json`` and deletes them (``toolcalls.py``). Every
turn thus leaves dead tuples behind, in ``tool_call`` and in the rows the
turn updates (``project_turn``, ``project_draft``), which only (auto)vacuum
makes reusable. This runs ``N`` turns through the store (``W`` threads, each
on its own project: ``start_turn``, ``C`` pairs of ``tool_started`` +
``tool_completed``, ``complete_turn``) on a fresh database with the server's
autovacuum as configured, and every ``M`` turns prints, per table, live and
dead tuples, heap and index bytes (``pg_relation_size``,
``pg_indexes_size``; total = ``pg_total_relation_size``) and how many times
autovacuum has run on it. The last line compares the tool-call table's
total size in the second half of the run with its peak in the first half:
bounded means the second half never needed more room than the first.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from .env import BenchEnv, progress

TABLES = ("tool_call", "project_turn", "project_draft")


def sample(conn) -> dict[str, tuple[int, int, int, int, int, int]]:  # type: ignore[no-untyped-def]
    rows = conn.execute(
        "SELECT relname, n_live_tup, n_dead_tup, pg_relation_size(relid), pg_indexes_size(relid), "
        "pg_total_relation_size(relid), autovacuum_count FROM pg_stat_user_tables WHERE relname = ANY(%s)",
        (list(TABLES),)).fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.toolcall_bloat", description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=100_000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--calls", type=int, default=4, help="tool-call pairs per turn")
    p.add_argument("--every", type=int, default=2_000, help="print the tables every M turns")
    args = p.parse_args(argv)
    with BenchEnv() as env:
        store = env.open_store(migrate=True)
        assert env.pg is not None
        settings = dict(env.pg.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN ('autovacuum', 'autovacuum_naptime', "
            "'autovacuum_vacuum_scale_factor', 'autovacuum_vacuum_threshold', "
            "'autovacuum_vacuum_insert_threshold', 'autovacuum_vacuum_cost_limit')").fetchall())
        print("server: " + ", ".join(f"{k}={v}" for k, v in sorted(settings.items())), flush=True)
        reloptions = env.pg.execute("SELECT relname, reloptions FROM pg_class WHERE relname = ANY(%s)",
                                    (list(TABLES),)).fetchall()
        print("table options: " + ", ".join(f"{n}={o}" for n, o in reloptions), flush=True)
        projects = [store.create_project(f"bloat-{i}", files={"a.py": b"x = 1\n"}).id for i in range(args.workers)]
        done = 0
        lock = threading.Lock()
        stop = threading.Event()
        errors: list[Exception] = []

        def worker(pid: str) -> None:
            nonlocal done
            try:
                while not stop.is_set():
                    t = store.start_turn(pid, "go")
                    for c in range(args.calls):
                        call = store.tool_started(t.id, "view_file", {"path": f"src/mod_{c}.py", "limit": 200})
                        store.tool_completed(t.id, call.seq, {"ok": True, "bytes": 1024, "preview": "def f(): ..."})
                    store.complete_turn(t.id, "done")
                    with lock:
                        done += 1
                        if done >= args.turns:
                            stop.set()
            except Exception as exc:  # noqa: BLE001 (reported by the main thread, which stops the others)
                errors.append(exc)
                stop.set()

        threads = [threading.Thread(target=worker, args=(pid,), daemon=True) for pid in projects]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        print(f"{'turns':>8} {'s':>6} {'turns/s':>8}  " + "  ".join(
            f"{t + ' live/dead':>24} {'heap+idx KiB':>14} {'total KiB':>9} {'av':>3}" for t in TABLES), flush=True)
        history: list[tuple[int, int]] = []
        next_at = 0
        while not stop.is_set() or any(th.is_alive() for th in threads):
            time.sleep(0.5)
            if done >= next_at or stop.is_set():
                s = sample(env.pg)
                elapsed = time.perf_counter() - t0
                cols = []
                for t in TABLES:
                    live, dead, heap, idx, total, av = s.get(t, (0, 0, 0, 0, 0, 0))
                    cols.append(f"{f'{live:,}/{dead:,}':>24} {f'{heap // 1024:,}+{idx // 1024:,}':>14} "
                                f"{total // 1024:>9,} {av:>3}")
                print(f"{done:>8,} {elapsed:>6.0f} {done / elapsed:>8.1f}  " + "  ".join(cols), flush=True)
                history.append((done, s.get("tool_call", (0,) * 6)[4]))
                next_at = done + args.every
                if stop.is_set() and not any(th.is_alive() for th in threads):
                    break
        if errors:
            raise errors[0]
        half = done // 2
        first = max((size for n, size in history if n <= half), default=0)
        second = max((size for n, size in history if n > half), default=0)
        print(f"toolcall_bloat turns={done} tool_call_total_kib first_half_peak={first // 1024} "
              f"second_half_peak={second // 1024} ratio={second / max(1, first):.2f}", flush=True)
        progress(f"{done:,} turns in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
