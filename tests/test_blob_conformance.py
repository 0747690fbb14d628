"""Blob store conformance: every backend keeps the same promises.

Runs on the embedded DirectoryBlobStore and on S3BlobStore against a real
SeaweedFS (``blob_store`` fixture). A backend is done when it passes this.
"""

from __future__ import annotations

import os
import re
import socket
import threading

import pytest

from draftstore.blobs import BlobStore, object_key, open_blob_store
from draftstore.blobs.s3 import S3BlobStore
from draftstore.digest import Digest, digest_of
from draftstore.errors import (
    BackendUnavailable,
    BlobNotFound,
    ChecksumMismatch,
    DraftstoreError,
    InvalidInput,
)

KEY_FORM = re.compile(r"^objects/[0-9a-f]{2}/[0-9a-f]{62}$")


def test_a_stored_object_comes_back_byte_for_byte_under_its_sha256(blob_store: BlobStore) -> None:
    assert isinstance(blob_store, BlobStore)
    data = b"print('hello')\n"
    digest = blob_store.put(data)
    assert digest == digest_of(data)
    assert isinstance(digest, Digest)
    assert blob_store.get(digest) == data
    assert blob_store.has(digest)


def test_empty_and_large_objects_round_trip(blob_store: BlobStore) -> None:
    empty = blob_store.put(b"")
    big_data = os.urandom(3 * 1024 * 1024 + 17)
    big = blob_store.put(big_data)
    assert blob_store.get(empty) == b""
    assert blob_store.get(big) == big_data


def test_putting_the_same_content_twice_is_harmless_and_stores_one_object(blob_store: BlobStore) -> None:
    first = blob_store.put(b"same bytes")
    second = blob_store.put(b"same bytes")
    assert first == second
    assert list(blob_store.iter_digests()) == [first]
    assert blob_store.get(first) == b"same bytes"


def test_racing_writers_of_the_same_content_all_succeed(blob_store: BlobStore) -> None:
    data = os.urandom(64 * 1024)
    results: list[Digest] = []
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            results.append(blob_store.put(data))
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert set(results) == {digest_of(data)}
    assert blob_store.get(digest_of(data)) == data


def test_asking_for_a_missing_object_raises_blob_not_found(blob_store: BlobStore) -> None:
    missing = digest_of(b"never stored")
    assert not blob_store.has(missing)
    with pytest.raises(BlobNotFound) as info:
        blob_store.get(missing)
    assert info.value.code == "blob.not_found"
    assert info.value.details["digest"] == missing


def test_a_corrupted_object_is_refused_with_checksum_mismatch(blob_store: BlobStore) -> None:
    digest = blob_store.put(b"the real content")
    # Tamper behind the store's back, through the backend's own raw hooks.
    key = object_key(digest)
    blob_store._delete_raw(key)  # type: ignore[attr-defined]
    blob_store._put_raw(key, b"tampered content")  # type: ignore[attr-defined]
    with pytest.raises(ChecksumMismatch) as info:
        blob_store.get(digest)
    assert info.value.code == "blob.checksum_mismatch"
    assert info.value.details["actual"] == digest_of(b"tampered content")


BIG = os.urandom(3 * 1024 * 1024 + 5)


@pytest.mark.parametrize("data,damage", [(b"the real content", b"tampered content"),
                                         (b"the real content", b"the real"),
                                         (b"the real content", b"the real contenT"),
                                         (b"the real content", b""),
                                         (BIG, BIG[:-1] + bytes([BIG[-1] ^ 1]))])  # past the first chunk
