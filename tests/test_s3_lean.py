"""The S3 store's lean GETs and PUTs (``blobs.s3lean``) on a real SeaweedFS: the same
answers as botocore's path for every outcome a read or a write can have, typed
failures, and a keep-alive connection the other side closed replaced without a
failed request."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import pytest

from draftstore.blobs import ObjectCache, object_key
from draftstore.blobs import s3 as s3_module
from draftstore.blobs.s3 import S3BlobStore
from draftstore.digest import Digest, digest_of
from draftstore.errors import BackendUnavailable, BlobNotFound

pytestmark = pytest.mark.real


def _pair(real_s3: Any, prefix: str) -> tuple[S3BlobStore, S3BlobStore]:
    """Two stores on one prefix, in-process cache off: lean GETs and PUTs, and botocore's."""
    lean = real_s3.open_store(prefix, cache=ObjectCache(0))
    plain = S3BlobStore.from_url(real_s3.url(prefix) + "&lean_reads=0&lean_writes=0", cache=ObjectCache(0))
    return lean, plain


def test_lean_reads_answer_exactly_as_botocore_does(real_s3: Any) -> None:
    lean, plain = _pair(real_s3, f"lean-{os.urandom(3).hex()}")
    try:
        assert lean._reader is not None and plain._reader is None and plain._writer is None
        data = os.urandom(200_000)
        d = plain.put(data)
        small = plain.put(b"x")
        missing = Digest("0" * 64)
        for store in (lean, plain):
            assert store.get(d) == data
            assert store.get_many([d, small]) == {d: data, small: b"x"}
            ranges = [(str(d), 0, 10), (str(d), 123_456, 5_000), (str(d), 199_990, 100), (str(d), 250_000, 10)]
            got = store.get_ranges(ranges)
            assert got[ranges[0]] == data[:10]
            assert got[ranges[1]] == data[123_456:128_456]
            assert got[ranges[2]] == data[199_990:]  # cut short at the end
            assert got[ranges[3]] == b""  # past the end
            assert store._get_raw(object_key(missing)) is None
            with pytest.raises(BlobNotFound):
                store.get(missing)
            with pytest.raises(BlobNotFound):
                store.get_ranges([(str(missing), 0, 10), (str(d), 0, 1)])
        assert lean.calls["get"] >= 3 and lean.calls["get_range"] >= 5
    finally:
        lean.close()
        plain.close()


# the same failure, whichever request meets it
REQUESTS = [("get", lambda store: store.get(Digest("1" * 64))), ("put", lambda store: store.put(b"refused"))]


@pytest.mark.parametrize("op,request_", REQUESTS, ids=[op for op, _ in REQUESTS])
def test_a_rejected_secret_fails_a_lean_request_as_backend_unavailable(real_s3: Any, op: str, request_: Any) -> None:
    store = S3BlobStore(real_s3.bucket, endpoint_url=real_s3.endpoint_url, region="us-east-1",
                        aws_access_key_id=real_s3.access_key, aws_secret_access_key=real_s3.secret_key + "-wrong",
                        check=False)
    try:
        assert store._reader is not None and store._writer is not None
        with pytest.raises(BackendUnavailable) as info:
            request_(store)
        assert "credentials" in info.value.message
        assert info.value.details["operation"] == op
        assert real_s3.secret_key not in str(info.value)
    finally:
        store.close()


@pytest.mark.parametrize("op,request_", REQUESTS, ids=[op for op, _ in REQUESTS])
def test_a_dead_endpoint_fails_a_lean_request_as_backend_unavailable_after_its_attempts(
        real_s3: Any, op: str, request_: Any) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = S3BlobStore(real_s3.bucket, endpoint_url=f"http://127.0.0.1:{port}", region="us-east-1",
                        max_attempts=2, connect_timeout_s=0.5, check=False)
    try:
        with pytest.raises(BackendUnavailable) as info:
            request_(store)
        assert "after 2 attempt(s)" in info.value.message
        assert info.value.details["operation"] == op
    finally:
        store.close()


# a write then a read, one of them lean; and the lean connection pool the lean one uses
ROUNDTRIPS = [("get", "_reader", lambda lean, plain, data: lean.get(plain.put(data))),
              ("put", "_writer", lambda lean, plain, data: plain.get(lean.put(data)))]


@pytest.mark.parametrize("op,pool,roundtrip", ROUNDTRIPS, ids=[op for op, _, _ in ROUNDTRIPS])
def test_a_keep_alive_connection_closed_underneath_is_replaced_without_a_failed_request(
        real_s3: Any, op: str, pool: str, roundtrip: Any) -> None:
    prefix = f"stale{op}-{os.urandom(3).hex()}"
    # one attempt: only the reconnect of a stale connection, not a retry, can save this request
    lean = S3BlobStore.from_url(real_s3.url(prefix) + "&max_attempts=1", cache=ObjectCache(0))
    plain = S3BlobStore.from_url(real_s3.url(prefix) + "&lean_reads=0&lean_writes=0", cache=ObjectCache(0))
    try:
        assert roundtrip(lean, plain, b"first") == b"first"
        conn = getattr(lean, pool)._local.conn
        assert conn.sock is not None
        conn.sock.shutdown(socket.SHUT_RDWR)  # the connection is dead; the client has not noticed
        assert roundtrip(lean, plain, b"second, on a new connection") == b"second, on a new connection"
        assert getattr(lean, pool)._local.conn is not conn
    finally:
        lean.close()
        plain.close()


