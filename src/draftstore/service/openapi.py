"""``/openapi.json`` as the contract a generated client is built from.

FastAPI describes the routes' parameters, bodies and success models; this
module finishes the document once, when it is first asked for (no cost per
request):

- every operation gets a readable, stable ``operationId`` (``OPERATION_IDS``,
  by handler name: a route without one is an error when the document is built);
- every error status an operation can answer is documented with one ``Error``
  schema, the body ``errors.py`` sends (FastAPI's ``HTTPValidationError`` is
  not what this service answers, so it is replaced);
- the bearer scheme is declared and applied to each operation whose handler
  names ``Allow(...)`` (not the health probes);
- schema names are unique: FastAPI names ``Page[Project]`` ``Page_Project_``
  with the title ``Page`` for every page, which generators read as one model
  defined several times; each becomes ``ProjectPage``.

Which errors an operation documents follows from what it does (``_errors``):
any route that checks a token can answer 401 and 403 and reaches the
backends (500, 502, 503); a route with parameters or a body 422; a path
naming a resource 404 (and ``NOT_FOUND_TOO``, whose body names one); a write
409; a request body 413 (the body limit).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from .schemas import Error

__all__ = ["OPERATION_IDS", "install", "finish"]

# handler name -> operationId: <resource>_<action>, what a generated client names its functions
OPERATION_IDS = {
    "healthz": "healthz", "readyz": "readyz",
    # turns and what an agent does during one
    "start_turn": "turns_start", "list_turns": "turns_list", "get_turn": "turns_get", "resume_context": "turns_resume_context",
    "complete": "turns_complete", "interrupt": "turns_interrupt", "fail": "turns_fail", "cancel": "turns_cancel",
    "heartbeat": "turns_heartbeat", "delta": "turns_append_delta",
    "patch_characters": "turns_patch_characters", "patch_world_settings": "turns_patch_world_settings",
    "tool_started": "tool_calls_start", "list_tool_calls": "tool_calls_list",
    "tool_call_payload": "tool_calls_payload",
    "tool_completed": "tool_calls_complete", "tool_failed": "tool_calls_fail", "approval": "tool_calls_decide",
    "write_file": "files_write", "delete_file": "files_delete", "apply_changes": "files_apply_changes",
    "move_file": "files_move",
    # projects, drafts, versions
    "create_project": "projects_create", "list_projects": "projects_list", "get_project": "projects_get",
    "diff": "projects_diff", "publish": "projects_publish", "rollback": "projects_rollback",
    "fork": "projects_fork", "get_draft": "drafts_get", "discard": "drafts_discard", "revert": "drafts_revert",
    "list_versions": "versions_list", "get_version": "versions_get", "list_head_moves": "head_moves_list",
    # reads through a view
    "state": "view_state", "read_file": "view_read_file", "stat": "view_stat", "list_dir": "view_list_dir",
    "find_files": "view_find_files", "search_code": "view_search_code",
    "turn_events": "events_turn", "project_events": "events_project",
    "list_snapshots": "snapshots_list", "create_snapshot": "snapshots_create", "best_snapshot": "snapshots_best",
    "open_sandbox_session": "sandbox_sessions_open", "list_sandbox_sessions": "sandbox_sessions_list",
    "get_sandbox_session": "sandbox_sessions_get", "sandbox_session_heartbeat": "sandbox_sessions_heartbeat",
    "close_sandbox_session": "sandbox_sessions_close",
    "whoami": "whoami", "create_token": "tokens_create", "list_tokens": "tokens_list",
    "revoke_token": "tokens_revoke",
}

# operations without a resource in their path that still answer 404: the body names a resource
NOT_FOUND_TOO = {"tokens_create"}  # a token scoped to a project that does not exist

ERROR_STATUSES = {
    401: "no token, or not a valid one (auth.required, auth.invalid)",
    403: "the token's role may not do this (auth.forbidden)",
    404: "not found, or outside the token's project",
    409: "the state does not allow it (a conflict: turn.not_running, publish.conflict, ...)",
    413: "the request body is too large (payload.too_large)",
    422: "invalid input (input.invalid and the library's other input errors)",
    500: "an unexpected error (internal; logged on the server)",
    502: "a backend answered an error (backend.error)",
    503: "a backend is unreachable (backend.unavailable, retryable)",
}

BEARER = {"type": "http", "scheme": "bearer", "description": (
    "An API token (``draftstore token create``). While no token exists (open mode) the service "
    "answers loopback clients without one.")}

_REF = "#/components/schemas/"
_PAGE = re.compile(r"Page_(\w+)_")


def install(app: FastAPI, routers: list[APIRouter]) -> None:
    """Serve the finished document as the app's ``openapi()``: FastAPI builds and caches it,
    it is finished once per build. ``routers`` hold every route the document lists."""
    plain = app.openapi
    routes = [route for router in routers for route in router.routes]
    finished: list[dict[str, Any]] = []  # the build last finished (held: its identity is the test)

    def openapi() -> dict[str, Any]:
        doc = plain()
        if not finished or finished[0] is not doc:  # a new build of FastAPI's (cached until the routes change)
            finished[:] = [finish(doc, routes)]
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def finish(doc: dict[str, Any], routes: list[Any]) -> dict[str, Any]:
    """The document FastAPI built, finished as the module docstring says (changed in place).
    Raises ``LookupError`` for a route with no operation id, or one outside ``routes``."""
    by_op: dict[tuple[str, str], APIRoute] = {}
    for route in routes:
        if isinstance(route, APIRoute) and route.include_in_schema:
            if route.name not in OPERATION_IDS:
                raise LookupError(f"no operationId for the route {route.path} ({route.name}): add it to OPERATION_IDS")
            for method in route.methods or ():
                by_op[(method.lower(), route.path_format)] = route
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = Error.model_json_schema(ref_template=_REF + "{model}")
    doc["components"]["securitySchemes"] = {"bearer": BEARER}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            route = by_op.get((method, path))
            if route is None:
                raise LookupError(f"{method.upper()} {path} is in no router given to openapi.install")
            op["operationId"] = OPERATION_IDS[route.name]
            secured = _roles(route) is not None
            if secured:
                op["security"] = [{"bearer": []}]
            responses = op["responses"]
            for status in _errors(method, path, op, secured):
                responses[str(status)] = {"description": ERROR_STATUSES[status], "content": {
                    "application/json": {"schema": {"$ref": _REF + "Error"}}}}
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's, never sent by this service
        schemas.pop(name, None)
    return _unique_names(doc)


def _roles(route: APIRoute) -> tuple[Any, ...] | None:
    """The roles the handler's ``Allow(...)`` admits (auth.py), None for an open route."""
    param = inspect.signature(route.endpoint).parameters.get("principal")
    dependency = getattr(param.default, "dependency", None) if param is not None else None
    return getattr(dependency, "roles", None)


