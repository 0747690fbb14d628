"""Set-up only: a lean S3 PUT client (SigV4 over ``http.client``) for building
big benchmark projects quickly. It is never on a measured path.

Why: on a 2-core machine boto3 spends about 2.5 ms of CPU per PUT, and the GIL
serialises that across ``S3BlobStore.put_many``'s threads, so 100,000 blobs
take minutes. This client signs with ``hmac``/``hashlib`` and keeps one
keep-alive connection per thread, so SeaweedFS, not Python, is the limit.
The objects land under exactly the keys ``S3BlobStore`` uses
(``objects/<2>/<62>``); the build then seeds the building store's cache, so
``create_project`` finds the blobs present and uploads only tree nodes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import http.client
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote, urlsplit

from draftstore.blobs import object_key
from draftstore.digest import Digest, digest_of


def _sign(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


class LeanS3Putter:
    """PUT objects to one bucket (path-style) with AWS Signature V4."""

    def __init__(self, endpoint_url: str, bucket: str, access_key: str, secret_key: str,
                 region: str = "us-east-1", workers: int = 8) -> None:
        parts = urlsplit(endpoint_url)
        self.https = parts.scheme == "https"
        self.host = parts.netloc
        self.bucket = bucket
        self.access_key = access_key
        self.region = region
        self.workers = workers
        self._secret = secret_key
        self._local = threading.local()
        self._keys: dict[str, bytes] = {}

    def _signing_key(self, day: str) -> bytes:
        key = self._keys.get(day)
        if key is None:
            k = _sign(("AWS4" + self._secret).encode(), day)
            for part in (self.region, "s3", "aws4_request"):
                k = _sign(k, part)
            self._keys[day] = key = k
        return key

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = self._local.conn = cls(self.host, timeout=30)
        return conn

    def put(self, key: str, data: bytes) -> None:
        now = dt.datetime.now(dt.timezone.utc)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        payload_hash = hashlib.sha256(data).hexdigest()
        path = f"/{self.bucket}/{quote(key, safe='/-_.~')}"
        headers = {"host": self.host, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
        signed = ";".join(sorted(headers))
        canonical = "\n".join([
            "PUT", path, "", *(f"{h}:{headers[h]}" for h in sorted(headers)), "", signed, payload_hash,
        ])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        signature = hmac.new(self._signing_key(day), to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, SignedHeaders={signed}, Signature={signature}"
        )
        headers["Content-Length"] = str(len(data))
        for attempt in range(3):
            conn = self._conn()
            try:
                conn.request("PUT", path, body=data, headers=headers)
                resp = conn.getresponse()
                body = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
                continue
            if resp.status == 200:
                return
            if resp.status < 500 or attempt == 2:
                raise RuntimeError(f"PUT {key}: HTTP {resp.status} {body[:300]!r}")

    def put_blobs(self, blobs: Sequence[bytes], on_done: Callable[[int], None] | None = None) -> list[Digest]:
        """Upload content-addressed blobs under the store's keys; returns their digests."""
        digests = [digest_of(b) for b in blobs]
        unique = dict(zip(digests, blobs))
        done = 0
        lock = threading.Lock()

        def one(item: tuple[Digest, bytes]) -> None:
            nonlocal done
            self.put(object_key(item[0]), item[1])
            with lock:
                done += 1
                if on_done is not None and done % 2000 == 0:
                    on_done(done)

        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            list(pool.map(one, unique.items()))
        return digests
