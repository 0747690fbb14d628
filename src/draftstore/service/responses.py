"""JSON responses: records (dataclasses, enums, datetimes) serialised by orjson.

``JSON`` is a ``JSONResponse`` so that FastAPI documents a route's
``response_model`` for it in ``/openapi.json``; a route returns a built
``JSON``, so FastAPI never validates or re-serialises the answer (the model is
documentation, orjson does the work).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from starlette.responses import JSONResponse

from ..records import json_default

__all__ = ["JSON", "dumps"]


def dumps(value: Any) -> bytes:
    """orjson, or (for valid JSON values orjson refuses: integers beyond 64 bits, nesting
    deeper than 254 levels, strings holding a lone surrogate) the standard library's encoder."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        return json.dumps(value, default=json_default, separators=(",", ":"), allow_nan=False).encode()


class JSON(JSONResponse):
    """A JSON response of any record, list or dict (no per-field validation: the
    library's records are already exactly what the API documents)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)
