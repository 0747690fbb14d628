"""service: API tokens, turn end reasons, tool-call approvals

- api_token: bearer tokens (only their SHA-256), with a role and an optional project scope.
- project_turn.end_reason: why a turn ended beyond its status (cancelled, heartbeat_lapsed, discarded).
- tool_call.approval_json: the approval decision of a call that needed one; tool_call.status
  widened to 32 characters (``awaiting_approval``).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_token",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("secret_hash", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("role", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("project_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["project_id"], ["project.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("secret_hash"),
    )
    with op.batch_alter_table("project_turn") as b:
        b.add_column(sa.Column("end_reason", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True))
    with op.batch_alter_table("tool_call") as b:
        b.add_column(sa.Column("approval_json", sa.Text(), nullable=True))
        b.alter_column("status", existing_type=sqlmodel.sql.sqltypes.AutoString(length=16),
                       type_=sqlmodel.sql.sqltypes.AutoString(length=32), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("tool_call") as b:
        b.drop_column("approval_json")
    with op.batch_alter_table("project_turn") as b:
        b.drop_column("end_reason")
    op.drop_table("api_token")
