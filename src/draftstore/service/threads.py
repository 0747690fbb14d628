"""The service's thread pool: where a request's blocking store call runs.

The store's calls block (database, blob store, coordinator), so a handler
runs them on a thread and awaits the answer. ``run_sync`` hands the call to a
pool of at most ``MAX_THREADS`` threads (started on demand, in the process that
uses them) through one queue, and the thread hands the outcome back with the
loop's ``call_soon_threadsafe``. Starlette's ``run_in_threadpool`` (anyio's
``to_thread``) does the same job with a capacity limiter, a cancel scope and
checkpoints around each call, and asyncio's ``run_in_executor`` with a
``concurrent.futures`` future chained to the asyncio one (locks, conditions
and callbacks on both sides); on the agent's hottest requests each cost a
measurable share of the service's CPU per request (see README, Benchmarks).

Guarantees, as with ``run_in_threadpool``: the call runs in a copy of the
caller's context (context variables read the same), at most ``MAX_THREADS``
calls run at once (more wait their turn, first come first served), and its
exception is raised to the awaiting handler. A call that has begun always
runs to its end, even if the request that awaited it is cancelled meanwhile;
at interpreter exit the pool's threads finish what they hold before the
process ends. A forked child starts a pool of its own. One difference: a
cancelled request stops waiting at once (anyio's default holds the
cancellation until the call returns). uvicorn cancels a request only when
it shuts down past its grace period; a client that goes away does not
cancel its request.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["run_sync", "MAX_THREADS"]

T = TypeVar("T")

# as anyio's default limiter; FastAPI's own sync routes (those off the fast lane) run on
# anyio's threads, under that limiter, not on these
MAX_THREADS = 40

_STOP = object()


def _deliver(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    """On the loop: settle ``fut`` unless its awaiter gave up (cancelled)."""
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class _Pool:
    """Up to ``size`` threads taking calls from one queue."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one permit per thread waiting for work
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], call: Callable[[], Any]) -> None:
        self._queue.put((loop, fut, call))
        if self._idle.acquire(blocking=False):
            return  # a waiting thread takes it
        with self._lock:
            if len(self._threads) < self.size:
                t = threading.Thread(target=self._work, name=f"draftstore-request_{len(self._threads)}",
                                     daemon=True)
                self._threads.append(t)
                t.start()

    def _work(self) -> None:
        take, idle = self._queue.get, self._idle
        while True:
            item = take()
            if item is _STOP:
                return
            loop, fut, call = item
            try:
                value, ok = call(), True
            except BaseException as exc:  # the awaiting handler raises it
                value, ok = exc, False
            try:
                loop.call_soon_threadsafe(_deliver, fut, ok, value)
            except RuntimeError:  # the loop closed meanwhile: nobody waits for this answer
                pass
            del item, loop, fut, call, value
            idle.release()

    def stop(self, timeout: float = 30.0) -> None:
        """Let every thread finish its call and what is queued before it, then end."""
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(_STOP)
        for t in threads:
            t.join(timeout)


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    """In a forked child: the parent's threads did not come along, so start afresh."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _get_pool() -> _Pool:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = _Pool(MAX_THREADS)
                # daemon threads, so exit never hangs on an idle one; this joins them first
                atexit.register(_pool.stop)
    return _pool


async def run_sync(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the service's thread pool (module docstring)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    ctx = contextvars.copy_context()
    _get_pool().submit(loop, fut, lambda: ctx.run(fn, *args, **kwargs))
    return await fut  # type: ignore[no-any-return]
