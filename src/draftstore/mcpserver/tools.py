"""The agent tools over one ``Store``, project and (optional) turn: no MCP in here.

Reads go through ``store.view(project_id)`` (the active draft, else head);
writes go through a running turn (``store.write_file(turn_id, ...)``). Every
call is recorded in the turn's tool history when a turn is known:
``begin`` records the start (``store.tool_started``), ``finish`` the result or
the error (``store.tool_completed`` / ``store.tool_failed``).

Which turn: the one named when the tools were made (``turn_id``), else the
project's running turn at the time of the call (the draft is ``running`` and
its ``last_turn_id`` is that turn). Without a turn a read is served
unrecorded and a write is refused with ``turn.not_running``, changing nothing.

Results are bounded (``Bounds``): a listing or a search says ``truncated``
when cut; ``view_file`` returns a line range and ``next_start_line`` to read on.
Bad input raises a typed ``InvalidInput`` before anything is written. Error
payloads are bounded too (``error_payload``): at most ``ERRORS_MAX`` entries of
a detail list (``errors``: the first ones, plus ``errors_total``), strings clipped.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from dataclasses import dataclass
from typing import Any

from .. import errors as E
from ..records import DraftStatus
from ..store import Store
from ..wire import internal_error

__all__ = ["AgentTools", "Bounds", "Recording", "READ_TOOLS", "WRITE_TOOLS", "TOOL_NAMES", "error_payload"]

log = logging.getLogger("draftstore.mcp")

READ_TOOLS = ("view_file", "list_dir", "find_files", "search_code")
WRITE_TOOLS = ("write_file", "delete_file", "move_file", "apply_changes", "patch_characters", "patch_world_settings")
TOOL_NAMES = frozenset(READ_TOOLS + WRITE_TOOLS)

_BINARY_SNIFF = 8192  # as search: a NUL in the first 8 KiB makes a file binary

ERRORS_MAX = 20  # entries of a list in an error's details (``errors``: the first ones, then ``errors_total``)
ERROR_STRING_CHARS = 1000  # a string in an error's details is clipped here
ERROR_MESSAGE_CHARS = 2000  # an error's message is clipped here
ERROR_BYTES = 32 * 1024  # an error payload still larger than this keeps only code, message, retryable


@dataclass(frozen=True)
class Bounds:
    """How much one tool result may hold."""

    view_lines: int = 1000  # lines one view_file returns at most
    view_bytes: int = 64 * 1024  # bytes of content one view_file returns at most
    list_entries: int = 1000  # list_dir entries (default and cap)
    find_default: int = 200
    find_max: int = 2000
    search_default: int = 50
    search_max: int = 500
    search_context_max: int = 10
    line_bytes: int = 500  # a search line (or context line) longer than this (UTF-8) is clipped
    search_bytes: int = 64 * 1024  # UTF-8 bytes of one search's lines and paths: no match is added past it
    json_bytes: int = 64 * 1024  # a patched document larger than this is not echoed back


@dataclass(frozen=True)
class Recording:
    """Where a call is recorded: ``turn_id`` and ``seq``, or None for an unrecorded read."""

    turn_id: str | None
    seq: int | None


def _bounded(value: Any) -> Any:
    """A detail value with its lists cut at ``ERRORS_MAX`` entries and its strings clipped."""
    if isinstance(value, str):
        return _clip(value, ERROR_STRING_CHARS)[0]
    if isinstance(value, (list, tuple)):
        return [_bounded(v) for v in value[:ERRORS_MAX]]
    if isinstance(value, dict):
        items = list(value.items())
        return {str(k)[:ERROR_STRING_CHARS]: _bounded(v) for k, v in items[:ERRORS_MAX]}
    return value


def error_payload(exc: E.DraftstoreError) -> dict[str, Any]:
    """The JSON form of an error, as recorded and as returned: ``{"code", "message", "retryable", ...details}``.

    Bounded: a detail list keeps its first ``ERRORS_MAX`` entries (the ``errors`` list of
    ``input.invalid`` says how many there were in ``errors_total``), strings are clipped,
    and a payload still over ``ERROR_BYTES`` keeps only code, message and retryable."""
    base = {"code": exc.code, "message": _clip(str(exc.message), ERROR_MESSAGE_CHARS)[0],
            "retryable": exc.retryable}
    out = exc.to_dict()
    errors = out.get("errors")
    total = len(errors) if isinstance(errors, (list, tuple)) else None
    out = {k: _bounded(v) for k, v in out.items() if k not in base}
    if total is not None and total > ERRORS_MAX:
        out["errors_total"] = total
    out = {**base, **out}
    try:
        if len(json.dumps(out).encode("utf-8")) > ERROR_BYTES:
            out = base
    except (TypeError, ValueError):  # a detail that is not JSON: keep what is stable
        out = base
    return out


def _positive(name: str, value: int, cap: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= cap:
        raise E.InvalidInput(f"{name} is an integer from 1 to {cap}", **{name: value, "max": cap})
    return value


def _clip(line: str, chars: int) -> tuple[str, bool]:
    return (line, False) if len(line) <= chars else (line[:chars] + "…", True)


def _clip_bytes(line: str, limit: int) -> tuple[str, bool]:
    """``line`` cut to at most ``limit`` UTF-8 bytes (never inside a character), then '…'."""
    if len(line) <= limit // 4:  # fast path: even four-byte characters fit
        return line, False
    data = line.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return line, False
    return data[:limit].decode("utf-8", "ignore") + "…", True


def _decode(content: str, encoding: str, path: str) -> bytes:
    if encoding == "utf-8":
        try:
            return content.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate
            raise E.InvalidInput(f"content of {path!r} is not valid Unicode", path=path) from exc
    if encoding == "base64":
        try:
            return base64.b64decode(content.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as exc:
            raise E.InvalidInput(f"content of {path!r} is not valid base64", path=path) from exc
    raise E.InvalidInput("encoding is 'utf-8' or 'base64'", encoding=encoding)


class AgentTools:
    """The tools of one project, reading its newest state and writing through a turn."""

    def __init__(self, store: Store, project_id: str, turn_id: str | None = None,
                 bounds: Bounds | None = None) -> None:
        self.store = store
        self.project_id = project_id
        self.turn_id = turn_id
        self.bounds = bounds or Bounds()

    # ------------------------------------------------------------- recording
    def current_turn(self) -> str | None:
        """The turn calls go through now: the named one, else the project's running turn, else None."""
        if self.turn_id is not None:
            return self.turn_id
        try:
            draft = self.store.get_draft(self.project_id)
        except E.DraftNone:
            return None
        return draft.last_turn_id if draft.status == DraftStatus.RUNNING else None

    def begin(self, name: str, args: Any) -> Recording:
        """Record that tool ``name`` starts with ``args``. A write without a running turn
        raises ``turn.not_running``; a read without one is served unrecorded."""
        write = name in WRITE_TOOLS
        turn_id = self.current_turn()
        if turn_id is None:
            if write:
                raise E.TurnNotRunning(
                    f"no turn of project {self.project_id} is running: start or continue one "
                    f"(or name it) before writing", project_id=self.project_id, tool=name)
            return Recording(None, None)
        try:
            call = self.store.tool_started(turn_id, name, args)
        except E.TurnNotRunning:
            if write:
                raise
            return Recording(None, None)  # the turn has ended: its history is closed, the read is still served
        except E.DraftstoreError as exc:
            # the history refuses these arguments (too large, not JSON): the call does not run, and
            # is recorded failed with that refusal, a stand-in in place of the arguments
            self._record_refused(turn_id, name, exc)
            raise
        return Recording(turn_id, call.seq)

    def _record_refused(self, turn_id: str, name: str, exc: E.DraftstoreError) -> None:
        stand_in = {"arguments_not_recorded": {"code": exc.code,
                                               "message": _clip(str(exc.message), ERROR_STRING_CHARS)[0]}}
        try:
            call = self.store.tool_started(turn_id, name, stand_in)
            self.store.tool_failed(turn_id, call.seq, error_payload(exc))
        except E.TurnNotRunning:
            pass
        except Exception:  # logged; the caller still gets the refusal
            log.exception("could not record the refused call of %s in turn %s", name, turn_id)

    def finish(self, rec: Recording, result: Any = None, error: dict[str, Any] | None = None) -> None:
        """Record the call's result (or ``error``); never raises.

        When the history refuses the real payload (``payload.too_large``, ...), the call is
        recorded ``failed`` with a small error ``{"code": <the refusal's code>, "message"}``
        instead, so it never stays ``started``; an unexpected failure is recorded as
        ``internal``. A turn that ended meanwhile keeps the call as started (its history is
        closed). A recording that fails is logged, never turned into the tool's answer."""
        if rec.turn_id is None or rec.seq is None:
            return
        what = "result" if error is None else "error"
        try:
            if error is None:
                self.store.tool_completed(rec.turn_id, rec.seq, result)
            else:
                self.store.tool_failed(rec.turn_id, rec.seq, error)
            return
        except E.TurnNotRunning:
            return
        except E.DraftstoreError as exc:
            log.warning("could not record the %s of tool call %s/%s: %s", what, rec.turn_id, rec.seq, exc)
            was = "" if error is None else f" ({error.get('code')})"
            fallback = {"code": exc.code, "retryable": False,
                        "message": _clip(f"the call's {what}{was} could not be recorded: {exc.message}",
                                         ERROR_MESSAGE_CHARS)[0]}
        except Exception:
            log.exception("could not record the %s of tool call %s/%s", what, rec.turn_id, rec.seq)
            fallback = {**internal_error(), "message": f"the call's {what} could not be recorded "
                                                         "(logged on the server)"}
        try:
            self.store.tool_failed(rec.turn_id, rec.seq, fallback)
        except E.TurnNotRunning:
            pass
        except Exception:
            log.exception("could not record tool call %s/%s as failed", rec.turn_id, rec.seq)

    # ------------------------------------------------------------------ reads
    def view_file(self, path: str, start_line: int = 1, end_line: int | None = None) -> dict[str, Any]:
        """Lines ``start_line``..``end_line`` (1-based, inclusive) of a file, at most
        ``bounds.view_lines`` lines and ``bounds.view_bytes`` bytes. A single line longer
        than the byte bound comes back cut to its first bytes, with ``line_clipped``."""
        b = self.bounds
        if isinstance(start_line, bool) or not isinstance(start_line, int) or start_line < 1:
            raise E.InvalidInput("start_line is an integer from 1", start_line=start_line)
        if end_line is not None and (isinstance(end_line, bool) or not isinstance(end_line, int)
                                     or end_line < start_line):
            raise E.InvalidInput("end_line is an integer no smaller than start_line",
                                 start_line=start_line, end_line=end_line)
        view = self.store.view(self.project_id)
        st = view.stat(path)
        data = view.read_file(st.path)
        out: dict[str, Any] = {"path": st.path, "size": st.size, "state": view.kind}
        if b"\x00" in data[:_BINARY_SNIFF]:
            return {**out, "binary": True, "content": None, "total_lines": None, "start_line": None,
                    "end_line": None, "truncated": False, "next_start_line": None, "line_clipped": False}
        text = data.decode("utf-8", "replace")
        lines = text.split("\n")
        if lines[-1] == "":
            lines.pop()  # the final newline ends the last line; it does not start another
        total = len(lines)
        if start_line > max(total, 1):
            raise E.InvalidInput(f"start_line {start_line} is past the end of {st.path!r} ({total} lines)",
                                 path=st.path, start_line=start_line, total_lines=total)
        want_end = min(total, end_line if end_line is not None else total)
        last_allowed = min(want_end, start_line + b.view_lines - 1)
        parts: list[str] = []
        used = 0
        clipped = False
        last = start_line - 1
        for n in range(start_line, last_allowed + 1):
            line = lines[n - 1] + ("\n" if n < total or text.endswith("\n") else "")
            size = len(line.encode("utf-8"))
            if used + size > b.view_bytes:
                if not parts:  # one line over the byte budget: its first bytes
                    parts.append(line.encode("utf-8")[:b.view_bytes].decode("utf-8", "ignore"))
                    clipped, last = True, n
                break
            parts.append(line)
            used += size
            last = n
        truncated = clipped or last < want_end
        return {**out, "binary": False, "content": "".join(parts), "total_lines": total,
                "start_line": start_line, "end_line": last, "truncated": truncated,
                "next_start_line": last + 1 if truncated and last < total else None, "line_clipped": clipped}

    def list_dir(self, path: str = "") -> dict[str, Any]:
        """Entries of a directory ('' is the root), at most ``bounds.list_entries``."""
        view = self.store.view(self.project_id)
        entries = view.list_dir(path)
        cap = self.bounds.list_entries
        return {"path": path, "state": view.kind,
                "entries": [{"name": e.name, "kind": e.kind, "size": e.size} for e in entries[:cap]],
                "truncated": len(entries) > cap, "total": len(entries)}

    def find_files(self, glob: str = "**", max_results: int | None = None) -> dict[str, Any]:
        """Paths matching ``glob``, sorted, at most ``max_results``."""
        b = self.bounds
        limit = _positive("max_results", b.find_default if max_results is None else max_results, b.find_max)
        view = self.store.view(self.project_id)
        paths = view.find_files(glob, limit=limit)
        return {"glob": glob, "state": view.kind, "paths": list(paths), "truncated": paths.truncated}

    def search_code(self, pattern: str, regex: bool = False, glob: str | None = None, context: int = 0,
                    ignore_case: bool = False, max_results: int | None = None) -> dict[str, Any]:
        """Lines matching ``pattern`` (literal, or RE2 with ``regex``), at most ``max_results``
        matches and ``bounds.search_bytes`` UTF-8 bytes of lines and paths (each line clipped at
        ``bounds.line_bytes``): past either, ``truncated``."""
        b = self.bounds
        limit = _positive("max_results", b.search_default if max_results is None else max_results, b.search_max)
        if isinstance(context, bool) or not isinstance(context, int) or not 0 <= context <= b.search_context_max:
            raise E.InvalidInput(f"context is an integer from 0 to {b.search_context_max}", context=context)
        view = self.store.view(self.project_id)
        found = view.search_code(pattern, regex=regex, glob=glob, context=context, max_results=limit,
                                 ignore_case=ignore_case)
        clipped = False
        truncated = found.truncated
        used = len(pattern.encode("utf-8", "surrogatepass"))  # echoed back
        matches = []
        for m in found.matches:
            line, c = _clip_bytes(m.line, b.line_bytes)
            before = [_clip_bytes(x, b.line_bytes) for x in m.before] if context else []
            after = [_clip_bytes(x, b.line_bytes) for x in m.after] if context else []
            size = 32 + len(m.path.encode("utf-8")) + sum(len(x.encode("utf-8", "surrogatepass")) + 4
                                                         for x in [line, *(x[0] for x in before + after)])
            if used + size > b.search_bytes and matches:  # the byte budget: this match and the rest left off
                truncated = True
                break
            used += size
            clipped = clipped or c or any(x[1] for x in before + after)
            match: dict[str, Any] = {"path": m.path, "line_number": m.line_number, "line": line}
            if context:
                match["before"], match["after"] = [x[0] for x in before], [x[0] for x in after]
            matches.append(match)
        return {"pattern": pattern, "state": view.kind, "matches": matches, "truncated": truncated,
                "lines_clipped": clipped, "files_searched": found.files_searched}

    # ----------------------------------------------------------------- writes
    def write_file(self, turn_id: str, path: str, content: str, encoding: str = "utf-8",
                   executable: bool = False) -> dict[str, Any]:
        data = _decode(content, encoding, path)
        self.store.write_file(turn_id, path, data, executable=executable)
        return {"path": path, "bytes": len(data), "executable": executable}

    def delete_file(self, turn_id: str, path: str) -> dict[str, Any]:
        self.store.delete_file(turn_id, path)
        return {"path": path, "deleted": True}

    def move_file(self, turn_id: str, src: str, dst: str, overwrite: bool = False) -> dict[str, Any]:
        self.store.move_file(turn_id, src, dst, overwrite=overwrite)
        return {"src": src, "dst": dst, "moved": True}

    def apply_changes(self, turn_id: str, changes: dict[str, str | None], encoding: str = "utf-8",
                      executable: list[str] | None = None) -> dict[str, Any]:
        if not isinstance(changes, dict) or not changes:
            raise E.InvalidInput("changes is a non-empty object {path: content or null}")
        batch = {p: None if c is None else _decode(c, encoding, p) for p, c in changes.items()}
        self.store.apply_changes(turn_id, batch, executable=tuple(executable or ()))
        return {"written": sum(1 for c in batch.values() if c is not None),
                "deleted": sum(1 for c in batch.values() if c is None)}

    def patch_characters(self, turn_id: str, patch: Any) -> dict[str, Any]:
        return self._echo("characters", self.store.patch_characters(turn_id, patch))

    def patch_world_settings(self, turn_id: str, patch: Any) -> dict[str, Any]:
        return self._echo("world_settings", self.store.patch_world_settings(turn_id, patch))

    def _echo(self, key: str, value: Any) -> dict[str, Any]:
        size = len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
        if size > self.bounds.json_bytes:
            return {key: None, "bytes": size, "truncated": True}
        return {key: value, "bytes": size, "truncated": False}
