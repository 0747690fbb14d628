"""The relational schema (SQLModel). Alembic migrations create it; nothing else does.

Invariants the database itself enforces:
- at most one open draft per project (partial unique index ``uq_draft_open``);
- at most one running turn per project (partial unique index ``uq_turn_running``);
- version numbers and turn numbers are unique per project;
- a tool call is keyed (turn_id, seq), so recording one is a row insert: O(1)
  however long the turn is.
"""

from __future__ import annotations

from datetime import datetime, timezone

import sqlalchemy as sa
from sqlmodel import Field, SQLModel

__all__ = [
    "ProjectRow",
    "VersionRow",
    "DraftRow",
    "DraftChangeRow",
    "TurnRow",
    "ToolCallRow",
    "SnapshotRow",
    "HeadMoveRow",
    "metadata",
    "utcnow",
]

metadata = SQLModel.metadata


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _ts(nullable: bool = False) -> sa.Column:
    return sa.Column(sa.DateTime(timezone=True), nullable=nullable)


ID = 32  # uuid4 hex
DIGEST = 64


class ProjectRow(SQLModel, table=True):
    __tablename__ = "project"
    id: str = Field(primary_key=True, max_length=ID)
    name: str = Field(max_length=200)
    current_version_id: str | None = Field(default=None, max_length=ID)
    active_draft_id: str | None = Field(default=None, max_length=ID)
    forked_from_version_id: str | None = Field(default=None, max_length=ID)
    created_at: datetime = Field(sa_column=_ts())


class VersionRow(SQLModel, table=True):
    __tablename__ = "project_version"
    __table_args__ = (sa.UniqueConstraint("project_id", "number", name="uq_version_number"),)
    id: str = Field(primary_key=True, max_length=ID)
    project_id: str = Field(foreign_key="project.id", index=True, max_length=ID)
    number: int
    parent_version_id: str | None = Field(default=None, max_length=ID)
    code_manifest_key: str = Field(max_length=DIGEST)
    file_count: int = 0
    characters_json: str = Field(sa_column=sa.Column(sa.Text, nullable=False))
    world_settings_json: str = Field(sa_column=sa.Column(sa.Text, nullable=False))
    summary: str = Field(default="", sa_column=sa.Column(sa.Text, nullable=False))
    created_by_turn_id: str | None = Field(default=None, max_length=ID)
    created_by: str | None = Field(default=None, max_length=200)
    created_at: datetime = Field(sa_column=_ts())


class DraftRow(SQLModel, table=True):
    __tablename__ = "project_draft"
    __table_args__ = (
        sa.Index(
            "uq_draft_open",
            "project_id",
            unique=True,
            sqlite_where=sa.text("closed_at IS NULL"),
            postgresql_where=sa.text("closed_at IS NULL"),
        ),
    )
    id: str = Field(primary_key=True, max_length=ID)
    project_id: str = Field(foreign_key="project.id", index=True, max_length=ID)
    base_version_id: str | None = Field(default=None, max_length=ID)
    # running | interrupted | paused | publishing
    status: str = Field(max_length=16)
    code_manifest_key: str = Field(max_length=DIGEST)
    file_count: int = 0
    characters_json: str = Field(sa_column=sa.Column(sa.Text, nullable=False))
    world_settings_json: str = Field(sa_column=sa.Column(sa.Text, nullable=False))
    revision: int = 0
    last_turn_id: str | None = Field(default=None, max_length=ID)
    partial_response_json: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    status_changed_at: datetime = Field(sa_column=_ts())
    created_at: datetime = Field(sa_column=_ts())
    closed_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    # published | discarded
    closed_reason: str | None = Field(default=None, max_length=16)
    published_version_id: str | None = Field(default=None, max_length=ID)


class DraftChangeRow(SQLModel, table=True):
    """The staging overlay: one row per path changed since the draft's last seal."""

    __tablename__ = "draft_change"
    draft_id: str = Field(foreign_key="project_draft.id", primary_key=True, max_length=ID)
    path: str = Field(primary_key=True, max_length=1024)
    digest: str | None = Field(default=None, max_length=DIGEST)  # None = deleted
    size: int = 0
    revision: int = 0


class TurnRow(SQLModel, table=True):
    __tablename__ = "project_turn"
    __table_args__ = (
        sa.UniqueConstraint("project_id", "number", name="uq_turn_number"),
        sa.Index(
            "uq_turn_running",
            "project_id",
            unique=True,
            sqlite_where=sa.text("status = 'running'"),
            postgresql_where=sa.text("status = 'running'"),
        ),
    )
    id: str = Field(primary_key=True, max_length=ID)
    project_id: str = Field(foreign_key="project.id", index=True, max_length=ID)
    draft_id: str = Field(foreign_key="project_draft.id", index=True, max_length=ID)
    number: int
    continues_turn_id: str | None = Field(default=None, max_length=ID)
    # running | completed | interrupted | failed | rolled_back
    status: str = Field(max_length=16)
    user_message: str = Field(sa_column=sa.Column(sa.Text, nullable=False))
    assistant_message: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    error: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    partial_response_json: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    # code tree roots at the turn's boundaries, and blob digests of the
    # {"characters", "world_settings"} JSON at the same moments
    start_root: str | None = Field(default=None, max_length=DIGEST)
    end_root: str | None = Field(default=None, max_length=DIGEST)
    start_state_digest: str | None = Field(default=None, max_length=DIGEST)
    end_state_digest: str | None = Field(default=None, max_length=DIGEST)
    started_at: datetime = Field(sa_column=_ts())
    ended_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class ToolCallRow(SQLModel, table=True):
    __tablename__ = "tool_call"
    turn_id: str = Field(foreign_key="project_turn.id", primary_key=True, max_length=ID)
    seq: int = Field(primary_key=True)
    tool_name: str = Field(max_length=200)
    # started | completed | failed
    status: str = Field(max_length=16)
    # serialised JSON when small; else NULL with the blob digest and a preview
    args_json: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    args_digest: str | None = Field(default=None, max_length=DIGEST)
    args_preview: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    result_json: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    result_digest: str | None = Field(default=None, max_length=DIGEST)
    result_preview: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    error: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    started_at: datetime = Field(sa_column=_ts())
    ended_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class SnapshotRow(SQLModel, table=True):
    """A sandbox snapshot: a cache; deleting every row loses nothing."""

    __tablename__ = "sandbox_snapshot"
    id: str = Field(primary_key=True, max_length=ID)
    project_id: str = Field(foreign_key="project.id", index=True, max_length=ID)
    version_id: str | None = Field(default=None, max_length=ID)
    draft_id: str | None = Field(default=None, max_length=ID)
    code_root: str = Field(max_length=DIGEST)
    bundle_digest: str | None = Field(default=None, max_length=DIGEST)
    external_ref: str | None = Field(default=None, max_length=1024)
    created_at: datetime = Field(sa_column=_ts())


class HeadMoveRow(SQLModel, table=True):
    """Every change of a project's head: who, when, from, to, why."""

    __tablename__ = "head_move"
    id: int | None = Field(default=None, primary_key=True)
    project_id: str = Field(foreign_key="project.id", index=True, max_length=ID)
    from_version_id: str | None = Field(default=None, max_length=ID)
    to_version_id: str | None = Field(default=None, max_length=ID)
    # create | publish | rollback
    reason: str = Field(max_length=16)
    actor: str | None = Field(default=None, max_length=200)
    turn_id: str | None = Field(default=None, max_length=ID)
    at: datetime = Field(sa_column=_ts())
