"""``python -m bench.capacity [--seconds S] [--workers W]``: CPU each service spends per operation.

What one core of PostgreSQL, Redis and the S3 store sustains is bounded by the
CPU each spends per operation. This runs three phases through the store, each
for ``S`` seconds with ``W`` threads on their own projects, and reads the CPU
time (user + system, ``/proc``) every service process used meanwhile:

- ``tool_pair``: ``tool_started`` + ``tool_completed`` in running turns;
- ``write_file``: a 1 KiB ``write_file`` in running turns;
- ``turn``: ``start_turn`` + ``complete_turn`` (one file written by the turn, untimed
  in the count but in the CPU: a turn that wrote nothing seals nothing).

The services must be this run's own, so their CPU is the run's alone: a
PostgreSQL server whose data directory this process can read
(``DRAFTSTORE_BENCH_PG_URL``; its postmaster and every child are counted), a
private SeaweedFS (started by ``BenchEnv`` when ``DRAFTSTORE_BENCH_S3_ENDPOINT``
is unset) and a private ``redis-server`` started here on a free port. Per phase it
prints operations per second and CPU milliseconds per operation of each
service and of the client (this process), and ``1000 / cpu_ms``: the operations
one core of that service would sustain if CPU were its only limit (an upper
bound: WAL flushes and disk I/O are not CPU).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .env import BenchEnv, progress

TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int, children_done: bool = False) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    used = int(fields[11]) + int(fields[12])  # utime, stime
    if children_done:
        used += int(fields[13]) + int(fields[14])  # cutime, cstime: children that exited
    return used / TICK


def _tree_cpu(root: int) -> float:
    """CPU seconds of ``root`` and its live children (and the children that exited)."""
    total = _cpu(root, children_done=True)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == root:
                total += _cpu(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return total


def _postmaster(pg) -> int:  # type: ignore[no-untyped-def]
    data = pg.execute("SHOW data_directory").fetchone()[0]
    return int((Path(data) / "postmaster.pid").read_text().split()[0])


class _Redis:
    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="draftstore-capacity-redis-")
        self.proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(self.port),
                                      "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.dir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--workers", type=int, default=4)
    args = p.parse_args(argv)
    if os.environ.get("DRAFTSTORE_BENCH_S3_ENDPOINT"):
        p.error("unset DRAFTSTORE_BENCH_S3_ENDPOINT: the S3 store must be this run's own to count its CPU")
    redis = _Redis()
    os.environ["DRAFTSTORE_BENCH_REDIS_URL"] = f"redis://127.0.0.1:{redis.port}/0"
    try:
        with BenchEnv() as env:
            assert env.pg is not None and env._seaweed is not None
            services = {"postgres": _postmaster(env.pg), "redis": redis.proc.pid,
                        "seaweedfs": int(env._seaweed.pid_file.read_text().split()[0])}
            store = env.open_store(migrate=True)
            projects = [store.create_project(f"cap-{i}", files={f"src/f{j}.py": b"x = 1\n" for j in range(50)}).id
                        for i in range(args.workers)]
            print(f"{'phase':<11} {'ops':>7} {'ops/s':>7}  " + "  ".join(
                f"{s + ' cpu ms/op':>20} {'ops/core-s':>10}" for s in (*services, "client")), flush=True)
            for phase in ("tool_pair", "write_file", "turn"):
                _phase(store, projects, phase, args.seconds, services)
    finally:
        redis.stop()
    return 0


def _phase(store, projects, phase, seconds, services) -> None:  # type: ignore[no-untyped-def]
    stop = threading.Event()
    counts = [0] * len(projects)
    errors: list[Exception] = []

    def worker(i: int, pid: str) -> None:
        try:
            t = store.start_turn(pid, "capacity") if phase != "turn" else None
            while not stop.is_set():
                if phase == "tool_pair":
                    call = store.tool_started(t.id, "view_file", {"path": "src/f1.py", "limit": 200})
                    store.tool_completed(t.id, call.seq, {"ok": True, "bytes": 1024, "preview": "def f(): ..."})
                    if call.seq >= 200:  # keep turns ordinary in length
                        store.complete_turn(t.id, "done")
                        t = store.start_turn(pid, "capacity")
                elif phase == "write_file":
                    store.write_file(t.id, f"src/f{counts[i] % 50}.py", os.urandom(512).hex().encode())
                else:
                    turn = store.start_turn(pid, "capacity")
                    store.write_file(turn.id, f"src/f{counts[i] % 50}.py", os.urandom(512).hex().encode())
                    store.complete_turn(turn.id, "done")
                counts[i] += 1
            if t is not None:
                store.complete_turn(t.id, "done")
        except Exception as exc:  # noqa: BLE001 (reported by the main thread, which stops the others)
            errors.append(exc)
            stop.set()

    before = {s: _tree_cpu(pid) for s, pid in services.items()}
    client0 = time.process_time()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i, pid), daemon=True) for i, pid in enumerate(projects)]
    for th in threads:
        th.start()
    time.sleep(seconds)
    stop.set()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    used = {s: _tree_cpu(pid) - before[s] for s, pid in services.items()}
    used["client"] = time.process_time() - client0
    if errors:
        raise errors[0]
    ops = sum(counts)
    cols = []
    for cpu in used.values():
        ms = 1e3 * cpu / max(1, ops)
        cols.append(f"{ms:>20.3f} {(1e3 / ms if ms else float('inf')):>10,.0f}")
    print(f"{phase:<11} {ops:>7,} {ops / wall:>7.1f}  " + "  ".join(cols), flush=True)
    progress(f"  {phase}: {ops} ops in {wall:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
