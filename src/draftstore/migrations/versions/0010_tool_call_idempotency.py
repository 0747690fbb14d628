"""tool-call idempotency keys

- tool_call.idempotency_key: the ``Idempotency-Key`` a caller gave when it recorded the
  start of a call (NULL: none given, every existing row).
- tool_call.request_digest: the SHA-256 of what that start asked (tool name, args,
  needs_approval), so a key reused for another request is told apart from a retry.
- uq_tool_call_idempotency: unique (turn_id, idempotency_key) where a key is set: two
  racing starts with one key record one call.
Only columns and an index are added: nothing earlier is rewritten.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tool_call") as batch:
        batch.add_column(sa.Column("idempotency_key", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True))
        batch.add_column(sa.Column("request_digest", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True))
    op.create_index("uq_tool_call_idempotency", "tool_call", ["turn_id", "idempotency_key"], unique=True,
                    sqlite_where=sa.text("idempotency_key IS NOT NULL"),
                    postgresql_where=sa.text("idempotency_key IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("uq_tool_call_idempotency", table_name="tool_call")
    with op.batch_alter_table("tool_call") as batch:
        batch.drop_column("request_digest")
        batch.drop_column("idempotency_key")
