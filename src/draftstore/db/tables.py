"""The relational schema (SQLModel). Alembic migrations create it; nothing else does.

Invariants the database itself enforces:
- at most one open draft per project (partial unique index ``uq_draft_open``);
- at most one running turn per project (partial unique index ``uq_turn_running``);
- version numbers and turn numbers are unique per project;
- a tool call is keyed (turn_id, seq), so recording one is a row insert: O(1)
  however long the turn is; the transaction that ends the turn compacts the
  rows into ``project_turn.tool_calls_json`` and deletes them.

JSON documents (characters, world settings, messages, partial responses, the
compacted tool history) are JSONB on PostgreSQL, so admins can query them in
SQL, and JSON (text) on SQLite.

Column names are the design's (``characters_state_json``, ``worldsettings_state_json``,
``e2b_snapshot_ref``, ...), so SQL written from the design runs as it is; where the
Python attribute is shorter, the column's ``key`` keeps it (README maps the names).

``PROJECTS``, ``VERSIONS``, ``DRAFTS``, ``DRAFT_CHANGES``, ``TURNS``, ``TOOL_CALLS``,
``SNAPSHOTS``, ``SANDBOX_SESSIONS``, ``HEAD_MOVES``, ``TOKENS``, ``PACKS`` and ``PACK_OBJECTS``
are the tables (SQLAlchemy Core), for the components that own their SQL.
"""

from __future__ import annotations

from datetime import datetime, timezone

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel

__all__ = [
    "ProjectRow",
    "VersionRow",
    "DraftRow",
    "DraftChangeRow",
    "TurnRow",
    "ToolCallRow",
    "SnapshotRow",
    "SandboxSessionRow",
    "HeadMoveRow",
    "metadata",
    "utcnow",
    "TokenRow",
    "PackRow",
    "PackObjectRow",
    "PROJECTS", "VERSIONS", "DRAFTS", "DRAFT_CHANGES", "TURNS", "TOOL_CALLS", "SNAPSHOTS", "SANDBOX_SESSIONS",
    "HEAD_MOVES", "TOKENS", "PACKS", "PACK_OBJECTS",
]

metadata = SQLModel.metadata


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _ts(nullable: bool = False) -> sa.Column:
    return sa.Column(sa.DateTime(timezone=True), nullable=nullable)


def _json(nullable: bool, name: str | None = None, key: str | None = None) -> sa.Column:
    # none_as_null: Python None is SQL NULL ("not set"), never the JSON literal null
    json = sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
    if name is None:
        return sa.Column(json, nullable=nullable)
    return sa.Column(name, json, key=key, nullable=nullable)


# The design names these columns; Python keeps the shorter attribute (``key``), so
# ``VERSIONS.c.characters_json`` is the column ``characters_state_json`` in every statement.
def _characters() -> sa.Column:
    return _json(False, "characters_state_json", "characters_json")


def _world_settings() -> sa.Column:
    return _json(False, "worldsettings_state_json", "world_settings_json")


ID = 32  # uuid4 hex
DIGEST = 64
NAME = 200


class ProjectRow(SQLModel, table=True):
    __tablename__ = "project"
    id: str = Field(primary_key=True, max_length=ID)
    name: str = Field(max_length=200)
    current_version_id: str | None = Field(default=None, max_length=ID)
    active_draft_id: str | None = Field(default=None, max_length=ID)
    forked_from_version_id: str | None = Field(default=None, max_length=ID)
    created_at: datetime = Field(sa_column=_ts())
    # retention of what is not kept for ever (NULL: the store's default)
    retain_turns_days: float | None = Field(default=None)
    retain_discarded_days: float | None = Field(default=None)


