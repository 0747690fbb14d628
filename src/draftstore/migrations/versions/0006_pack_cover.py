"""pack cover: a spine pack's row names every packed subtree of its tree

- pack.cover: on a ``spine`` row, JSON ``[[prefix, tree, kind], ...]``: the tree and
  files packs that together cover every file of the tree (NULL on other rows, and on
  spine rows written before this revision: readers then walk the spine).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pack") as b:
        b.add_column(sa.Column("cover", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("pack") as b:
        b.drop_column("cover")
