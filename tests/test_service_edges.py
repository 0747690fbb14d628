"""The service's edges, against a real ``draftstore serve`` process: a caller who is not
known, or who sends too much, is answered from the request's head, before the service
reads (or holds) what follows.

The requests are written on a raw socket, so a test can declare a body it never sends
in full: an answer that comes at all proves the service did not wait for the rest.
"""

from __future__ import annotations

import json
import re
import os
import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from draftstore.settings import Settings
from draftstore.store import Store
from service_fixtures import _wait_ready, free_port

HUNDRED_MIB = 100 * 1024 * 1024


@dataclass
class Served:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    admin: str

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """``draftstore serve`` on an embedded store that has an admin token."""
    urls = {"database_url": f"sqlite:///{tmp_path}/ds.db", "blob_url": f"file://{tmp_path}/blobs"}
    with Store.open(**urls, settings=Settings(), migrate=True) as store:
        admin = store.tokens.create("admin", name="tests")[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTSTORE_")}
    env.update({f"DRAFTSTORE_{k.upper()}": v for k, v in urls.items()})
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from draftstore.cli import main; main()", "serve",
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc)
        yield Served(f"http://127.0.0.1:{port}", port, proc, admin)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def exchange(port: int, head: str, body: bytes = b"", wait_s: float = 20) -> tuple[int, dict[str, str], bytes]:
    """Send ``head`` (request line and headers, without the blank line) and ``body`` (which may
    be only the start of what the head declares), then read one answer. A service that waits
    for the rest of the body answers nothing: the read times out and the test fails."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        data = memoryview(head.encode("latin-1") + b"\r\n\r\n" + body)
        for at in range(0, len(data), 65536):  # stop sending once the service has answered
            if select.select([s], [], [], 0)[0]:
                break
            try:
                s.sendall(data[at:at + 65536])
            except (BrokenPipeError, ConnectionResetError):  # it answered and closed: read the answer
                break
        raw = b""
        while b"\r\n\r\n" not in raw:
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
        head_part, _, rest = raw.partition(b"\r\n\r\n")
        lines = head_part.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        return int(lines[0].split()[1]), headers, rest


def test_a_hundred_mib_body_without_a_token_is_refused_before_it_is_read(served: Served) -> None:
    before = served.rss_kib()
    status, headers, body = exchange(served.port, "\r\n".join([
        "POST /v1/turns/turn_x/tool-calls HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
        f"Content-Length: {HUNDRED_MIB}"]), b'{"tool_name": "' + b"x" * 4096)
    assert status == 401 and json.loads(body)["code"] == "auth.required"
    assert headers["connection"] == "close"  # the rest of the body is never read
    assert served.rss_kib() - before < 20 * 1024


def test_a_body_with_an_unknown_token_is_refused_before_it_is_read(served: Served) -> None:
    status, _, body = exchange(served.port, "\r\n".join([
        "PUT /v1/turns/turn_x/files/big.bin HTTP/1.1", "Host: 127.0.0.1", "Authorization: Bearer dst_nobody",
        f"Content-Length: {HUNDRED_MIB}"]), b"x" * 4096)
    assert status == 401 and json.loads(body)["code"] == "auth.invalid"


def test_a_malformed_json_body_without_a_token_is_told_to_authenticate_not_that_it_is_malformed(
        served: Served) -> None:
    for path in ("/v1/projects", "/v1/turns/turn_x/tool-calls"):  # a FastAPI route and a fast-lane one
        text = "{not json"
        status, _, body = exchange(served.port, "\r\n".join([
            f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(text)}"]), text.encode())
        assert (status, json.loads(body)["code"]) == (401, "auth.required"), path


def test_a_chunked_body_to_an_unknown_route_is_answered_404_without_being_buffered(served: Served) -> None:
    chunk = b"x" * 4096
    start = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(4))  # the start of a body that never ends
    status, headers, body = exchange(served.port, "\r\n".join([
        "POST /v1/no/such/route HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {served.admin}",
        "Transfer-Encoding: chunked"]), start)
    assert status == 404 and json.loads(body)["code"] == "route.not_found"
    assert headers["connection"] == "close"


def test_a_huge_header_is_refused_431_and_the_connection_closed(served: Served) -> None:
    status, headers, body = exchange(served.port, "\r\n".join([
        "GET /v1/whoami HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {served.admin}",
        "X-Padding: " + "a" * (48 * 1024 * 1024)]), wait_s=60)
    assert status == 431 and json.loads(body)["code"] == "headers.too_large"
    assert headers["connection"] == "close"


def test_too_many_header_fields_are_refused_431(served: Served) -> None:
    many = [f"X-Field-{i}: {i}" for i in range(150)]
    status, _, body = exchange(served.port, "\r\n".join([
        "GET /v1/whoami HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {served.admin}", *many]))
    assert status == 431 and json.loads(body)["code"] == "headers.too_large"


def test_ordinary_requests_still_pass_the_gate(served: Served) -> None:
    body = json.dumps({"name": "edges"}).encode()
    status, _, answer = exchange(served.port, "\r\n".join([
        "POST /v1/projects HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {served.admin}",
        "Content-Type: application/json", f"Content-Length: {len(body)}"]), body)
    assert status == 201, answer


def test_a_new_tokens_secret_is_answered_with_no_store(served: Served) -> None:
    import httpx

    r = httpx.post(f"{served.url}/v1/tokens", json={"role": "agent", "name": "ci"},
                   headers={"authorization": f"Bearer {served.admin}"})
    assert r.status_code == 201 and r.json()["token"].startswith("dst_")
    assert r.headers["cache-control"] == "no-store"  # no proxy or browser cache keeps the secret


def test_the_api_docs_are_served_from_the_package_under_the_admin_pages_policy(served: Served) -> None:
    import httpx

    page = httpx.get(f"{served.url}/docs")
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    assert "cdn" not in page.text and "https://" not in page.text  # nothing from a third party's host
    assert "<script>" not in page.text  # no inline script: the policy would block it
    for src in re.findall(r'(?:src|href)="([^"]+)"', page.text):
        asset = httpx.get(f"{served.url}{src}")
        assert asset.status_code == 200 and asset.content, src
    assert httpx.get(f"{served.url}/docs/static/..%2Fpasswd").status_code == 404
    assert httpx.get(f"{served.url}/redoc").status_code == 404  # FastAPI's ReDoc page loads from a CDN: not served
