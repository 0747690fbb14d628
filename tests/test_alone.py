"""The suite's own parallel run: an ``alone`` test really runs alone, and a real
test that skips still fails CI when it ran on an xdist worker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from alone import ENV_LOCK_DIR, hold

TESTS = Path(__file__).resolve().parent


def holder(exclusive: bool, directory: Path, log: list[str], name: str, release: threading.Event) -> threading.Thread:
    def run() -> None:
        with hold(exclusive, directory):
            log.append(f"{name} in")
            release.wait(30)
            log.append(f"{name} out")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_for(log: list[str], entry: str) -> None:
    done = threading.Event()
    for _ in range(300):
        if entry in log:
            return
        done.wait(0.01)
    raise AssertionError(f"{entry!r} never happened: {log}")


def test_an_alone_test_waits_for_the_running_ones_and_no_new_one_starts_while_it_waits(tmp_path: Path) -> None:
    log: list[str] = []
    first, alone, later = threading.Event(), threading.Event(), threading.Event()
    t1 = holder(False, tmp_path, log, "first", first)
    wait_for(log, "first in")
    t2 = holder(True, tmp_path, log, "alone", alone)
    threading.Event().wait(0.3)
    t3 = holder(False, tmp_path, log, "later", later)  # arrives while the alone test waits
    threading.Event().wait(0.3)
    assert log == ["first in"]  # neither the alone test nor the later one got in
    first.set()
    wait_for(log, "alone in")
    threading.Event().wait(0.3)
    assert log == ["first in", "first out", "alone in"]  # the later one still waits
    alone.set()
    wait_for(log, "later in")
    later.set()
    for t in (t1, t2, t3):
        t.join(30)
    assert log == ["first in", "first out", "alone in", "alone out", "later in", "later out"]


def test_ordinary_tests_run_side_by_side(tmp_path: Path) -> None:
    log: list[str] = []
    release = threading.Event()
    threads = [holder(False, tmp_path, log, name, release) for name in ("a", "b")]
    wait_for(log, "a in")
    wait_for(log, "b in")
    release.set()
    for t in threads:
        t.join(30)


def test_a_real_test_that_skips_on_a_worker_fails_the_run(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from services import pytest_runtest_makereport  # the hook tests/conftest.py uses
    """))
    (tmp_path / "test_skips.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.real
        def test_real_but_unreachable():
            pytest.skip("no server")

        def test_embedded_may_skip():
            pytest.skip("not here")
    """))
    env = {k: v for k, v in os.environ.items() if k != ENV_LOCK_DIR}
    env.update(DRAFTSTORE_REQUIRE_REAL="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # xdist alone: a quick start
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "xdist", "-n", "1", "-p", "no:cacheprovider", "-q",
                           "-o", "markers=real", "-W", "ignore::pytest.PytestAssertRewriteWarning", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 1 skipped" in done.stdout, done.stdout
    assert "real-service test skipped while DRAFTSTORE_REQUIRE_REAL=1: " in done.stdout, done.stdout


def test_on_two_workers_nothing_runs_beside_an_alone_test(tmp_path: Path) -> None:
    suite, log = tmp_path / "suite", tmp_path / "log"
    suite.mkdir()
    log.mkdir()
    (suite / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from alone import pytest_configure, pytest_runtest_protocol, pytest_unconfigure
    """))
    (suite / "test_mixed.py").write_text(textwrap.dedent(f"""
        import time
        from pathlib import Path

        import pytest

        def span(name):
            start = time.time()
            time.sleep(0.4)
            Path({str(log)!r}, name).write_text(f"{{start}} {{time.time()}}")

        @pytest.mark.parametrize("i", range(8))
        def test_ordinary(i):
            span(f"ordinary{{i}}")

        @pytest.mark.alone
        def test_alone():
            span("alone")

        @pytest.mark.parametrize("i", range(8, 12))
        def test_ordinary_after(i):
            span(f"ordinary{{i}}")
    """))
    env = {k: v for k, v in os.environ.items() if k != ENV_LOCK_DIR}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "xdist", "-n", "2", "-p", "no:cacheprovider", "-q",
                           "-o", "markers=alone", str(suite)], cwd=suite, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "13 passed" in done.stdout, done.stdout + done.stderr
    spans = {p.name: tuple(map(float, p.read_text().split())) for p in log.iterdir()}
    assert len(spans) == 13
    a0, a1 = spans.pop("alone")
    beside = [name for name, (s0, s1) in spans.items() if s0 < a1 and a0 < s1]
    assert not beside, f"ran beside the alone test: {beside}"
