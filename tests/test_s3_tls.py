"""S3 requests over https verify the server as botocore would: against the CA
bundle botocore is configured with (``ca_bundle`` in the AWS config file, or
``AWS_CA_BUNDLE``) on top of the system's, never against nothing.

A local https server with a self-signed certificate answers every GET with one
object; a store whose configuration names that certificate reads it, one
without is refused, typed (``backend.unavailable``)."""

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
from draftstore.digest import digest_of
from draftstore.errors import BackendUnavailable, DraftstoreError

BODY = b"served over tls"


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.send_header("Last-Modified", self.date_time_string())
        self.send_header("ETag", '"1"')
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args: Any) -> None:
        pass


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(endpoint URL, CA certificate file) of an https server on loopback whose
    certificate that private CA signed (as a self-hosted store's would be)."""
    ca, ca_key = tmp_path / "ca.pem", tmp_path / "ca-key.pem"
    cert, key, csr = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "cert.csr"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "1",
             "-subj", "/CN=draftstore test CA")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-out", str(cert), "-days", "1", "-extfile", str(ext))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", ca
    finally:
        server.shutdown()
        server.server_close()


def _store(endpoint: str) -> S3BlobStore:
    return S3BlobStore("bucket", endpoint_url=endpoint, region="us-east-1", aws_access_key_id="k",
                       aws_secret_access_key="s", cache=ObjectCache(0), check=False, max_attempts=1)


def test_https_reads_verify_against_the_ca_bundle_botocore_is_configured_with(
        tls_server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint, cert = tls_server
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    untrusted = _store(endpoint)
    try:
        with pytest.raises(BackendUnavailable):  # a self-signed server is not trusted
            untrusted.get(digest_of(BODY))
    finally:
        untrusted.close()

    config = tmp_path / "config"
    config.write_text(f"[default]\nca_bundle = {cert}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    trusted = _store(endpoint)
    try:
        assert trusted.get(digest_of(BODY)) == BODY
    finally:
        trusted.close()

    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CA_BUNDLE", str(cert))
    by_env = _store(endpoint)
    try:
        assert by_env.get(digest_of(BODY)) == BODY
    finally:
        by_env.close()


def test_an_unreadable_ca_bundle_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "missing.pem"))
    with pytest.raises(DraftstoreError) as info:
        _store("https://127.0.0.1:1")
    assert info.value.code == "config.invalid"
