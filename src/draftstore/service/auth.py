"""Who is asking: bearer tokens, roles and project scopes.

Every route states the roles it admits (``Allow``). A token scoped to one
project that names another project's resource gets ``404`` exactly as if it
did not exist, so ids never leak across projects.

Open mode: while no token exists at all, the service answers loopback
clients only, every one as an admin (``draftstore serve`` refuses to bind any
other address in that state). Creating the first token ends open mode within
``AUTH_CACHE_S``. In open mode a request must also name a loopback ``Host``
and carry no ``Origin`` other than a loopback one (``auth.forbidden``): a web
page the user visits could otherwise reach the service through DNS rebinding.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, Request
from .threads import run_sync

from .. import errors as E
from ..records import Role
from ..store import Store

__all__ = ["Principal", "Allow", "authorize", "StoreDep", "ADMIN", "AGENT", "ANY", "DECIDERS", "PUBLISHED_ONLY",
           "TURN_READERS", "project_scope", "turn_scope",
           "check_open_mode_origin", "loopback_host"]

AUTH_CACHE_S = 5.0  # an authenticated (or revoked) token is re-checked after this long


@dataclass(frozen=True)
class Principal:
    role: Role
    project_id: str | None  # None: every project
    token_id: str | None  # None: open mode
    token_name: str = ""

    @property
    def actor(self) -> str | None:
        """Who this caller is in the records (head moves, versions, turns, approvals) when a
        request names no ``actor``: the token's name, else ``token:<id>``; None in open mode."""
        if self.token_id is None:
            return None
        return self.token_name or f"token:{self.token_id}"

    @property
    def published_only(self) -> bool:
        """This caller reads published versions only, never a draft (an observer, an approver)."""
        return self.role in PUBLISHED_ONLY

    def may_see(self, project_id: str) -> bool:
        return self.project_id is None or self.project_id == project_id


async def get_store(request: Request) -> Store:
    # async: a plain lookup must not cost a thread-pool hop per request
    return request.app.state.store


StoreDep = Annotated[Store, Depends(get_store)]


_EVENT_ROUTE = re.compile(r"/v1/(?:projects|turns)/[^/]+/events")  # the two event streams, nothing below them


def credential(request: Request) -> str | None:
    """The request's ``Authorization`` header; for a GET of an event stream without one, the
    ``access_token`` query parameter as a bearer token (a browser's ``EventSource`` cannot
    send headers). Nowhere else: a token in a URL can end up in a proxy's logs."""
    header = request.headers.get("authorization")
    if header is None and request.method == "GET" and _EVENT_ROUTE.fullmatch(_route_path(request)):
        token = request.query_params.get("access_token")
        if token:
            return f"Bearer {token}"
    return header


def _route_path(request: Request) -> str:
    """The request's path as the app's routes see it (without the root path it is served under)."""
    path, root = request.url.path, request.scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class Authenticator:
    """Tokens -> principals, cached briefly (one database read per token per few seconds)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cache: OrderedDict[str, tuple[float, Principal | E.DraftstoreError]] = OrderedDict()
        self._any_token: tuple[float, bool] = (float("-inf"), False)  # never checked
        self._lock = threading.Lock()

    def _cached_tokens_exist(self) -> bool | None:
        """Whether a token exists, as checked within ``AUTH_CACHE_S`` (None: not lately)."""
        checked, exists = self._any_token
        return exists if time.monotonic() - checked <= AUTH_CACHE_S else None

    def tokens_exist(self) -> bool:
        exists = self._cached_tokens_exist()
        if exists is None:
            exists = self.store.tokens.any_active()
            self._any_token = (time.monotonic(), exists)
        return exists

    async def principal_async(self, request: Request) -> Principal:
        """``principal`` without a thread-pool hop when the answer is cached (the common case)."""
        header = credential(request)
        if header is not None:
            key = hashlib.sha256(header.partition(" ")[2].strip().encode()).hexdigest()
            with self._lock:
                hit = self._cache.get(key)
            if hit is not None and time.monotonic() - hit[0] <= AUTH_CACHE_S and header[:7].lower() == "bearer ":
                if isinstance(hit[1], E.DraftstoreError):
                    raise hit[1]
                return hit[1]
        else:
            exists = self._cached_tokens_exist()
            if exists is not None:
                return self._tokenless(request, exists)
        return await run_sync(self.principal, request)

    def principal(self, request: Request) -> Principal:
        header = credential(request)
        if header is None:
            return self._tokenless(request, self.tokens_exist())
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise E.AuthInvalid("Authorization must be 'Bearer <token>'")
        key = hashlib.sha256(secret.strip().encode()).hexdigest()
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit is None or now - hit[0] > AUTH_CACHE_S:
            try:
                token = self.store.tokens.authenticate(secret.strip())
                result: Principal | E.DraftstoreError = Principal(token.role, token.project_id, token.id, token.name)
            except E.AuthInvalid as exc:
                result = exc
            with self._lock:
                self._cache[key] = (now, result)
                self._cache.move_to_end(key)
                while len(self._cache) > 10_000:
                    self._cache.popitem(last=False)
            hit = (now, result)
        if isinstance(hit[1], E.DraftstoreError):
            raise hit[1]
        return hit[1]

    @staticmethod
    def _tokenless(request: Request, tokens_exist: bool) -> Principal:
        """A request without a token: admin in open mode (no token exists) from loopback, else refused."""
        if not tokens_exist:
            if _loopback(request):
                check_open_mode_origin(request.headers.get("host"), request.headers.get("origin"))
                return Principal(Role.ADMIN, None, None)
            raise E.AuthRequired("no token configured: the service answers loopback clients only")
        raise E.AuthRequired("this route needs a bearer token (Authorization: Bearer dst_...)")


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    return host == "testclient" or loopback_host(host)


def loopback_host(host: str) -> bool:
    """``host`` (a bind address, a Host header, or the host[:port] of an Origin) names this machine's loopback."""
    host = host.strip().lower()
    if host.startswith("["):  # [v6]:port
        name, _, rest = host[1:].partition("]")
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return False
    else:
        name, sep, port = host.rpartition(":") if host.count(":") == 1 else (host, "", "")
        if sep and not port.isdigit():
            return False
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_open_mode_origin(host: str | None, origin: str | None) -> None:
    """In open mode, refuse a request a non-loopback page could have sent (DNS rebinding)."""
    if host is None or not loopback_host(host):
        raise E.Forbidden("open mode (no token exists) serves loopback origins only: this request's Host "
                          "is not a loopback name", host=(host or "")[:200])
    if origin is not None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not loopback_host(parts.netloc):
            raise E.Forbidden("open mode (no token exists) serves loopback origins only: this request's "
                              "Origin is not loopback", origin=origin[:200])


