"""The processes draftstore owns tune their garbage collector once (heap.py): the
service at start-up, the CLI when it opens its store -- start-up heap frozen,
``THRESHOLDS`` set. Each check runs in a new
interpreter, so nothing this test process froze earlier can make it pass."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def _run(code: str, home: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTSTORE_")}
    env["DRAFTSTORE_HOME"] = str(home)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_service_tunes_its_collector_once(tmp_path: Path) -> None:
    before, started, again, thresholds = _run("""
        import gc
        from starlette.testclient import TestClient
        from draftstore.heap import THRESHOLDS, tune_collector
        from draftstore.service.app import create_app
        assert gc.get_threshold() != THRESHOLDS
        print(gc.get_freeze_count())
        with TestClient(create_app()) as client:
            assert client.get("/healthz").status_code == 200
            print(gc.get_freeze_count())
            garbage = [object() for _ in range(1000)]
            tune_collector()  # once per process: nothing more is frozen
            print(gc.get_freeze_count())
            print(gc.get_threshold() == THRESHOLDS)
    """, tmp_path)
    assert int(before) == 0 < int(started) == int(again)
    assert thresholds == "True"


def test_the_cli_tunes_the_collector_when_it_opens_its_store(tmp_path: Path) -> None:
    before, opened, thresholds = _run("""
        import gc
        from draftstore.cli.root import open_store
        from draftstore.heap import THRESHOLDS
        print(gc.get_freeze_count())
        store = open_store()
        print(gc.get_freeze_count())
        print(gc.get_threshold() == THRESHOLDS)
        store.close()
    """, tmp_path)
    assert int(before) == 0 < int(opened)
    assert thresholds == "True"
