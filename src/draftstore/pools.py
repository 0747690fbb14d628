"""Thread pools: running calls side by side and starting workers ahead of need.

Shared by the blob store's transfer pool and the store's read pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

__all__ = ["settle", "drain", "start_workers"]

T = TypeVar("T")
R = TypeVar("R")


def settle(pool: ThreadPoolExecutor, fn: Callable[[T], R], items: list[T]) -> list[R]:
    """``[fn(item) for item in items]``, the calls run on ``pool``. Returns only after
    every call has settled; if any failed, raises a failure (the first in ``items``
    order among the calls that ran) once the calls not started yet are cancelled and
    the running ones have ended: a batch against a dead backend fails after the
    calls in flight, not after every call has used its retries. Nothing is left
    running either way."""
    futures = [pool.submit(fn, item) for item in items]
    wait(futures, return_when=FIRST_EXCEPTION)
    drain(futures)
    first = next((e for f in futures if not f.cancelled() and (e := f.exception()) is not None), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]


def drain(futures: list[Future[Any]]) -> None:
    """Cancel the calls not started yet and wait for the running ones to end."""
    for f in futures:
        f.cancel()  # a no-op for a call that runs or ran
    wait(futures)


def start_workers(pool: ThreadPoolExecutor, n: int) -> None:
    """Start ``n`` of the pool's threads now, not in a request; returns once they all
    run, or after 2 s."""
    started = threading.Barrier(n + 1)

    def wait() -> None:
        try:
            started.wait(timeout=2.0)
        except threading.BrokenBarrierError:
            pass

    for _ in range(n):
        pool.submit(wait)
    try:
        started.wait(timeout=2.0)
    except threading.BrokenBarrierError:
        pass
