"""Lean S3 requests: GETs and PUTs signed by ``sigv4``, sent by ``http1``.

Small requests dominate: a cold process's reads (index directories, pack
frames, blobs) and every write's PUTs (a source file, the tree nodes on its
path). botocore spends about 1 ms of CPU on each request outside the network
(event hooks, the request and response pipelines, checksums, its retry
handler); on a 2-core machine that is half of a 27 KB GET or a 1 KiB PUT to a
loopback store, and because it holds the GIL, parallel requests queue behind
one another. Measured here: 4 parallel GETs took 6.8 ms through botocore,
2.8 ms through this client; 3 parallel 600-byte PUTs (a write's tree nodes)
3.7-4.1 ms through botocore, 2.0-2.2 ms through this client.

Signing and sending cost little more again when neither goes through the
general-purpose libraries: botocore's signer (0.2-0.4 ms per request) and
``http.client``'s response parsing (0.3-0.4 ms) made a 27 KB GET cost 0.9-1.2
ms of CPU here; ``sigv4`` and ``http1`` make it about 0.2 ms.

``LeanClient`` keeps the parts that matter and drops the rest:

- each request is signed with SigV4 (``sigv4.SigV4``: the headers botocore's
  ``S3SigV4Auth`` sets, byte for byte), with credentials from the store's
  boto3 session (refreshed as botocore refreshes them); a PUT's signature
  covers the SHA-256 of its body (``x-amz-content-sha256``), as botocore's
  does;
- it goes out on the calling thread's keep-alive connection (one per thread,
  opened on first use, closed by ``close``);
- outcomes are the botocore path's: a GET's body; ``None`` for a missing key;
  ``b""`` for a range past the end; a stored PUT returns. A rejected identity,
  a missing bucket, or a transient failure still failing after
  ``max_attempts`` tries (connection errors, timeouts, 5xx, ``SlowDown``;
  jittered exponential backoff) raise ``BackendUnavailable``; any other
  answer raises ``BackendError``. Retrying a PUT is safe: a key is the digest
  of its bytes, so every try writes the same object.

Only path-style URLs go this way (the store falls back to botocore for
virtual-hosted buckets, for PUTs over ``MAX_LEAN_PUT`` bytes, and for every
other operation).
"""

from __future__ import annotations

import hashlib
import random
import re
import ssl
import threading
import time
from typing import Any
from urllib.parse import quote, urlsplit

from ..errors import BackendError, BackendUnavailable
from .http1 import ConnectionClosed, HTTPConnection
from .sigv4 import EMPTY_SHA256, SigV4

__all__ = ["LeanClient", "MAX_LEAN_PUT"]

_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")
# the S3 error codes the store maps (``s3.py`` maps botocore's errors with the same sets)
AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
              "AuthorizationHeaderMalformed"}
TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeoutException",
                   "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
                   "RequestThrottledException", "RequestLimitExceeded", "TooManyRequestsException",
                   "PriorRequestNotComplete", "BandwidthLimitExceeded", "EC2ThrottledException"}
