"""The MCP server (official MCP Python SDK, ``MCPServer``) over ``AgentTools``.

``build_server(agent_of)`` registers the ten tools; ``agent_of(context)`` gives
the ``AgentTools`` a call goes to (one fixed instance over stdio; over HTTP the
one the mount attached to the request). ``call_tool`` wraps every call: it
records the start in the turn's history, lets the SDK validate the arguments
and run the tool, then records how the call ended, shielded from cancellation
so a recorded call never stays ``started``: a body that returned is
``completed`` (even when the call was cancelled afterwards), a body that raised
is ``failed`` with its error, a call cancelled before its body ran is
``failed`` with ``cancelled``. Every failure comes back as a tool error
(``isError``) whose structured content is ``{"error": {"code", "message",
"retryable", ...}}`` with draftstore's stable code, and whose text is
``[code] message``; an unexpected exception is ``internal`` (logged).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, TextContent, ToolAnnotations
from pydantic import Field, ValidationError

from .. import __version__
from .. import errors as E
from ..wire import internal_error
from . import results as R
from .tools import READ_TOOLS, TOOL_NAMES, AgentTools, Recording, error_payload

__all__ = ["build_server", "DraftstoreMCP"]

log = logging.getLogger("draftstore.mcp")

INSTRUCTIONS = (
    "Tools over one draftstore project. Reads (view_file, list_dir, find_files, search_code) see the "
    "active draft, else the published head. Writes change the draft through the running turn. Every "
    "call is recorded in the turn's tool history. Errors carry a stable code such as path.not_found, "
    "path.denied, turn.not_running, patch.invalid, pattern.invalid, input.invalid."
)


@dataclass
class _Call:
    agent: AgentTools
    turn_id: str | None
    # what the body did, set by the body itself (in its worker thread): whatever the SDK's
    # wrappers or a cancellation do afterwards, the call is recorded as the body ended
    ran: bool = False
    returned: Any = None
    error: dict[str, Any] | None = None


_CALL: contextvars.ContextVar[_Call] = contextvars.ContextVar("draftstore_mcp_call")


def _tool(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A tool body: a draftstore error becomes an anticipated tool error (its cause kept). Its return
    annotation (a TypedDict of ``results.py``) is the tool's ``outputSchema``: the SDK reads it through
    ``functools.wraps`` and validates each result against it."""

    @functools.wraps(fn)
    def run(**kwargs: Any) -> Any:
        call = _CALL.get()
        call.ran = True
        try:
            out = fn(**kwargs)
        except E.DraftstoreError as exc:
            call.error = error_payload(exc)
            raise ToolError(str(exc)) from exc
        except Exception as exc:
            call.error = _payload_of(exc)
            raise
        call.returned = out
        return out

    return run


def _agent() -> AgentTools:
    return _CALL.get().agent


def _turn() -> str:
    turn_id = _CALL.get().turn_id
    assert turn_id is not None  # call_tool refuses a write without a turn before the body runs
    return turn_id


Path = Annotated[str, Field(description="a relative path, '/'-separated (e.g. 'src/main.py')")]
Encoding = Annotated[Literal["utf-8", "base64"], Field(description="how content is given: text, or base64 bytes")]
Patch = Annotated[list[dict[str, Any]] | dict[str, Any],
                  Field(description="a JSON Patch (RFC 6902, a list of operations) or a JSON Merge Patch "
                                    "(RFC 7386, an object)")]


@_tool
def view_file(path: Path,
              start_line: Annotated[int, Field(strict=True, description="first line, 1-based")] = 1,
              end_line: Annotated[int | None, Field(strict=True, description="last line (inclusive); default: as many "
                                                                "as the bounds allow")] = None) -> R.ViewFile:
    """Read a file of the project's newest state (the draft, else head) as text, by line range.
    At most 1000 lines / 64 KiB per call: when cut, `truncated` is true and `next_start_line`
    says where to go on. A single line over 64 KiB comes back cut (`line_clipped: true`).
    A binary file returns `binary: true` and no content."""
    return _agent().view_file(path, start_line, end_line)


