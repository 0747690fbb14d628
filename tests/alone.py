"""Tests marked ``alone`` run with no other test of the same run beside them.

The suite runs on pytest-xdist workers (``-n``). Most tests share nothing but the
servers, each under its own database, S3 prefix and Redis prefix, so they may run
side by side. A few must not: they bound response times, count what happens per
second, or read answers with sub-second timeouts (the fuzzer's event routes). Those
carry ``@pytest.mark.alone``.

The guarantee: while an ``alone`` test is between the start of its set-up and
the end of its teardown, no other test of the run is. Every test holds a lock
file of the run for that span: shared for an ordinary test, exclusive for an
``alone`` one. A turnstile (a second, exclusive lock taken briefly on the way
in) keeps a waiting ``alone`` test from being starved by ordinary tests that
keep taking the shared lock: once it waits, no new test starts.

Without xdist (one process) tests already run one at a time and no lock is
taken. Locks are ``fcntl.flock`` on two files in a directory the controlling
process creates for the run (and removes at its end) and hands to its workers
through ``DRAFTSTORE_TESTS_LOCK_DIR``: two runs on one machine never wait for each
other, and a worker killed mid-test frees its locks with its process.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

MARKER = "alone"  # registered in pyproject.toml
ENV_LOCK_DIR = "DRAFTSTORE_TESTS_LOCK_DIR"
_LOCK_DIR = pytest.StashKey[str]()


@contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextmanager
def hold(exclusive: bool, directory: Path) -> Iterator[None]:
    """Hold the run's lock in ``directory``: exclusive (alone) or shared (everyone else)."""
    gate, turnstile = directory / "gate.lock", directory / "turnstile.lock"
    if exclusive:
        with _flock(turnstile, fcntl.LOCK_EX), _flock(gate, fcntl.LOCK_EX):
            yield
    else:
        with _flock(turnstile, fcntl.LOCK_EX):
            pass  # an alone test waiting inside stops us here
        with _flock(gate, fcntl.LOCK_SH):
            yield


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return  # a worker (it inherits the directory) or a run in one process (no lock needed)
    directory = tempfile.mkdtemp(prefix="draftstore-tests-")
    config.stash[_LOCK_DIR] = directory
    os.environ[ENV_LOCK_DIR] = directory  # before the workers start: they inherit it


def pytest_unconfigure(config: pytest.Config) -> None:
    directory = config.stash.get(_LOCK_DIR, None)
    if directory is not None:
        os.environ.pop(ENV_LOCK_DIR, None)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    directory = os.environ.get(ENV_LOCK_DIR)
    if directory is None or not hasattr(item.config, "workerinput"):
        yield
        return
    with hold(item.get_closest_marker(MARKER) is not None, Path(directory)):
        yield