ADMIN = (Role.ADMIN,)
AGENT = (Role.ADMIN, Role.AGENT)
ANY = (Role.ADMIN, Role.AGENT, Role.OBSERVER, Role.APPROVER)
# a turn's record, tool calls and events: what an approver reads to decide
TURN_READERS = (Role.ADMIN, Role.AGENT, Role.APPROVER)
# deciding a tool call awaiting approval is a person's act: never an agent's
DECIDERS = (Role.ADMIN, Role.APPROVER)
# roles that read published versions only, never a draft
PUBLISHED_ONLY = frozenset({Role.OBSERVER, Role.APPROVER})


async def authorize(request: Request, roles: tuple[Role, ...]) -> Principal:
    """The caller's principal, if its role is one of ``roles`` (else ``auth.forbidden``). A
    project-scoped token asking about another project (or a turn of one) is told it is not
    found, whatever its role: 404 before 403, as if the other project did not exist."""
    principal = await request.app.state.auth.principal_async(request)
    if principal.role not in roles:
        if principal.project_id is not None:
            await run_sync(_in_scope, request, principal)
        raise E.Forbidden(f"a {principal.role} token may not do this", role=principal.role)
    return principal


def _in_scope(request: Request, principal: Principal) -> None:
    """Raise the not-found error of the project or turn the request's path names, if it is not
    the scoped token's (or does not exist)."""
    params = request.path_params
    if "project_id" in params:
        project_scope(principal, params["project_id"])
    elif "turn_id" in params:
        turn_scope(principal, request.app.state.store, params["turn_id"], request.app.state.turn_projects)


def Allow(*roles: Role) -> object:
    """A dependency: ``authorize(request, roles)``. The roles stay readable on the
    dependency (``.dependency.roles``: the service's fast lane reads them)."""

    async def check(request: Request) -> Principal:
        return await authorize(request, roles)

    check.roles = roles  # type: ignore[attr-defined]
    return Depends(check)


def project_scope(principal: Principal, project_id: str) -> None:
    """A project-scoped token sees only its project: anything else is not found."""
    if not principal.may_see(project_id):
        raise E.ProjectNotFound(f"no project {project_id!r}", project_id=project_id)


def turn_scope(principal: Principal, store: Store, turn_id: str, cache: "TurnProjects") -> str:
    """The turn's project, checked against the token's scope (404 for another project's turn)."""
    if principal.project_id is None:
        return ""
    project_id = cache.project_of(store, turn_id)
    if project_id != principal.project_id:
        raise E.turn_not_found(turn_id)
    return project_id


class TurnProjects:
    """turn id -> project id (a turn never changes project), bounded LRU."""

    def __init__(self, size: int = 50_000) -> None:
        self._map: OrderedDict[str, str] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def project_of(self, store: Store, turn_id: str) -> str:
        with self._lock:
            hit = self._map.get(turn_id)
        if hit is not None:
            return hit
        project_id = store.get_turn(turn_id, tool_calls=False).project_id
        with self._lock:
            self._map[turn_id] = project_id
            while len(self._map) > self._size:
                self._map.popitem(last=False)
        return project_id
