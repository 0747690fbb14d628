"""The command line on the embedded default: the demo, diffs, errors with their codes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"DRAFTSTORE_HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": "200",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "draftstore.cli", *args], capture_output=True, text=True,
                          env=env, cwd=home, timeout=120)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "store"


def test_the_demo_walks_the_whole_lifecycle_and_the_log_shows_it(home: Path) -> None:
    home.mkdir()
    run = _cli(home, "demo")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for step in ("started turn 1", "recorded 2 tool calls", "interrupted turn 1", "turn.not_running",
                 "continued with turn 2", "published version 2", "rolled head back to version 1"):
        assert step in out
    project_id = re.search(r"done: project ([0-9a-f]{32})", out).group(1)
    log = _cli(home, "log", project_id)
    assert log.returncode == 0, log.stderr
    assert "rollback" in log.stdout and "publish" in log.stdout and "interrupted" in log.stdout


def test_diff_between_versions_and_a_bad_reference_exits_2_with_its_code(home: Path) -> None:
    home.mkdir()
    out = _cli(home, "demo").stdout
    project_id = re.search(r"done: project ([0-9a-f]{32})", out).group(1)
    from draftstore import Settings, Store

    with Store.open(settings=Settings(home=home)) as store:
        v1, v2 = (v.id for v in store.list_versions(project_id))
    diff = _cli(home, "diff", v1, v2)
    assert diff.returncode == 0, diff.stderr
    assert "added     game/dragon.py" in diff.stdout and "+print('Hello, Smaug!')" in diff.stdout
    bad = _cli(home, "diff", "0" * 32, v2)
    assert bad.returncode == 2
    assert "[version.not_found]" in bad.stderr


def test_import_snapshot_and_materialize_round_trip_files_and_executable_bits(home: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (src / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(src / "run.sh", 0o755)
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    home.mkdir()
    imported = _cli(home, "import", str(src), "--name", "tools")
    assert imported.returncode == 0, imported.stderr
    project_id = re.search(r"project ([0-9a-f]{32})", imported.stdout).group(1)
    snap = _cli(home, "snapshot", project_id)
    assert snap.returncode == 0, snap.stderr
    assert re.search(r"snapshot [0-9a-f]{32} ready: 2 files", snap.stdout), snap.stdout
    out = tmp_path / "out"
    done = _cli(home, "materialize", project_id, str(out))
    assert done.returncode == 0, done.stderr
    assert "from snapshot" in done.stdout
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == ["pkg/mod.py", "run.sh"]
    assert (out / "run.sh").stat().st_mode & 0o777 == 0o755 and (out / "pkg/mod.py").stat().st_mode & 0o777 == 0o644
    again = _cli(home, "materialize", project_id, str(out))
    assert again.returncode == 2 and "[path.conflict]" in again.stderr
    replaced = _cli(home, "materialize", project_id, str(out), "--replace")
    assert replaced.returncode == 0, replaced.stderr


def test_serve_without_a_token_refuses_any_address_but_loopback(home: Path) -> None:
    home.mkdir()
    for host in ("0.0.0.0", "10.0.0.1", "::"):
        run = _cli(home, "serve", "--host", host, "--port", "9")
        assert run.returncode == 2, (host, run.stdout, run.stderr)
        assert "auth.required" in run.stderr and f"refusing to serve {host} open" in run.stderr
        assert "serving on" not in run.stderr
