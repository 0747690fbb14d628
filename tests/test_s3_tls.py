"""Lean S3 GETs over https verify the server as botocore would: against the CA
bundle botocore is configured with (``ca_bundle`` in the AWS config file, or
``AWS_CA_BUNDLE``), never against nothing.

A local https server with a self-signed certificate answers every GET; a store
whose configuration names that certificate reads through it, one without is
refused, typed."""

from __future__ import annotations

import http.server
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from draftstore.blobs import ObjectCache
from draftstore.blobs.s3 import S3BlobStore
from draftstore.errors import DraftstoreError


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = b"served over tls"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(endpoint URL, certificate file) of an https server on loopback."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", cert
    finally:
        server.shutdown()
        server.server_close()


def _store(endpoint: str) -> S3BlobStore:
    return S3BlobStore("bucket", endpoint_url=endpoint, region="us-east-1", aws_access_key_id="k",
                       aws_secret_access_key="s", cache=ObjectCache(0), check=False, max_attempts=1)


def test_lean_reads_verify_against_the_ca_bundle_botocore_is_configured_with(
        tls_server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint, cert = tls_server
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    untrusted = _store(endpoint)
    try:
        assert untrusted._reader is not None  # noqa: SLF001 - the lean path is the one under test
        with pytest.raises(DraftstoreError):
            untrusted._get_raw("objects/any")  # noqa: SLF001 - a self-signed server is not trusted
    finally:
        untrusted.close()

    config = tmp_path / "config"
    config.write_text(f"[default]\nca_bundle = {cert}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    trusted = _store(endpoint)
    try:
        assert trusted._reader is not None and trusted._reader.ca_bundle == str(cert)  # noqa: SLF001
        assert trusted._get_raw("objects/any") == b"served over tls"  # noqa: SLF001
    finally:
        trusted.close()

    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CA_BUNDLE", str(cert))
    by_env = _store(endpoint)
    try:
        assert by_env._get_raw("objects/any") == b"served over tls"  # noqa: SLF001
    finally:
        by_env.close()
