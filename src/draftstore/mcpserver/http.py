"""The MCP tools over streamable HTTP, mounted in the service at ``/mcp``.

URLs (each is one MCP endpoint; POST carries JSON-RPC):

- ``/mcp/projects/{project_id}`` — calls go through the project's running turn
  at the time of each call (reads without one are served unrecorded);
- ``/mcp/projects/{project_id}/turns/{turn_id}`` — calls go through that turn.

Every request is authenticated by the service's own ``Authenticator``: an
agent or admin token (or open mode on loopback); an observer token is
``auth.forbidden`` (403); a token scoped to another project (whatever its role),
an unknown project or a turn of another project is not found (404), so ids
never leak. Refusals
are the service's error bodies ``{"code", "message", "details", "retryable"}``.

Open mode (no token exists; every loopback client is an admin) serves loopback
origins only: a request whose ``Host`` is not a loopback name or address
(``localhost``, ``127.0.0.1``, ``[::1]``, any port), or that carries an
``Origin`` that is not loopback, is ``auth.forbidden`` (403). A web page the
user visits could otherwise reach the endpoint through DNS rebinding and write
drafts. With tokens, the token guards the endpoint and any host name is served.

Stateless streamable HTTP with JSON responses: no session lives in a process,
so any worker of ``draftstore serve --workers N`` answers any request. The
server sends nothing unasked, so it offers no server-to-client stream: a GET
(which would open one, and in stateless mode would never end) is answered
405 ``method.not_allowed`` with ``Allow: POST``, as the MCP transport allows.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from .. import errors as E
from ..records import Role
from ..wire import error_response, exception_response
from .server import build_server
from .tools import AgentTools, Bounds

__all__ = ["McpHttpApp", "SCOPE_KEY"]

SCOPE_KEY = "draftstore.mcp"  # the request scope entry holding the call's AgentTools
MAX_BODY_BYTES = 65 * 1024 * 1024  # one tool call's arguments are at most 64 MiB (MAX_PAYLOAD_BYTES)


def _agent_of(context: Any) -> AgentTools:
    request = context.request_context.request if context is not None else None
    agent = request.scope.get(SCOPE_KEY) if request is not None else None
    if agent is None:  # only the mount below routes requests to this server
        raise E.InvalidInput("this MCP request did not come through /mcp/projects/{project_id}")
    return agent


class _KnownProjects:
    """Ids of projects seen to exist (projects are never deleted), bounded LRU."""

    def __init__(self, size: int = 10_000) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def check(self, store: Any, project_id: str) -> None:
        with self._lock:
            if project_id in self._ids:
                self._ids.move_to_end(project_id)
                return
        store.get_project(project_id)  # project.not_found
        with self._lock:
            self._ids[project_id] = None
            while len(self._ids) > self._size:
                self._ids.popitem(last=False)


class McpHttpApp:
    """ASGI app: authenticate, resolve the project (and turn) from the path, hand the
    request to the SDK's streamable-HTTP session manager with its ``AgentTools`` attached.

    ``lifespan()`` runs the session manager; the service enters it inside its own lifespan.
    """

    def __init__(self, bounds: Bounds | None = None) -> None:
        self.bounds = bounds
        self.server = build_server(_agent_of)
        self._manager: StreamableHTTPSessionManager | None = None
        self._projects = _KnownProjects()

    @asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        # a session manager runs once: a fresh one each time the app starts
        self.server.streamable_http_app(
            json_response=True, stateless_http=True, max_request_body_size=MAX_BODY_BYTES,
            # the tokens guard this endpoint (open mode: auth.check_open_mode_origin); the SDK's Host check
            # would refuse every non-loopback name
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
        manager = self.server.session_manager
        async with manager.run():
            self._manager = manager
            try:
                yield
            finally:
                self._manager = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # websocket: not served here
            return
        try:
            agent = await self._authorize(scope)
        except E.DraftstoreError as exc:
            await exception_response(exc)(scope, receive, send)
            return
        if scope["method"] != "POST":  # GET would open an SSE stream with nothing ever on it; DELETE ends no session
            response = error_response(405, "method.not_allowed", "MCP requests are POSTed: this endpoint offers no "
                                      "server-to-client stream and keeps no session", headers={"Allow": "POST"})
            await response(scope, receive, send)
            return
        if self._manager is None:
            response = error_response(503, "backend.unavailable", "the MCP endpoint is not running",
                                      retryable=True)
            await response(scope, receive, send)
            return
        await self._manager.handle_request({**scope, SCOPE_KEY: agent}, receive, send)

    async def _authorize(self, scope: Scope) -> AgentTools:
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        parts = [p for p in path.split("/") if p]
        if not (len(parts) == 2 and parts[0] == "projects") and \
                not (len(parts) == 4 and parts[0] == "projects" and parts[2] == "turns"):
            raise _RouteNotFound()
        project_id = parts[1]
        turn_id = parts[3] if len(parts) == 4 else None
        app = scope["app"]  # the service; its lifespan set the store and the authenticator
        store, auth = app.state.store, app.state.auth
        # open mode: the authenticator refuses a non-loopback Host or Origin (DNS rebinding),
        # which is why the SDK's own host check is off (see lifespan)
        principal = await auth.principal_async(Request(scope))
        if not principal.may_see(project_id):  # before the role: another project is not found, whoever asks
            raise E.ProjectNotFound(f"no project {project_id!r}", project_id=project_id)
        if principal.role not in (Role.ADMIN, Role.AGENT):
            raise E.Forbidden(f"an {principal.role} token may not use the agent tools", role=principal.role)
        await run_in_threadpool(self._projects.check, store, project_id)
        if turn_id is not None:
            owner = await run_in_threadpool(app.state.turn_projects.project_of, store, turn_id)
            if owner != project_id:
                raise E.turn_not_found(turn_id, project_id)
        return AgentTools(store, project_id, turn_id, self.bounds)


class _RouteNotFound(E.NotFound):
    code = "route.not_found"

    def __init__(self) -> None:
        super().__init__("MCP endpoints are /mcp/projects/{project_id} and "
                         "/mcp/projects/{project_id}/turns/{turn_id}")
