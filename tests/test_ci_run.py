"""The test command the README gives is the one CI runs (``.ci/run``), word for word."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_runs_the_tests_as_ci_does() -> None:
    ci = re.findall(r"^(\.venv/bin/python -m pytest[^<|\n]*?)\s*(?:<|\|\||$)",
                    (ROOT / ".ci" / "run").read_text(encoding="utf-8"), re.M)
    readme = re.findall(r"^(\.venv/bin/python -m pytest.*)$", (ROOT / "README.md").read_text(encoding="utf-8"), re.M)
    assert len(ci) == 1 and len(readme) == 1, (ci, readme)
    assert readme[0].strip() == ci[0].strip()
    assert " -n " in ci[0]  # the suite runs on xdist workers: tests/alone.py keeps the few that must not share
