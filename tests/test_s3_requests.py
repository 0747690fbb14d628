"""The S3 blob store's requests on a real SeaweedFS, through the public blob API: every
outcome a read or a write can have, the requests counted, typed failures (rejected
credentials, a dead endpoint, a missing bucket, a closed store), one kept connection
reused, and connections cut underneath replaced or retried without a failed call.

Connection faults are real: a TCP relay in front of SeaweedFS closes the store's
connections, or resets new ones as they arrive."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from draftstore.blobs import ObjectCache, object_key
from draftstore.blobs import s3 as s3_module
from draftstore.blobs.s3 import S3BlobStore
from draftstore.digest import Digest, digest_of
from draftstore.errors import BackendUnavailable, BlobNotFound

pytestmark = pytest.mark.real


def _store(real_s3: Any, prefix: str, endpoint: str | None = None, **kwargs: Any) -> S3BlobStore:
    """A store on ``prefix`` of the session's bucket, in-process cache off (every read is a request)."""
    kwargs.setdefault("cache", ObjectCache(0))
    return S3BlobStore(real_s3.bucket, prefix, endpoint_url=endpoint or real_s3.endpoint_url, region="us-east-1",
                       **kwargs)


def _prefix(what: str) -> str:
    return f"{what}-{os.urandom(3).hex()}"


def test_reads_and_writes_answer_every_outcome_and_count_their_requests(real_s3: Any) -> None:
    prefix = _prefix("req")
    store = _store(real_s3, prefix)
    client = real_s3.client()
    try:
        bodies = [b"", b"x", os.urandom(1024), os.urandom(200_000), bytes(range(256)) * 40]
        before = dict(store.calls)
        digests = [store.put(b) for b in bodies]
        assert store.put_many(bodies[2:]) == digests[2:]  # in parallel on the transfer pool
        assert store.calls["put"] - before.get("put", 0) == len(bodies) + 3  # one request per object
        for d, b in zip(digests, bodies):  # read back by another client, byte for byte
            got = client.get_object(Bucket=real_s3.bucket, Key=f"{prefix}/{object_key(d)}")["Body"].read()
            assert got == b

        big, missing = digests[3], Digest("0" * 64)
        data = bodies[3]
        gets = store.calls["get"]
        assert store.get(big) == data
        assert store.get_many([big, digests[1], digests[0]]) == {big: data, digests[1]: b"x", digests[0]: b""}
        assert store.calls["get"] - gets == 4
        ranges = [(str(big), 0, 10), (str(big), 123_456, 5_000), (str(big), 199_990, 100), (str(big), 250_000, 10),
                  (str(big), 200_000, 1)]
        got = store.get_ranges(ranges)
        assert got[ranges[0]] == data[:10]
        assert got[ranges[1]] == data[123_456:128_456]
        assert got[ranges[2]] == data[199_990:]  # cut short at the end
        assert got[ranges[3]] == b"" and got[ranges[4]] == b""  # past the end
        assert store.get_ranges([(str(big), 5, 0)]) == {(str(big), 5, 0): b""}  # nothing asked, nothing sent
        assert store.calls["get_range"] == 5
        with pytest.raises(BlobNotFound):
            store.get(missing)
        with pytest.raises(BlobNotFound):
            store.get_ranges([(str(missing), 0, 10), (str(big), 0, 1)])

        assert store.has(big) and not store.has(missing)
        assert abs(store.modified(big) - time.time()) < 120 and store.modified(missing) is None
        assert set(store.iter_digests()) == set(digests)
        assert {o.digest: o.size for o in store.iter_objects()} == {d: len(b) for d, b in zip(digests, bodies)}
        store.delete(big)
        store.delete(big)  # absent is not an error
        assert not store.has(big) and big not in set(store.iter_digests())
    finally:
        store.close()
        client.close()


def test_an_object_over_the_single_put_limit_goes_up_in_parts_and_reads_back_whole(
        real_s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_module, "SINGLE_PUT_MAX", 1000)
    monkeypatch.setattr(s3_module, "MULTIPART_PART", 5 * 1024 * 1024)  # S3's smallest part
    store = _store(real_s3, _prefix("multipart"))
    try:
        data = os.urandom(6 * 1024 * 1024 + 3)
        d = store.put(data)
        assert store.get(d) == data
        assert [o.size for o in store.iter_objects()] == [len(data)]
    finally:
        store.close()


# the same failure, whichever request meets it
REQUESTS = [("get", lambda store: store.get(Digest("1" * 64))), ("put", lambda store: store.put(b"refused"))]
IDS = [op for op, _ in REQUESTS]


@pytest.mark.parametrize("op,request_", REQUESTS, ids=IDS)
def test_a_rejected_secret_fails_a_request_as_backend_unavailable(real_s3: Any, op: str, request_: Any) -> None:
    store = _store(real_s3, "", aws_access_key_id=real_s3.access_key,
                   aws_secret_access_key=real_s3.secret_key + "-wrong", check=False)
    try:
        with pytest.raises(BackendUnavailable) as info:
            request_(store)
        assert "credentials" in info.value.message
        assert info.value.details["operation"] == op
        assert real_s3.secret_key not in str(info.value)
    finally:
        store.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("op,request_", REQUESTS, ids=IDS)
def test_a_dead_endpoint_fails_a_request_as_backend_unavailable_after_its_attempts(
        real_s3: Any, op: str, request_: Any) -> None:
    store = _store(real_s3, "", endpoint=f"http://127.0.0.1:{_free_port()}", max_attempts=2, connect_timeout_s=0.5,
                   check=False)
    try:
        with pytest.raises(BackendUnavailable) as info:
            request_(store)
        assert "after 2 attempt(s)" in info.value.message
        assert info.value.details["operation"] == op
        assert info.value.__cause__ is not None
    finally:
        store.close()


