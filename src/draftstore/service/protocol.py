"""The HTTP/1.1 protocol ``draftstore serve`` runs: uvicorn's httptools protocol with a bound
on a request's head (request line and headers).

uvicorn bounds a request's head only on its h11 protocol
(``h11_max_incomplete_event_size``); httptools (llhttp) has no limit, so a
client could make the server buffer a header of any size before the app sees
it (a 48 MB header was answered 200). ``BoundedHead`` counts the bytes that
arrive while a request's head is incomplete and, past ``MAX_HEAD_BYTES``,
answers 431 ``headers.too_large`` and closes the connection. The bound is
``MAX_HEAD_BYTES`` plus one socket read (at most 64 KiB, asyncio's read size).
The ASGI ``Gate`` (``gate.py``) then bounds the parsed fields (count and bytes)
under any server.
"""

from __future__ import annotations

import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .gate import MAX_HEADER_BYTES

__all__ = ["BoundedHead", "MAX_HEAD_BYTES"]

MAX_HEAD_BYTES = MAX_HEADER_BYTES + 8 * 1024  # the header fields plus a request line (the URL) of up to 8 KiB

_BODY = json.dumps({"code": "headers.too_large", "retryable": False, "details": {"max_bytes": MAX_HEAD_BYTES},
                    "message": f"a request's line and headers are at most {MAX_HEAD_BYTES} bytes"}).encode()
_REFUSAL = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(_BODY)) + _BODY


class BoundedHead(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a request whose head passes ``MAX_HEAD_BYTES``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # a connection starts with a request's head
        self._head_bytes = 0

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                if self.cycle is None or self.cycle.response_complete:  # not in the middle of an answer
                    self.transport.write(_REFUSAL)
                self.transport.close()
                return
        super().data_received(data)
