"""What the public API returns: immutable records of rows, detached from any session.

Statuses are ``StrEnum`` members, so ``turn.status == "running"`` holds and
they serialise as plain strings. A code state is always named by its tree
``root`` (the design's ``code_manifest_key`` column).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from enum import StrEnum
from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = [
    "json_default",
    "Project",
    "Version",
    "Draft",
    "Turn",
    "ToolCall",
    "HeadMove",
    "ResumeContext",
    "ResumeTurn",
    "ResumeToolCall",
    "DraftChanges",
    "ContinuedTurn",
    "TurnStatus",
    "DraftStatus",
    "ToolCallStatus",
    "HeadMoveReason",
    "DraftClosedReason",
    "TurnEndReason",
    "end_reason_of",
    "Role",
    "Token",
    "Page",
    "Snapshot",
    "SnapshotStatus",
    "SandboxSession",
    "SandboxStatus",
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
    AWAITING_APPROVAL = "awaiting_approval"  # recorded with needs_approval; waits for a decision
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"
    DENIED = "denied"  # the approval was refused: final, and not a failure of the turn
    # set when the turn ended (any end: interrupt, cancel, failure, reap, discard) with the call unfinished
    INTERRUPTED = "interrupted"  # was ``started``: its worker never reported how it went
    EXPIRED = "expired"  # was ``awaiting_approval``: no decision came before the turn ended


class TurnEndReason(StrEnum):
    """Why a turn ended, beyond its status (None: ended as its worker asked).

    A turn's end event carries ``end_reason`` always (``end_reason_of``): this
    value, else the status its worker ended it with (``completed``,
    ``interrupted``, ``failed``)."""

    CANCELLED = "cancelled"  # interrupted by a user's cancel: not a failure
    HEARTBEAT_LAPSED = "heartbeat_lapsed"  # interrupted by the recovery sweep
    DISCARDED = "discarded"  # rolled back with its draft


def end_reason_of(status: str, reason: str | None) -> str:
    """Why an ended turn ended, in one word a subscriber can switch on: ``completed``,
    ``interrupted`` or ``failed`` (its worker's end), ``cancelled`` (a user's cancel),
    ``heartbeat_lapsed`` (reaped by the recovery sweep), ``discarded`` (rolled back
    with its draft)."""
    return str(reason) if reason is not None else str(status)


class SnapshotStatus(StrEnum):
    PENDING = "pending"  # scheduled (e.g. by publish), not built yet
    READY = "ready"
    FAILED = "failed"  # could not be built, or its bundle was found missing or corrupt
    STALE = "stale"  # the draft it was taken of has moved on


class SandboxStatus(StrEnum):
    STARTING = "starting"
    READY = "ready"
    PAUSED = "paused"
    CLOSED = "closed"  # final: closed by its owner
    LOST = "lost"  # final: its heartbeat lapsed (the recovery sweep), or its provider lost it


class Role(StrEnum):
    ADMIN = "admin"  # everything
    AGENT = "agent"  # turns, tool calls, draft writes, views, turn streams; never decides a tool call
    OBSERVER = "observer"  # published versions, their files, diffs between them, committed events
    # what an observer reads, plus turns, their tool calls and events; decides tool calls awaiting
    # approval (a backend relaying a person's click). Never writes a draft, never reads one.
    APPROVER = "approver"


class HeadMoveReason(StrEnum):
    CREATE = "create"
    PUBLISH = "publish"
    ROLLBACK = "rollback"
    # not a move: head stays; the draft went back to a turn's start (``turn_id``), by ``actor``
    REVERT = "revert"


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
    #: the latest snapshot of the draft's exact tree that became ready (None once the tree moved on)
    snapshot_id: str | None = None
    #: when the draft last changed: any write, patch, seal, status change, snapshot, publish or discard
    updated_at: datetime | None = None


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
    approval: Any = None  # {"approved": bool, "reason", "by", "at"} once decided

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
    ``tool_calls`` is the ordered history (empty in ``list_turns``).
    ``reverted_at``/``reverted_by``: when and by whom the draft was reverted to
    this turn's start or an earlier one (None: its changes still stand)."""

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
    end_reason: TurnEndReason | None = None
    reverted_at: datetime | None = None
    reverted_by: str | None = None


