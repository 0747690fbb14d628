"""Every check on caller input, in one place, before anything is stored.

The database backends disagree on what they accept (PostgreSQL refuses a NUL
character and a string longer than its column; SQLite takes both), so every
value crosses a check here first and the outcome is the same typed error on
every backend: ``input.invalid`` (or a more specific code) and nothing changed.

Rules for stored text (names, actors, summaries, tool names, messages, JSON
strings): a ``str``, valid Unicode (no lone surrogate), no NUL character,
within its length limit. Paths have their own validator (``paths.py``).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import errors as E
from .paths import normalize_path, parent_dirs
from .settings import Limits

__all__ = [
    "JSONText",
    "dump_json",
    "as_value",
    "text",
    "name",
    "actor",
    "json_text",
    "json_value",
    "message",
    "file_data",
    "batch",
    "batch_shape",
    "executables",
    "project_id",
    "turn_id",
    "version_id",
    "session_id",
    "snapshot_id",
    "flag",
    "seq",
    "MAX_NAME_CHARS",
    "MAX_ACTOR_CHARS",
]

MAX_NAME_CHARS = 200  # project names, tool names (the columns' length)
MAX_ACTOR_CHARS = 200
_MAX_SEQ = 2**31 - 1  # the seq column is a 32-bit integer

_ID = re.compile(r"[0-9a-f]{32}")
# json.dumps writes NUL as \u0000; an escaped backslash before "u0000" is not one
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


class JSONText(str):
    """JSON text already serialised and checked; stored as it is (``dump_json``
    passes it through, so a value is never serialised twice)."""

    __slots__ = ()


def dump_json(value: Any) -> str:
    """The serialiser the database engines use for JSON columns."""
    if isinstance(value, JSONText):
        return value
    out = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return _dumps_exact(value) if "e+" in out else out


def as_value(value: Any) -> Any:
    """The Python value of ``value`` (parsed if it is checked ``JSONText``)."""
    return json.loads(value) if isinstance(value, JSONText) else value


def _check_chars(field: str, value: str) -> None:
    if "\x00" in value:
        raise E.InvalidInput(f"{field} contains a NUL character", field=field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise E.InvalidInput(f"{field} is not valid Unicode (it holds a lone surrogate)", field=field) from None


def text(field: str, value: Any, *, max_chars: int | None = None, max_bytes: int | None = None) -> str:
    """A stored string. Raises ``input.invalid``, or ``payload.too_large`` past ``max_bytes``."""
    if not isinstance(value, str):
        raise E.InvalidInput(f"{field} must be a string", field=field)
    _check_chars(field, value)
    if max_chars is not None and len(value) > max_chars:
        raise E.InvalidInput(f"{field} is longer than {max_chars} characters", field=field, limit=max_chars)
    if max_bytes is not None and len(value.encode("utf-8")) > max_bytes:
        raise E.PayloadTooLarge(f"{field} is larger than {max_bytes} bytes", field=field, limit=max_bytes)
    return value


def name(field: str, value: Any) -> str:
    """A non-empty name (project, tool), stripped of surrounding blanks."""
    cleaned = text(field, value, max_chars=MAX_NAME_CHARS).strip()
    if not cleaned:
        raise E.InvalidInput(f"{field} must not be empty", field=field)
    return cleaned


def actor(value: Any) -> str | None:
    """Who did it (recorded on turns, versions, head moves, closed drafts); None is anonymous."""
    return None if value is None else text("actor", value, max_chars=MAX_ACTOR_CHARS)


MAX_JSON_DEPTH = 200  # arrays and objects inside one another; deeper documents are refused


_DEPTH_CHUNK = 1 << 22  # bytes of JSON text looked at at a time (bounded temporary arrays)
_KIND = np.zeros(256, np.int8)  # per byte: +1 opens a level, -1 closes one, 2 a quote, 0 anything else
_KIND[[0x5B, 0x7B]], _KIND[[0x5D, 0x7D]], _KIND[0x22] = 1, -1, 2


def _depth(text: str) -> int:
    """How deep arrays and objects nest in the JSON ``text``, at numpy speed (a tool result
    may be megabytes). Brackets inside strings are text: a quote opens or closes a string
    unless an odd run of backslashes precedes it. Read a chunk at a time, carrying the
    depth, whether a string is open, and the backslashes ending the chunk before."""
    data = text.encode("utf-8")  # multi-byte characters hold no ASCII byte: quotes and brackets are safe
    depth = deepest = open_string = slashes = 0
    for start in range(0, len(data), _DEPTH_CHUNK):
        raw = data[start:start + _DEPTH_CHUNK]
        b = np.frombuffer(raw, np.uint8)
        kind = _KIND[b]
        at = np.flatnonzero(kind)  # quotes and brackets only: a small share of the text
        k = kind[at]
        quote = k == 2
        if slashes or b"\\" in raw:  # a quote after an odd run of backslashes is text
            quote[quote] = _unescaped(b, at[quote], slashes)
        inside = (np.cumsum(quote, dtype=np.int64) + open_string) % 2 == 1
        step = np.where(quote | inside | (k == 2), 0, k).astype(np.int64)
        levels = np.cumsum(step) + depth
        if len(levels):
            deepest = max(deepest, int(levels.max()))
            depth, open_string = int(levels[-1]), int(inside[-1])
        tail = len(raw) - len(raw.rstrip(b"\\"))
        slashes = slashes + tail if tail == len(raw) else tail
    return deepest


def _unescaped(b: Any, quotes: Any, carried: int) -> Any:
    """For the quotes at positions ``quotes`` of the chunk ``b``: True where an even run of
    backslashes (none included) precedes it; ``carried`` backslashes end the chunk before.
    Works on the backslashes' positions only (code in JSON strings has one per line)."""
    bs = np.flatnonzero(b == 0x5C)
    if not len(bs):
        return np.where(quotes == 0, carried % 2 == 0, True)
    new_run = np.ones(len(bs), bool)
    new_run[1:] = np.diff(bs) != 1
    starts = bs[np.maximum.accumulate(np.where(new_run, np.arange(len(bs)), 0))]  # each one's run start
    starts = np.where(starts == 0, -carried, starts)  # a run from the chunk's start goes on the carried one
    last = np.searchsorted(bs, quotes) - 1  # the last backslash before each quote
    at = np.maximum(last, 0)
    adjacent = (last >= 0) & (bs[at] == quotes - 1)
    run = np.where(adjacent, quotes - starts[at], np.where(quotes == 0, carried, 0))
    return run % 2 == 0


