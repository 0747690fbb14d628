"""One keep-alive HTTP/1.1 client connection: a request at a time, the response
parsed by httptools (llhttp, the parser behind uvicorn).

``http.client`` spends about 0.4 ms of CPU on a small GET here, most of it
parsing the response headers through the ``email`` package; a raw socket
with llhttp's parser spends about 0.15 ms. The lean S3 client sends all its
GETs and PUTs through this class.

Guarantees:

- ``request`` returns the whole response (status, body, whether the
  connection may be reused) or raises ``OSError``: ``ConnectionClosed`` when
  the peer closed the connection before the first byte of the response (a
  keep-alive connection the server dropped while idle; the request may be
  sent again on a new connection), ``ProtocolError`` on a malformed or
  truncated response, the socket's own errors (refused, reset, timed out)
  otherwise. After any failure the connection is closed.
- Interim answers (1xx) are skipped; a response's body ends as HTTP/1.1 says: after ``Content-Length`` bytes,
  at the last chunk of a chunked body, or, with neither, when the peer
  closes the connection (which then is not reused).
- Header names and values are sent as given; one holding a CR or LF is
  refused (``ValueError``) before anything is sent.
"""

from __future__ import annotations

import socket
import ssl
from typing import NamedTuple

import httptools

__all__ = ["HTTPConnection", "Response", "ConnectionClosed", "ProtocolError"]

_RECV = 256 * 1024  # bytes per receive
_BIG_BODY = 64 * 1024  # a body this large is sent on its own (not copied onto the request head)


class ConnectionClosed(ConnectionError):
    """The peer closed the connection before sending any byte of the response."""


class ProtocolError(OSError):
    """The response was malformed, or the connection ended in the middle of it."""


class Response(NamedTuple):
    status: int
    body: bytes
    keep_alive: bool  # False: the server closes the connection (this client already did)


class _Reader:
    """httptools' callbacks for one response."""

    __slots__ = ("parser", "chunks", "framed", "headers_done", "keep_alive", "interim", "done")

    def __init__(self) -> None:
        self.parser: httptools.HttpResponseParser | None = None
        self.chunks: list[bytes] = []
        self.framed = False  # a Content-Length or Transfer-Encoding says where the body ends
        self.headers_done = False
        self.keep_alive = False
        self.interim = False  # a 1xx answer: the final response follows it
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.interim = 100 <= self.parser.get_status_code() < 200
        self.headers_done = not self.interim
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.interim:  # e.g. "100 Continue": skipped, as http.client does
            self.interim = False
            self.chunks.clear()
            self.framed = False
            return
        self.done = True


class HTTPConnection:
    """A client connection to ``host:port`` (TLS when ``ssl_context`` is given),
    opened by ``connect`` or by the first request; not thread-safe (one per thread)."""

    def __init__(self, host: str, port: int, *, connect_timeout: float, read_timeout: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.host = host
        self.port = port
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._ssl = ssl_context
        self.sock: socket.socket | None = None
        self._buf = bytearray(_RECV)

    def connect(self) -> None:
        """Open the connection (no-op when open). Raises ``OSError``."""
        if self.sock is not None:
            return
        sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=self.host)
            sock.settimeout(self._read_timeout)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    def request(self, method: str, target: str, headers: dict[str, str], body: bytes | None = None) -> Response:
        """Send one request and read its whole response (module docstring)."""
        lines = [f"{method} {target} HTTP/1.1"]
        for name, value in headers.items():
            lines.append(f"{name}: {value}")
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        if any("\r" in line or "\n" in line for line in lines):
            raise ValueError("a request line or header holds a CR or LF")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self.connect()
        try:
            return self._exchange(data, body)
        except BaseException:
            self.close()
            raise

    def _exchange(self, head: bytes, body: bytes | None) -> Response:
        sock = self.sock
        assert sock is not None
        if body is not None and len(body) >= _BIG_BODY:
            sock.sendall(head)
            sock.sendall(body)
        else:
            sock.sendall(head + body if body else head)
        reader = _Reader()
        parser = reader.parser = httptools.HttpResponseParser(reader)
        buf = self._buf
        view = memoryview(buf)
        got_any = False
        while not reader.done:
            n = sock.recv_into(buf)
            if not n:
                if not got_any:
                    raise ConnectionClosed("the server closed the connection before answering")
                if reader.headers_done and not reader.framed:  # the body ends where the connection does
                    reader.keep_alive = False
                    break
                raise ProtocolError("the connection closed in the middle of a response")
            got_any = True
            try:
                parser.feed_data(view[:n])
            except httptools.HttpParserError as exc:
                raise ProtocolError(f"malformed HTTP response: {exc}") from exc
        response = Response(parser.get_status_code(), b"".join(reader.chunks), reader.keep_alive)
        if not response.keep_alive:
            self.close()
        return response
