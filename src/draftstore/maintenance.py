"""Keeping a store healthy and bounded: retention, version pruning, garbage collection, fsck.

Nothing here runs on a request's path. Versions are never removed by
retention or garbage collection; pruning versions is an explicit admin act
(``prune_versions``) that refuses head, and every version a recorded head
move names, unless forced.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa

from . import errors as E
from . import validation as check
from .database import Database
from .db.tables import HEAD_MOVES, PROJECTS, SNAPSHOTS, VERSIONS
from .fsck import Checker, FsckReport
from .gc import Collector, GCStats, Retention, project_retention
from .objects import Objects
from .settings import MAX_RETAIN_DAYS, Settings

__all__ = ["Maintenance"]


def _days(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_RETAIN_DAYS:
        raise E.InvalidInput(f"{name} is a number of days from 0 to 36,500, or null (for ever)", field=name)
    return float(value)


class Maintenance:
    def __init__(self, db: Database, objects: Objects, settings: Settings) -> None:
        self.db = db
        self.objects = objects
        self.settings = settings

    def retention(self, project_id: str) -> Retention:
        check.project_id(project_id)
        with self.db.tx(read_only=True) as conn:
            row = conn.execute(sa.select(PROJECTS.c.retain_turns_days, PROJECTS.c.retain_discarded_days)
                               .where(PROJECTS.c.id == project_id)).first()
        if row is None:
            raise E.ProjectNotFound(f"no project {project_id!r}", project_id=project_id)
        s = self.settings
        return Retention(s.retain_turns_days if row.retain_turns_days is None else row.retain_turns_days,
                         s.retain_discarded_days if row.retain_discarded_days is None else row.retain_discarded_days)

    def set_retention(self, project_id: str, values: dict[str, Any]) -> Retention:
        """``values``: ``turns_days`` and/or ``discarded_days`` (a number, or None for the default)."""
        check.project_id(project_id)
        unknown = set(values) - {"turns_days", "discarded_days"}
        if unknown:
            raise E.InvalidInput(f"unknown retention setting(s): {', '.join(sorted(unknown))}", field="retention")
        columns = {f"retain_{k}": _days(k, v) for k, v in values.items()}
        with self.db.tx() as conn:
            if conn.execute(PROJECTS.update().where(PROJECTS.c.id == project_id).values(**columns)).rowcount != 1:
                raise E.ProjectNotFound(f"no project {project_id!r}", project_id=project_id)
        return self.retention(project_id)

    def prune_versions(self, project_id: str, version_ids: Iterable[str], force: bool) -> int:
        """Delete version rows (their trees become garbage unless shared). Refuses head,
        and any version a head move names, unless ``force``; never head even then."""
        check.project_id(project_id)
        ids = [check.version_id(v) for v in version_ids]
        with self.db.tx() as conn:
            project = conn.execute(self.db.for_update(sa.select(PROJECTS).where(PROJECTS.c.id == project_id))).first()
            if project is None:
                raise E.ProjectNotFound(f"no project {project_id!r}", project_id=project_id)
            found = set(conn.execute(sa.select(VERSIONS.c.id)
                                     .where(VERSIONS.c.project_id == project_id, VERSIONS.c.id.in_(ids))).scalars())
            missing = [v for v in ids if v not in found]
            if missing:
                raise E.VersionNotFound(f"no version {missing[0]!r} in project {project_id}", version_id=missing[0])
            if project.current_version_id in found:
                raise E.InvalidInput("the head version cannot be pruned (roll back first)",
                                     version_id=project.current_version_id)
            moves = HEAD_MOVES.c.project_id == project_id
            named = set(conn.execute(sa.select(HEAD_MOVES.c.to_version_id).where(moves)).scalars())
            named |= set(conn.execute(sa.select(HEAD_MOVES.c.from_version_id).where(moves)).scalars())
            protected = sorted(found & named)
            if protected and not force:
                raise E.VersionProtected(f"{len(protected)} of these versions were head once (a head move names them): "
                                      "prune them with force", version_ids=protected[:20])
            conn.execute(SNAPSHOTS.delete().where(SNAPSHOTS.c.source_kind == "version",
                                                  SNAPSHOTS.c.source_id.in_(found)))
            return conn.execute(VERSIONS.delete().where(VERSIONS.c.id.in_(found))).rowcount

    def gc(self, dry_run: bool, progress: Any = None) -> GCStats:
        return Collector(self.db, self.objects, project_retention(self.db, self.settings),
                         grace_s=self.settings.gc_grace_s).run(dry_run=dry_run, progress=progress)

    def fsck(self, verify_objects: bool, progress: Any = None) -> FsckReport:
        return Checker(self.db, self.objects).run(verify_objects=verify_objects, progress=progress)
