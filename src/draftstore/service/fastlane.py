"""The agent's hottest requests, answered without FastAPI's generic per-request machinery.

A turn is mostly tool-call records and file writes. FastAPI's dependency
resolution and body validation cost ~0.15-0.3 ms of CPU per request on top
of routing (measured in-process: the tool-call completion route, store call
stubbed, ~340 us through FastAPI, ~180 us as a plain Starlette route), and
the app's middleware stack (server errors, telemetry, body limit, exception
table, exit stack, then the router trying each route) as much again for a
route that does nothing. For the routes in ``HOT``, ``FastLane`` sits in
front of that stack (the outermost layer after the gate and the body limit,
``app.py``) and does the same work directly. The order is FastAPI's: the gate
(``gate.py``) has authenticated a request with a body before any of it is
read, then the body is read and parsed, then the role is checked:

- the endpoint is the FastAPI route's own function (no handler is written
  twice), called with the same arguments FastAPI would give it: path
  parameters (matched and converted as Starlette matches them), the body
  parsed as FastAPI parses it (``json.loads``, then the body model the
  endpoint's signature names), the request, the store and the principal its
  ``Allow(...)`` default names (same roles, same check);
- a sync endpoint runs on the service's turn pool (``threads.py``), short records
  ahead of the slower calls queued there (the lane ``HOT`` names); an async
  endpoint (the file write, which streams its body) is awaited on the loop and
  hands its store call to a pool itself, so ``HOT`` names no lane for it;
- an error the endpoint or the check raise gets the app's handler for it,
  as the stack's exception layers would give it.

Anything off the happy path (a body that is empty, not JSON, not of the
declared content type, or not valid for its model) is handed over to the
app's own stack with the body replayed: every such answer is FastAPI's own.
The FastAPI routes stay registered: they document the API
(``/openapi.json``) and answer whatever the fast lane hands over.
``create_app(fast_lane=False)`` serves everything through FastAPI (the
parity test compares both).
"""

from __future__ import annotations

import email.message
import functools
import inspect
import json
import typing
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.routing import compile_path, get_route_path

from .auth import authorize
from .threads import TURN, TURN_QUICK, Lane, run_in, run_sync

__all__ = ["HOT", "FastLane", "build"]

# (method, path, lane) of the routes an agent's turn sends most: each must exist in the app.
# A sync endpoint runs on the turn pool (threads.py), the short records ahead of queued
# slower calls; an async endpoint (lane None) awaits a pool of its own choosing.
HOT: tuple[tuple[str, str, Lane | None], ...] = (
    ("POST", "/v1/turns/{turn_id}/tool-calls", TURN_QUICK),
    ("POST", "/v1/turns/{turn_id}/tool-calls/{seq}/complete", TURN_QUICK),
    ("POST", "/v1/turns/{turn_id}/tool-calls/{seq}/fail", TURN_QUICK),
    ("PUT", "/v1/turns/{turn_id}/files/{path:path}", None),  # streams its body, then writes on GENERAL
    ("POST", "/v1/turns/{turn_id}/heartbeat", TURN_QUICK),
    ("POST", "/v1/turns/{turn_id}/deltas", TURN_QUICK),
    ("POST", "/v1/turns/{turn_id}/complete", TURN),
    ("POST", "/v1/projects/{project_id}/turns", TURN),
)

# path parameters whose FastAPI type is int: the plain route matches digits only, and
# anything else falls through to FastAPI's route (which answers 422)
_INT_PARAMS = frozenset({"seq"})
_PATH_PARAMS = frozenset({"turn_id", "project_id", "path", "seq"})


def _json_content_type(value: str | None) -> bool:
    """FastAPI's test for a body it parses as JSON (with a declared content type)."""
    if not value:
        return False
    # a client sends one or two values again and again: each short one is parsed once
    return _json_media_type(value) if len(value) <= 128 else _json_media_type.__wrapped__(value)


