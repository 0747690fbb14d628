"""The agent's hottest requests, answered without FastAPI's generic per-request machinery.

A turn is mostly tool-call records and file writes; FastAPI's dependency
resolution and body validation, generic code paths, cost ~0.15-0.3 ms of CPU
per request on top of routing (measured in-process: the tool-call completion
route, store call stubbed, ~340 us through FastAPI, ~180 us as a plain
Starlette route). For the routes in ``HOT`` the service puts a plain route in
front of FastAPI's that does the same work directly:

- the endpoint is the FastAPI route's own function (no handler is written
  twice), called with the same arguments FastAPI would give it: path
  parameters, the body parsed as FastAPI parses it (``json.loads``, then the
  body model the endpoint's signature names), the request, the store and the
  principal its ``Allow(...)`` default names (same roles, same check);
- a sync endpoint runs in the thread pool, as FastAPI runs it;
- errors the endpoint or the check raise reach the app's error table.

Anything off the happy path (a body that is empty, not JSON, not of the
declared content type, or not valid for its model) is dispatched again
through the app's router, past the fast lane, with the body replayed: every
such answer is FastAPI's own. The
FastAPI routes stay registered: they document the API (``/openapi.json``)
and answer whatever the fast lane hands over. ``create_app(fast_lane=False)``
serves everything through FastAPI (the parity test compares both).
"""

from __future__ import annotations

import email.message
import inspect
import json
import typing
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.routing import Match, Route

from .auth import authorize

__all__ = ["HOT", "install"]

# (method, path) of the routes an agent's turn sends most: each must exist in the app
HOT: tuple[tuple[str, str], ...] = (
    ("POST", "/v1/turns/{turn_id}/tool-calls"),
    ("POST", "/v1/turns/{turn_id}/tool-calls/{seq}/complete"),
    ("POST", "/v1/turns/{turn_id}/tool-calls/{seq}/fail"),
    ("PUT", "/v1/turns/{turn_id}/files/{path:path}"),
    ("POST", "/v1/turns/{turn_id}/heartbeat"),
    ("POST", "/v1/turns/{turn_id}/deltas"),
    ("POST", "/v1/turns/{turn_id}/complete"),
    ("POST", "/v1/projects/{project_id}/turns"),
)

# path parameters whose FastAPI type is int: the plain route matches digits only, and
# anything else falls through to FastAPI's route (which answers 422)
_INT_PARAMS = frozenset({"seq"})
_PATH_PARAMS = frozenset({"turn_id", "project_id", "path", "seq"})
_HANDED_OVER = "draftstore.fast_lane.handed_over"  # scope key: FastAPI's route answers this request


def _json_content_type(value: str | None) -> bool:
    """FastAPI's test for a body it parses as JSON (with a declared content type)."""
    if not value:
        return False
    message = email.message.Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class _FastEndpoint:
    """One hot route's work as a plain ASGI app (see the module docstring)."""

    def __init__(self, api_route: APIRoute, router: Any) -> None:
        self.api_route = api_route
        self.router = router  # the app's router: a handed-over request is dispatched again through it
        fn = api_route.endpoint
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn)
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
            response = await run_in_threadpool(self.fn, **kwargs)
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

        await self.router(dict(scope, **{_HANDED_OVER: True}), replay, send)


class _FastRoute(Route):
    """A plain route that steps aside for a request the fast lane handed over."""

    def matches(self, scope: Any) -> tuple[Match, Any]:
        if scope.get(_HANDED_OVER):
            return Match.NONE, {}
        return super().matches(scope)


def _fast_path(path: str) -> str:
    for name in _INT_PARAMS:
        path = path.replace("{" + name + "}", "{" + name + ":int}")
    return path


def install(app: FastAPI, routers: Iterable[APIRouter]) -> None:
    """Put a plain route in front of the app's routes for each route of ``HOT``, found
    among ``routers`` (those the app includes, with no dependencies of their own)."""
    api_routes = {(method, r.path): r for router in routers for r in router.routes
                  if isinstance(r, APIRoute) for method in r.methods}
    fast = []
    for method, path in HOT:
        api_route = api_routes.get((method, path))
        if api_route is None:
            raise RuntimeError(f"fast lane: no route {method} {path}")
        fast.append(_FastRoute(_fast_path(path), _FastEndpoint(api_route, app.router), methods=[method],
                               include_in_schema=False))
    app.router.routes[:0] = fast