class VersionRow(SQLModel, table=True):
    __tablename__ = "project_version"
    __table_args__ = (
        sa.UniqueConstraint("project_id", "number", name="uq_version_number"),
        # the versions still to pack, in the background packer's order: a handful of rows however
        # many versions exist (migration 0011)
        sa.Index("ix_project_version_unpacked", "pack_attempts", "created_at",
                 sqlite_where=sa.text("packed_at IS NULL"), postgresql_where=sa.text("packed_at IS NULL")),
    )
    id: str = Field(primary_key=True, max_length=ID)
    project_id: str = Field(foreign_key="project.id", index=True, max_length=ID)
    number: int
    parent_version_id: str | None = Field(default=None, max_length=ID)
    code_manifest_key: str = Field(max_length=DIGEST)  # the code tree's root
    file_count: int = 0
    characters_json: Any = Field(sa_column=_characters())
    world_settings_json: Any = Field(sa_column=_world_settings())
    summary: str = Field(default="", sa_column=sa.Column(sa.Text, nullable=False))
    created_by_turn_id: str | None = Field(default=None, max_length=ID)
    created_by: str | None = Field(default=None, max_length=NAME)
    created_at: datetime = Field(sa_column=_ts())
    packed_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))  # NULL: packs not written yet
    pack_attempts: int = 0  # failed packing attempts (the background job backs off after a few)


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
        # the open drafts (closed ones pile up, one per publish or discard): the recovery sweep's
        # drafts stuck in publishing, the background packer's open trees (migration 0011)
        sa.Index("ix_project_draft_open", "status", "status_changed_at",
                 sqlite_where=sa.text("closed_at IS NULL"), postgresql_where=sa.text("closed_at IS NULL")),
    )
    id: str = Field(primary_key=True, max_length=ID)
    project_id: str = Field(foreign_key="project.id", index=True, max_length=ID)
    base_version_id: str | None = Field(default=None, max_length=ID)
    # running | interrupted | paused | publishing
    status: str = Field(max_length=16)
    code_manifest_key: str = Field(max_length=DIGEST)  # the tree root as of the last seal
    file_count: int = 0
    characters_json: Any = Field(sa_column=_characters())
    world_settings_json: Any = Field(sa_column=_world_settings())
    revision: int = 0
    last_turn_id: str | None = Field(default=None, max_length=ID)
    partial_response_json: Any = Field(default=None, sa_column=_json(True))
    status_changed_at: datetime = Field(sa_column=_ts())
    created_at: datetime = Field(sa_column=_ts())
    closed_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    # published | discarded
    closed_reason: str | None = Field(default=None, max_length=16)
    closed_by: str | None = Field(default=None, max_length=NAME)
    published_version_id: str | None = Field(default=None, max_length=ID)
    snapshot_id: str | None = Field(default=None, max_length=ID)  # its latest sandbox snapshot
    # when any statement last changed the row: SQLAlchemy sets it on every INSERT and
    # UPDATE of this table that does not set it itself (every change to a draft goes
    # through ``D.update()``), so no code path can forget it
    updated_at: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False,
                                                     default=utcnow, onupdate=utcnow))


class DraftChangeRow(SQLModel, table=True):
    """The staging overlay: one row per path changed since the draft's last seal."""

    __tablename__ = "draft_change"
    draft_id: str = Field(foreign_key="project_draft.id", primary_key=True, max_length=ID)
    path: str = Field(primary_key=True, max_length=1024)
    digest: str | None = Field(default=None, max_length=DIGEST)  # None = deleted
    size: int = 0
    executable: bool = False
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
    base_version_id: str | None = Field(default=None, max_length=ID)
    actor: str | None = Field(default=None, max_length=NAME)
    # running | completed | interrupted | failed | rolled_back
    status: str = Field(max_length=16)
    user_message_json: Any = Field(sa_column=_json(False))
    assistant_message_json: Any = Field(default=None, sa_column=_json(True))
    error_json: Any = Field(default=None, sa_column=_json(True))
    partial_response_json: Any = Field(default=None, sa_column=_json(True))
    # the ordered tool history, compacted when the turn ends (NULL while it runs)
    tool_calls_json: Any = Field(default=None, sa_column=_json(True))
    # why it ended, beyond its status: cancelled | heartbeat_lapsed | discarded (NULL: as asked)
    end_reason: str | None = Field(default=None, max_length=32)
    # when garbage collection stopped keeping its boundary states and payloads (retention ended)
    pruned_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    # code tree roots at the turn's boundaries, and blob digests of the
    # {"characters", "world_settings"} JSON at the same moments
    start_root: str | None = Field(default=None, max_length=DIGEST)
    end_root: str | None = Field(default=None, max_length=DIGEST)
    start_state_digest: str | None = Field(default=None, max_length=DIGEST)
    end_state_digest: str | None = Field(default=None, max_length=DIGEST)
    started_at: datetime = Field(sa_column=_ts())
    ended_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    # set when an admin reverted the draft to this turn's start or an earlier one: the row
    # stays for the record, its changes no longer stand (and it leaves the resume context)
    reverted_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    reverted_by: str | None = Field(default=None, max_length=NAME)


