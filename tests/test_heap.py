"""The processes draftstore owns freeze their start-up heap once (heap.py): the
service at start-up, the CLI when it opens its store. Each check runs in a new
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


def test_the_service_freezes_its_start_up_heap_once(tmp_path: Path) -> None:
    before, started, again = _run("""
        import gc
        from starlette.testclient import TestClient
        from draftstore.heap import freeze_startup_heap
        from draftstore.service.app import create_app
        print(gc.get_freeze_count())
        with TestClient(create_app()) as client:
            assert client.get("/healthz").status_code == 200
            print(gc.get_freeze_count())
            garbage = [object() for _ in range(1000)]
            freeze_startup_heap()  # once per process: nothing more is frozen
            print(gc.get_freeze_count())
    """, tmp_path)
    assert int(before) == 0 < int(started) == int(again)


def test_the_cli_freezes_the_heap_when_it_opens_its_store(tmp_path: Path) -> None:
    before, opened = _run("""
        import gc
        from draftstore.cli.root import open_store
        print(gc.get_freeze_count())
        store = open_store()
        print(gc.get_freeze_count())
        store.close()
    """, tmp_path)
    assert int(before) == 0 < int(opened)
