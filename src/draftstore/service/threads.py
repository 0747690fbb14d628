"""The service's thread pools: where a request's blocking store call runs.

The store's calls block (database, blob store, coordinator), so a handler
runs them on a thread and awaits the answer. ``run_sync`` and ``run_in`` hand
the call to a pool of threads (started on demand, in the process that uses
them) through its queues, and the thread hands the outcome back with the
loop's ``call_soon_threadsafe``. Starlette's ``run_in_threadpool`` (anyio's
``to_thread``) does the same job with a capacity limiter, a cancel scope and
checkpoints around each call, and asyncio's ``run_in_executor`` with a
``concurrent.futures`` future chained to the asyncio one (locks, conditions
and callbacks on both sides); on the agent's hottest requests each cost a
measurable share of the service's CPU per request (measured in runs that bench/README.md's git history keeps).

Two pools, so one kind of work cannot hold up the other (bulkheads):

- ``GENERAL`` (``run_sync``; at most ``MAX_THREADS`` threads): every route
  off the fast lane, reads and admin work, snapshots and imports included,
  and the agent's file writes (measured: on the turn pool they made the
  tool-call records' tail under load longer, and their own no shorter).
- the turn pool (``TURN`` and ``TURN_QUICK``; ``TURN_THREADS`` threads at
  most, or the ``turn_threads`` setting): the agent's other hot routes (``fastlane.HOT``). The store's calls are
  mostly Python holding the GIL, so more threads add no throughput, only
  contention: under load the calls wait in the pool's queues, where the
  order is ours. A ``TURN_QUICK`` call (a tool-call record, a heartbeat, a
  delta: well under a millisecond of work) goes ahead of queued ``TURN``
  calls (starting or ending a turn: 3-10 ms), so a burst of
  the slow ones (fifty agents starting their turns at once) does not hold
  up every short request behind it. No call waits for ever: while a
  ``TURN`` call waits, at most ``QUICK_RUN`` quick calls in a row go ahead
  of it. Within each queue, first come first served.

Guarantees, as with ``run_in_threadpool``: the call runs in a copy of the
caller's context (context variables read the same), at most the pool's size
of calls run at once (more wait their turn, in the order above), and its
exception is raised to the awaiting handler. A call that has begun always
runs to its end, even if the request that awaited it is cancelled meanwhile;
at interpreter exit the pools' threads finish what they hold and what is
queued before the process ends. A forked child starts pools of its own. One
difference: a cancelled request stops waiting at once (anyio's default holds
the cancellation until the call returns). uvicorn cancels a request only
when it shuts down past its grace period; a client that goes away does not
cancel its request.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextvars
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from ..settings import Settings

__all__ = ["run_sync", "run_in", "set_turn_threads", "Lane", "GENERAL", "TURN", "TURN_QUICK", "MAX_THREADS",
           "TURN_THREADS", "QUICK_RUN"]

T = TypeVar("T")

# as anyio's default limiter; FastAPI's own sync routes (those off the fast lane) run on
# anyio's threads, under that limiter, not on these
MAX_THREADS = 40
# the turn pool's default size, the setting's (the service sets it from ``Settings.turn_threads``):
# enough to overlap calls' waits on the database, the blob store and the coordinator with
# other calls' work, few enough that under load calls queue where quick ones can go first
TURN_THREADS: int = Settings.model_fields["turn_threads"].default
QUICK_RUN = 4  # quick calls taken in a row while an ordinary call waits


class Lane(NamedTuple):
    """Which pool a call runs on, and whether it goes ahead of that pool's ordinary calls."""

    pool: str
    quick: bool = False


GENERAL = Lane("general")
TURN = Lane("turn")
TURN_QUICK = Lane("turn", quick=True)
_SIZES = {"general": MAX_THREADS, "turn": TURN_THREADS}


def _deliver(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    """On the loop: settle ``fut`` unless its awaiter gave up (cancelled)."""
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class _Pool:
    """Up to ``size`` threads taking calls from two queues: quick ones first, but at
    most ``quick_run`` of them in a row while an ordinary call waits."""

    def __init__(self, name: str, size: int, quick_run: int = QUICK_RUN) -> None:
        self.name, self.size, self.quick_run = name, size, quick_run
        self._quick: collections.deque[Any] = collections.deque()
        self._ordinary: collections.deque[Any] = collections.deque()
        self._streak = 0  # quick calls taken in a row while an ordinary one waited
        self._cv = threading.Condition(threading.Lock())
        self._idle = 0  # threads waiting for work that no wake-up has claimed yet
        self._stopping = False
        self._threads: list[threading.Thread] = []

    def submit(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], call: Callable[[], Any],
               quick: bool = False) -> None:
        with self._cv:
            (self._quick if quick else self._ordinary).append((loop, fut, call))
            if self._idle:
                self._idle -= 1  # that thread is as good as taken: the next submit starts another
                self._cv.notify()
            elif len(self._threads) < self.size:
                t = threading.Thread(target=self._work, name=f"draftstore-{self.name}_{len(self._threads)}",
                                     daemon=True)
                self._threads.append(t)
                t.start()

    def resize(self, size: int) -> None:
        """At most ``size`` threads from now on: threads over it end once their call is done."""
        with self._cv:
            self.size = size
            over = min(self._idle, len(self._threads) - size)
            if over > 0:  # wake that many waiting threads (a wake-up claims one): they end
                self._idle -= over
                self._cv.notify(over)

    def _take(self) -> Any:
        """The next call (None: this thread ends, the pool stopping with nothing left, or
        grown larger than its size)."""
        with self._cv:
            while True:
                if len(self._threads) > self.size:
                    self._threads.remove(threading.current_thread())
                    return None
                if self._quick or self._ordinary:
                    break
                if self._stopping:
                    return None
                self._idle += 1
                self._cv.wait()
            if self._quick and (not self._ordinary or self._streak < self.quick_run):
                self._streak = self._streak + 1 if self._ordinary else 0
                return self._quick.popleft()
            self._streak = 0
            return self._ordinary.popleft()

    def _work(self) -> None:
        while (item := self._take()) is not None:
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

    def stop(self, timeout: float = 30.0) -> None:
        """Let every thread finish its call and what is queued, then end."""
        with self._cv:
            self._stopping = True
            self._idle = 0  # every waiting thread is woken
            self._cv.notify_all()
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)


_pools: dict[str, _Pool] = {}
_pools_lock = threading.Lock()


def _forget_pools() -> None:
    """In a forked child: the parent's threads did not come along, so start afresh."""
    global _pools, _pools_lock
    _pools, _pools_lock = {}, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def _get_pool(name: str) -> _Pool:
    pool = _pools.get(name)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(name)
            if pool is None:
                pool = _pools[name] = _Pool(name, _SIZES[name])
                # daemon threads, so exit never hangs on an idle one; this joins them first
                atexit.register(pool.stop)
    return pool


def set_turn_threads(n: int) -> None:
    """Size the turn pool of this process (threads over the size end once their call is done)."""
    if n < 1:
        raise ValueError("the turn pool needs at least one thread")
    with _pools_lock:
        _SIZES["turn"] = n
        if "turn" in _pools:
            _pools["turn"].resize(n)


async def run_in(lane: Lane, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on ``lane``'s pool (module docstring)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    ctx = contextvars.copy_context()
    _get_pool(lane.pool).submit(loop, fut, lambda: ctx.run(fn, *args, **kwargs), lane.quick)
    return await fut  # type: ignore[no-any-return]


async def run_sync(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the general pool (module docstring)."""
    return await run_in(GENERAL, fn, *args, **kwargs)
