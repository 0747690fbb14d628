"""Blob store backend: any S3-compatible object store, via boto3.

URL form::

    s3://bucket[/prefix]?endpoint_url=http://127.0.0.1:8333&region=us-east-1[&create=1][&workers=16]

Credentials come from boto3's default chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance roles, ...); they never
appear in the URL. Works with AWS S3, SeaweedFS, MinIO and R2.

Error mapping at this boundary (botocore never leaks out):

- a missing object is ``None`` from ``_get_raw`` (``blob.not_found`` from ``get``);
- an unreachable endpoint, a timeout, missing or rejected credentials, a missing
  bucket, throttling or a 5xx answer: ``BackendUnavailable`` [backend.unavailable],
  chained with ``from``;
- any other S3 or botocore error: ``BackendError`` [backend.error], chained.
"""

from __future__ import annotations

import threading
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar
from urllib.parse import parse_qs, urlencode, urlsplit

import boto3
import botocore.session
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError as BotoConnectionError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from ..digest import Digest, digest_of
from ..errors import BackendError, BackendUnavailable, ConfigInvalid
from ..pools import settle, start_workers
from .base import BlobStoreBase, object_key
from .cache import ObjectCache
from .s3lean import AUTH_CODES, MAX_LEAN_PUT, TRANSIENT_CODES, LeanClient

K = TypeVar("K")
R = TypeVar("R")

__all__ = ["S3BlobStore"]

DEFAULT_WORKERS = 16

# S3 error codes that mean "no such object" (GET says NoSuchKey, HEAD only has a status).
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_NO_BUCKET_CODES = {"NoSuchBucket"}
# Rejected identity: the store is there but we cannot use it.
_AUTH_CODES = {"403"} | AUTH_CODES
_TRANSIENT_CODES = {"503", "500"} | TRANSIENT_CODES

_TRUE = {"1", "true", "yes", "on"}


