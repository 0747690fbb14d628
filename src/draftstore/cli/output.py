"""What the CLI prints: plain text exactly as stored, full ids, aligned columns, JSON.

Nothing here interprets markup: user text (messages, names, paths) is printed
as typed. Ids are never shortened; only free text is cut, with an ellipsis,
so a row stays on one line. ``--json`` output is one JSON document on stdout.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import sys

import click
import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..records import json_default

__all__ = ["echo", "warn", "table", "emit_json", "clip", "message_text", "when", "took", "progress_bar"]

_SPACE = re.compile(r"\s+")


def progress_bar() -> Progress:
    """Progress on stderr, shown only on a terminal (scripts' stderr stays clean)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=False, disable=not sys.stderr.isatty())


def echo(text: str = "") -> None:
    """One line (or block) on stdout, as is."""
    click.echo(text)


def warn(text: str) -> None:
    """A line on stderr."""
    click.echo(text, err=True)


def clip(value: Any, limit: int | None = 60) -> str:
    """Free text on one line: whitespace collapsed, cut to ``limit`` with an ellipsis."""
    text = _SPACE.sub(" ", "" if value is None else str(value)).strip()
    if limit is not None and len(text) > limit:
        return text[: limit - 1] + "…"
    return text


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None) -> None:
    """Aligned columns, two spaces apart; cells are printed whole (clip free text first)."""
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    if title:
        echo(f"{title} ({len(cells)})")
    line = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    echo(line(list(headers)))
    for row in cells:
        echo(line(row))


def emit_json(value: Any) -> None:
    """``value`` (records are dataclasses; datetimes become ISO 8601) as indented JSON on stdout.

    orjson, or (for valid JSON values it refuses: integers beyond 64 bits, nesting deeper
    than 254 levels, strings holding a lone surrogate) the standard library's encoder."""
    try:
        text = orjson.dumps(value, default=json_default, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()
    except orjson.JSONEncodeError:
        text = json.dumps(value, default=json_default, indent=2, ensure_ascii=False)
    click.echo(text)


def message_text(value: Any) -> str:
    """A JSON message as text: a string as it is, else its text parts, else JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("text"), str) and len(value) == 1:
        return value["text"]
    if isinstance(value, dict) and isinstance(value.get("content"), list):
        texts = [part.get("text") for part in value["content"] if isinstance(part, dict)]
        if texts and all(isinstance(t, str) for t in texts):
            return " ".join(texts)
    return json.dumps(value, ensure_ascii=False)


def when(at: datetime | None) -> str:
    """A timestamp to the second, UTC."""
    return "-" if at is None else at.strftime("%Y-%m-%d %H:%M:%S")


def took(start: datetime | None, end: datetime | None) -> str:
    """A duration: ms under a second, else seconds, else minutes."""
    if start is None or end is None:
        return "-"
    d: timedelta = end - start
    s = d.total_seconds()
    if s < 1:
        return f"{s * 1000:.0f}ms"
    if s < 120:
        return f"{s:.1f}s"
    return f"{s / 60:.1f}min"
