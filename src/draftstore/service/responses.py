"""JSON responses: records (dataclasses, enums, datetimes) serialised by orjson."""

from __future__ import annotations

import dataclasses
import json
from datetime import date, datetime
from typing import Any

import orjson
from starlette.responses import Response

__all__ = ["JSON", "dumps"]


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    return str(value)


def dumps(value: Any) -> bytes:
    """orjson, or (for valid JSON values orjson refuses: integers beyond 64 bits, nesting
    deeper than 254 levels, strings holding a lone surrogate) the standard library's encoder."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        return json.dumps(value, default=_plain, separators=(",", ":"), allow_nan=False).encode()


class JSON(Response):
    """A JSON response of any record, list or dict (no per-field validation: the
    library's records are already exactly what the API documents)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)