@_tool
def list_dir(path: Annotated[str, Field(description="a directory; '' is the root")] = "") -> R.ListDir:
    """List a directory: entries with name, kind (file|dir) and size (bytes, or files below a
    directory). At most 1000 entries (`truncated` when cut)."""
    return _agent().list_dir(path)


@_tool
def find_files(glob: Annotated[str, Field(description="'*' and '?' stay in one directory, '**' spans "
                                                      "directories: '**/*.py' is every Python file")] = "**",
               max_results: Annotated[int | None, Field(strict=True, description="1..2000, default 200")] = None
               ) -> R.FindFiles:
    """Paths matching a glob (whole path), sorted; `truncated` when there are more."""
    return _agent().find_files(glob, max_results)


@_tool
def search_code(pattern: Annotated[str, Field(description="the text to find (a literal unless regex)")],
                regex: Annotated[bool, Field(strict=True, description="pattern is an RE2 regular expression")] = False,
                glob: Annotated[str | None, Field(description="only files matching this glob")] = None,
                context: Annotated[int, Field(strict=True, description="lines of context before and after, 0..10")] = 0,
                ignore_case: Annotated[bool, Field(strict=True)] = False,
                max_results: Annotated[int | None, Field(strict=True, description="1..500, default 50")] = None
                ) -> R.SearchCode:
    """Search file contents line by line, like grep. Matches carry path, line_number and line
    (clipped at 500 bytes, `lines_clipped`). At most 64 KiB of lines per call: `truncated` when
    more matches exist than max_results or than the byte budget holds."""
    return _agent().search_code(pattern, regex, glob, context, ignore_case, max_results)


@_tool
def write_file(path: Path, content: str, encoding: Encoding = "utf-8",
               executable: Annotated[bool, Field(strict=True)] = False) -> R.WriteFile:
    """Create or replace one file in the draft (through the running turn)."""
    return _agent().write_file(_turn(), path, content, encoding, executable)


@_tool
def delete_file(path: Path) -> R.DeleteFile:
    """Delete one file from the draft (path.not_found if absent)."""
    return _agent().delete_file(_turn(), path)


@_tool
def move_file(src: Path, dst: Path,
              overwrite: Annotated[bool, Field(strict=True, description="replace dst if it is a file")] = False
              ) -> R.MoveFile:
    """Rename a file in the draft, atomically. An existing dst is path.conflict unless overwrite is true."""
    return _agent().move_file(_turn(), src, dst, overwrite)


@_tool
def apply_changes(changes: Annotated[dict[str, str | None],
                                     Field(description="{path: new content, or null to delete}")],
                  encoding: Encoding = "utf-8",
                  executable: Annotated[list[str] | None,
                                        Field(description="written paths that are executable")] = None
                  ) -> R.ApplyChanges:
    """Write and delete several files at once, atomically: all or nothing."""
    return _agent().apply_changes(_turn(), changes, encoding, executable)


@_tool
def patch_characters(patch: Patch) -> R.PatchCharacters:
    """Patch the draft's characters JSON; returns the new value (omitted over 64 KiB, `truncated`)."""
    return _agent().patch_characters(_turn(), patch)


@_tool
def patch_world_settings(patch: Patch) -> R.PatchWorldSettings:
    """Patch the draft's world-settings JSON; returns the new value (omitted over 64 KiB, `truncated`)."""
    return _agent().patch_world_settings(_turn(), patch)


TOOLS: tuple[Callable[..., Any], ...] = (
    view_file, list_dir, find_files, search_code,
    write_file, delete_file, move_file, apply_changes, patch_characters, patch_world_settings,
)
assert {t.__name__ for t in TOOLS} == TOOL_NAMES


def error_result(payload: dict[str, Any]) -> CallToolResult:
    """A tool error carrying a draftstore error payload."""
    return CallToolResult(content=[TextContent(type="text", text=f"[{payload['code']}] {payload['message']}")],
                          structured_content={"error": payload}, is_error=True)