@pytest.mark.parametrize("op,request_", REQUESTS, ids=IDS)
def test_a_closed_store_refuses_requests(real_s3: Any, op: str, request_: Any) -> None:
    store = _store(real_s3, _prefix("closed"))
    store.close()
    store.close()  # idempotent
    with pytest.raises(Exception) as info:
        request_(store)
    assert getattr(info.value, "code", None) == "backend.error"


def test_a_store_used_in_a_forked_child_fails_typed_instead_of_hanging(real_s3: Any) -> None:
    store = _store(real_s3, _prefix("fork"))
    try:
        d = store.put(b"before the fork")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report the outcome's code through the pipe, never run pytest's teardown
            try:
                store.get(d)
                outcome = "read"
            except Exception as exc:  # noqa: BLE001 - the code is the outcome under test
                outcome = getattr(exc, "code", type(exc).__name__)
            os.write(write, outcome.encode())
            os._exit(0)
        os.close(write)
        deadline = time.monotonic() + 30
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung on its request")
            time.sleep(0.05)
        with os.fdopen(read, "rb") as pipe:
            assert pipe.read() == b"backend.error"
        assert store.get(d) == b"before the fork"  # the parent's store is untouched
    finally:
        store.close()


def test_a_missing_bucket_fails_reads_as_backend_unavailable_naming_it(real_s3: Any) -> None:
    bucket = f"dstest-absent-{os.urandom(4).hex()}"
    store = S3BlobStore(bucket, endpoint_url=real_s3.endpoint_url, region="us-east-1", check=False)
    try:
        for read in (lambda: store.get(Digest("3" * 64)), lambda: store.get_ranges([("3" * 64, 0, 10)])):
            with pytest.raises(BackendUnavailable) as info:
                read()
            assert bucket in info.value.message
            assert info.value.details["s3_code"] == "NoSuchBucket"
    finally:
        store.close()


# -- connections, through a relay that can cut them ------------------------------------------
class Relay:
    """A TCP relay on loopback in front of ``target``: counts the connections it accepts,
    can close every open one (``cut``) and reset the next ``n`` as they arrive (``reset_next``)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.accepted = 0
        self._reset = 0
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                reset, self._reset = self._reset > 0, max(0, self._reset - 1)
            if reset:  # an abortive close: the client sees a reset connection
                down.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                down.close()
                continue
            up = socket.create_connection(self.target)
            with self._lock:
                self._open += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        """Close every relayed connection, both sides, as a server dropping idle keep-alives does."""
        with self._lock:
            conns, self._open = self._open, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def reset_next(self, n: int) -> None:
        with self._lock:
            self._reset = n

    def close(self) -> None:
        self._listener.close()
        self.cut()


@pytest.fixture
def relay(real_s3: Any) -> Iterator[Relay]:
    from urllib.parse import urlsplit

    parts = urlsplit(real_s3.endpoint_url)
    r = Relay((parts.hostname or "127.0.0.1", parts.port or 80))
    try:
        yield r
    finally:
        r.close()


def test_requests_one_after_another_reuse_one_kept_connection(real_s3: Any, relay: Relay) -> None:
    store = _store(real_s3, _prefix("reuse"), endpoint=relay.endpoint)
    try:
        digests = [store.put(os.urandom(100)) for _ in range(10)]
        opened = relay.accepted
        for _ in range(3):
            for d in digests:
                store.get(d)
                store.has(d)
        # 60 more requests on the kept connection (a new one only when a request starts before
        # the previous answer's connection is back in the pool: a race in the client, rare)
        assert relay.accepted - opened <= 3
        store.get_many(digests)  # parallel reads open at most one connection per transfer thread
        assert relay.accepted <= opened + store.workers
    finally:
        store.close()


@pytest.mark.parametrize("op", ["get", "put"])
def test_connections_closed_underneath_are_replaced_without_a_failed_request(
        real_s3: Any, relay: Relay, op: str) -> None:
    # one attempt: only a fresh connection, not a retry, can save these requests
    store = _store(real_s3, _prefix(f"stale{op}"), endpoint=relay.endpoint, max_attempts=1)
    try:
        d = store.put(b"first")
        for n in range(3):
            relay.cut()
            time.sleep(0.2)  # the server's close has reached the client's idle connection
            opened = relay.accepted
            if op == "get":
                assert store.get(d) == b"first"
            else:
                assert store.get(store.put(f"again {n}".encode())) == f"again {n}".encode()
            assert relay.accepted > opened  # on a new connection
    finally:
        store.close()


@pytest.mark.parametrize("op,request_", [("get", lambda store, d: store.get(d) == b"kept"),
                                         ("put", lambda store, d: store.put(b"retried") == digest_of(b"retried"))],
                         ids=IDS)
def test_a_reset_connection_is_retried_up_to_max_attempts(real_s3: Any, relay: Relay, op: str,
                                                           request_: Any) -> None:
    patient = _store(real_s3, _prefix(f"retry{op}"), endpoint=relay.endpoint, max_attempts=3)
    hasty = _store(real_s3, patient.prefix, endpoint=relay.endpoint, max_attempts=1)
    try:
        d = patient.put(b"kept")
        relay.cut()
        time.sleep(0.2)
        relay.reset_next(2)  # the next two connections are reset as they open
        opened = relay.accepted
        assert request_(patient, d)  # the third attempt gets through
        assert relay.accepted >= opened + 3
        relay.cut()
        time.sleep(0.2)
        relay.reset_next(1)
        with pytest.raises(BackendUnavailable) as info:
            request_(hasty, d)
        assert "after 1 attempt(s)" in info.value.message
        assert request_(hasty, d)  # and the next request is fine again
    finally:
        patient.close()
        hasty.close()
