"""JSON responses: records (dataclasses, enums, datetimes) serialised by orjson.

``JSON`` is a ``JSONResponse`` so that FastAPI documents a route's
``response_model`` for it in ``/openapi.json``; a route returns a built
``JSON``, so FastAPI never validates or re-serialises the answer (the model is
documentation, orjson does the work).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from ..wire import dumps

__all__ = ["JSON", "dumps"]


class JSON(JSONResponse):
    """A JSON response of any record, list or dict (no per-field validation: the
    library's records are already exactly what the API documents)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)
