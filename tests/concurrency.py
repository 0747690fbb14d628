"""Test helper: how many calls of a pool ran at once."""

from __future__ import annotations

import threading
import time


class Peak:
    """``call`` holds for ``hold_s`` seconds; ``most`` is the most calls that ran at once."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.running = 0
        self.most = 0
        self._lock = threading.Lock()

    def call(self) -> None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.hold_s)
        with self._lock:
            self.running -= 1
