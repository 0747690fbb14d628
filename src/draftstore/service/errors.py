"""HTTP errors: one table from the library's typed errors to HTTP statuses.

Every error body is ``{"code", "message", "details", "retryable"}`` (the
``Error`` schema of ``/openapi.json``, ``schemas.Error``) with the library's stable code; ``retryable`` says the same request may succeed later
unchanged (a backend came back, a lock was freed). Request bodies and parameters FastAPI cannot parse are
``input.invalid`` (422); an unknown route is ``route.not_found`` (404). An
unexpected exception is logged and answered ``internal`` (500) without its
text, so a traceback never reaches a client.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from .. import errors as E
from .responses import dumps

__all__ = ["STATUS", "status_of", "error_response", "install"]

log = logging.getLogger("draftstore.service")

# most specific first: the first class an error is an instance of decides
STATUS: list[tuple[type[E.DraftstoreError], int]] = [
    (E.AuthRequired, 401),
    (E.AuthInvalid, 401),
    (E.Forbidden, 403),
    (E.PayloadTooLarge, 413),
    (E.HeadersTooLarge, 431),
    (E.NotFound, 404),
    (E.StateConflict, 409),
    (E.InvalidInput, 422),
    (E.BackendUnavailable, 503),
    (E.SchemaOutdated, 503),
    (E.IntegrityError, 500),
    (E.BackendError, 502),
]


def status_of(exc: E.DraftstoreError) -> int:
    return next((status for cls, status in STATUS if isinstance(exc, cls)), 500)


def error_response(status: int, code: str, message: str, details: dict[str, Any] | None = None,
                   headers: dict[str, str] | None = None, retryable: bool = False) -> Response:
    body = dumps({"code": code, "message": message, "details": details or {}, "retryable": retryable})
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def install(app: FastAPI) -> None:
    @app.exception_handler(E.DraftstoreError)
    async def _draftstore(_: Request, exc: E.DraftstoreError) -> Response:
        status = status_of(exc)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        if isinstance(exc, E.BackendUnavailable):
            headers = {"Retry-After": "1"}
        return error_response(status, exc.code, exc.message, exc.details, headers, exc.retryable)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"])
        return error_response(422, E.InvalidInput.code, f"{where}: {first['msg']}", {"errors": errors})

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400:  # FastAPI: a body it could not parse (not UTF-8, nested too deeply)
            return error_response(422, E.InvalidInput.code, "the request body is not a JSON value this service reads",
                                  {"reason": str(exc.detail)})
        code = {404: "route.not_found", 405: "method.not_allowed"}.get(exc.status_code, "http.error")
        return error_response(exc.status_code, code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, "internal", "internal error (logged on the server)")
