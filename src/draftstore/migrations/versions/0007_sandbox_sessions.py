"""sandbox sessions

- sandbox_session: which sandbox (provider, its external id) is open on which draft or
  version (exactly one) and turn, restored from which snapshot, its status
  (starting | ready | paused | closed | lost) and its latest heartbeat (last_seen_at).
  A new table: nothing earlier is rewritten.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def _s(n: int) -> sa.types.TypeEngine:
    return sqlmodel.sql.sqltypes.AutoString(length=n)


def upgrade() -> None:
    op.create_table(
        "sandbox_session",
        sa.Column("id", _s(32), nullable=False),
        sa.Column("project_id", _s(32), nullable=False),
        sa.Column("draft_id", _s(32), nullable=True),
        sa.Column("version_id", _s(32), nullable=True),
        sa.Column("turn_id", _s(32), nullable=True),
        sa.Column("provider", _s(64), nullable=False),
        sa.Column("external_id", _s(1024), nullable=False),
        sa.Column("snapshot_id", _s(32), nullable=True),
        sa.Column("status", _s(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("(draft_id IS NULL) <> (version_id IS NULL)", name="ck_sandbox_session_one_state"),
        sa.ForeignKeyConstraint(["project_id"], ["project.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_sandbox_session_project", "sandbox_session", ["project_id", "created_at", "id"])
    op.create_index("ix_sandbox_session_project_status", "sandbox_session",
                    ["project_id", "status", "created_at", "id"])
    op.create_index("ix_sandbox_session_seen", "sandbox_session", ["status", "last_seen_at"])


def downgrade() -> None:
    op.drop_index("ix_sandbox_session_seen", table_name="sandbox_session")
    op.drop_index("ix_sandbox_session_project_status", table_name="sandbox_session")
    op.drop_index("ix_sandbox_session_project", table_name="sandbox_session")
    op.drop_table("sandbox_session")
