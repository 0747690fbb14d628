"""What the public API returns: immutable snapshots of rows, detached from any session."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

__all__ = ["Project", "Version", "Draft", "Turn", "ToolCall", "HeadMove", "TurnStatus", "DraftStatus"]


class TurnStatus:
    RUNNING = "running"
    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"


class DraftStatus:
    RUNNING = "running"
    INTERRUPTED = "interrupted"
    PAUSED = "paused"
    PUBLISHING = "publishing"


def aware(ts: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every timestamp we store is UTC."""
    if ts is not None and ts.tzinfo is None:
        return ts.replace(tzinfo=timezone.utc)
    return ts


def loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


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
    id: str
    project_id: str
    number: int
    parent_version_id: str | None
    code_manifest_key: str
    file_count: int
    characters: Any
    world_settings: Any
    summary: str
    created_by_turn_id: str | None
    created_by: str | None
    created_at: datetime


@dataclass(frozen=True)
class Draft:
    id: str
    project_id: str
    base_version_id: str | None
    status: str
    code_manifest_key: str
    file_count: int
    revision: int
    last_turn_id: str | None
    partial_response: Any
    created_at: datetime
    closed_at: datetime | None
    closed_reason: str | None


@dataclass(frozen=True)
class ToolCall:
    """One recorded tool call. ``args``/``result`` are None when offloaded to the
    blob store; then ``args_digest``/``result_digest`` name the payload
    (``Store.read_payload``) and ``*_preview`` holds its first characters."""

    turn_id: str
    seq: int
    tool_name: str
    status: str  # started | completed | failed
    args: Any
    args_digest: str | None
    args_preview: str | None
    result: Any
    result_digest: str | None
    result_preview: str | None
    error: str | None
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
    id: str
    project_id: str
    draft_id: str
    number: int
    continues_turn_id: str | None
    status: str
    user_message: str
    assistant_message: str | None
    error: str | None
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
    reason: str
    actor: str | None
    turn_id: str | None
    at: datetime