@dataclass(frozen=True)
class ContinuedTurn(Turn):
    """What ``continue_turn`` answers: the new turn (a ``Turn``) with its resume
    context inline (the first page), so continuing is one call."""

    context: ResumeContext | None = None


@dataclass(frozen=True)
class ResumeToolCall:
    """One tool call as a resume context shows it: a ``ToolCall``'s fields plus
    ``unfinished`` (True when the turn ended before the call did: status
    ``interrupted`` or ``expired``). Offloaded args/results come as digest and
    preview; ``Store.read_payload(digest)`` reads the whole value."""

    seq: int
    tool_name: str
    status: ToolCallStatus
    unfinished: bool
    args: Any
    args_digest: str | None
    args_preview: str | None
    result: Any
    result_digest: str | None
    result_preview: str | None
    error: Any
    approval: Any
    started_at: datetime
    ended_at: datetime | None


@dataclass(frozen=True)
class ResumeTurn:
    """One earlier turn of the draft, as a backend rebuilds the model's context
    from it: messages (or the partial response of a turn cut short), how and
    why it ended, and its tool history in ``seq`` order."""

    id: str
    number: int
    continues_turn_id: str | None
    status: TurnStatus
    end_reason: str | None  # ``end_reason_of``: None while the turn runs
    user_message: Any
    assistant_message: Any
    partial_response: Any
    error: Any
    started_at: datetime
    ended_at: datetime | None
    tool_calls: tuple[ResumeToolCall, ...]


@dataclass(frozen=True)
class DraftChanges:
    """What the draft changed since its base version: paths only (no contents;
    ``Store.diff`` has those), and whether characters or world settings differ."""

    added: tuple[str, ...]
    modified: tuple[str, ...]
    deleted: tuple[str, ...]
    characters_changed: bool
    world_settings_changed: bool


@dataclass(frozen=True)
class ResumeContext:
    """Everything a backend needs to rebuild the model's context for turn
    ``turn_id``: the draft's earlier turns since its base (oldest first, reverted
    ones left out) and what the draft changed. Bounded: ``truncated`` says more
    turns follow, fetched with ``cursor``."""

    turn_id: str
    project_id: str
    draft_id: str
    base_version_id: str | None
    turns: tuple[ResumeTurn, ...]
    changes: DraftChanges
    truncated: bool
    cursor: str | None


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


@dataclass(frozen=True)
class Token:
    """An API token's record; the secret itself is shown once, when it is created."""

    id: str
    role: Role
    project_id: str | None  # None: every project
    name: str
    created_at: datetime
    created_by: str | None
    revoked_at: datetime | None


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list (oldest first unless asked newest first); ``next_cursor`` fetches the
    next page (None: the last one)."""

    items: list[T]
    next_cursor: str | None


@dataclass(frozen=True)
class Snapshot:
    """A sandbox snapshot: a bundle (``bundle_key``) or an external reference that
    rebuilds one state fast. A cache, never truth."""

    id: str
    project_id: str
    source_kind: str  # version | draft
    source_id: str
    root: str
    status: SnapshotStatus
    bundle_key: str | None
    external_ref: str | None
    files: int
    size_bytes: int
    error: str | None
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class SandboxSession:
    """A sandbox a provider runs on one state of a project: the draft (``draft_id``) or a
    version (``version_id``), exactly one of them; metadata only, the sandbox itself lives
    with its ``provider`` under ``external_id``. ``last_seen_at`` is its latest heartbeat."""

    id: str
    project_id: str
    draft_id: str | None
    version_id: str | None
    turn_id: str | None
    provider: str
    external_id: str
    snapshot_id: str | None  # the snapshot it was restored from, if any
    status: SandboxStatus
    created_at: datetime
    updated_at: datetime
    last_seen_at: datetime


def json_default(value: Any) -> Any:
    """For a JSON encoder's ``default``: a record as a dict of its fields, a date or time in
    ISO 8601, a set or tuple as a list, bytes as UTF-8 text, anything else as ``str``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
