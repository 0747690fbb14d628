"""Drafts: the one open, unfinished state of a project.

A draft is derived from head when a project's first turn (after a publish or
a discard) starts; it holds a sealed tree root, the characters and world
settings, and a revision that every change bumps. The database allows at most
one open draft per project (partial unique index). Closing a draft (publish,
discard) belongs to ``publishing``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import errors as E
from . import validation as check
from .database import Database
from .db.tables import DRAFTS, PROJECTS, VERSIONS
from .digest import EMPTY_TREE
from .ids import new_id
from .records import Draft, DraftClosedReason, DraftStatus, aware

__all__ = ["Drafts", "draft_record"]


def draft_record(r: Any) -> Draft:
    return Draft(
        id=r.id, project_id=r.project_id, base_version_id=r.base_version_id, status=DraftStatus(r.status),
        root=r.code_manifest_key, file_count=r.file_count, revision=r.revision, last_turn_id=r.last_turn_id,
        partial_response=r.partial_response_json, created_at=aware(r.created_at), closed_at=aware(r.closed_at),
        closed_reason=None if r.closed_reason is None else DraftClosedReason(r.closed_reason),
        closed_by=r.closed_by, snapshot_id=r.snapshot_id, updated_at=aware(r.updated_at),
    )


class Drafts:
    def __init__(self, db: Database) -> None:
        self.db = db

    def get(self, project_id: str) -> Draft:
        """The project's active draft. Raises ``project.not_found``, ``draft.none``."""
        check.project_id(project_id)
        with self.db.tx(read_only=True) as conn:
            row = conn.execute(
                sa.select(PROJECTS.c.id.label("project"), DRAFTS)
                .select_from(PROJECTS.outerjoin(DRAFTS, DRAFTS.c.id == PROJECTS.c.active_draft_id))
                .where(PROJECTS.c.id == project_id)).first()
        if row is None:
            raise E.ProjectNotFound(f"no project {project_id!r}", project_id=project_id)
        if row.id is None:
            raise E.DraftNone(f"project {project_id} has no active draft", project_id=project_id)
        return draft_record(row)

    def active(self, conn: Connection, project: Any, lock: bool = False) -> Any | None:
        """The project's active draft row (locked if asked), or None."""
        if project.active_draft_id is None:
            return None
        stmt = sa.select(DRAFTS).where(DRAFTS.c.id == project.active_draft_id)
        return conn.execute(self.db.for_update(stmt) if lock else stmt).first()

    def lock_open(self, conn: Connection, project: Any, doing: str) -> Any:
        """The project's open draft row, locked (project row locked first by the
        caller). Raises ``draft.none`` (saying what there is none to ``doing``)."""
        draft = self.active(conn, project, lock=True)
        if draft is None:
            raise E.DraftNone(f"project {project.id} has no draft to {doing}", project_id=project.id)
        return draft

    def derive(self, conn: Connection, project: Any, now: datetime) -> Any:
        """Open a draft on the project's head (empty if it has none); the project
        row must be locked by the caller. Returns the new row."""
        if project.current_version_id is not None:
            head = conn.execute(sa.select(VERSIONS.c.code_manifest_key, VERSIONS.c.file_count,
                                          VERSIONS.c.characters_json, VERSIONS.c.world_settings_json)
                                .where(VERSIONS.c.id == project.current_version_id)).one()
            root, count, chars, world = (head.code_manifest_key, head.file_count, head.characters_json,
                                         head.world_settings_json)
        else:
            root, count, chars, world = EMPTY_TREE, 0, {}, {}
        did = new_id()
        conn.execute(DRAFTS.insert().values(
            id=did, project_id=project.id, base_version_id=project.current_version_id, status=DraftStatus.PAUSED,
            code_manifest_key=root, file_count=count, characters_json=chars, world_settings_json=world,
            revision=0, status_changed_at=now, created_at=now,
        ))
        conn.execute(PROJECTS.update().where(PROJECTS.c.id == project.id).values(active_draft_id=did))
        return conn.execute(sa.select(DRAFTS).where(DRAFTS.c.id == did)).first()
