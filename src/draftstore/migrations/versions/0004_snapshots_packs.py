"""snapshots, packs, file modes

- draft_change.executable: the staged file's executable bit (trees record it as kind "x").
- sandbox_snapshot: rebuilt with the design's fields (source_kind, source_id, root, status,
  bundle_key, external_ref, files, size_bytes, error, finished_at). No earlier release wrote
  the table, and a snapshot is a cache, never truth: nothing is lost by recreating it.
- project_draft.snapshot_id: the draft's latest snapshot.
- project_version.packed_at: when its packs were written (NULL: not yet; the background job does).
- pack, pack_object: packs of subtrees and where each object lives in them.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _s(n: int) -> sa.types.TypeEngine:
    return sqlmodel.sql.sqltypes.AutoString(length=n)


def upgrade() -> None:
    with op.batch_alter_table("draft_change") as b:
        b.add_column(sa.Column("executable", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("project_draft") as b:
        b.add_column(sa.Column("snapshot_id", _s(32), nullable=True))
    with op.batch_alter_table("project_version") as b:
        b.add_column(sa.Column("packed_at", sa.DateTime(timezone=True), nullable=True))
        b.add_column(sa.Column("pack_attempts", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("sandbox_snapshot") as b:
        b.drop_index(b.f("ix_sandbox_snapshot_project_id"))
    op.drop_table("sandbox_snapshot")
    op.create_table(
        "sandbox_snapshot",
        sa.Column("id", _s(32), nullable=False),
        sa.Column("project_id", _s(32), nullable=False),
        sa.Column("source_kind", _s(16), nullable=False),
        sa.Column("source_id", _s(32), nullable=False),
        sa.Column("root", _s(64), nullable=False),
        sa.Column("status", _s(16), nullable=False),
        sa.Column("bundle_key", _s(64), nullable=True),
        sa.Column("external_ref", _s(1024), nullable=True),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["project_id"], ["project.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_sandbox_snapshot_project_id", "sandbox_snapshot", ["project_id"])
    op.create_table(
        "pack",
        sa.Column("tree", _s(64), nullable=False),
        sa.Column("kind", _s(8), nullable=False),
        sa.Column("part", sa.Integer(), nullable=False),
        sa.Column("digest", _s(64), nullable=False),
        sa.Column("objects", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("search_index", _s(64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tree", "kind", "part"),
    )
    op.create_index("ix_pack_digest", "pack", ["digest"])
    op.create_table(
        "pack_object",
        sa.Column("digest", _s(64), nullable=False),
        sa.Column("pack", _s(64), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("length", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("digest", "pack"),
    )


def downgrade() -> None:
    op.drop_table("pack_object")
    op.drop_index("ix_pack_digest", table_name="pack")
    op.drop_table("pack")
    with op.batch_alter_table("project_draft") as b:
        b.drop_column("snapshot_id")
    with op.batch_alter_table("draft_change") as b:
        b.drop_column("executable")