_NO_BUCKET = "NoSuchBucket"
_RETRY_STATUS = {429, 500, 502, 503, 504}  # retried, as botocore's standard mode does
# a bigger body goes through botocore: per-request CPU is noise beside its bytes, and
# botocore streams it and retries it on its own
MAX_LEAN_PUT = 16 * 1024 * 1024
# what a reused keep-alive connection raises when the server closed it meanwhile
_STALE = (ConnectionClosed, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class _Transient(Exception):
    """One failed try worth another (the reason is kept for the final error)."""


class LeanClient:
    """GETs and PUTs of objects in one bucket, path-style (module docstring)."""

    def __init__(self, endpoint_url: str, bucket: str, credentials: Any, region: str, *,
                 connect_timeout_s: float, read_timeout_s: float, max_attempts: int,
                 ca_bundle: str | None = None) -> None:
        parts = urlsplit(endpoint_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) endpoint: {endpoint_url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._origin = f"{parts.scheme}://{parts.netloc}"
        default = 443 if self._https else 80
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # an IPv6 literal
        self._host_header = host + (f":{parts.port}" if parts.port and parts.port != default else "")
        self._base = parts.path.rstrip("/") + f"/{quote(bucket, safe='')}/"
        self.bucket = bucket
        self._credentials = credentials
        self._region = region
        self._signer = SigV4(region, self._host_header)
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s
        self._attempts = max(1, max_attempts)
        # https: verified against ``ca_bundle`` (the store passes the one botocore uses), else the system's CAs
        self.ca_bundle = ca_bundle or None
        self._ssl = ssl.create_default_context(cafile=self.ca_bundle) if self._https else None
        self._local = threading.local()
        # every open connection, by the thread it belongs to: one of a thread that has ended is
        # closed when the next connection opens (pool threads come and go)
        self._conns: dict[threading.Thread, HTTPConnection] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- the requests ------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The object at ``key``, or None if there is none."""
        status, body = self._request(key, None, "get")
        return None if status == 404 else body

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` (at most ``MAX_LEAN_PUT`` bytes); returns once stored."""
        if len(data) > MAX_LEAN_PUT:
            raise ValueError(f"a lean PUT carries at most {MAX_LEAN_PUT} bytes, not {len(data)}")
        self._request(key, None, "put", bytes(data))

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        """``length`` bytes from ``start`` (cut short at the end; ``b""`` past it), or None."""
        status, body = self._request(key, f"bytes={start}-{start + length - 1}", "get range")
        if status == 404:
            return None
        if status == 416:
            return b""
        if status == 200:  # a server that ignores Range sends the whole object
            return body[start:start + length]
        return body

    def warm(self) -> None:
        """Open the calling thread's connection now (a pool thread's, at start-up)."""
        try:
            self._conn()
        except OSError:
            pass  # the first real read retries, and says so, typed

    # -- one request, retried -------------------------------------------------------------
    def _request(self, key: str, byte_range: str | None, op: str, data: bytes | None = None) -> tuple[int, bytes]:
        """One GET (``data`` None) or PUT, tried up to ``max_attempts`` times."""
        path = self._base + quote(key, safe="/-_.~")
        last: Exception | None = None
        for attempt in range(self._attempts):
            if attempt:
                time.sleep(random.uniform(0, min(1.0, 0.05 * 2 ** attempt)))
            try:
                status, body = self._send(path, byte_range, data)
            except _Transient as exc:
                last = exc.__cause__ or exc
                continue
            if status in ((200,) if data is not None else (200, 206, 416)):
                return status, body
            code = _error_code(body)
            details = {"bucket": self.bucket, "operation": op, "s3_code": code or str(status)}
            if status == 404 and code != _NO_BUCKET and data is None:
                return status, b""
            if status in _RETRY_STATUS or code in TRANSIENT_CODES:
                last = BackendUnavailable(f"S3 answered {status} {code}".strip(), **details)
                continue
            if code == _NO_BUCKET:
                raise BackendUnavailable(f"S3 bucket {self.bucket!r} does not exist ({op})", **details)
            if code in AUTH_CODES or (status == 403 and not code):
                raise BackendUnavailable(f"S3 rejected the credentials for bucket {self.bucket!r} "
                                         f"({op}: {code or status})", **details)
            if status >= 500:
                raise BackendUnavailable(f"S3 unavailable during {op} on s3://{self.bucket}/{key}: "
                                         f"{code or status}", **details)
            raise BackendError(f"S3 error during {op} on s3://{self.bucket}/{key}: {code or status}", **details)
        raise BackendUnavailable(
            f"S3 endpoint {self._origin} unavailable during {op} of s3://{self.bucket}/{key} "
            f"after {self._attempts} attempt(s): {last}", bucket=self.bucket, operation=op,
        ) from last

    def _send(self, path: str, byte_range: str | None, data: bytes | None = None) -> tuple[int, bytes]:
        method = "GET" if data is None else "PUT"
        headers = self._signed(method, path, byte_range, data)
        conn: HTTPConnection | None = None
        try:
            conn, fresh = self._conn_for_request()
            try:
                resp = conn.request(method, path, headers, data)
            except _STALE:
                if fresh:
                    raise
                # the server closed an idle keep-alive connection: once more on a new one (not a retry)
                self._drop(conn)
                conn, _ = self._conn_for_request()
                resp = conn.request(method, path, headers, data)
            if not resp.keep_alive:
                self._drop(conn)
            return resp.status, resp.body
        except OSError as exc:  # refused, reset, timed out, cut short, malformed
            if conn is not None:
                self._drop(conn)
            raise _Transient() from exc

    def _signed(self, method: str, path: str, byte_range: str | None, data: bytes | None) -> dict[str, str]:
        creds = self._credentials.get_frozen_credentials()
        # a PUT's body is hashed into the signature (x-amz-content-sha256)
        payload = hashlib.sha256(data).hexdigest() if data else EMPTY_SHA256
        headers = {"Host": self._host_header}
        headers.update(self._signer.sign(method, path, access_key=creds.access_key, secret_key=creds.secret_key,
                                         token=creds.token, byte_range=byte_range, payload_sha256=payload))
        return headers

    # -- connections ------------------------------------------------------------------------
    def _conn_for_request(self) -> tuple[HTTPConnection, bool]:
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None:
            return conn, False
        return self._conn(), True

    def _conn(self) -> HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None:
            return conn
        conn = HTTPConnection(self._host, self._port, connect_timeout=self._connect_timeout,
                              read_timeout=self._read_timeout, ssl_context=self._ssl)
        me = threading.current_thread()
        with self._lock:
            if self._closed:
                raise BackendError("the S3 blob store is closed", bucket=self.bucket)
            ended = [t for t in self._conns if not t.is_alive()]
            stale = [self._conns.pop(t) for t in ended]
            old = self._conns.pop(me, None)
            self._conns[me] = conn
        for c in stale + ([old] if old is not None else []):
            c.close()
        conn.connect()  # on a failure the caller drops it
        self._local.conn = conn
        return conn

    def _drop(self, conn: HTTPConnection) -> None:
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            me = threading.current_thread()
            if self._conns.get(me) is conn:
                del self._conns[me]

    def open_connections(self) -> int:
        """Connections open now (one per thread that has sent a request, at most)."""
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        """Close every thread's connection. Idempotent; later requests raise ``backend.error``."""
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()


def _error_code(body: bytes) -> str:
    m = _CODE.search(body[:4096])
    return m.group(1).decode("ascii", "replace") if m else ""
