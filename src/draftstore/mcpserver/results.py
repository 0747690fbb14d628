"""The shape of each tool's structured result, as the tools' ``outputSchema``.

The MCP SDK derives a tool's ``outputSchema`` from its return annotation and
validates every result against it before it leaves the server (a client such
as the SDK's validates it again). These TypedDicts are those annotations: the
exact keys ``AgentTools`` returns (``tools.py``), no others (``extra="forbid"``,
so a key added to a result without its schema fails the call in the tests
rather than being dropped). A tool error is not a result: its structured
content is ``{"error": {"code", "message", "retryable", ...details}}``
(``server.error_result``), whatever the tool.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field
from typing_extensions import NotRequired, TypedDict  # pydantic reads a TypedDict's config only from typing_extensions' on 3.11

__all__ = ["ViewFile", "ListDir", "FindFiles", "SearchCode", "WriteFile", "DeleteFile", "MoveFile",
           "ApplyChanges", "PatchCharacters", "PatchWorldSettings"]

_STRICT = ConfigDict(extra="forbid")

State = Annotated[Literal["draft", "version", "empty"],
                  Field(description="what was read: the active draft, else the published head version "
                                    "(empty: a project with neither)")]


class ViewFile(TypedDict):
    """A line range of a file (``content`` null for a binary file)."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    path: str
    size: int
    state: State
    binary: bool
    content: str | None
    total_lines: int | None
    start_line: int | None
    end_line: int | None
    truncated: Annotated[bool, Field(description="more lines follow: read on from next_start_line")]
    next_start_line: int | None
    line_clipped: Annotated[bool, Field(description="a single line over the byte bound came back cut")]


class DirEntry(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    name: str
    kind: Literal["file", "dir"]
    size: Annotated[int, Field(description="bytes of a file, or files below a directory")]


class ListDir(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    path: str
    state: State
    entries: list[DirEntry]
    truncated: bool
    total: int


class FindFiles(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    glob: str
    state: State
    paths: list[str]
    truncated: bool


class Match(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    path: str
    line_number: int
    line: str
    before: NotRequired[Annotated[list[str], Field(description="context lines before (when context > 0)")]]
    after: NotRequired[Annotated[list[str], Field(description="context lines after (when context > 0)")]]


class SearchCode(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    pattern: str
    state: State
    matches: list[Match]
    truncated: bool
    lines_clipped: bool
    files_searched: int


class WriteFile(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    path: str
    bytes: int
    executable: bool


class DeleteFile(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    path: str
    deleted: bool


class MoveFile(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    src: str
    dst: str
    moved: bool


class ApplyChanges(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    written: int
    deleted: int


class PatchCharacters(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    characters: Annotated[Any, Field(description="the new characters JSON; null when over the echo bound")]
    bytes: int
    truncated: bool


class PatchWorldSettings(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    world_settings: Annotated[Any, Field(description="the new world-settings JSON; null when over the echo bound")]
    bytes: int
    truncated: bool
