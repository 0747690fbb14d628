"""turn revert

- project_turn.reverted_at, project_turn.reverted_by: set on the turns an admin's revert
  of the draft to a turn's start undid (that turn and the later ones of the draft). The
  rows stay; NULL (every existing turn) means the turn's changes still stand.
- head_move.reason gains the value ``revert`` (a string column: no schema change).
  Only columns are added: nothing earlier is rewritten.

Revision ID: 0009
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("project_turn") as batch:
        batch.add_column(sa.Column("reverted_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("reverted_by", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("project_turn") as batch:
        batch.drop_column("reverted_by")
        batch.drop_column("reverted_at")
