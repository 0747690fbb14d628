"""JSON responses: records (dataclasses, enums, datetimes) serialised by orjson."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

__all__ = ["JSON", "dumps"]


def dumps(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)


class JSON(Response):
    """A JSON response of any record, list or dict (no per-field validation: the
    library's records are already exactly what the API documents)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)
