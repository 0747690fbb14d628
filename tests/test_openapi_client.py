"""The OpenAPI document is the contract: a client generated from it works, typed.

A backend team generates its client with ``openapi-python-client`` from the
``/openapi.json`` a running service serves. The story: the generator reads the
document without a warning, ``mypy --strict`` accepts a driver written against
the generated package (``tests/openapi_driver.py``: answers are ``Project``,
``Turn``, ``ToolCall``, ``Version``, ``Error``, not ``str``), and the driver
runs a project's lifecycle against the real service (uvicorn in a subprocess,
``service_fixtures.py``), each answer parsed by the generated models. The
document itself states what a client relies on: a model for every success,
the one ``Error`` schema for every error status, the bearer scheme, readable
operation ids and one name per schema.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from draftstore.service import errors
from draftstore.service.app import create_app
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


def test_the_document_states_every_answer_the_bearer_scheme_and_readable_names() -> None:
    doc = create_app().openapi()  # the document the app serves (no store is opened for this)
    schemas = doc["components"]["schemas"]
    sent = json.loads(errors.error_response(409, "turn.not_running", "m", {"turn_id": "t"}).body)
    assert set(schemas["Error"]["required"]) == set(schemas["Error"]["properties"]) == set(sent)
    (name, bearer), = doc["components"]["securitySchemes"].items()
    assert (name, bearer["type"], bearer["scheme"]) == ("bearer", "http", "bearer")
    assert all(name == schema["title"] for name, schema in schemas.items())  # generators name models by title
    assert "HTTPValidationError" not in schemas and not [n for n in schemas if n.startswith("Page")]

    ids = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            where = f"{method.upper()} {path}"
            ids.append(op["operationId"])
            open_route = path in ("/healthz", "/readyz")
            assert op.get("security") == (None if open_route else [{"bearer": []}]), where
            (status, success), = [(s, r) for s, r in op["responses"].items() if s.startswith("2")]
            content = success.get("content", {})
            if status == "204":
                assert not content, where
            elif "application/octet-stream" in content:
                assert content["application/octet-stream"]["schema"] == {"type": "string", "format": "binary"}
            else:
                assert content["application/json"]["schema"]["$ref"].startswith("#/components/schemas/"), where
            failures = {s: r for s, r in op["responses"].items() if s >= "400"}
            assert open_route or {"401", "403", "500", "503"} <= set(failures), where
            if "requestBody" in op:
                assert {"413", "422"} <= set(failures), where
            for s, r in failures.items():
                ref = r["content"]["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/" + ("Readiness" if path == "/readyz" else "Error"), (where, s)
    assert len(ids) == len(set(ids)) >= 48
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", i) for i in ids), ids
    assert {"turns_start", "tool_calls_start", "tool_calls_complete", "projects_create", "projects_publish",
            "projects_rollback", "drafts_revert", "versions_list"} <= set(ids)


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
