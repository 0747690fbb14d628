"""The service's thread pool keeps run_in_threadpool's guarantees (service/threads.py)."""

from __future__ import annotations

import asyncio
import contextvars
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from concurrency import Peak
from draftstore.service import threads

who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")


def test_a_call_runs_off_the_loop_in_the_callers_context_and_returns_or_raises() -> None:
    async def main() -> None:
        who.set("request-7")
        loop_thread = threading.get_ident()
        got = await threads.run_sync(lambda a, b=0: (who.get(), threading.get_ident(), a + b), 1, b=2)
        assert got[0] == "request-7" and got[1] != loop_thread and got[2] == 3

        def boom() -> None:
            raise KeyError("missing")

        with pytest.raises(KeyError, match="missing"):
            await threads.run_sync(boom)

    asyncio.run(main())


def _peak(lanes: list[threads.Lane]) -> int:
    """The most calls that ran at once when one call per lane was submitted together."""
    peak = Peak(0.3)  # long enough for every thread of the pool to have started meanwhile

    async def main() -> None:
        await asyncio.gather(*(threads.run_in(lane, peak.call) for lane in lanes))

    asyncio.run(main())
    return peak.most


def test_at_most_max_threads_calls_run_at_once_and_the_rest_wait_their_turn() -> None:
    assert _peak([threads.GENERAL] * (threads.MAX_THREADS + 20)) == threads.MAX_THREADS


def test_the_turn_pool_runs_at_most_turn_threads_calls_at_once() -> None:
    assert _peak([threads.TURN, threads.TURN_QUICK] * (threads.TURN_THREADS + 5)) == threads.TURN_THREADS


def test_the_service_sizes_the_turn_pool_from_its_settings(tmp_path) -> None:
    from fastapi.testclient import TestClient

    from draftstore import Store
    from draftstore.service.app import create_app
    from draftstore.settings import Settings

    settings = Settings(home=tmp_path, turn_threads=3)
    try:
        with Store.open(settings=settings) as store, TestClient(create_app(store)):
            assert _peak([threads.TURN_QUICK] * 8) == 3
    finally:
        threads.set_turn_threads(threads.TURN_THREADS)
    assert _peak([threads.TURN] * (threads.TURN_THREADS + 4)) == threads.TURN_THREADS
    with pytest.raises(ValueError):
        threads.set_turn_threads(0)


def test_a_full_turn_pool_does_not_hold_up_the_general_pool() -> None:
    release = threading.Event()

    async def main() -> None:
        held = [asyncio.ensure_future(threads.run_in(threads.TURN, release.wait, 10))
                for _ in range(threads.TURN_THREADS + 3)]
        try:
            # every turn thread is blocked and more turn calls are queued: the general pool answers
            assert await asyncio.wait_for(threads.run_sync(lambda: "general"), 5) == "general"
            assert not any(h.done() for h in held)
        finally:
            release.set()
        assert all(await asyncio.gather(*held))

    asyncio.run(main())


def _order_of(size: int, quick_run: int, lanes: str) -> str:
    """The order a pool of ``size`` threads runs calls submitted while its threads are busy:
    ``lanes`` names each call by a letter, upper case for a quick one."""
    pool = threads._Pool("probe", size, quick_run)
    gate, ran = threading.Event(), []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        busy = [loop.create_future() for _ in range(size)]
        for fut in busy:
            pool.submit(loop, fut, lambda: gate.wait(10))
        await asyncio.sleep(0.1)  # every thread holds a blocked call: what follows is queued
        futs = []
        for name in lanes:
            fut = loop.create_future()
            pool.submit(loop, fut, lambda name=name: ran.append(name), quick=name.isupper())
            futs.append(fut)
        gate.set()
        await asyncio.gather(*busy, *futs)

    try:
        asyncio.run(main())
    finally:
        pool.stop()
    return "".join(ran)


def test_quick_calls_go_ahead_of_queued_ordinary_ones_but_never_starve_them() -> None:
    # one thread: the order is exactly the pool's; at most 4 quick calls in a row while an ordinary one waits
    assert _order_of(1, 4, "abABCDEFGHIJ") == "ABCDaEFGHbIJ"
    assert _order_of(1, 4, "aAbBcC") == "ABCabc"
    assert _order_of(1, 2, "abcABCDEFG") == "ABaCDbEFcG"
    # first come first served within each queue, and no quick call at all: plain FIFO
    assert _order_of(1, 4, "abcdef") == "abcdef"
    assert _order_of(1, 4, "ABCDEF") == "ABCDEF"


def test_stopping_a_pool_runs_what_is_queued_first() -> None:
    pool = threads._Pool("probe", 1)
    ran: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for i in range(5):
            pool.submit(loop, loop.create_future(), lambda i=i: (time.sleep(0.02), ran.append(i)), quick=i % 2 == 0)

    asyncio.run(main())  # the loop is gone: the answers are dropped, the calls still run
    pool.stop()
    assert sorted(ran) == [0, 1, 2, 3, 4]


def test_a_call_that_began_runs_to_its_end_even_if_its_request_is_cancelled() -> None:
    began, finished = threading.Event(), threading.Event()

    def slow() -> None:
        began.set()
        time.sleep(0.2)
        finished.set()

    loop_errors: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
        task = asyncio.ensure_future(threads.run_sync(slow))
        while not began.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.wait(5)
        await asyncio.sleep(0.05)  # the answer nobody awaits reaches the loop meanwhile

    asyncio.run(main())
    assert finished.is_set()
    assert loop_errors == []  # delivered to a cancelled future: dropped, not an InvalidStateError


def test_the_process_exits_only_once_the_call_in_hand_has_finished(tmp_path) -> None:
    # the loop is gone (asyncio.run returned) while the call still runs: exit waits for it
    marker = tmp_path / "finished"
    script = textwrap.dedent(f"""
        import asyncio, threading, time
        from draftstore.service import threads
        began = threading.Event()

        def slow():
            began.set()
            time.sleep(0.5)
            open({str(marker)!r}, "w").write("done")

        async def main():
            task = asyncio.ensure_future(threads.run_sync(slow))
            while not began.is_set():
                await asyncio.sleep(0.005)
            task.cancel()

        asyncio.run(main())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "done"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_runs_calls_on_a_pool_of_its_own() -> None:
    # the parent's pool threads do not survive a fork: a child that reused the pool would queue
    # its calls for threads that are not there and wait for ever
    script = textwrap.dedent("""
        import asyncio, os, sys, threading
        from draftstore.service import threads

        async def who():
            return await threads.run_sync(threading.get_ident)

        asyncio.run(who())  # the parent's pool now exists, its first thread waiting for work
        pid = os.fork()
        if pid == 0:
            try:
                asyncio.run(asyncio.wait_for(who(), 10))
                os._exit(0)
            except BaseException:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr)
