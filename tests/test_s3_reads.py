"""The S3 store's lean GETs (``blobs.s3reads``) on a real SeaweedFS: the same answers
as botocore's path for every outcome a read can have, typed failures, and a
keep-alive connection the other side closed replaced without a failed read."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import pytest

from draftstore.blobs import ObjectCache, object_key
from draftstore.blobs.s3 import S3BlobStore
from draftstore.digest import Digest
from draftstore.errors import BackendUnavailable, BlobNotFound

pytestmark = pytest.mark.real


def _pair(real_s3: Any, prefix: str) -> tuple[S3BlobStore, S3BlobStore]:
    """Two stores on one prefix, in-process cache off: lean GETs, and botocore's."""
    lean = real_s3.open_store(prefix, cache=ObjectCache(0))
    plain = S3BlobStore.from_url(real_s3.url(prefix) + "&lean_reads=0", cache=ObjectCache(0))
    return lean, plain


def test_lean_reads_answer_exactly_as_botocore_does(real_s3: Any) -> None:
    lean, plain = _pair(real_s3, f"lean-{os.urandom(3).hex()}")
    try:
        assert lean._reader is not None and plain._reader is None
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


def test_a_rejected_secret_fails_a_lean_read_as_backend_unavailable(real_s3: Any) -> None:
    store = S3BlobStore(real_s3.bucket, endpoint_url=real_s3.endpoint_url, region="us-east-1",
                        aws_access_key_id=real_s3.access_key, aws_secret_access_key=real_s3.secret_key + "-wrong",
                        check=False)
    try:
        assert store._reader is not None
        with pytest.raises(BackendUnavailable) as info:
            store.get(Digest("1" * 64))
        assert "credentials" in info.value.message
        assert real_s3.secret_key not in str(info.value)
    finally:
        store.close()


def test_a_dead_endpoint_fails_a_lean_read_as_backend_unavailable_after_its_attempts(real_s3: Any) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = S3BlobStore(real_s3.bucket, endpoint_url=f"http://127.0.0.1:{port}", region="us-east-1",
                        max_attempts=2, connect_timeout_s=0.5, check=False)
    try:
        with pytest.raises(BackendUnavailable) as info:
            store.get(Digest("2" * 64))
        assert "after 2 attempt(s)" in info.value.message
        assert info.value.details["operation"] == "get"
    finally:
        store.close()


def test_a_keep_alive_connection_closed_underneath_is_replaced_without_a_failed_read(real_s3: Any) -> None:
    prefix = f"stale-{os.urandom(3).hex()}"
    # one attempt: only the reconnect of a stale connection, not a retry, can save this read
    lean = S3BlobStore.from_url(real_s3.url(prefix) + "&max_attempts=1", cache=ObjectCache(0))
    plain = S3BlobStore.from_url(real_s3.url(prefix) + "&lean_reads=0", cache=ObjectCache(0))
    try:
        d = plain.put(b"still here")
        assert lean.get(d) == b"still here"
        conn = lean._reader._local.conn  # type: ignore[union-attr]
        assert conn.sock is not None
        conn.sock.shutdown(socket.SHUT_RDWR)  # the connection is dead; the client has not noticed
        assert lean.get(d) == b"still here"
        assert lean._reader._local.conn is not conn  # type: ignore[union-attr]
    finally:
        lean.close()
        plain.close()


def test_a_closed_store_refuses_lean_reads(real_s3: Any) -> None:
    lean, plain = _pair(real_s3, f"closed-{os.urandom(3).hex()}")
    d = plain.put(b"bytes")
    plain.close()
    lean.close()
    with pytest.raises(Exception) as info:
        lean.get(d)
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
