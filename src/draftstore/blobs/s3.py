"""Blob store backend: any S3-compatible object store, through obstore.

URL form::

    s3://bucket[/prefix]?endpoint_url=http://127.0.0.1:8333&region=us-east-1[&create=1][&workers=16]

Every object request (GET, range GET, PUT, HEAD, LIST, DELETE) goes through
obstore, the Python binding of Rust's ``object_store``: signing, the pooled
keep-alive HTTP connections, retries with jittered backoff and response
parsing happen in Rust, outside the GIL, for about 0.15-0.2 ms of CPU per
small request (botocore spends about 1 ms).

Credentials come from boto3's default chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance roles, ...) through
obstore's boto3 credential provider; they never appear in the URL. An https
endpoint is verified against the system's CAs plus the CA bundle botocore is
configured with (``AWS_CA_BUNDLE``, or ``ca_bundle`` in the AWS config file).
Works with AWS S3, SeaweedFS, MinIO and R2.

boto3 is still called for one thing obstore cannot do: creating a missing
bucket (``create=1``); ``object_store`` has no bucket operations.

obstore's client does not survive ``fork()`` (its Rust runtime's threads stay in
the parent; a request in the child would wait forever): a store used in a
forked child raises ``backend.error`` instead, so open stores after forking
(``draftstore serve --workers`` spawns its workers, it does not fork them).

Error mapping at this boundary (``s3errors``; obstore's errors never leak out):

- a missing object is ``None`` from ``_get_raw`` (``blob.not_found`` from ``get``);
- an unreachable endpoint, a timeout, missing or rejected credentials, a missing
  bucket, throttling or a 5xx answer: ``BackendUnavailable`` [backend.unavailable],
  chained with ``from``;
- any other S3 error: ``BackendError`` [backend.error], chained.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar
from urllib.parse import parse_qs, urlencode, urlsplit

import boto3
import botocore.session
import obstore
from obstore.auth.boto3 import Boto3CredentialProvider
from obstore.exceptions import BaseError as ObstoreError
from obstore.store import S3Store

from ..digest import Digest, digest_of
from ..errors import BackendError, BackendUnavailable, ConfigInvalid
from ..pools import settle, start_workers
from .base import BlobStoreBase, object_key
from .cache import ObjectCache
from .s3errors import NO_BUCKET, is_missing_object, is_past_the_end, map_s3_error

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig, S3Config

K = TypeVar("K")
R = TypeVar("R")

__all__ = ["S3BlobStore"]

DEFAULT_WORKERS = 16
# a body up to this size is one PUT (one request, nothing left behind if it fails); a bigger
# one is a multipart upload in parts of MULTIPART_PART bytes, several at a time
SINGLE_PUT_MAX = 256 * 1024 * 1024
MULTIPART_PART = 16 * 1024 * 1024
# obstore caches the credentials it is handed until they expire: botocore refreshes
# temporary credentials 10-15 minutes before they lapse, so five minutes is always safe
CREDENTIALS_TTL = timedelta(minutes=5)
# what obstore and botocore raise on a failed request (FileNotFoundError is an OSError)
_FAILURES = (ObstoreError, OSError, ValueError, RuntimeError)

_TRUE = {"1", "true", "yes", "on"}


def _root_certificates(session: botocore.session.Session) -> str | None:
    """PEM text of the CA bundle botocore is configured with (``AWS_CA_BUNDLE`` or
    ``ca_bundle`` in the AWS config file), or None. Raises ``config.invalid`` if it
    names a file that cannot be read."""
    path = session.get_config_variable("ca_bundle")
    if not path:
        return None
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigInvalid(f"cannot read the S3 CA bundle {path!r}: {exc}", ca_bundle=str(path)) from exc


class S3BlobStore(BlobStoreBase):
    """Content-addressed objects in one S3 bucket, under an optional key prefix.

    Guarantees (beyond ``BlobStore``'s): one request per ``put`` up to
    ``SINGLE_PUT_MAX`` bytes (no HEAD first: an object's key is its digest,
    so a repeated PUT writes the same bytes and is harmless); ``put_many``
    uploads in parallel on a bounded thread pool and returns only after
    every upload finished, raising the first failure; each request is tried
    up to ``max_attempts`` times on a connection error, a timeout or a 5xx
    answer; the bucket is checked when the store is opened, so a wrong
    endpoint, bad credentials or a missing bucket fail at once with
    ``backend.unavailable`` (``create=True`` creates a missing bucket
    instead). Thread-safe: one obstore client (one connection pool) is
    shared by every thread. ``calls`` counts the requests sent, by kind.
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
        check: bool = True,
    ) -> None:
        super().__init__(cache)
        if not bucket:
            raise ConfigInvalid("an S3 blob store URL needs a bucket: s3://bucket[/prefix]")
        prefix = prefix.strip("/")
        if any(seg in ("", ".", "..") for seg in prefix.split("/")) and prefix:
            raise ConfigInvalid(f"bad S3 key prefix {prefix!r}", prefix=prefix)
        if addressing_style not in (None, "auto", "path", "virtual"):
            raise ConfigInvalid(f"addressing_style must be auto, path or virtual, not {addressing_style!r}")
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self.endpoint_url = endpoint_url
        self.workers = max(1, int(workers))
        self.max_attempts = max(1, int(max_attempts))
        query: dict[str, str] = {}
        if endpoint_url:
            query["endpoint_url"] = endpoint_url
        if region:
            query["region"] = region
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        if query:
            self.url += "?" + urlencode(query)

        # A private session: boto3's default session is not safe to share across threads.
        core = botocore.session.Session()
        self._session = boto3.session.Session(
            botocore_session=core,
            aws_access_key_id=aws_access_key_id,
            aws_secret_access_key=aws_secret_access_key,
            aws_session_token=aws_session_token,
            region_name=region,
        )
        self.region = self._session.region_name or "us-east-1"
        # A custom endpoint (SeaweedFS, MinIO, a loopback address) rarely has per-bucket
        # DNS names; path-style addressing works everywhere there.
        self._style = "path" if addressing_style in (None, "auto") and endpoint_url else (addressing_style or "auto")
        if self._session.get_credentials() is None:
            raise BackendUnavailable(
                f"no usable S3 credentials for bucket {bucket!r} (set AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY or an AWS profile)", bucket=bucket, operation="open")
        self._store: S3Store | None = self._open(
            prefix, _root_certificates(core), connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
        self._pid = os.getpid()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        # requests sent, by kind (get, get_range, head, put, delete; list counts listings): for operators
        # and benchmarks
        self.calls: Counter[str] = Counter()
        self._calls_lock = threading.Lock()
        if check:
            self._check_bucket(create)
            start_workers(self._executor(), self.workers)

    def _open(self, prefix: str, root_certificates: str | None, *, connect_timeout_s: float,
              read_timeout_s: float) -> S3Store:
        """The obstore client: timeouts, retries, TLS roots and addressing of this store."""
        endpoint = self.endpoint_url
        config: S3Config = {"region": self.region, "virtual_hosted_style_request": self._style == "virtual"}
        if endpoint:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigInvalid(f"endpoint_url must be an http(s) URL, not {endpoint!r}", url=self.url)
            if self._style == "virtual":  # obstore wants the bucket in a virtual-hosted endpoint
                endpoint = f"{parts.scheme}://{self.bucket}.{parts.netloc}{parts.path}"
            config["endpoint"] = endpoint.rstrip("/")
        client: ClientConfig = {
            "allow_http": bool(endpoint) and urlsplit(endpoint or "").scheme == "http",
            "connect_timeout": timedelta(seconds=connect_timeout_s),
            # per read of the answer: a hung endpoint fails the attempt; a large, slow body does not
            "read_timeout": timedelta(seconds=read_timeout_s),
            "timeout": timedelta(hours=1),
            # one idle connection kept per transfer thread, so parallel requests never wait to connect
            "pool_max_idle_per_host": str(self.workers + 4),
        }
        if root_certificates:
            client["root_certificate"] = root_certificates
        retry: RetryConfig = {"max_retries": self.max_attempts - 1,
                 "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=1),
                             "base": 2}}
        try:
            return S3Store(self.bucket, prefix=prefix or None, config=config, client_options=client,
                           retry_config=retry,
                           credential_provider=Boto3CredentialProvider(self._session, ttl=CREDENTIALS_TTL))
        except (ObstoreError, ValueError) as exc:
            raise ConfigInvalid(f"cannot configure the S3 client for {self.url}: {exc}", url=self.url) from exc

    # -- construction --------------------------------------------------------------
    @classmethod
    def from_url(cls, url: str, cache: ObjectCache | None = None, **kwargs: Any) -> "S3BlobStore":
        """Open ``s3://bucket[/prefix]?endpoint_url=..&region=..&create=1&workers=N``.

        Also ``connect_timeout`` and ``read_timeout`` (seconds, default 3 and
        10), ``max_attempts`` (attempts per request, retries included,
        default 3): how long an operation waits on a dead or hung endpoint
        before it fails with ``backend.unavailable``; and
        ``addressing_style`` (``path``, ``virtual`` or ``auto``).
        ``lean_reads`` and ``lean_writes`` are accepted and ignored (every
        request goes through obstore).

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
            cache=cache,
            **kwargs,
        )

    def _check_bucket(self, create: bool) -> None:
        """One GET of a key that does not exist: it proves the endpoint, the credentials
        and the bucket, and pays the fixed costs of a first request (a connection, the
        credentials) now rather than in a read."""
        try:
            self._get_raw("objects/.warm-up")
            return
        except BackendUnavailable as exc:
            if exc.details.get("s3_code") != NO_BUCKET:
                raise
            if not create:
                raise BackendUnavailable(
                    f"S3 bucket {self.bucket!r} does not exist at {self.endpoint_url or 'AWS'} "
                    "(create it, or add create=1 to the blob URL)",
                    bucket=self.bucket,
                ) from exc
        self._create_bucket()

    def _create_bucket(self) -> None:
        """Create the bucket with boto3: ``object_store`` has no bucket operations."""
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            client = self._session.client(
                "s3", endpoint_url=self.endpoint_url,
                config=Config(s3={"addressing_style": self._style}, retries={"total_max_attempts": self.max_attempts}))
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            # us-east-1 is the one region that refuses an explicit location constraint.
            if self.region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
            try:
                client.create_bucket(**kwargs)
            finally:
                client.close()
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            # Someone else created it between our GET and CREATE: that is what we wanted.
            if code not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                raise BackendUnavailable(f"cannot create S3 bucket {self.bucket!r}: {code}", bucket=self.bucket,
                                         operation="create bucket", s3_code=code) from exc
        except (BotoCoreError, ValueError) as exc:
            raise BackendUnavailable(f"cannot create S3 bucket {self.bucket!r}: {exc}", bucket=self.bucket,
                                     operation="create bucket") from exc

    # -- error mapping ---------------------------------------------------------------
    def _raise(self, op: str, exc: BaseException, key: str | None = None) -> NoReturn:
        """Map an obstore error to the draftstore family (``s3errors``), chained with ``from``."""
        where = f"s3://{self.bucket}/" + (self.prefix + key if key else self.prefix)
        raise map_s3_error(exc, bucket=self.bucket, operation=op, where=where,
                           endpoint=self.endpoint_url or "AWS", attempts=self.max_attempts) from exc

    # -- raw hooks -------------------------------------------------------------------
    def _client(self, op: str) -> S3Store:
        """The obstore client, counting one request of kind ``op``; ``backend.error`` once closed
        or in a forked child."""
        store = self._store
        if store is None:
            raise BackendError("the S3 blob store is closed", bucket=self.bucket, operation=op)
        if os.getpid() != self._pid:
            raise BackendError("an S3 blob store cannot be used across fork(); open it in the child process",
                               bucket=self.bucket, operation=op)
        with self._calls_lock:
            self.calls[op] += 1
        return store

    def _put_raw(self, key: str, data: bytes) -> None:
        store = self._client("put")
        try:
            obstore.put(store, key, data, use_multipart=len(data) > SINGLE_PUT_MAX, chunk_size=MULTIPART_PART)
        except _FAILURES as exc:
            self._raise("put", exc, key)

    def _get_raw(self, key: str) -> bytes | None:
        store = self._client("get")
        try:
            return bytes(obstore.get(store, key).bytes())
        except _FAILURES as exc:
            if is_missing_object(exc):
                return None
            self._raise("get", exc, key)

    def _get_range_raw(self, key: str, start: int, length: int) -> bytes | None:
        if length <= 0:
            return b""
        store = self._client("get_range")
        try:
            return bytes(obstore.get_range(store, key, start=start, length=length))
        except _FAILURES as exc:
            if is_missing_object(exc):
                return None
            if is_past_the_end(exc):
                return b""
            self._raise("get range", exc, key)

    def _has_raw(self, key: str) -> bool:
        return self._modified_raw(key) is not None

    def _modified_raw(self, key: str) -> float | None:
        store = self._client("head")
        try:
            return obstore.head(store, key)["last_modified"].timestamp()
        except _FAILURES as exc:
            # a HEAD answer has no body: a 404 may be a missing bucket too, which the next GET or PUT names
            if isinstance(exc, FileNotFoundError):
                return None
            self._raise("head", exc, key)

    def _delete_raw(self, key: str) -> None:
        # S3 DELETE of an absent key succeeds: "absent is not an error" for free.
        store = self._client("delete")
        try:
            obstore.delete(store, key)
        except _FAILURES as exc:
            if is_missing_object(exc):
                return
            self._raise("delete", exc, key)

    def _list_raw(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        # keys come back relative to the store's prefix; S3 answers 1,000 keys a request, and
        # `calls["list"]` counts listings, not their pages
        store = self._client("list")
        try:
            for chunk in obstore.list(store, prefix, chunk_size=1000):
                for meta in chunk:
                    yield meta["path"], int(meta["size"]), meta["last_modified"].timestamp()
        except _FAILURES as exc:
            self._raise("list", exc, prefix)

    def _iter_raw(self, prefix: str) -> Iterator[str]:
        for key, _, _ in self._list_raw(prefix):
            yield key

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
        """Stop the transfer pool and drop the client (its connections close with it).
        Idempotent; later requests raise ``backend.error``."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._store = None

    def __repr__(self) -> str:
        return f"S3BlobStore({self.url!r})"
