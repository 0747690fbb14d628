"""growth indexes: the background work of every replica stays off sequential scans

Found by ``tests/test_growth_indexes.py`` (EXPLAIN of every statement the hot
operations and the background work send, on a grown database): the packer's
statement read all of ``project_version`` (a row per publish) every interval,
on every replica; the two open-draft statements read all of ``project_draft``
when open drafts were a large share of its rows (most projects with a draft
open), and otherwise walked every open draft through ``uq_draft_open``.

- ix_project_version_unpacked: project_version (pack_attempts, created_at)
  WHERE packed_at IS NULL — the versions still to pack, in the order the
  background packer takes them (``Projects.pack_pending``); almost every version
  is packed, so the index holds a handful of rows however many versions exist.
- ix_project_draft_open: project_draft (status, status_changed_at) WHERE
  closed_at IS NULL — the open drafts (at most one per project; closed ones
  pile up, one per publish or discard): the recovery sweep's drafts stuck in
  ``publishing`` (``Publishing.release_stuck``) and the open drafts whose
  trees the background packer looks at (``Projects.pack_open_drafts``).

Only indexes are added: nothing earlier is rewritten.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_UNPACKED = sa.text("packed_at IS NULL")
_OPEN = sa.text("closed_at IS NULL")


def upgrade() -> None:
    op.create_index("ix_project_version_unpacked", "project_version", ["pack_attempts", "created_at"],
                    postgresql_where=_UNPACKED, sqlite_where=_UNPACKED)
    op.create_index("ix_project_draft_open", "project_draft", ["status", "status_changed_at"],
                    postgresql_where=_OPEN, sqlite_where=_OPEN)


def downgrade() -> None:
    op.drop_index("ix_project_draft_open", table_name="project_draft")
    op.drop_index("ix_project_version_unpacked", table_name="project_version")
