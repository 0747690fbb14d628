"""The service's thread pool: where a request's blocking store call runs.

The store's calls block (database, blob store, coordinator), so a handler
runs them on a thread and awaits the answer. ``run_sync`` does it through
asyncio's own executor hand-off onto a pool of ``MAX_THREADS`` threads
(created on first use, in the process that uses it). Starlette's
``run_in_threadpool`` (anyio's ``to_thread``) does the same job with a
capacity limiter, a cancel scope and checkpoints around each call; on the
agent's hottest requests that machinery cost ~20 % of the service's CPU per
request (py-spy, GIL samples), about what the hand-off itself costs.

Guarantees, as with ``run_in_threadpool``: the call runs in a copy of the
caller's context (context variables read the same), at most ``MAX_THREADS``
calls run at once (more wait their turn), and its exception is raised to the
awaiting handler. A call that has begun always runs to its end, even if the
request that awaited it is cancelled meanwhile. One difference: a cancelled
request stops waiting at once (anyio's default holds the cancellation until
the call returns). uvicorn cancels a request only when it shuts down past
its grace period; a client that goes away does not cancel its request.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["run_sync", "MAX_THREADS"]

T = TypeVar("T")

MAX_THREADS = 40  # as anyio's default limiter, which FastAPI's own sync routes share

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="draftstore-request")
    return _pool


async def run_sync(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the service's thread pool (module docstring)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_executor(), call)
