"""``blobs.sigv4`` signs exactly as botocore's ``S3SigV4Auth`` does (no service needed):
the same headers, byte for byte, for every request shape the lean client sends."""

from __future__ import annotations

import calendar
import hashlib
import time

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from draftstore.blobs.sigv4 import SigV4

NOW = calendar.timegm((2026, 12, 3, 23, 59, 58))


def _botocore(creds: Credentials, region: str, method: str, url: str, byte_range: str | None,
              data: bytes | None, now: float) -> dict[str, str]:
    """botocore's add_auth, step by step, at a fixed time (add_auth itself reads the clock)."""
    auth = S3SigV4Auth(creds, "s3", region)
    req = AWSRequest(method=method, url=url, data=data, headers={"Range": byte_range} if byte_range else {})
    req.context["timestamp"] = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    auth._modify_request_before_signing(req)  # noqa: SLF001 - the steps of add_auth
    canonical = auth.canonical_request(req)
    signature = auth.signature(auth.string_to_sign(req, canonical), req)
    auth._inject_signature_to_request(req, signature)  # noqa: SLF001
    return {k: v for k, v in req.headers.items() if k.lower() != "host"}


@pytest.mark.parametrize("method,byte_range,data", [
    ("GET", None, None),
    ("GET", "bytes=208011-225674", None),
    ("PUT", None, b"a source file\n"),
    ("PUT", None, b""),
])
@pytest.mark.parametrize("token", [None, "a-session-token/with+odd=chars"])
@pytest.mark.parametrize("endpoint,host", [("http://127.0.0.1:8333", "127.0.0.1:8333"),
                                           ("https://s3.example.com", "s3.example.com")])
def test_headers_match_botocore_s_signer(method: str, byte_range: str | None, data: bytes | None, token: str | None,
                                         endpoint: str, host: str) -> None:
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    path = "/bucket/objects/ab/cd%20ef/0123456789abcdef"
    ours = SigV4("eu-west-3", host).sign(
        method, path, access_key=creds.access_key, secret_key=creds.secret_key, token=creds.token,
        byte_range=byte_range, payload_sha256=hashlib.sha256(data or b"").hexdigest(), now=NOW)
    theirs = _botocore(creds, "eu-west-3", method, endpoint + path, byte_range, data, NOW)
    assert ours == theirs


def test_the_signing_key_follows_the_date_and_the_secret() -> None:
    signer = SigV4("us-east-1", "127.0.0.1:8333")

    def auth(secret: str, now: float) -> str:
        return signer.sign("GET", "/b/k", access_key="AK", secret_key=secret, now=now)["Authorization"]

    first = auth("secret-1", NOW)
    assert auth("secret-1", NOW + 3) != first  # a new timestamp, a new signature
    next_day = auth("secret-1", NOW + 5)  # past midnight: another day's key and scope
    assert "/20261204/us-east-1/s3/aws4_request" in next_day
    rotated = auth("secret-2", NOW)
    assert rotated != first
    assert auth("secret-1", NOW) == first  # a key evicted and derived again gives the same signature
    creds = Credentials("AK", "secret-2")
    assert rotated == _botocore(creds, "us-east-1", "GET", "http://127.0.0.1:8333/b/k", None, None,
                                NOW)["Authorization"]
