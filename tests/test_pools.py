"""``pools.settle``: every call's result in order, or a failure once nothing of the
batch runs any more, without starting the calls still queued."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from draftstore.pools import settle


def test_results_come_back_in_item_order() -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        assert settle(pool, lambda i: (time.sleep(0.001 * (i % 3)), i * i)[1], list(range(20))) == \
            [i * i for i in range(20)]


def test_a_failure_cancels_the_calls_not_started_and_waits_for_the_running_ones() -> None:
    ran: list[int] = []
    running = 0
    lock = threading.Lock()

    def call(i: int) -> int:
        nonlocal running
        with lock:
            ran.append(i)
            running += 1
        try:
            time.sleep(0.02)
            if i == 0:
                raise OSError("the backend is gone")
            return i
        finally:
            with lock:
                running -= 1

    with ThreadPoolExecutor(max_workers=2) as pool:
        with pytest.raises(OSError, match="the backend is gone"):
            settle(pool, call, list(range(100)))
        assert running == 0  # nothing of the batch runs once it raised
        # the two workers took at most a couple of calls each before the failure was seen
        assert len(ran) <= 6, ran
        assert 0 in ran
