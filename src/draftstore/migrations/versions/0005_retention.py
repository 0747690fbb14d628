"""retention: per-project retention, pruned turns

- project.retain_turns_days / retain_discarded_days: how long ended turns' boundary states and
  payloads, and discarded drafts' trees, are kept (NULL: the store's defaults).
- project_turn.pruned_at: when garbage collection stopped keeping them for this turn.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("project") as b:
        b.add_column(sa.Column("retain_turns_days", sa.Float(), nullable=True))
        b.add_column(sa.Column("retain_discarded_days", sa.Float(), nullable=True))
    with op.batch_alter_table("project_turn") as b:
        b.add_column(sa.Column("pruned_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("project_turn") as b:
        b.drop_column("pruned_at")
    with op.batch_alter_table("project") as b:
        b.drop_column("retain_discarded_days")
        b.drop_column("retain_turns_days")