def json_text(field: str, value: Any, max_bytes: int, *,
              error: type[E.InvalidInput] = E.InvalidInput) -> tuple[JSONText, bool]:
    """Serialise a JSON value: JSON-serialisable (no NaN or infinity), valid
    Unicode, at most ``max_bytes`` UTF-8 bytes, arrays and objects nested at most
    ``MAX_JSON_DEPTH`` deep (every reader of it, a JSON Patch included, can then
    walk it). Returns (text, whether a string in it holds a NUL character).
    Raises ``error`` or ``payload.too_large``."""
    try:
        out = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        if "e+" in out:  # maybe a float >= 1e16, written with an exponent
            out = _dumps_exact(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise error(f"{field} is not a JSON value: {exc}", field=field) from exc
    try:
        size = len(out.encode("utf-8"))
    except UnicodeEncodeError:
        raise error(f"{field} is not valid Unicode (it holds a lone surrogate)", field=field) from None
    if size > max_bytes:
        raise E.PayloadTooLarge(f"{field} is larger than {max_bytes} bytes", field=field, limit=max_bytes)
    # an opening bracket per level: a text with few of them (in strings or not) cannot nest deep
    if out.count("[") + out.count("{") > MAX_JSON_DEPTH and _depth(out) > MAX_JSON_DEPTH:
        raise error(f"{field} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep", field=field,
                    limit=MAX_JSON_DEPTH)
    return JSONText(out), "\\u0000" in out and _JSON_NUL.search(out) is not None


_FLOAT_MARK = f"draftstore-float-{secrets.token_hex(8)}-"
_MARKED = re.compile(f'"{_FLOAT_MARK}(\\d+)"')


def _dumps_exact(value: Any) -> str:
    """``json.dumps``, with floats of magnitude >= 1e16 written as their exact
    decimal value with a ".0" (every such float is a whole number). Python
    writes them with an exponent, which PostgreSQL's JSONB turns into an
    integer (1.1e25 -> 11000000000000000000000000, a different number that
    reads back as an int); written exactly, they read back as the same float
    on every backend."""
    found: list[str] = []

    def mark(v: Any) -> Any:
        if isinstance(v, float):
            if abs(v) >= 1e16 and v == v and abs(v) != float("inf"):
                found.append(f"{int(v)}.0")
                return f"{_FLOAT_MARK}{len(found) - 1}"
            return v
        if isinstance(v, dict):
            return {k: mark(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [mark(x) for x in v]
        return v

    out = json.dumps(mark(value), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return _MARKED.sub(lambda m: found[int(m.group(1))], out) if found else out


def json_value(field: str, value: Any, max_bytes: int, *, error: type[E.InvalidInput] = E.InvalidInput) -> JSONText:
    """``json_text`` for a stored document, which may not hold a NUL character
    anywhere (PostgreSQL's JSONB cannot)."""
    out, nul = json_text(field, value, max_bytes, error=error)
    if nul:
        raise error(f"{field} contains a NUL character", field=field)
    return out


def message(field: str, value: Any, limits: Limits) -> JSONText:
    """A chat message or an error: any JSON value but null (a string stays valid)."""
    if value is None:
        raise E.InvalidInput(f"{field} is required", field=field)
    return json_value(field, value, limits.max_message_bytes)


def file_data(path: str, data: Any, limits: Limits) -> bytes:
    """File content: bytes (or a str, stored as UTF-8). None is refused: deleting is ``delete_file``."""
    if data is None:
        raise E.InvalidInput(f"content of {path!r} is None; use delete_file to delete", path=path)
    if isinstance(data, str):
        try:
            data = data.encode("utf-8")
        except UnicodeEncodeError:
            raise E.InvalidInput(f"content of {path!r} is not valid Unicode (lone surrogate)", path=path) from None
    elif isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
    else:
        raise E.InvalidInput(f"content of {path!r} must be bytes or str", path=path)
    if len(data) > limits.max_file_bytes:
        raise E.PayloadTooLarge(f"{path!r} is {len(data)} bytes, larger than {limits.max_file_bytes}",
                                path=path, limit=limits.max_file_bytes)
    return data


def batch(changes: Any, max_paths: int, field: str, limits: Limits) -> dict[str, bytes | None]:
    """``{path: content | None}`` (None deletes): every path canonical and named
    once, contents within limits, no path both a file and a directory of another."""
    if not isinstance(changes, Mapping):
        raise E.InvalidInput(f"{field} must be a mapping of path to bytes (or None to delete)", field=field)
    if len(changes) > max_paths:
        raise E.LimitExceeded(f"more than {max_paths} paths in one call", limit=max_paths)
    cleaned: dict[str, bytes | None] = {}
    for raw, data in changes.items():
        path = normalize_path(raw, limits)
        if path in cleaned:
            raise E.PathConflict(f"path {path!r} given twice", path=path)
        cleaned[path] = None if data is None else file_data(path, data, limits)
    batch_shape(cleaned)
    return cleaned


def batch_shape(writes: Mapping[str, Any]) -> None:
    """No written path may also be a directory of another written path."""
    for path, value in writes.items():
        if value is None:  # a deletion never makes a directory
            continue
        for parent in parent_dirs(path):
            if writes.get(parent) is not None:
                raise E.PathConflict(f"{parent!r} cannot be a file and a directory", path=parent)


def executables(paths: Any, files: Mapping[str, Any]) -> frozenset[str]:
    """The paths to mark executable: canonical paths among ``files`` that are written (not deleted)."""
    if isinstance(paths, (str, bytes)) or not hasattr(paths, "__iter__"):
        raise E.InvalidInput("executable is a collection of paths", field="executable")
    out = set()
    for raw in paths:
        path = normalize_path(raw)
        if files.get(path) is None:
            raise E.InvalidInput(f"executable path {path!r} is not among the written files", field="executable",
                                 path=path)
        out.add(path)
    return frozenset(out)


def _ident(value: Any, field: str, missing: type[E.NotFound]) -> str:
    """An id: a string, else ``input.invalid``; a string that cannot be an id
    names nothing, so it is ``<kind>.not_found`` (and never reaches the database)."""
    if not isinstance(value, str):
        raise E.InvalidInput(f"{field} must be a string", field=field)
    if _ID.fullmatch(value) is None:
        raise missing(f"no {field.removesuffix('_id')} {value[:80]!r}", **{field: value[:80]})
    return value


def project_id(value: Any) -> str:
    return _ident(value, "project_id", E.ProjectNotFound)


def turn_id(value: Any) -> str:
    return _ident(value, "turn_id", E.TurnNotFound)


def version_id(value: Any) -> str:
    return _ident(value, "version_id", E.VersionNotFound)


def session_id(value: Any) -> str:
    """A sandbox session's id."""
    return _ident(value, "session_id", E.SandboxNotFound)


def snapshot_id(value: Any) -> str:
    return _ident(value, "snapshot_id", E.SnapshotNotFound)


MAX_IDEMPOTENCY_KEY_CHARS = 200
_IDEMPOTENCY_KEY = re.compile(rf"[\x21-\x7e]{{1,{MAX_IDEMPOTENCY_KEY_CHARS}}}")


def idempotency_key(value: Any) -> str | None:
    """An ``Idempotency-Key``: None (no key), or 1 to 200 visible ASCII characters
    (what an HTTP header carries unchanged: no blank, no control character)."""
    if value is None:
        return None
    if not isinstance(value, str) or not _IDEMPOTENCY_KEY.fullmatch(value):
        raise E.InvalidInput(f"idempotency_key is 1 to {MAX_IDEMPOTENCY_KEY_CHARS} visible ASCII characters",
                             field="idempotency_key")
    return value


def flag(field: str, value: Any) -> bool:
    """A yes/no parameter: exactly ``True`` or ``False`` (not 1, "yes" or None)."""
    if not isinstance(value, bool):
        raise E.InvalidInput(f"{field} must be true or false", field=field)
    return value


def seq(turn: str, value: Any) -> int:
    """A tool call's sequence number (1, 2, 3, ...)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise E.InvalidInput("seq must be an integer", field="seq")
    if not 1 <= value <= _MAX_SEQ:
        raise E.ToolCallNotFound(f"turn {turn} has no tool call {value}", turn_id=turn, seq=value)
    return value