class ToolCallRow(SQLModel, table=True):
    __tablename__ = "tool_call"
    __table_args__ = (
        # a retried start names the call it repeats: one call per key within a turn
        sa.Index("uq_tool_call_idempotency", "turn_id", "idempotency_key", unique=True,
                 sqlite_where=sa.text("idempotency_key IS NOT NULL"),
                 postgresql_where=sa.text("idempotency_key IS NOT NULL")),
    )
    turn_id: str = Field(foreign_key="project_turn.id", primary_key=True, max_length=ID)
    seq: int = Field(primary_key=True)
    tool_name: str = Field(max_length=NAME)
    # awaiting_approval | started | completed | failed | denied
    status: str = Field(max_length=32)
    # serialised JSON when small; else NULL with the blob digest and a preview
    args_json: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    args_digest: str | None = Field(default=None, max_length=DIGEST)
    args_preview: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    result_json: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    result_digest: str | None = Field(default=None, max_length=DIGEST)
    result_preview: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    # a failed call's error, serialised JSON
    error_json: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    # the approval decision of a call that needed one: {"approved", "reason", "by", "at"}, serialised
    approval_json: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    started_at: datetime = Field(sa_column=_ts())
    ended_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    # the caller's Idempotency-Key of the start, and the SHA-256 of what that start asked
    # (tool name, args, needs_approval): the same key with another request is a conflict
    idempotency_key: str | None = Field(default=None, max_length=NAME)
    request_digest: str | None = Field(default=None, max_length=DIGEST)


class SnapshotRow(SQLModel, table=True):
    """A sandbox snapshot: a cache that rebuilds a state fast; deleting every row loses nothing."""

    __tablename__ = "sandbox_snapshot"
    id: str = Field(primary_key=True, max_length=ID)
    project_id: str = Field(foreign_key="project.id", index=True, max_length=ID)
    # version | draft
    source_kind: str = Field(max_length=16)
    source_id: str = Field(max_length=ID)
    root: str = Field(max_length=DIGEST)  # the code tree it was built from
    # pending | ready | failed | stale
    status: str = Field(max_length=16)
    bundle_key: str | None = Field(default=None, max_length=DIGEST)  # the tar+zstd bundle's digest
    # e.g. a sandbox provider's snapshot id (the design's name; ``SNAPSHOTS.c.external_ref`` in Python)
    external_ref: str | None = Field(default=None, sa_column=sa.Column(
        "e2b_snapshot_ref", sa.String(1024), key="external_ref", nullable=True))
    files: int = 0
    size_bytes: int = Field(default=0, sa_column=sa.Column(sa.BigInteger, nullable=False))
    error: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    created_at: datetime = Field(sa_column=_ts())
    finished_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class SandboxSessionRow(SQLModel, table=True):
    """A sandbox open on one state (the draft or a version: exactly one, checked here too)."""

    __tablename__ = "sandbox_session"
    __table_args__ = (
        sa.CheckConstraint("(draft_id IS NULL) <> (version_id IS NULL)", name="ck_sandbox_session_one_state"),
        # the list (a project's sessions in creation order, with or without a status filter)
        sa.Index("ix_sandbox_session_project", "project_id", "created_at", "id"),
        sa.Index("ix_sandbox_session_project_status", "project_id", "status", "created_at", "id"),
        # the recovery sweep (open sessions whose heartbeat lapsed)
        sa.Index("ix_sandbox_session_seen", "status", "last_seen_at"),
    )
    id: str = Field(primary_key=True, max_length=ID)
    project_id: str = Field(foreign_key="project.id", max_length=ID)
    # no foreign keys below: a session is a record of what ran, kept when versions are pruned
    draft_id: str | None = Field(default=None, max_length=ID)
    version_id: str | None = Field(default=None, max_length=ID)
    turn_id: str | None = Field(default=None, max_length=ID)
    provider: str = Field(max_length=64)  # free text: e2b, docker, local, ...
    external_id: str = Field(max_length=1024)  # the provider's id of the sandbox
    snapshot_id: str | None = Field(default=None, max_length=ID)  # restored from
    # starting | ready | paused | closed | lost
    status: str = Field(max_length=16)
    created_at: datetime = Field(sa_column=_ts())
    updated_at: datetime = Field(sa_column=_ts())
    last_seen_at: datetime = Field(sa_column=_ts())


