"""The OpenAPI document is the contract: a client generated from it works, typed.

A backend team generates its client with ``openapi-python-client`` from the
``/openapi.json`` a running service serves. The story: the generator reads the
document without a warning, ``mypy --strict`` accepts a driver written against
the generated package (``tests/openapi_driver.py``: answers are ``Project``,
``Turn``, ``ToolCall``, ``Version``, ``Error``, not ``str``), and the driver
runs a project's lifecycle against the real service (uvicorn in a subprocess,
``service_fixtures.py``), each answer parsed by the generated models.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from service_fixtures import Service

DRIVER = Path(__file__).with_name("openapi_driver.py")
PACKAGE = "draftstore_client"  # the generated package's name, what the driver imports


def generate(service: Service, into: Path) -> str:
    """Generate the client from the served document into ``into``/draftstore_client; the generator's output."""
    doc = httpx.get(f"{service.url}/openapi.json", timeout=30).json()
    (into / "openapi.json").write_text(json.dumps(doc))
    # no formatter hooks: the generated code is read by mypy and Python, not by a person
    (into / "generator.yaml").write_text("post_hooks: []\n")
    done = subprocess.run(
        [sys.executable, "-m", "openapi_python_client", "generate", "--path", str(into / "openapi.json"),
         "--output-path", str(into / PACKAGE), "--meta", "none", "--config", str(into / "generator.yaml")],
        capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def type_check(into: Path) -> str:
    """``mypy --strict`` on the driver, the generated package followed silently; mypy's report."""
    config = into / "mypy.ini"
    config.write_text(f"[mypy]\ncache_dir = {into / '.mypy_cache'}\n\n"
                      f"[mypy-{PACKAGE}.*]\nfollow_imports = silent\n")
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--config-file", str(config), str(DRIVER)],
                          capture_output=True, text=True, timeout=600, cwd=into, env={"MYPYPATH": str(into),
                                                                                      "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_a_client_generated_from_the_served_document_drives_a_project_typed(
        service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    output = generate(service, tmp_path)
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines == [f"Generating {tmp_path / PACKAGE}"], output  # no warning, no skipped part

    assert "Success: no issues found" in type_check(tmp_path)

    monkeypatch.syspath_prepend(str(tmp_path))
    driver: Any = importlib.import_module("openapi_driver")
    assert service.admin is not None
    driver.drive(service.url, service.admin)
