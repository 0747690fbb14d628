"""The service's request-size guard (``service.app.BodyLimit``), at the ASGI level.

A body over the limit is refused with 413 ``payload.too_large`` whether its
length is declared (the route never runs) or it comes chunked with none (the
body streams to the route as it arrives, and the read that passes the limit is
answered 413 while the route hears the client left): no route ever holds more
than the limit of one request, and the guard buffers nothing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from draftstore.service.app import BodyLimit


class _Route:
    """The app behind the guard: reads the whole body, answers 200 with its length."""

    def __init__(self) -> None:
        self.calls = 0
        self.seen: list[Any] = []
        self.sent: list[Any] = []  # what the client was sent, by the guard or the route

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls += 1
        body = b""
        while True:
            message = await receive()
            self.seen.append(message["type"])
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})


class _Ignoring(_Route):
    """A route that answers without reading the body (an unknown route's 404, a heartbeat)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls += 1
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _call(headers: list[tuple[bytes, bytes]], chunks: list[bytes], limit: int,
          disconnect_after: int | None = None, route: _Route | None = None) -> tuple[_Route, int, bytes]:
    """(the route, the status sent or 0 for none, the body sent)"""
    route = route or _Route()
    guard = BodyLimit(route, max_bytes=limit)
    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    if disconnect_after is not None:
        incoming = incoming[:disconnect_after] + [{"type": "http.disconnect"}]
    sent: list[Any] = []

    async def receive() -> Any:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/projects", "headers": headers}
    asyncio.run(guard(scope, receive, send))
    route.sent = sent
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), 0)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return route, status, body


CHUNKED = [(b"transfer-encoding", b"chunked"), (b"content-type", b"application/json")]


def test_a_chunked_body_over_the_limit_is_refused_once_it_passes_the_limit() -> None:
    route, status, body = _call(CHUNKED, [b"x" * 400] * 5, limit=1000)
    assert status == 413
    answer = json.loads(body)
    assert answer["code"] == "payload.too_large" and answer["details"]["limit"] == 1000
    # the route read two chunks (800 bytes), then heard the client leave: it never held more than the limit
    assert route.seen == ["http.request", "http.request", "http.disconnect"]


def test_a_chunked_body_within_the_limit_streams_to_the_route_as_it_arrives() -> None:
    route, status, body = _call(CHUNKED, [b"x" * 300] * 3 + [b""], limit=1000)
    assert (status, body, route.calls) == (200, b"900", 1)
    assert route.seen == ["http.request"] * 4  # chunk by chunk, nothing buffered in between


def test_an_answer_given_before_the_body_is_read_closes_the_connection() -> None:
    route, status, _ = _call(CHUNKED, [b"x" * 400] * 5, limit=1000)
    assert status == 413
    # what the service does not read, it does not wait for: the server closes the connection
    start = next(m for m in route.sent if m["type"] == "http.response.start")
    assert (b"connection", b"close") in start["headers"]


def test_a_declared_length_over_the_limit_is_refused_unread() -> None:
    route, status, body = _call([(b"content-length", b"5000")], [b"x" * 5000], limit=1000)
    assert status == 413 and route.calls == 0 and json.loads(body)["code"] == "payload.too_large"
    route, status, body = _call([(b"content-length", b"900")], [b"x" * 900], limit=1000)
    assert (status, body) == (200, b"900")


def test_a_client_that_leaves_mid_body_is_heard_as_gone_by_the_route() -> None:
    route, status, _ = _call(CHUNKED, [b"x" * 100] * 5, limit=1000, disconnect_after=2)
    assert route.calls == 1 and route.seen == ["http.request", "http.request", "http.disconnect"]
    assert status == 0  # nothing is answered to a client that left


def closes(route: _Route) -> bool:
    start = next(m for m in route.sent if m["type"] == "http.response.start")
    return (b"connection", b"close") in start["headers"]


def test_a_route_that_ignores_a_big_or_chunked_body_closes_the_connection_and_a_small_one_keeps_it() -> None:
    big = [(b"content-length", b"500000")]
    route, status, _ = _call(big, [b"x" * 1000, b"x" * 499_000], limit=10**6, route=_Ignoring())
    assert status == 204 and closes(route)  # the server would read 500 kB it has no use for
    route, status, _ = _call(CHUNKED, [b"x" * 1000] * 3, limit=10**6, route=_Ignoring())
    assert status == 204 and closes(route)  # a chunked rest could be any size
    route, status, _ = _call([(b"content-length", b"2")], [b"{}"], limit=10**6, route=_Ignoring())
    assert status == 204 and not closes(route)  # a heartbeat's "{}": skipped, the connection kept
