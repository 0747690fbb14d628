"""HTTP errors: the FastAPI handlers that answer every failure through ``wire``
(the one table from the library's typed errors to statuses and bodies, shared
with the MCP endpoint; the body is ``schemas.Error`` in ``/openapi.json``).

Request bodies and parameters FastAPI cannot parse are ``input.invalid``
(422); an unknown route is ``route.not_found`` (404). An unexpected exception
is logged and answered ``internal`` (500) without its text, so a traceback
never reaches a client.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from .. import errors as E
from ..wire import INTERNAL_CODE, INTERNAL_MESSAGE, error_response, exception_response

__all__ = ["error_response", "install"]

log = logging.getLogger("draftstore.service")


def install(app: FastAPI) -> None:
    @app.exception_handler(E.DraftstoreError)
    async def _draftstore(_: Request, exc: E.DraftstoreError) -> Response:
        return exception_response(exc)

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
        return error_response(500, INTERNAL_CODE, INTERNAL_MESSAGE)
