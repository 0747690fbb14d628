"""Request bodies (and the answers that are not a library record). Field names are
the Python API's parameter names.

The answer models here document ``/openapi.json`` (``service/openapi.py``); the
routes send the same shapes built as dicts or records, unvalidated (``responses.py``).

JSON values (messages, args, results, errors, patches, characters) are
``Any``: the library checks them. File contents in JSON travel base64-encoded.
Unknown fields are refused, so a misspelt field is an error, not a no-op.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, fields
from typing import Annotated, Any, Literal

from fastapi import Query
from pydantic import BaseModel, ConfigDict, Field

from .. import errors as E
from ..records import Draft, Project, Token, Turn, Version
from ..search import SearchResult

# the query parameters of every paged list
Cursor = Annotated[str | None, Query(description="from the previous page's next_cursor")]
Limit = Annotated[int | None, Query(ge=1, le=200)]

__all__ = [
    "CreateProject", "StartTurn", "Complete", "Interrupt", "Fail", "ToolStart", "ToolComplete", "ToolFail",
    "Approval", "Changes", "Move", "Patch", "Delta", "Publish", "Rollback", "Fork", "CreateToken", "Actor",
    "Whoami", "SearchPage", "ProjectDetail", "TurnDetail", "NewToken", "ViewState", "PathPage", "Event",
    "EventPage", "Health", "Readiness", "Error", "decode_files",
]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Actor(Body):
    actor: str | None = None


class CreateProject(Body):
    name: str
    files: dict[str, str] | None = Field(None, description="path -> base64 content")
    characters: Any = None
    world_settings: Any = None
    actor: str | None = None


class StartTurn(Body):
    user_message: Any = Field(..., description="any JSON value: a string or a structured chat message")
    continue_: bool = Field(False, alias="continue", description="true: continue on the existing draft")
    from_turn_id: str | None = Field(None, description="with continue: the ended turn of the draft it continues "
                                                       "(default: the draft's last turn); else turn.conflict")
    actor: str | None = None


class Complete(Body):
    assistant_message: Any


class Interrupt(Body):
    partial_response: Any = None


class Fail(Body):
    error: Any


class ToolStart(Body):
    tool_name: str
    args: Any = None
    needs_approval: bool = False


class ToolComplete(Body):
    result: Any = None


class ToolFail(Body):
    error: Any


class Approval(Body):
    approved: bool
    reason: Any = None
    actor: str | None = None


class Changes(Body):
    changes: dict[str, str | None] = Field(..., description="path -> base64 content, or null to delete")


class Move(Body):
    src: str
    dst: str
    overwrite: bool = False  # replace an existing dst (else path.conflict)


class Patch(Body):
    patch: Any = Field(..., description="a JSON Patch (list, RFC 6902) or a JSON Merge Patch (object, RFC 7386)")


class Delta(Body):
    text: str


class Publish(Body):
    summary: str = ""
    force: bool = False
    actor: str | None = None


class Rollback(Body):
    version_id: str
    actor: str | None = None


class Revert(Body):
    to_turn_id: str = Field(description="the turn whose start the draft goes back to; it and the later turns "
                                        "of the draft are marked reverted")
    actor: str | None = None


class Fork(Body):
    name: str
    version_id: str | None = Field(None, description="default: the project's head")
    actor: str | None = None


class CreateToken(Body):
    role: str
    project_id: str | None = None
    name: str = ""


class Whoami(BaseModel):
    """The caller as the service sees it (``GET /v1/whoami``)."""

    role: Literal["admin", "agent", "observer", "approver"]
    project_id: str | None = Field(..., description="the one project the token is scoped to; null: every project")
    token_id: str | None = Field(..., description="the token's id; null in open mode")
    open_mode: bool = Field(..., description="true: no token exists, the service answers loopback clients as admins")


class Error(BaseModel):
    """The body of every error answer (``wire.error_body``), whatever its status."""

    code: str = Field(..., description="the library's stable error code, e.g. turn.not_running (docs/concepts.md: Errors)")
    message: str = Field(..., description="what went wrong, for a person")
    details: dict[str, Any] = Field(..., description="the error's fields (ids, limits, the invalid fields)")
    retryable: bool = Field(..., description="true: the same request may succeed later unchanged")


class ViewState(BaseModel):
    """Which state a view reads (``GET /v1/projects/{project_id}/view``)."""

    project_id: str
    kind: Literal["draft", "version", "empty"] = Field(..., description="empty: no version and no draft yet")
    root: str = Field(..., description="the digest of the code tree's root")
    version_id: str | None
    draft_id: str | None
    revision: int | None = Field(..., description="the draft's revision (null for a version)")
    characters: Any
    world_settings: Any


class PathPage(BaseModel):
    """Paths matching a glob, sorted; ``next_cursor`` (while ``truncated``) reads the next ones."""

    paths: list[str]
    truncated: bool
    next_cursor: str | None


class Event(BaseModel):
    id: str = Field(..., description="<epoch>:<n>, what ``after`` and Last-Event-ID take back")
    type: str
    data: Any


class EventPage(BaseModel):
    """One page of a stream's buffered events (``Accept: application/json``)."""

    events: list[Event]
    epoch: str | None = Field(..., description="the buffer's identity")
    has_more_before: bool
    has_more_after: bool
    next_after: str = Field(..., description="``after`` for the next page forwards")
    next_before: int = Field(..., description="``before`` for the next page backwards")


class Payload(BaseModel):
    """The whole args or result of one tool call (``GET .../tool-calls/{seq}/payload``)."""

    seq: int
    part: Literal["args", "result"]
    value: Any = None


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    """Each backend's check (``ok`` or why it is down); a 503 also names the ones that are down."""

    status: Literal["ready", "unavailable"]
    checks: dict[str, str]
    code: str | None = None
    message: str | None = None
    details: dict[str, str] | None = None


def decode_files(files: dict[str, str | None], field: str) -> dict[str, bytes | None]:
    """Base64 contents -> bytes (None stays a deletion). Raises ``input.invalid``."""
    out: dict[str, bytes | None] = {}
    for path, text in files.items():
        if text is None:
            out[path] = None
            continue
        try:
            out[path] = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise E.InvalidInput(f"{field}[{path[:100]!r}] is not base64", field=field, path=path[:200]) from None
    return out


@dataclass
class SearchPage(SearchResult):
    """A search's matches, ``max_results`` at a time: ``next_cursor`` (while ``truncated``)
    asks for the matches after the last one here."""

    next_cursor: str | None = None

    @classmethod
    def of(cls, result: SearchResult, next_cursor: str | None) -> "SearchPage":
        return cls(**{f.name: getattr(result, f.name) for f in fields(result)}, next_cursor=next_cursor)


@dataclass(frozen=True)
class ProjectDetail(Project):
    """One project with its head version and its active draft (none for an observer)."""

    head: Version | None = None
    draft: Draft | None = None


@dataclass(frozen=True)
class TurnDetail(Turn):
    """A turn with the first page of its tool calls; ``tool_calls_next_cursor`` reads the
    rest through ``GET /v1/turns/{turn_id}/tool-calls``."""

    tool_calls_next_cursor: str | None = None


@dataclass(frozen=True)
class NewToken(Token):
    """A token just created: its record and ``token``, the secret, shown only in this answer."""

    token: str = ""