def test_storing_an_object_again_repairs_a_damaged_copy(blob_store: BlobStore, data: bytes, damage: bytes) -> None:
    digest = blob_store.put(data)
    key = object_key(digest)
    blob_store._delete_raw(key)  # type: ignore[attr-defined]
    blob_store._put_raw(key, damage)  # type: ignore[attr-defined]  (other, shorter, same size, empty)
    blob_store.cache.clear()  # type: ignore[attr-defined]  (a fresh reader)
    with pytest.raises(ChecksumMismatch):
        blob_store.get(digest)
    assert blob_store.put(data) == digest  # the writer that stores it again (a snapshot built anew, say)
    blob_store.cache.clear()  # type: ignore[attr-defined]
    assert blob_store.get(digest) == data
    assert blob_store._get_raw(key) == data  # type: ignore[attr-defined]  (the stored copy itself)


def test_object_keys_are_derived_from_digests_and_never_from_user_text(blob_store: BlobStore) -> None:
    user_texts = [b"../../etc/passwd", "src/\u00e9t\u00e9/caf\u00e9.py".encode(), b"a b\nc", b"C:\\windows"]
    digests = [blob_store.put(t) for t in user_texts]
    keys = sorted(blob_store._iter_raw(""))  # type: ignore[attr-defined]
    assert keys == sorted(object_key(d) for d in digests)
    assert all(KEY_FORM.match(k) for k in keys), keys