def _errors(method: str, path: str, op: dict[str, Any], secured: bool) -> list[int]:
    """The error statuses an operation can answer (the rule in the module docstring)."""
    if not secured:  # the health probes: no token, no input, no store call that can fail as an error body
        return []
    statuses = {401, 403, 500, 502, 503}
    if op.get("parameters") or "requestBody" in op:
        statuses.add(422)
    if "{" in path or op["operationId"] in NOT_FOUND_TOO:
        statuses.add(404)
    if method != "get":
        statuses.add(409)
    if "requestBody" in op:
        statuses.add(413)
    return sorted(statuses)


def _unique_names(doc: dict[str, Any]) -> dict[str, Any]:
    """``Page_X_`` -> ``XPage`` (the key, its title and every reference); every schema titled
    with its (unique) name, since generators name models by title."""
    schemas = doc["components"]["schemas"]
    renamed = {name: f"{m.group(1)}Page" for name in schemas if (m := _PAGE.fullmatch(name))}
    for old, new in renamed.items():
        schemas[new] = schemas.pop(old)
    for name, schema in schemas.items():
        schema["title"] = name
    doc["components"]["schemas"] = dict(sorted(schemas.items()))

    def relink(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith(_REF) and ref[len(_REF):] in renamed:
                node["$ref"] = _REF + renamed[ref[len(_REF):]]
            for value in node.values():
                relink(value)
        elif isinstance(node, list):
            for value in node:
                relink(value)

    relink(doc)
    return doc
