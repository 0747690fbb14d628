"""The README's Python API block runs as written, top to bottom, on the embedded default.

The block is taken from README.md and run by a fresh interpreter in an empty
directory with no ``DRAFTSTORE_*`` variables set (so ``Store.from_env()`` opens
``./.draftstore``); then the state it leaves is checked through a store of the test's own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from draftstore import Store

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_block() -> str:
    text = README.read_text()
    m = re.search(r"^## Python API\n.*?^```python\n(.*?)^```\n", text, re.S | re.M)
    assert m, "the README's Python API block is gone"
    return m.group(1)


def test_the_readme_python_block_runs_top_to_bottom(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTSTORE_")}
    out = subprocess.run([sys.executable, "-c", _python_block()], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "sandbox" / "dragon.py").read_bytes() == b"DRAGON = 1"
    assert not (tmp_path / "sandbox" / "old.py").exists()
    root = tmp_path / ".draftstore"
    with Store.open(database_url=f"sqlite:///{root / 'draftstore.db'}", blob_url=f"file://{root / 'blobs'}") as store:
        by_name = {p.name: p for p in store.list_projects()}
        assert set(by_name) == {"game", "game-copy"}
        game = by_name["game"]
        versions = store.list_versions(game.id)
        assert [v.number for v in versions] == [1, 2] and game.current_version_id == versions[0].id  # rolled back
        assert game.active_draft_id is None  # discarded
        assert sorted(store.view_at(game.id, versions[1].id).list_files()) == ["a.py", "dragon.py", "main.py",
                                                                                "src/util.py"]
        assert [(m.reason, m.actor) for m in store.head_moves(game.id)] == [
            ("create", "alice"), ("publish", "admin"), ("rollback", "admin"), ("revert", "admin")]