def _invalid_arguments(exc: ValidationError) -> E.InvalidInput:
    errors = [{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg", ""), "type": e.get("type", "")}
              for e in exc.errors()]
    first = errors[0] if errors else {"loc": [], "msg": "invalid arguments"}
    where = ".".join(first["loc"]) or "arguments"
    return E.InvalidInput(f"{where}: {first['msg']}", errors=errors)


def _payload_of(exc: BaseException) -> dict[str, Any]:
    """The draftstore error behind a failed call (walking the SDK's wrappers)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, E.DraftstoreError):
            return error_payload(seen)
        if isinstance(seen, ValidationError):
            return error_payload(_invalid_arguments(seen))
        seen = seen.__cause__
    log.error("tool call failed unexpectedly", exc_info=exc)
    return internal_error()


_CANCELLED = {"code": "cancelled", "message": "the call was cancelled before it ran", "retryable": True}
_CANCELLED_RUNNING = {"code": "cancelled", "message": "the call was cancelled while it ran", "retryable": False}


class DraftstoreMCP(MCPServer):
    """The draftstore tools; every call recorded in its turn's history."""

    def __init__(self, agent_of: Callable[[Context[Any, Any] | None], AgentTools]) -> None:
        super().__init__(name="draftstore", version=__version__, instructions=INSTRUCTIONS, log_level="WARNING")
        self._agent_of = agent_of
        # each tool's argument names: any other is refused (the SDK would drop it unseen)
        self._params = {fn.__name__: frozenset(inspect.signature(fn).parameters) for fn in TOOLS}
        for fn in TOOLS:
            read = fn.__name__ in READ_TOOLS
            self.add_tool(fn, annotations=ToolAnnotations(read_only_hint=read, destructive_hint=not read,
                                                          idempotent_hint=read, open_world_hint=False))

    async def call_tool(self, name: str, arguments: dict[str, Any],
                        context: Context[Any, Any] | None = None) -> Any:
        if name not in TOOL_NAMES:
            return error_result(error_payload(E.InvalidInput(f"unknown tool {name!r}", tools=sorted(TOOL_NAMES))))
        try:
            agent = self._agent_of(context)
            rec = await anyio.to_thread.run_sync(agent.begin, name, arguments)
        except E.DraftstoreError as exc:  # a write without a running turn; args the history refuses
            return error_result(error_payload(exc))
        except Exception as exc:  # nothing recorded: the call did not start
            return error_result(_payload_of(exc))
        # recorded as started: from here on the call is always recorded as ended
        call = _Call(agent, rec.turn_id)
        token = _CALL.set(call)
        result: Any = None
        error: dict[str, Any] | None = None
        raised: BaseException | None = None
        try:
            unknown = sorted(set(arguments or ()) - self._params[name])
            if unknown:
                raise E.InvalidInput(f"{name} takes no argument {', '.join(map(repr, unknown))}",
                                     unknown=unknown[:20], arguments=sorted(self._params[name]))
            result = await super().call_tool(name, arguments, context)
        except Exception as exc:  # ToolError (the body's error, bad arguments) or an unexpected one
            error = call.error or _payload_of(exc)
            result = error_result(error)
        except BaseException as exc:  # cancelled (or the process exits): recorded, then passed on
            raised = exc
            error = call.error or (_CANCELLED if not call.ran else _CANCELLED_RUNNING)
        finally:
            _CALL.reset(token)
        if call.returned is not None:  # the body returned, its write happened: completed, whatever came after
            await self._finish(agent, rec, call.returned, None)
        elif error is not None:
            await self._finish(agent, rec, None, error)
        else:  # not expected: every tool body returns a result
            await self._finish(agent, rec, getattr(result, "structured_content", None), None)
        if raised is not None:
            raise raised
        return result

    @staticmethod
    async def _finish(agent: AgentTools, rec: Recording, value: Any, error: dict[str, Any] | None) -> None:
        """Record how the call ended, whatever cancellation is pending (``finish`` never raises)."""
        with anyio.CancelScope(shield=True):
            try:
                await anyio.to_thread.run_sync(agent.finish, rec, value, error)
            except Exception:
                log.exception("could not record the end of tool call %s/%s", rec.turn_id, rec.seq)


def build_server(agent_of: Callable[[Context[Any, Any] | None], AgentTools]) -> DraftstoreMCP:
    return DraftstoreMCP(agent_of)
