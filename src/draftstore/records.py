"""What the public API returns: immutable records of rows, detached from any session.

Statuses are ``StrEnum`` members, so ``turn.status == "running"`` holds and
they serialise as plain strings. A code state is always named by its tree
``root`` (the design's ``code_manifest_key`` column).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import StrEnum
from typing import Any

__all__ = [
    "Project",
    "Version",
    "Draft",
    "Turn",
    "ToolCall",
    "HeadMove",
    "TurnStatus",
    "DraftStatus",
    "ToolCallStatus",
    "HeadMoveReason",
    "DraftClosedReason",
    "aware",
]


class TurnStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"


class DraftStatus(StrEnum):
    RUNNING = "running"
    INTERRUPTED = "interrupted"
    PAUSED = "paused"
    # a publish in progress; a publish is one transaction, so only a row written
    # by an older release can be left in this state (the recovery sweep releases it)
    PUBLISHING = "publishing"


class ToolCallStatus(StrEnum):
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"


class HeadMoveReason(StrEnum):
    CREATE = "create"
    PUBLISH = "publish"
    ROLLBACK = "rollback"


class DraftClosedReason(StrEnum):
    PUBLISHED = "published"
    DISCARDED = "discarded"


def aware(ts: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every timestamp we store is UTC."""
    if ts is not None and ts.tzinfo is None:
        return ts.replace(tzinfo=timezone.utc)
    return ts


@dataclass(frozen=True)
class Project:
    id: str
    name: str
    current_version_id: str | None
    active_draft_id: str | None
    forked_from_version_id: str | None
    created_at: datetime


@dataclass(frozen=True)
class Version:
    """An immutable published state: code tree ``root`` + characters + world settings."""

    id: str
    project_id: str
    number: int
    parent_version_id: str | None
    root: str
    file_count: int
    characters: Any
    world_settings: Any
    summary: str
    created_by_turn_id: str | None
    created_by: str | None
    created_at: datetime


@dataclass(frozen=True)
class Draft:
    """The one open state of a project. ``root`` is the tree as of its last seal."""

    id: str
    project_id: str
    base_version_id: str | None
    status: DraftStatus
    root: str
    file_count: int
    revision: int
    last_turn_id: str | None
    partial_response: Any
    created_at: datetime
    closed_at: datetime | None
    closed_reason: DraftClosedReason | None
    closed_by: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """One recorded tool call. ``args``/``result`` are None when offloaded to the
    blob store; then ``args_digest``/``result_digest`` name the payload
    (``Store.read_payload``) and ``*_preview`` holds its first characters.
    ``error`` is the JSON value a failed call was given (often a string)."""

    turn_id: str
    seq: int
    tool_name: str
    status: ToolCallStatus
    args: Any
    args_digest: str | None
    args_preview: str | None
    result: Any
    result_digest: str | None
    result_preview: str | None
    error: Any
    started_at: datetime
    ended_at: datetime | None

    @property
    def args_offloaded(self) -> bool:
        return self.args_digest is not None

    @property
    def result_offloaded(self) -> bool:
        return self.result_digest is not None


@dataclass(frozen=True)
class Turn:
    """One QA turn. Messages and ``error`` are JSON values (a string, or a
    structured chat message). ``start_root``/``end_root`` are the code tree at
    the turn's boundaries (``end_root`` is set in the transaction that ends it).
    ``tool_calls`` is the ordered history (empty in ``list_turns``)."""

    id: str
    project_id: str
    draft_id: str
    number: int
    continues_turn_id: str | None
    base_version_id: str | None
    actor: str | None
    status: TurnStatus
    user_message: Any
    assistant_message: Any
    error: Any
    partial_response: Any
    start_root: str | None
    end_root: str | None
    started_at: datetime
    ended_at: datetime | None
    tool_calls: tuple[ToolCall, ...] = field(default=())


@dataclass(frozen=True)
class HeadMove:
    id: int
    project_id: str
    from_version_id: str | None
    to_version_id: str | None
    reason: HeadMoveReason
    actor: str | None
    turn_id: str | None
    at: datetime