@functools.lru_cache(maxsize=64)
def _json_media_type(value: str) -> bool:
    message = email.message.Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class _FastEndpoint:
    """One hot route's work as a plain ASGI app (see the module docstring)."""

    def __init__(self, api_route: APIRoute, front: "FastLane", lane: Lane | None) -> None:
        self.api_route = api_route
        self.front = front  # the fast lane in front of the app: hands over what it does not serve
        fn = api_route.endpoint
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn)
        if self.is_async != (lane is None):  # a lane given to an async endpoint would be ignored
            raise TypeError(f"fast lane: {api_route.path} is {'async' if self.is_async else 'sync'}: "
                            f"{'it picks its own pool, name no lane' if self.is_async else 'name its lane'}")
        self.lane = lane or TURN  # the thread pool (and its queue) a sync endpoint runs on
        params = inspect.signature(fn).parameters
        hints = typing.get_type_hints(fn)
        self.params = tuple(params)
        unknown = [p for p in params if p not in _PATH_PARAMS | {"body", "request", "store", "principal"}]
        if unknown:
            raise TypeError(f"fast lane: {api_route.path} takes {unknown}, which it cannot supply")
        self.model: type[BaseModel] | None = hints.get("body") if "body" in params else None
        if "body" in params and not (isinstance(self.model, type) and issubclass(self.model, BaseModel)):
            raise TypeError(f"fast lane: {api_route.path}'s body is not a required pydantic model")
        default = params["principal"].default if "principal" in params else None
        self.roles = getattr(getattr(default, "dependency", None), "roles", None)
        if self.roles is None:
            raise TypeError(f"fast lane: {api_route.path} has no Allow(...) principal")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # the whole request, answer included, is one span of the store's activity: the
        # event publisher appends between requests, not while this one runs or answers
        with scope["app"].state.store.activity.running():
            await self._serve(scope, receive, send)

    async def _serve(self, scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        body: BaseModel | None = None
        if self.model is not None:
            raw = await request.body()
            body = self._parse(request, raw)
            if body is None:  # off the happy path: FastAPI's route answers, with the body replayed
                await self._hand_over(scope, receive, send, raw)
                return
        principal = await authorize(request, self.roles)
        path_params = scope["path_params"]
        supplied = {"body": body, "request": request, "principal": principal, "store": request.app.state.store}
        kwargs = {p: path_params[p] if p in path_params else supplied[p] for p in self.params}
        if self.is_async:
            response = await self.fn(**kwargs)
        else:
            response = await run_in(self.lane, self.fn, **kwargs)
        await response(scope, receive, send)

    def _parse(self, request: Request, raw: bytes) -> BaseModel | None:
        if not raw or not _json_content_type(request.headers.get("content-type")):
            return None
        try:
            return self.model.model_validate(json.loads(raw))  # type: ignore[union-attr]
        except (ValueError, ValidationError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return None

    async def _hand_over(self, scope: Any, receive: Any, send: Any, raw: bytes) -> None:
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        scope.pop("path_params", None)
        await self.front.hand_over(scope, replay, send)


class FastLane:
    """The outermost layer of the app's middleware stack: a request for a hot route is
    served here, anything else goes on to the app's own stack (``inner``) untouched.

    What the stack's layers do for a hot route is done here: an error the endpoint
    or its check raise gets the app's handler for it (as ``ExceptionMiddleware`` and
    ``ServerErrorMiddleware`` would give it), unless the answer has already begun.
    """

    def __init__(self, app: FastAPI, routes: Iterable[tuple[str, APIRoute, Lane | None]]) -> None:
        self.app = app
        self.inner: Any = None  # the app's own middleware stack, set when the app builds it
        self.routes = []
        for method, api_route, lane in routes:
            regex, _, convertors = compile_path(_fast_path(api_route.path))
            self.routes.append((method, regex, convertors, _FastEndpoint(api_route, self, lane)))

    def match(self, method: str, path: str) -> tuple[_FastEndpoint, dict[str, Any]] | None:
        """The hot route's endpoint for this request, with its path parameters (None: not hot)."""
        for m, regex, convertors, endpoint in self.routes:
            if m == method and (found := regex.match(path)) is not None:
                return endpoint, {k: convertors[k].convert(v) for k, v in found.groupdict().items()}
        return None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        hit = self.match(scope["method"], get_route_path(scope)) if scope["type"] == "http" else None
        if hit is None:
            await self.inner(scope, receive, send)
            return
        endpoint, scope["path_params"] = hit
        started = False

        async def sender(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.serve(endpoint, scope, receive, sender)
        except Exception as exc:
            handler = _handler_for(self.app.exception_handlers, exc)
            if handler is None or started:
                raise
            request = Request(scope, receive)
            if inspect.iscoroutinefunction(handler):
                response = await handler(request, exc)
            else:
                response = await run_sync(handler, request, exc)
            await response(scope, receive, sender)
            exc.__traceback__ = None  # a reused exception instance would keep every request's frames

    async def serve(self, endpoint: _FastEndpoint, scope: Any, receive: Any, send: Any) -> None:
        """A hot request, served here."""
        await endpoint(scope, receive, send)

    async def hand_over(self, scope: Any, receive: Any, send: Any) -> None:
        """A hot request off the happy path, answered by FastAPI's route through the app's stack."""
        await self.inner(scope, receive, send)


def _handler_for(handlers: dict[Any, Any], exc: Exception) -> Any:
    """The app's handler for ``exc``: its class's, else the nearest base class's."""
    if isinstance(exc, StarletteHTTPException) and exc.status_code in handlers:
        return handlers[exc.status_code]
    return next((handlers[cls] for cls in type(exc).__mro__ if cls in handlers), None)


def _fast_path(path: str) -> str:
    for name in _INT_PARAMS:
        path = path.replace("{" + name + "}", "{" + name + ":int}")
    return path


def build(app: FastAPI, routers: Iterable[APIRouter]) -> FastLane:
    """A fast lane for the routes of ``HOT``, found among ``routers`` (those the app
    includes, with no dependencies of their own). The app puts it in front of its
    middleware stack and sets its ``inner`` to that stack (``app.py``)."""
    api_routes = {(method, r.path): r for router in routers for r in router.routes
                  if isinstance(r, APIRoute) for method in r.methods}
    missing = [f"{method} {path}" for method, path, _ in HOT if (method, path) not in api_routes]
    if missing:
        raise RuntimeError(f"fast lane: no route {', '.join(missing)}")
    return FastLane(app, [(method, api_routes[(method, path)], pool) for method, path, pool in HOT])