def test_a_non_digest_name_is_rejected_before_reaching_the_backend(blob_store: BlobStore) -> None:
    for bad in ["../../etc/passwd", "ABCDEF" * 10 + "ABCD", "", "0" * 63]:
        with pytest.raises(InvalidInput):
            blob_store.get(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            blob_store.has(bad)  # type: ignore[arg-type]


def test_put_many_stores_a_batch_and_returns_digests_in_input_order(blob_store: BlobStore) -> None:
    # Sealing a tree puts many small objects at once; duplicates are allowed.
    blobs = [f"tree node {i}".encode() for i in range(120)] + [b"tree node 7", b"tree node 0"]
    digests = blob_store.put_many(blobs)
    assert digests == [digest_of(b) for b in blobs]
    assert set(blob_store.iter_digests()) == set(digests)
    for data, digest in zip(blobs, digests):
        assert blob_store.get(digest) == data


def test_get_many_returns_every_object_verified_and_fails_on_a_missing_one(blob_store: BlobStore) -> None:
    blobs = [os.urandom(100 + i) for i in range(40)]
    digests = blob_store.put_many(blobs)
    blob_store.cache.clear()  # make the backend fetch them
    got = blob_store.get_many(digests + digests[:3])
    assert got == dict(zip(digests, blobs))
    missing = digest_of(b"never stored " + os.urandom(8))
    with pytest.raises(BlobNotFound):
        blob_store.get_many([digests[0], missing])


def test_get_ranges_reads_byte_ranges_of_stored_objects_and_fails_on_a_missing_one(blob_store: BlobStore) -> None:
    blobs = [os.urandom(5000 + i) for i in range(6)]
    digests = blob_store.put_many(blobs)
    blob_store.cache.clear()
    ranges = [(d, 17 * i, 1000 + i) for i, d in enumerate(digests)] + [(digests[0], 4990, 100)]  # past the end
    got = blob_store.get_ranges(ranges)
    assert set(got) == set(ranges)
    for (d, start, length), data in got.items():
        assert data == blobs[digests.index(d)][start:start + length]
    assert got[(digests[0], 4990, 100)] == blobs[0][4990:]  # cut short at the end
    missing = digest_of(b"never stored " + os.urandom(8))
    with pytest.raises(BlobNotFound):
        blob_store.get_ranges([(digests[0], 0, 10), (missing, 0, 10)])


def test_put_many_of_nothing_is_a_no_op(blob_store: BlobStore) -> None:
    assert blob_store.put_many([]) == []
    assert list(blob_store.iter_digests()) == []


def test_iter_digests_lists_exactly_what_was_stored(blob_store: BlobStore) -> None:
    assert list(blob_store.iter_digests()) == []
    stored = {blob_store.put(f"object {i}".encode()) for i in range(25)}
    listed = list(blob_store.iter_digests())
    assert len(listed) == len(stored)
    assert set(listed) == stored


def test_delete_removes_an_object_and_deleting_again_is_not_an_error(blob_store: BlobStore) -> None:
    keep = blob_store.put(b"keep me")
    gone = blob_store.put(b"collect me")
    blob_store.delete(gone)
    blob_store.delete(gone)
    blob_store.delete(digest_of(b"never existed"))
    assert not blob_store.has(gone)
    with pytest.raises(BlobNotFound):
        blob_store.get(gone)
    assert list(blob_store.iter_digests()) == [keep]
    # Content addressing: a deleted object can simply be put again.
    assert blob_store.put(b"collect me") == gone
    assert blob_store.get(gone) == b"collect me"


# -- the S3 backend at its boundary ------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_s3_endpoint_is_a_typed_backend_unavailable() -> None:
    url = f"s3://draftstore-nowhere?endpoint_url=http://127.0.0.1:{_free_port()}&region=us-east-1"
    with pytest.raises(BackendUnavailable) as info:
        open_blob_store(url)
    assert info.value.code == "backend.unavailable"
    assert info.value.__cause__ is not None  # the obstore error, chained


def test_credentials_in_the_s3_url_are_refused() -> None:
    with pytest.raises(DraftstoreError) as info:
        open_blob_store("s3://key:secret@bucket?endpoint_url=http://127.0.0.1:1")
    assert info.value.code == "config.invalid"


@pytest.mark.real
def test_s3_blob_url_opens_an_s3_store_under_its_prefix(real_s3) -> None:  # type: ignore[no-untyped-def]
    store = open_blob_store(real_s3.url("tenant-a"))
    try:
        assert isinstance(store, S3BlobStore)
        digest = store.put(b"prefixed")
        client = real_s3.client()
        head = client.head_object(Bucket=real_s3.bucket, Key="tenant-a/" + object_key(digest))
        assert head["ContentLength"] == len(b"prefixed")
        client.close()
        # Another prefix in the same bucket is another store.
        other = open_blob_store(real_s3.url("tenant-b"))
        assert not other.has(digest)
        other.close()
    finally:
        store.close()


@pytest.mark.real
def test_a_wrong_s3_secret_is_rejected_as_backend_unavailable(real_s3) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(BackendUnavailable) as info:
        S3BlobStore(
            real_s3.bucket,
            endpoint_url=real_s3.endpoint_url,
            region="us-east-1",
            aws_access_key_id=real_s3.access_key,
            aws_secret_access_key=real_s3.secret_key + "-wrong",
        )
    assert info.value.code == "backend.unavailable"
    assert "credentials" in info.value.message
    assert real_s3.secret_key not in str(info.value)


@pytest.mark.real
def test_a_missing_bucket_is_named_unless_create_is_asked(real_s3) -> None:  # type: ignore[no-untyped-def]
    bucket = f"dstest-missing-{os.urandom(4).hex()}"
    with pytest.raises(BackendUnavailable) as info:
        open_blob_store(real_s3.url(bucket=bucket))
    assert bucket in info.value.message
    created = open_blob_store(real_s3.url(bucket=bucket, create=True))
    try:
        digest = created.put(b"in a new bucket")
        assert created.get(digest) == b"in a new bucket"
        created.delete(digest)
    finally:
        created.close()
        client = real_s3.client()
        client.delete_bucket(Bucket=bucket)
        client.close()


def test_listing_gives_every_object_with_its_size_and_age(blob_store) -> None:
    import time

    before = time.time() - 120  # clocks of a store and its client may differ a little
    digests = {blob_store.put(b"x" * n) for n in (1, 10, 1000)}
    listed = {o.digest: o for o in blob_store.iter_objects()}
    assert set(listed) == digests
    assert sorted(o.size for o in listed.values()) == [1, 10, 1000]
    assert all(before < o.modified < time.time() + 120 for o in listed.values())
