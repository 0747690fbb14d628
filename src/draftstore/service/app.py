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
from . import admin, errors, fastlane
from .auth import Authenticator, TurnProjects
from .threads import set_turn_threads
from .routes import health, projects, snapshots, states, streams, tokens, turns
from .routes import sandboxes
from . import openapi

__all__ = ["create_app"]

log = logging.getLogger("draftstore.service")

MAX_BODY_BYTES = 256 * 1024 * 1024


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

    app = _App(title="draftstore", version=__version__, lifespan=lifespan,
               description="The state store behind AI agents that edit a project over many turns.")
    errors.install(app)

    # turns first: an agent's tool-call and write requests are most of the traffic, and routes match in order
    routers = [m.router for m in (health, turns, projects, states, streams, snapshots, tokens)]
    routers.append(sandboxes.router)
    for router in routers:
        app.include_router(router)
    openapi.install(app, routers)  # /openapi.json as the contract (openapi.py)
    app.include_router(admin.router)  # the admin web page at /admin (not in the OpenAPI document)
    if fast_lane:  # the agent's hottest requests, served in front of FastAPI's stack (fastlane.py)
        app.fast_lane = fastlane.build(app, routers)
    app.mount("/mcp", mcp)  # /mcp/projects/{project_id}[/turns/{turn_id}] (docs/mcp.md)
    return app


class _App(FastAPI):
    """FastAPI, with two plain ASGI layers outside its middleware stack: the body
    limit (every request), then the fast lane (``fastlane.py``) if it has one."""

    fast_lane: fastlane.FastLane | None = None

    def build_middleware_stack(self) -> Any:
        stack = super().build_middleware_stack()
        if self.fast_lane is not None:
            self.fast_lane.inner = stack
            stack = self.fast_lane
        return BodyLimit(stack, max_bytes=MAX_BODY_BYTES)


class BodyLimit:
    """Refuse a request whose body is over ``max_bytes`` (413). A declared length
    is checked before anything is read; a body sent without one (chunked) is
    read here, up to the limit, and handed on whole, so no route ever holds
    more than ``max_bytes`` of a request.

    Plain ASGI rather than ``BaseHTTPMiddleware``, which costs a task and a
    stream copy per request (measured: ~0.3 ms of a ~2 ms request).
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            declared = chunked = False
            for name, value in scope["headers"]:
                if name == b"content-length":
                    declared = True
                    if value.isdigit() and int(value) > self.max_bytes:
                        await self._refuse(scope, receive, send)
                        return
                elif name == b"transfer-encoding":
                    chunked = True
            if chunked and not declared:
                body = bytearray()
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left: the app hears it
                        receive = _replay([message], receive)
                        break
                    body += message.get("body", b"")
                    if len(body) > self.max_bytes:
                        await self._refuse(scope, receive, send)
                        return
                    if not message.get("more_body", False):
                        receive = _replay([{"type": "http.request", "body": bytes(body), "more_body": False}],
                                          receive)
                        break
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        response = errors.error_response(413, "payload.too_large", f"request bodies are at most {self.max_bytes} bytes",
                                         {"limit": self.max_bytes})
        await response(scope, receive, send)


def _replay(messages: list[Any], receive: Any) -> Any:
    """A ``receive`` that gives ``messages`` first, then what ``receive`` gives."""
    async def replayed() -> Any:
        return messages.pop(0) if messages else await receive()
    return replayed