@pytest.mark.parametrize("op,request_", REQUESTS, ids=[op for op, _ in REQUESTS])
def test_a_closed_store_refuses_lean_requests(real_s3: Any, op: str, request_: Any) -> None:
    lean, plain = _pair(real_s3, f"closed{op}-{os.urandom(3).hex()}")
    plain.close()
    lean.close()
    with pytest.raises(Exception) as info:
        request_(lean)
    assert getattr(info.value, "code", None) == "backend.error"


def test_connections_of_threads_that_ended_are_closed(real_s3: Any) -> None:
    lean, plain = _pair(real_s3, f"threads-{os.urandom(3).hex()}")
    try:
        d = plain.put(b"read by short-lived threads")
        assert lean._reader is not None
        before = lean._reader.open_connections()  # the transfer pool's, opened with the store
        for _ in range(20):  # each thread reads once and ends, as a pruned worker thread does
            t = threading.Thread(target=lambda: lean.get(d))
            t.start()
            t.join()
        assert lean.get(d) == b"read by short-lived threads"
        assert lean._reader.open_connections() <= before + 2
    finally:
        lean.close()
        plain.close()
    assert lean._reader.open_connections() == 0


def test_a_missing_bucket_fails_a_lean_read_as_backend_unavailable_naming_it(real_s3: Any) -> None:
    bucket = f"dstest-absent-{os.urandom(4).hex()}"
    store = S3BlobStore(bucket, endpoint_url=real_s3.endpoint_url, region="us-east-1", check=False)
    try:
        assert store._reader is not None
        for read in (lambda: store.get(Digest("3" * 64)), lambda: store.get_ranges([("3" * 64, 0, 10)])):
            with pytest.raises(BackendUnavailable) as info:
                read()
            assert bucket in info.value.message
            assert info.value.details["s3_code"] == "NoSuchBucket"
    finally:
        store.close()


# -- PUTs ----------------------------------------------------------------------------------
def test_lean_puts_store_exactly_the_bytes_botocore_reads_back(real_s3: Any) -> None:
    lean, plain = _pair(real_s3, f"leanput-{os.urandom(3).hex()}")
    try:
        assert lean._writer is not None
        bodies = [b"", b"x", os.urandom(1024), os.urandom(300_000), bytes(range(256)) * 40]
        digests = [lean.put(b) for b in bodies]
        assert digests == [digest_of(b) for b in bodies]
        assert lean.put_many(bodies[2:]) == digests[2:]  # the transfer pool's threads, each its connection
        for d, b in zip(digests, bodies):
            assert plain._get_raw(object_key(d)) == b  # read through botocore
        assert lean.calls["put"] == len(bodies) + 3
    finally:
        lean.close()
        plain.close()


def test_a_put_over_the_lean_limit_or_with_lean_writes_off_goes_through_botocore(
        real_s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    lean, plain = _pair(real_s3, f"bigput-{os.urandom(3).hex()}")
    sent: list[int] = []
    try:
        assert lean._writer is not None
        real_put = lean._writer.put
        monkeypatch.setattr(lean._writer, "put", lambda key, data: (sent.append(len(data)), real_put(key, data)))
        monkeypatch.setattr(s3_module, "MAX_LEAN_PUT", 1000)
        small, big = os.urandom(1000), os.urandom(1001)
        assert plain.get(lean.put(small)) == small
        assert plain.get(lean.put(big)) == big
        assert sent == [1000]  # the bigger body went through botocore, and landed all the same
        assert plain._writer is None and lean.get(plain.put(b"botocore's")) == b"botocore's"
    finally:
        lean.close()
        plain.close()


def test_a_put_into_a_bucket_that_does_not_exist_ends_as_botocore_s_does(real_s3: Any) -> None:
    # S3 answers NoSuchBucket (backend.unavailable, as a lean GET's test shows); SeaweedFS
    # creates the bucket and stores the object. Either way the two paths must agree.
    outcomes = []
    for lean_writes in (True, False):
        bucket = f"dstest-absent-{os.urandom(4).hex()}"
        store = S3BlobStore(bucket, endpoint_url=real_s3.endpoint_url, region="us-east-1", check=False,
                            lean_writes=lean_writes)
        try:
            assert (store._writer is not None) == lean_writes
            try:
                d = store.put(b"no bucket for this yet")
                outcomes.append(("stored", store._get_raw(object_key(d))))
            except BackendUnavailable as exc:
                outcomes.append(("refused", exc.details.get("s3_code")))
        finally:
            store.close()
    assert outcomes[0] == outcomes[1]
    assert outcomes[0] in (("stored", b"no bucket for this yet"), ("refused", "NoSuchBucket"))


def test_the_read_pool_threads_hold_open_connections_from_the_start(real_s3: Any, tmp_path: Any) -> None:
    # a search's chains of reads run on the store's read pool, one GET at a time on the
    # pool's own threads: the first search of a process must not open their connections
    from draftstore import Store
    from draftstore.settings import Settings

    with Store.open(database_url=f"sqlite:///{tmp_path}/ds.db", blob_url=real_s3.url(f"pool-{os.urandom(3).hex()}"),
                    coord_url="memory://", settings=Settings.load().model_copy(update={"cache_bytes": 0})) as store:
        blobs = store.blobs
        assert isinstance(blobs, S3BlobStore) and blobs._reader is not None
        d = blobs.put(b"read on the read pool")
        before = blobs._reader.open_connections()
        got = store._b.in_parallel(lambda _: blobs.get(d), list(range(8)))
        assert got == [b"read on the read pool"] * 8
        assert blobs._reader.open_connections() == before
