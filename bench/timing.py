"""Timing helpers: warm-up, then medians of many samples, ours and baseline interleaved."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from draftstore.heap import THRESHOLDS


def freeze_set_up() -> None:
    """After a set-up step (stores opened, a project built): collect, then freeze what the
    harness holds, with the service's thresholds. The bench process stands in for a service
    process, which tunes its collector once its store is open (``draftstore.heap``); the
    harness's own copies of projects (kept for the baselines) are frozen the same way, so a
    full collection inside a timed call scans what such a process would hold, not the
    harness's set-up (else one costs 100+ ms here)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)


class GcClock:
    """While entered: how many garbage collections ran, by generation, and how long they took
    (a note's figure: a timed call that sets off a full collection pays for the whole heap)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._t0

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def note(self) -> str:
        return "garbage collections while timed: " + ", ".join(
            f"gen{g} {n} ({1e3 * s:.1f} ms)" for g, (n, s) in enumerate(zip(self.count, self.seconds)))


def timed(fn: Callable[[], object]) -> float:
    """Wall time of one call, in seconds."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def interleave(fns: list[Callable[[], object]], n: int, warmup: int, block: int = 5,
               prepare: list[Callable[[], object] | None] | None = None) -> list[list[float]]:
    """Time each of ``fns`` ``n`` times after ``warmup`` untimed calls, alternating
    in blocks of ``block`` so drift on a shared machine hits every side alike.
    ``prepare[i]`` (untimed) runs before each call of ``fns[i]``."""
    prepare = prepare or [None] * len(fns)
    for fn, prep in zip(fns, prepare):
        for _ in range(warmup):
            if prep is not None:
                prep()
            fn()
    out: list[list[float]] = [[] for _ in fns]
    done = 0
    while done < n:
        k = min(block, n - done)
        for i, (fn, prep) in enumerate(zip(fns, prepare)):
            for _ in range(k):
                if prep is not None:
                    prep()
                out[i].append(timed(fn))
        done += k
    return out


@dataclass
class Result:
    name: str
    goal: float
    ours_ms: float | None = None
    baseline_ms: float | None = None
    skipped: str | None = None
    ours_what: str = ""
    baseline_what: str = ""
    notes: list[str] = field(default_factory=list)
    # a row of an alternative the product does not ship (FastAPI without the fast lane):
    # read against the same goal, to show what shipping it would cost; not a goal of its own
    comparison: bool = False

    @property
    def ratio(self) -> float | None:
        if self.ours_ms is None or not self.baseline_ms:
            return None
        return self.ours_ms / self.baseline_ms

    @property
    def verdict(self) -> str:
        if self.skipped is not None:
            return "SKIP"
        r = self.ratio
        verdict = "PASS" if r is not None and r <= self.goal else "MISS"
        return f"({verdict})" if self.comparison else verdict

    def line(self) -> str:
        if self.skipped is not None:
            return f"{self.name} skipped: {self.skipped}"
        return f"{self.name} ratio={self.ratio:.2f} ours_ms={self.ours_ms:.3f} baseline_ms={self.baseline_ms:.3f}"
