"""``blobs.http1``: one keep-alive HTTP/1.1 connection, against a loopback server that
answers exactly the bytes each test scripts (every way a response can end, and fail)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from draftstore.blobs.http1 import ConnectionClosed, HTTPConnection, ProtocolError

Script = Callable[[socket.socket, bytes], None]  # (the accepted socket, the request's bytes)


@pytest.fixture
def server() -> Iterator[Callable[[list[Script]], tuple[int, list[bytes], list[int]]]]:
    """Start a server answering the i-th request with the i-th script (on whichever
    connection it arrives); returns (port, requests seen, connections accepted)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(scripts: list[Script]) -> tuple[int, list[bytes], list[int]]:
        seen: list[bytes] = []
        accepted = [0]

        def serve_conn(conn: socket.socket) -> None:
            with conn:
                buf = b""
                while scripts:
                    while b"\r\n\r\n" not in buf:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        buf += chunk
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    while len(buf) < length:
                        buf += conn.recv(65536)
                    seen.append(head + b"\r\n\r\n" + buf[:length])
                    buf = buf[length:]
                    scripts.pop(0)(conn, seen[-1])

        def accept() -> None:
            listener.settimeout(0.2)
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                accepted[0] += 1
                t = threading.Thread(target=serve_conn, args=(conn,), daemon=True)
                t.start()
                threads.append(t)

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        threads.append(t)
        return listener.getsockname()[1], seen, accepted

    yield start
    stop.set()
    for t in threads:
        t.join(timeout=2)
    listener.close()


def _send(data: bytes) -> Script:
    return lambda conn, _: conn.sendall(data)


def _conn(port: int) -> HTTPConnection:
    return HTTPConnection("127.0.0.1", port, connect_timeout=2, read_timeout=2)


def test_content_length_responses_reuse_one_connection(server) -> None:  # type: ignore[no-untyped-def]
    port, seen, accepted = server([_send(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"),
                                   _send(b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nnop")])
    c = _conn(port)
    r = c.request("GET", "/b/k", {"Host": "h", "Range": "bytes=0-4"})
    assert (r.status, r.body, r.keep_alive) == (200, b"hello", True)
    r = c.request("PUT", "/b/k2", {"Host": "h"}, b"body!")
    assert (r.status, r.body) == (404, b"nop")
    assert accepted[0] == 1
    assert seen[0].startswith(b"GET /b/k HTTP/1.1\r\nHost: h\r\nRange: bytes=0-4\r\n\r\n")
    assert seen[1].endswith(b"Content-Length: 5\r\n\r\nbody!")
    c.close()


def test_an_interim_answer_is_skipped(server) -> None:  # type: ignore[no-untyped-def]
    port, _, _ = server([_send(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ndone")])
    r = _conn(port).request("PUT", "/", {}, b"x")
    assert (r.status, r.body, r.keep_alive) == (200, b"done", True)


def test_a_chunked_body_is_reassembled(server) -> None:  # type: ignore[no-untyped-def]
    port, _, _ = server([_send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                               b"4\r\nWiki\r\n6\r\npedia \r\nE\r\nin \r\n\r\nchunks.\r\n0\r\n\r\n")])
    r = _conn(port).request("GET", "/", {})
    assert (r.status, r.body, r.keep_alive) == (200, b"Wikipedia in \r\n\r\nchunks.", True)


def test_a_body_split_across_many_packets_and_a_large_one_arrive_whole(server) -> None:  # type: ignore[no-untyped-def]
    big = bytes(range(256)) * 8192  # 2 MiB, several receives

    def trickle(conn: socket.socket, _: bytes) -> None:
        for piece in (b"HTTP/1.1 20", b"0 OK\r\nConte", b"nt-Length: 3\r\n", b"\r\na", b"bc"):
            conn.sendall(piece)

    port, seen, _ = server([trickle, _send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big)])
    c = _conn(port)
    assert c.request("GET", "/", {}).body == b"abc"
    assert c.request("PUT", "/", {}, big).body == big
    assert seen[1].endswith(big)


def test_without_length_the_body_ends_with_the_connection(server) -> None:  # type: ignore[no-untyped-def]
    def answer_and_close(conn: socket.socket, _: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        conn.shutdown(socket.SHUT_WR)

    port, _, _ = server([answer_and_close])
    c = _conn(port)
    r = c.request("GET", "/", {})
    assert (r.status, r.body, r.keep_alive) == (200, b"until the end", False)
    assert c.sock is None  # not reused


def test_connection_close_and_http_1_0_are_not_reused(server) -> None:  # type: ignore[no-untyped-def]
    port, _, accepted = server([_send(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"),
                                _send(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"),
                                _send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")])
    c = _conn(port)
    for _ in range(2):
        r = c.request("GET", "/", {})
        assert (r.body, r.keep_alive, c.sock) == (b"ok", False, None)
    assert c.request("GET", "/", {}).keep_alive is True
    assert accepted[0] == 3


@pytest.mark.parametrize("answer,error", [
    (b"", ConnectionClosed),  # closed before answering: the request may be sent again
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", ProtocolError),  # cut short
    (b"HTTP/1.1 200 OK\r\nContent-Le", ProtocolError),  # in the headers
    (b"NOT HTTP AT ALL\r\n\r\n", ProtocolError),  # malformed
], ids=["closed-before-answering", "body-cut-short", "headers-cut-short", "malformed"])
def test_a_missing_truncated_or_malformed_response_fails_typed_and_closes(  # type: ignore[no-untyped-def]
        server, answer: bytes, error: type[OSError]) -> None:
    def answer_and_close(conn: socket.socket, _: bytes) -> None:
        conn.sendall(answer)
        conn.shutdown(socket.SHUT_RDWR)

    port, _, _ = server([answer_and_close])
    c = _conn(port)
    with pytest.raises(error):
        c.request("GET", "/", {})
    assert c.sock is None


def test_a_silent_server_times_out(server) -> None:  # type: ignore[no-untyped-def]
    port, _, _ = server([lambda conn, _: time.sleep(1)])  # holds the connection open, answers nothing
    c = HTTPConnection("127.0.0.1", port, connect_timeout=2, read_timeout=0.3)
    with pytest.raises(TimeoutError):
        c.request("GET", "/", {})
    assert c.sock is None


@pytest.mark.parametrize("headers,target", [({"X-Evil": "a\r\nInjected: 1"}, "/"), ({}, "/a b HTTP/1.1\r\nX: y")])
def test_a_cr_or_lf_in_a_header_or_target_is_refused_before_sending(headers: dict[str, str], target: str) -> None:
    c = HTTPConnection("127.0.0.1", 9, connect_timeout=0.5, read_timeout=0.5)  # never connected
    with pytest.raises(ValueError):
        c.request("GET", target, headers)
    assert c.sock is None


def test_a_refused_connection_raises_oserror() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    with pytest.raises(ConnectionRefusedError):
        _conn(port).request("GET", "/", {})
