"""The service's front door: who asks, and how much they send, before anything is read.

FastAPI reads and parses a request's body before the route's dependencies run,
so a route's ``Allow(...)`` alone would let anyone make the service read (and
hold) a body up to the size limit, and answer a malformed one 422 before
saying the caller is unknown. ``Gate`` is the outermost ASGI layer (``app.py``)
and decides from the request line and headers alone:

1. more than ``MAX_HEADERS`` header fields, or more than ``MAX_HEADER_BYTES``
   of them: 431 ``headers.too_large``. The bytes are bounded before they are
   buffered by the server's protocol (``protocol.py``); this check holds under
   any ASGI server;
2. a request that carries a body (a ``Content-Length`` other than 0, or any
   ``Transfer-Encoding``) is authenticated here, as the routes authenticate
   (``auth.Authenticator``, cached, open mode included): an unknown, missing or
   revoked token is answered 401 (403 for open mode's foreign Host/Origin)
   with the body unread, and the connection is closed so the rest of it is
   not read either.

Requests without a body go on untouched: the route's own check answers them,
and there is nothing to read. Whether the caller's *role* may use the route is
still the route's decision (``auth.authorize``), after its body is parsed.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from .. import errors as E

__all__ = ["Gate", "MAX_HEADERS", "MAX_HEADER_BYTES"]

MAX_HEADERS = 100  # header fields per request
MAX_HEADER_BYTES = 64 * 1024  # names and values together; browsers send ~1-2 KiB, a bearer token ~50 bytes


def carries_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """The request says a body follows (a length other than 0, or chunked)."""
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"0", b"")):
            return True
    return False


class Gate:
    """The outermost layer: header bounds, then authentication of any request with a body
    (see the module docstring). Plain ASGI, so it costs one pass over the headers."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            size = sum(len(n) + len(v) for n, v in headers)
            if len(headers) > MAX_HEADERS or size > MAX_HEADER_BYTES:
                await self._answer(scope, receive, send, E.HeadersTooLarge(
                    f"request headers are at most {MAX_HEADERS} fields and {MAX_HEADER_BYTES} bytes",
                    fields=len(headers), bytes=size, max_fields=MAX_HEADERS, max_bytes=MAX_HEADER_BYTES))
                return
            if carries_body(headers):
                auth = scope["app"].state.auth
                try:
                    await auth.principal_async(Request(scope))
                except E.AuthError as exc:
                    await self._answer(scope, receive, send, exc)
                    return
        await self.app(scope, receive, send)

    @staticmethod
    async def _answer(scope: Any, receive: Any, send: Any, exc: E.DraftstoreError) -> None:
        """The app's own answer to ``exc`` (its error table), with the connection closed:
        the body the client may still be sending is never read."""
        handler = scope["app"].exception_handlers[E.DraftstoreError]
        response = await handler(Request(scope), exc)
        response.headers["connection"] = "close"
        await response(scope, receive, send)
