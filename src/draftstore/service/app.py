"""The HTTP service: a thin FastAPI layer over one ``Store``.

``create_app()`` opens the store the ``DRAFTSTORE_*`` environment describes
(or takes one), installs the error table and the routes. Every handler calls
the store and maps its typed errors; no domain logic lives here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from typing import Any

from fastapi import FastAPI

from .. import __version__
from ..heap import tune_collector
from ..mcpserver import mcp_http_app
from ..store import Store
from . import admin, docs, errors, fastlane
from .auth import Authenticator, TurnProjects
from .gate import Gate, carries_body
from .threads import set_turn_threads
from .routes import health, projects, snapshots, states, streams, tokens, turns
from .routes import sandboxes
from . import openapi

__all__ = ["create_app"]

log = logging.getLogger("draftstore.service")

MAX_BODY_BYTES = 256 * 1024 * 1024
UNREAD_KEPT_BYTES = 64 * 1024  # an answer leaving more of a body unread (or any of a chunked one) closes the connection


def _background(store: Store, stop: threading.Event) -> None:
    """Off every request's path: pack newly published versions, build scheduled snapshots."""
    while not stop.wait(store.settings.background_interval_s):
        try:
            store.run_background(limit=5)
        except Exception:  # logged; the next round tries again
            log.exception("background work failed")


def create_app(store: Store | None = None, *, fast_lane: bool = True) -> FastAPI:
    """The service app. Without ``store``, one is opened from the environment at
    startup and closed at shutdown. ``fast_lane=False`` serves the hot agent routes
    through FastAPI too (``fastlane.py``; the same answers, more CPU per request)."""
    mcp = mcp_http_app()  # the agent tools over MCP (streamable HTTP), mounted at /mcp below

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = store is None
        s = Store.from_env() if owned else store
        app.state.store = s
        app.state.auth = Authenticator(s)
        app.state.turn_projects = TurnProjects()
        set_turn_threads(s.settings.turn_threads)
        tune_collector()  # start-up heap frozen, fewer young collections (heap.py)
        stop = threading.Event()
        worker = None
        if s.settings.background_interval_s > 0:
            worker = threading.Thread(target=_background, args=(s, stop), name="draftstore-background", daemon=True)
            worker.start()
        try:
            async with mcp.lifespan():
                yield
        finally:
            stop.set()
            if worker is not None:
                worker.join(timeout=30)
            if owned:
                s.close()

    # docs_url/redoc_url None: FastAPI's pages load their scripts from a CDN; /docs is served from the package (docs.py)
    app = _App(title="draftstore", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
               description="The state store behind AI agents that edit a project over many turns.")
    errors.install(app)

    # turns first: an agent's tool-call and write requests are most of the traffic, and routes match in order
    routers = [m.router for m in (health, turns, projects, states, streams, snapshots, tokens)]
    routers.append(sandboxes.router)
    for router in routers:
        app.include_router(router)
    openapi.install(app, routers)  # /openapi.json as the contract (openapi.py)
    app.include_router(admin.router)  # the admin web page at /admin (not in the OpenAPI document)
    app.include_router(docs.router)  # the API's documentation at /docs, Swagger UI from the package (docs.py)
    if fast_lane:  # the agent's hottest requests, served in front of FastAPI's stack (fastlane.py)
        app.fast_lane = fastlane.build(app, routers)
    app.mount("/mcp", mcp)  # /mcp/projects/{project_id}[/turns/{turn_id}] (docs/mcp.md)
    return app


class _App(FastAPI):
    """FastAPI, with plain ASGI layers outside its middleware stack, outermost
    first: the gate (header bounds, authentication before any body is read:
    ``gate.py``), the body limit, then the fast lane (``fastlane.py``) if it has one."""

    fast_lane: fastlane.FastLane | None = None

    def build_middleware_stack(self) -> Any:
        stack = super().build_middleware_stack()
        if self.fast_lane is not None:
            self.fast_lane.inner = stack
            stack = self.fast_lane
        return Gate(BodyLimit(stack, max_bytes=MAX_BODY_BYTES))


class BodyLimit:
    """Refuse a request whose body is over ``max_bytes`` (413 ``payload.too_large``)
    without ever reading more than that. A declared length over the limit is
    refused before anything is read. Any other body (a smaller declared length,
    or chunked with none) streams through to the route as it arrives, counted:
    the read that passes the limit is answered 413 (if the route has not begun
    its answer) and the route hears that the client left, so no route holds
    more than ``max_bytes`` of a request and nothing is buffered here.

    An answer given before the body was read to its end (a 404, a 413) closes
    the connection when the rest is chunked or more than ``UNREAD_KEPT_BYTES``,
    so the server does not read it either; a smaller declared rest is skipped
    by the server and the connection kept.

    Plain ASGI rather than ``BaseHTTPMiddleware``, which costs a task and a
    stream copy per request (measured: ~0.3 ms of a ~2 ms request).
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared: int | None = None
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit():
                declared = int(value)
                if declared > self.max_bytes:
                    await self._refuse(scope, receive, send)
                    return
        received = 0
        unread = carries_body(scope["headers"])  # body bytes may still be on their way
        started = refused = False

        async def counted() -> Any:
            nonlocal received, unread, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] != "http.request":
                unread = False
                return message
            received += len(message.get("body", b""))
            unread = message.get("more_body", False)
            if received > self.max_bytes:
                refused = True
                if not started:
                    await self._refuse(scope, receive, send)
                return {"type": "http.disconnect"}  # the route stops reading; its answer is dropped
            return message

        async def answer(message: Any) -> None:
            nonlocal started
            if refused:
                return
            if message["type"] == "http.response.start":
                started = True
                # a small unread rest (a body a route ignores) is cheaper to skip than a new connection
                if unread and (declared is None or declared - received > UNREAD_KEPT_BYTES):
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, counted, answer)

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        response = errors.error_response(413, "payload.too_large", f"request bodies are at most {self.max_bytes} bytes",
                                         {"limit": self.max_bytes}, headers={"connection": "close"})
        await response(scope, receive, send)