class PackRow(SQLModel, table=True):
    """A pack of one subtree (one part of it): the content-addressed object bundling its objects.

    Keyed by what it covers, not by its digest: two subtrees may have a part with
    the same bytes (the same files), and each must find it.
    """

    __tablename__ = "pack"
    tree: str = Field(primary_key=True, max_length=DIGEST)  # the subtree it covers
    # tree (the whole subtree) | files (a large directory's own files) | spine (the nodes above packed subtrees)
    kind: str = Field(primary_key=True, max_length=8)
    part: int = Field(default=0, primary_key=True)
    digest: str = Field(index=True, max_length=DIGEST)  # the pack object
    objects: int = 0
    bytes: int = 0  # uncompressed
    search_index: str | None = Field(default=None, max_length=DIGEST)  # trigram index of its files
    # spine rows: JSON [[prefix, tree, kind], ...], the tree/files packs covering every file of the tree
    cover: str | None = Field(default=None, sa_column=sa.Column(sa.Text))
    created_at: datetime = Field(sa_column=_ts())


class PackObjectRow(SQLModel, table=True):
    """Where an object lives inside a pack (so any object stays addressable by digest)."""

    __tablename__ = "pack_object"
    digest: str = Field(primary_key=True, max_length=DIGEST)
    pack: str = Field(primary_key=True, max_length=DIGEST)
    offset: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))
    length: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))


class HeadMoveRow(SQLModel, table=True):
    """Every change of a project's head: who, when, from, to, why."""

    __tablename__ = "head_move"
    id: int | None = Field(default=None, primary_key=True)
    project_id: str = Field(foreign_key="project.id", index=True, max_length=ID)
    from_version_id: str | None = Field(default=None, max_length=ID)
    to_version_id: str | None = Field(default=None, max_length=ID)
    # create | publish | rollback | revert (head stays: the draft went back to turn_id's start)
    reason: str = Field(max_length=16)
    actor: str | None = Field(default=None, max_length=NAME)
    turn_id: str | None = Field(default=None, max_length=ID)
    at: datetime = Field(sa_column=_ts())


class TokenRow(SQLModel, table=True):
    """An API token: only its SHA-256 is stored, so it can never be read back."""

    __tablename__ = "api_token"
    id: str = Field(primary_key=True, max_length=ID)
    secret_hash: str = Field(max_length=DIGEST, unique=True)
    # admin | agent | observer
    role: str = Field(max_length=16)
    project_id: str | None = Field(default=None, foreign_key="project.id", max_length=ID)  # NULL: every project
    name: str = Field(default="", max_length=NAME)
    created_at: datetime = Field(sa_column=_ts())
    created_by: str | None = Field(default=None, max_length=NAME)
    revoked_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))


PROJECTS = ProjectRow.__table__
VERSIONS = VersionRow.__table__
DRAFTS = DraftRow.__table__
DRAFT_CHANGES = DraftChangeRow.__table__
TURNS = TurnRow.__table__
TOOL_CALLS = ToolCallRow.__table__
SNAPSHOTS = SnapshotRow.__table__
SANDBOX_SESSIONS = SandboxSessionRow.__table__
HEAD_MOVES = HeadMoveRow.__table__
TOKENS = TokenRow.__table__
PACKS = PackRow.__table__
PACK_OBJECTS = PackObjectRow.__table__
