"""What a client reads when a call fails, the same through every front end.

The HTTP service (``service``) and the MCP endpoint (``mcpserver``) both answer
errors from here, so a code means one status and one body shape whichever door
a client came in by. Every error body is ``{"code", "message", "details",
"retryable"}`` with the library's stable code; ``retryable`` says the same
request may succeed later unchanged. An unexpected exception is answered
``internal`` without its text (the cause is logged where it happened), so a
traceback never reaches a client.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from starlette.responses import Response

from . import errors as E
from .records import json_default

__all__ = [
    "INTERNAL_CODE",
    "INTERNAL_MESSAGE",
    "STATUS",
    "dumps",
    "error_body",
    "error_headers",
    "error_response",
    "exception_response",
    "internal_error",
    "status_of",
]

INTERNAL_CODE = "internal"
INTERNAL_MESSAGE = "internal error (logged on the server)"

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
    """The HTTP status of a library error (500 for a code the table does not place)."""
    return next((status for cls, status in STATUS if isinstance(exc, cls)), 500)


def error_headers(exc: E.DraftstoreError, status: int) -> dict[str, str] | None:
    """The headers a client needs to act on ``exc``: how to authenticate (401), when to retry (503)."""
    if isinstance(exc, E.BackendUnavailable):
        return {"Retry-After": "1"}
    return {"WWW-Authenticate": "Bearer"} if status == 401 else None


def internal_error() -> dict[str, Any]:
    """The error of a request that failed unexpectedly: its code and a message that hides the cause."""
    return {"code": INTERNAL_CODE, "message": INTERNAL_MESSAGE, "retryable": False}


def dumps(value: Any) -> bytes:
    """orjson, or (for valid JSON values orjson refuses: integers beyond 64 bits, nesting
    deeper than 254 levels, strings holding a lone surrogate) the standard library's encoder."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        return json.dumps(value, default=json_default, separators=(",", ":"), allow_nan=False).encode()


def error_body(code: str, message: str, details: dict[str, Any] | None = None, retryable: bool = False) -> dict[str, Any]:
    """The body of every error answer (the ``Error`` schema of ``/openapi.json``)."""
    return {"code": code, "message": message, "details": details or {}, "retryable": retryable}


def error_response(status: int, code: str, message: str, details: dict[str, Any] | None = None,
                   headers: dict[str, str] | None = None, retryable: bool = False) -> Response:
    """An error answer: ``status`` with the JSON ``error_body``."""
    return Response(dumps(error_body(code, message, details, retryable)), status_code=status,
                     media_type="application/json", headers=headers)


def exception_response(exc: E.DraftstoreError) -> Response:
    """The answer to a library error: its status from ``STATUS``, its headers, its body."""
    status = status_of(exc)
    return error_response(status, exc.code, exc.message, exc.details, error_headers(exc, status), exc.retryable)