def _error_code(exc: ClientError) -> str:
    err = exc.response.get("Error", {}) if isinstance(exc.response, dict) else {}
    return str(err.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def _no_expect_continue(request: Any, **_: Any) -> None:
    """Drop ``Expect: 100-continue`` from small PUTs.

    botocore asks the server for a go-ahead before sending any PutObject body:
    one more round trip per object. Our objects are small (tree nodes, source
    files) and content-addressed, so a rejected body costs nothing to resend;
    measured here, the round trip is 10-15% of a 1 KiB PUT.
    """
    if "Expect" not in request.headers:
        return
    try:
        size = int(request.headers.get("Content-Length", ""))
    except ValueError:
        return
    if size <= _EXPECT_CONTINUE_ABOVE:
        del request.headers["Expect"]


_EXPECT_CONTINUE_ABOVE = 8 * 1024 * 1024


def _proxied(endpoint_url: str) -> bool:
    """True if the environment sends requests to ``endpoint_url`` through a proxy
    (``HTTP(S)_PROXY`` without a ``NO_PROXY`` match): botocore honours that, the
    lean reader does not, so such a store reads through botocore."""
    parts = urlsplit(endpoint_url)
    return bool(urllib.request.getproxies().get(parts.scheme)) and not urllib.request.proxy_bypass(parts.netloc)


class S3BlobStore(BlobStoreBase):
    """Content-addressed objects in one S3 bucket, under an optional key prefix.

    Guarantees (beyond ``BlobStore``'s): one request per ``put`` (no HEAD
    first: an object's key is its digest, so a repeated PUT writes the same
    bytes and is harmless); ``put_many`` uploads in parallel on a bounded
    thread pool and returns only after every upload finished, raising the
    first failure; the bucket is checked when the store is opened, so a
    wrong endpoint, bad credentials or a missing bucket fail at once with
    ``backend.unavailable`` (``create=True`` creates a missing bucket instead).
    Thread-safe: one botocore client is shared, as botocore allows.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        create: bool = False,
        workers: int = DEFAULT_WORKERS,
        cache: ObjectCache | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        connect_timeout_s: float = 3.0,
        read_timeout_s: float = 10.0,
        max_attempts: int = 3,
        addressing_style: str | None = None,
        lean_reads: bool = True,
        lean_writes: bool = True,
        check: bool = True,
    ) -> None:
        super().__init__(cache)
        if not bucket:
            raise ConfigInvalid("an S3 blob store URL needs a bucket: s3://bucket[/prefix]")
        prefix = prefix.strip("/")
        if any(seg in ("", ".", "..") for seg in prefix.split("/")) and prefix:
            raise ConfigInvalid(f"bad S3 key prefix {prefix!r}", prefix=prefix)
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self.endpoint_url = endpoint_url
        self.region = region
        self.workers = max(1, int(workers))
        query: dict[str, str] = {}
        if endpoint_url:
            query["endpoint_url"] = endpoint_url
        if region:
            query["region"] = region
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        if query:
            self.url += "?" + urlencode(query)

        style = addressing_style or ("path" if endpoint_url else "auto")
        config = Config(
            # Small objects dominate (tree nodes, file blobs): fail fast on a dead
            # endpoint, retry transient errors a few times with jittered backoff,
            # and keep one pooled connection per upload worker so put_many never
            # queues for a socket.
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            # total_max_attempts counts the first try; botocore's max_attempts counts retries only
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            max_pool_connections=self.workers + 4,
            tcp_keepalive=True,
            # A custom endpoint (SeaweedFS, MinIO, a loopback address) rarely has
            # per-bucket DNS names; path-style addressing works everywhere there.
            s3={"addressing_style": style},
        )
        # A private Session: boto3's default session is not safe to share across threads.
        # (built on a botocore session of our own, whose configuration is public API)
        core = botocore.session.Session()
        session = boto3.session.Session(
            botocore_session=core,
            aws_access_key_id=aws_access_key_id,
            aws_secret_access_key=aws_secret_access_key,
            aws_session_token=aws_session_token,
            region_name=region,
        )
        try:
            self._client = session.client("s3", endpoint_url=endpoint_url, config=config)
        except (BotoCoreError, ValueError) as exc:
            raise ConfigInvalid(f"cannot configure S3 client for {self.url}: {exc}", url=self.url) from exc
        self._client.meta.events.register_first("before-send.s3.PutObject", _no_expect_continue)
        # GETs and small PUTs skip botocore's request pipeline (s3lean); path-style endpoints only
        self._lean: LeanClient | None = None
        lean = (lean_reads or lean_writes) and endpoint_url and style == "path" and not _proxied(endpoint_url)
        credentials = session.get_credentials() if lean else None
        if credentials is not None:
            # the CA bundle botocore verifies with (AWS_CA_BUNDLE, or ca_bundle in the AWS config file)
            ca_bundle = core.get_config_variable("ca_bundle")
            self._lean = LeanClient(endpoint_url or "", bucket, credentials,
                                    self._client.meta.region_name or "us-east-1",
                                    connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s,
                                    max_attempts=max_attempts, ca_bundle=ca_bundle)
        self._reader = self._lean if lean_reads else None
        self._writer = self._lean if lean_writes else None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        # requests sent, by kind (get, get_range, head, put): for operators and benchmarks
        self.calls: Counter[str] = Counter()
        self._calls_lock = threading.Lock()
        if check:
            self._check_bucket(create)
            self._warm_up()

    # -- construction --------------------------------------------------------------
    @classmethod
    def from_url(cls, url: str, cache: ObjectCache | None = None, **kwargs: Any) -> "S3BlobStore":
        """Open ``s3://bucket[/prefix]?endpoint_url=..&region=..&create=1&workers=N``.

        Also ``connect_timeout`` and ``read_timeout`` (seconds, default 3 and
        10) and ``max_attempts`` (attempts per request, retries included,
        default 3): how long an operation waits on a dead or hung endpoint
        before it fails with ``backend.unavailable``. ``lean_reads=0`` sends GETs
        and ``lean_writes=0`` sends PUTs through botocore too (by default a
        path-style store signs them with botocore and sends them itself:
        ``s3lean``).

        Raises ``config.invalid`` on a malformed URL and ``backend.unavailable``
        if the bucket cannot be reached.
        """
        parts = urlsplit(url)
        if parts.scheme != "s3":
            raise ConfigInvalid(f"not an s3:// URL: {url!r}", url=url)
        if parts.username or parts.password:
            raise ConfigInvalid("credentials do not belong in the blob URL; use the AWS_* environment variables")
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        known = {"endpoint_url", "region", "create", "workers", "addressing_style", "lean_reads", "lean_writes",
                 "connect_timeout", "read_timeout", "max_attempts"}
        unknown = set(query) - known
        if unknown:
            raise ConfigInvalid(f"unknown S3 URL parameter(s): {', '.join(sorted(unknown))}", url=url)
        try:
            workers = int(query.get("workers", DEFAULT_WORKERS))
        except ValueError as exc:
            raise ConfigInvalid("workers must be an integer", url=url) from exc
        for name, kind, low, high in (("connect_timeout", float, 0.1, 300), ("read_timeout", float, 0.1, 3600),
                                      ("max_attempts", int, 1, 20)):
            if name not in query:
                continue
            try:
                value = kind(query[name])
            except ValueError as exc:
                raise ConfigInvalid(f"{name} must be a number from {low:g} to {high:g}", url=url) from exc
            if not low <= value <= high:
                raise ConfigInvalid(f"{name} must be a number from {low:g} to {high:g}", url=url)
            kwargs.setdefault("connect_timeout_s" if name == "connect_timeout" else
                              "read_timeout_s" if name == "read_timeout" else name, value)
        return cls(
            parts.netloc,
            parts.path,
            endpoint_url=query.get("endpoint_url") or None,
            region=query.get("region") or None,
            create=query.get("create", "").lower() in _TRUE,
            workers=workers,
            addressing_style=query.get("addressing_style") or None,
            lean_reads=query.get("lean_reads", "1").lower() in _TRUE,
            lean_writes=query.get("lean_writes", "1").lower() in _TRUE,
            cache=cache,
            **kwargs,
        )

    def _check_bucket(self, create: bool) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as exc:
            code = _error_code(exc)
            if code not in _NOT_FOUND_CODES and code not in _NO_BUCKET_CODES:
                self._raise("open bucket", exc)
            if not create:
                raise BackendUnavailable(
                    f"S3 bucket {self.bucket!r} does not exist at {self.endpoint_url or 'AWS'} "
                    "(create it, or add create=1 to the blob URL)",
                    bucket=self.bucket,
                ) from exc
        except (BotoCoreError, ValueError) as exc:
            self._raise("open bucket", exc)
        try:
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            # us-east-1 is the one region that refuses an explicit location constraint.
            if self.region and self.region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
            self._client.create_bucket(**kwargs)
        except ClientError as exc:
            # Someone else created it between our HEAD and CREATE: that is what we wanted.
            if _error_code(exc) not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                self._raise("create bucket", exc)
        except (BotoCoreError, ValueError) as exc:
            self._raise("create bucket", exc)

    def warm_thread(self) -> None:
        """Open the calling thread's connection of the lean client (GETs and PUTs
        alike; a single read runs on the caller's thread, so the store's read pool
        and this store's transfer pool call this as their threads start)."""
        if self._lean is not None:
            self._lean.warm()

    def _warm_up(self) -> None:
        """Pay the fixed costs of the first read now, not in a request: the first
        GET (one of a key that does not exist: the lean reader's connection, or
        botocore's operation model, serializer and handlers) and the start of the
        worker threads of parallel reads, each with its connection open."""
        try:
            self._get_raw("objects/.warm-up")
        except (BackendError, BackendUnavailable):
            pass  # the first real read says so, typed
        start_workers(self._executor(), self.workers, self.warm_thread)

    # -- error mapping ---------------------------------------------------------------
    def _raise(self, op: str, exc: Exception, key: str | None = None) -> NoReturn:
        """Map a botocore error to the draftstore family, chained with ``from``."""
        where = f"s3://{self.bucket}" + (f"/{key}" if key else "")
        details: dict[str, Any] = {"bucket": self.bucket, "operation": op}
        if isinstance(exc, ClientError):
            code = _error_code(exc)
            details["s3_code"] = code
            if code in _NO_BUCKET_CODES:
                raise BackendUnavailable(f"S3 bucket {self.bucket!r} does not exist ({op})", **details) from exc
            if code in _AUTH_CODES:
                raise BackendUnavailable(
                    f"S3 rejected the credentials for bucket {self.bucket!r} ({op}: {code})", **details
                ) from exc
            if code == "InvalidBucketName":
                raise ConfigInvalid(f"invalid S3 bucket name {self.bucket!r}", **details) from exc
            if code in _TRANSIENT_CODES or code.startswith("5"):
                raise BackendUnavailable(f"S3 unavailable during {op} on {where}: {code}", **details) from exc
            raise BackendError(f"S3 error during {op} on {where}: {code}", **details) from exc
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            raise BackendUnavailable(
                f"no usable S3 credentials for bucket {self.bucket!r} (set AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY or an AWS profile)",
                **details,
            ) from exc
        if isinstance(exc, (BotoConnectionError, HTTPClientError)):
            raise BackendUnavailable(
                f"S3 endpoint {self.endpoint_url or 'AWS'} unreachable during {op}: {exc}", **details
            ) from exc
        raise BackendError(f"S3 client error during {op} on {where}: {exc}", **details) from exc

    # -- raw hooks -------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return self.prefix + key

    def _count(self, op: str) -> None:
        with self._calls_lock:
            self.calls[op] += 1

    def _put_raw(self, key: str, data: bytes) -> None:
        self._count("put")
        if self._writer is not None and len(data) <= MAX_LEAN_PUT:
            self._writer.put(self._key(key), data)
            return
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except (ClientError, BotoCoreError) as exc:
            self._raise("put", exc, key)

    def _get_raw(self, key: str) -> bytes | None:
        self._count("get")
        if self._reader is not None:
            return self._reader.get(self._key(key))
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            return resp["Body"].read()
        except ClientError as exc:
            if _error_code(exc) in _NOT_FOUND_CODES:
                return None
            self._raise("get", exc, key)
        except BotoCoreError as exc:
            self._raise("get", exc, key)

    def _get_range_raw(self, key: str, start: int, length: int) -> bytes | None:
        if length <= 0:
            return b""
        self._count("get_range")
        if self._reader is not None:
            return self._reader.get_range(self._key(key), start, length)
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._key(key),
                                           Range=f"bytes={start}-{start + length - 1}")
            return resp["Body"].read()
        except ClientError as exc:
            code = _error_code(exc)
            if code in _NOT_FOUND_CODES:
                return None
            if code in ("InvalidRange", "416"):  # the range starts past the end
                return b""
            self._raise("get range", exc, key)
        except BotoCoreError as exc:
            self._raise("get range", exc, key)

    def _has_raw(self, key: str) -> bool:
        return self._modified_raw(key) is not None

    def _modified_raw(self, key: str) -> float | None:
        self._count("head")
        try:
            return self._client.head_object(Bucket=self.bucket, Key=self._key(key))["LastModified"].timestamp()
        except ClientError as exc:
            if _error_code(exc) in _NOT_FOUND_CODES:
                return None
            self._raise("head", exc, key)
        except BotoCoreError as exc:
            self._raise("head", exc, key)

    def _delete_raw(self, key: str) -> None:
        # S3 DELETE of an absent key succeeds: "absent is not an error" for free.
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if _error_code(exc) in _NOT_FOUND_CODES:
                return
            self._raise("delete", exc, key)
        except BotoCoreError as exc:
            self._raise("delete", exc, key)

    def _iter_raw(self, prefix: str) -> Iterator[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        cut = len(self.prefix)
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
                for obj in page.get("Contents", ()):
                    yield obj["Key"][cut:]
        except (ClientError, BotoCoreError) as exc:
            self._raise("list", exc, prefix)

    def _list_raw(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        paginator = self._client.get_paginator("list_objects_v2")
        cut = len(self.prefix)
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
                for obj in page.get("Contents", ()):
                    yield obj["Key"][cut:], int(obj["Size"]), obj["LastModified"].timestamp()
        except (ClientError, BotoCoreError) as exc:
            self._raise("list", exc, prefix)

    # -- parallel upload ---------------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        # Created on first use and kept: sealing a tree calls put_many often,
        # and a fresh pool per call would pay thread start-up every time.
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="draftstore-s3")
            return self._pool

    def put_many(self, blobs: Iterable[bytes]) -> list[Digest]:
        """Store several objects in parallel; idempotent; digests in input order.

        Duplicates are uploaded once; every distinct object is uploaded even if
        cached (see ``BlobStoreBase.put``). Returns
        after every upload has finished; if any failed, raises the first
        failure (``backend.*``) — the others may or may not be stored, which
        is harmless for content-addressed objects.
        """
        items = [bytes(b) for b in blobs]
        digests = [digest_of(b) for b in items]
        todo: dict[Digest, bytes] = {}
        for d, b in zip(digests, items):
            if d not in todo:
                todo[d] = b
        if len(todo) <= 1:
            for d, b in todo.items():
                self._put_raw(object_key(d), b)
                self.cache.add(d, b)
            return digests
        self._on_pool(lambda d: self._put_cached(d, todo[d]), list(todo))
        return digests

    def _put_cached(self, d: Digest, b: bytes) -> None:
        self._put_raw(object_key(d), b)
        self.cache.add(d, b)

    def _on_pool(self, fn: Callable[[K], R], items: list[K]) -> dict[K, R]:
        """``fn(item)`` for every item on the transfer pool: {item: result}. Returns only
        after every call has settled; if any failed, raises the first failure (in
        ``items`` order) -- nothing is left running either way."""
        return dict(zip(items, settle(self._executor(), fn, items)))

    def get_many(self, digests: Iterable[Digest]) -> dict[Digest, bytes]:
        """Several objects, verified; the ones not cached are fetched in parallel."""
        out: dict[Digest, bytes] = {}
        todo: list[Digest] = []
        for d in digests:
            d = Digest(d)
            if d in out:
                continue
            cached = self.cache.get(d)
            if cached is not None:
                out[d] = cached
            elif d not in todo:
                todo.append(d)
        if len(todo) <= 1:
            for d in todo:
                out[d] = self.get(d)
            return out
        out.update(self._on_pool(self.get, todo))
        return out

    def get_ranges(self, ranges: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], bytes]:
        """Byte ranges, unverified (see ``BlobStoreBase.get_ranges``), fetched in parallel."""
        todo = list(dict.fromkeys(ranges))
        if len(todo) <= 1:
            return super().get_ranges(todo)
        return self._on_pool(self._get_range, todo)

    def close(self) -> None:
        """Stop the upload pool and close the HTTP connections. Idempotent."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self._lean is not None:
            self._lean.close()
        try:
            self._client.close()
        except Exception:  # closing is best effort; nothing to recover
            pass

    def __repr__(self) -> str:
        return f"S3BlobStore({self.url!r})"
