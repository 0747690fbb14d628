"""The HTTP guide's curl walk-through of the service runs as written.

The block (from ``S=http://127.0.0.1:8765`` to the search) is taken from
docs/http.md and run by bash against a real service, with a token and in open
mode; only the address changes, the stream is cut after a moment and ``jq``
(not on every machine) is stood in for by Python; the block makes its own files. Every step must answer
2xx, and the end state must be what the walk-through says.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from service_fixtures import Service

HTTP_GUIDE = Path(__file__).resolve().parent.parent / "docs" / "http.md"


def _walkthrough() -> str:
    text = HTTP_GUIDE.read_text()
    m = re.search(r"^S=http://127\.0\.0\.1:8765;.*?view/search\?q=DRAGON\"\n", text, re.S | re.M)
    assert m, "the curl walk-through in docs/http.md is gone"
    return m.group(0)


def _run(block: str, url: str, admin: str | None, cwd: Path) -> list[str]:
    script = block.replace("http://127.0.0.1:8765", url)
    script = script.replace("| jq -r .id", f"| {shlex.quote(sys.executable)} -c "
                            "'import json,sys; print(json.load(sys.stdin)[\"id\"])'")
    script = script.replace("curl -s -N ", "curl -s -N --max-time 2 ")
    if admin is None:
        script = re.sub(r"^AUTH=\(.*$", "AUTH=()", script, flags=re.M)
    # every curl whose answer is printed reports its status on a line of its own
    script = re.sub(r"^curl -s ", "curl -s -w '\\nHTTP %{http_code}\\n' ", script, flags=re.M)
    out = subprocess.run(["bash", "-c", "set -u\n" + script], cwd=cwd, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "ADMIN": admin or ""}, timeout=120)
    return out.stdout.splitlines()


def _check(lines: list[str]) -> None:
    statuses = [line.split()[1] for line in lines if line.startswith("HTTP ")]
    assert len(statuses) == 7, lines  # the two $(...) steps print only the id
    assert all(s in ("200", "201", "204") for s in statuses), lines
    assert any(line.startswith("event: tool.completed") for line in lines), lines
    bodies = [json.loads(line) for line in lines if line.startswith("{")]
    versions = [b for b in bodies if b.get("summary") == "dragon"]
    assert len(versions) == 1 and versions[0]["number"] == 2 and versions[0]["file_count"] == 2, lines
    search = bodies[-1]
    assert [(m["path"], m["line"]) for m in search["matches"]] == [("dragon.py", 'DRAGON = "red"')]


def test_the_readme_curl_walkthrough_runs_with_a_token(service: Service, tmp_path: Path) -> None:
    _check(_run(_walkthrough(), service.url, service.admin, tmp_path))


def test_the_readme_curl_walkthrough_runs_in_open_mode(service_factory: Callable[..., Service],
                                                       tmp_path: Path) -> None:
    service = service_factory(with_admin=False)
    _check(_run(_walkthrough(), service.url, None, tmp_path))
