"""Publishing and discarding: how a draft closes.

Publish is ONE transaction: it seals whatever is left in the overlay, inserts
the version, moves head, records the head move and closes the draft, or does
none of it. Two racing publishes produce exactly one version (the project and
draft rows are locked, and the loser finds no open draft). Discard closes the
draft without a version; a turn still running on it ends ``rolled_back`` in
the same transaction, its writes sealed into its end root for the record.
"""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa

from . import errors as E
from . import faults
from . import validation as check
from .coordination import Coordination
from .database import Database
from .db.tables import DRAFTS, PROJECTS, TURNS, utcnow
from .deferred import retry_unlocked
from .drafts import Drafts, draft_record
from .projects import Projects
from .records import (Draft, DraftClosedReason, DraftStatus, HeadMoveReason, Turn, TurnEndReason, TurnStatus, Version,
                      aware)
from .sealing import Sealing
from .settings import Settings
from .turns import Turns

__all__ = ["Publishing"]

log = logging.getLogger("draftstore")


class Publishing:
    def __init__(self, db: Database, coordination: Coordination, settings: Settings, projects: Projects,
                 drafts: Drafts, sealing: Sealing, turns: Turns, snapshots: Any = None) -> None:
        self.db = db
        self.coordination = coordination
        self.settings = settings
        self.limits = settings.limits
        self.snapshots = snapshots
        self.projects = projects
        self.drafts = drafts
        self.sealing = sealing
        self.turns = turns

    def publish(self, project_id: str, summary: str, force: bool, actor: str | None) -> Version:
        check.project_id(project_id)
        summary = check.text("summary", summary, max_bytes=self.limits.max_message_bytes)
        actor = check.actor(actor)
        check.flag("force", force)
        # the overlay is empty unless a writer of an older release died: then it is folded here
        fold = self.sealing.prepare_open(project_id)

        def attempt() -> Version:
            with self.db.tx() as conn:
                project = self.projects.load(conn, project_id, lock=True)
                draft = self.drafts.lock_open(conn, project, "publish")
                now = utcnow()  # after the locks: head moves are stamped in the order they happen
                if draft.status in (DraftStatus.RUNNING, DraftStatus.PUBLISHING):
                    raise E.DraftBusy(
                        f"draft {draft.id} is {draft.status}; finish or interrupt the turn first"
                        if draft.status == DraftStatus.RUNNING else f"draft {draft.id} is already being published",
                        draft_id=draft.id, status=draft.status)
                if draft.base_version_id != project.current_version_id and not force:
                    raise E.DraftConflict(
                        f"draft {draft.id} is based on {draft.base_version_id}, head is now "
                        f"{project.current_version_id}: publish with force=True to replace head with the draft",
                        draft_id=draft.id, base_version_id=draft.base_version_id,
                        head_version_id=project.current_version_id)
                root, files = self.sealing.apply(conn, fold, draft)
                version = self.projects.insert_version(
                    conn, project, root=root, file_count=files, characters=draft.characters_json,
                    world_settings=draft.world_settings_json, summary=summary, turn_id=draft.last_turn_id,
                    actor=actor, now=now, reason=HeadMoveReason.PUBLISH)
                self._close(conn, project_id, draft.id, DraftClosedReason.PUBLISHED, actor, now,
                            published_version_id=version.id)
                if self.snapshots is not None and self.settings.snapshot_on_publish:
                    self.snapshots.schedule(conn, project_id, version.id, root)  # built later, off this path
                faults.point("publish.before_commit")
            return version

        try:
            version = retry_unlocked(attempt)
        finally:
            fold.settle()
        faults.point("publish.after_commit")
        self.coordination.emit(f"project:{project_id}", "version.published",
                               {"version_id": version.id, "number": version.number})
        return version

    def discard(self, project_id: str, actor: str | None) -> Draft:
        check.project_id(project_id)
        actor = check.actor(actor)
        fold = self.sealing.prepare_open(project_id)

        def attempt() -> tuple[Draft, Turn | None]:
            ended: Turn | None = None
            with self.db.tx() as conn:
                project = self.projects.load(conn, project_id, lock=True)
                now = utcnow()  # after the lock: a discard is stamped in the order it happens (as head moves are)
                draft = self.drafts.lock_open(conn, project, "discard")
                if draft.status == DraftStatus.PUBLISHING:
                    raise E.DraftBusy(f"draft {draft.id} is being published", draft_id=draft.id)
                running = conn.execute(sa.select(TURNS.c.id).where(
                    TURNS.c.draft_id == draft.id, TURNS.c.status == TurnStatus.RUNNING.value)).scalar()
                if running is not None:
                    ended = self.turns.finish(conn, running, draft, fold, TurnStatus.ROLLED_BACK, now,
                                              {"end_reason": TurnEndReason.DISCARDED})
                self._close(conn, project_id, draft.id, DraftClosedReason.DISCARDED, actor, now)
                result = draft_record(conn.execute(sa.select(DRAFTS).where(DRAFTS.c.id == draft.id)).one())
            return result, ended

        try:
            result, rolled_back = retry_unlocked(attempt)
        finally:
            fold.settle()
        if rolled_back is not None:
            self.turns.ended(rolled_back)
        self.coordination.emit(f"project:{project_id}", "draft.discarded", {"draft_id": result.id})
        return result

    def _close(self, conn: Any, project_id: str, draft_id: str, reason: DraftClosedReason, actor: str | None,
               now: Any, published_version_id: str | None = None) -> None:
        conn.execute(DRAFTS.update().where(DRAFTS.c.id == draft_id).values(
            closed_at=now, closed_reason=reason, closed_by=actor, published_version_id=published_version_id,
            status_changed_at=now, revision=DRAFTS.c.revision + 1))
        conn.execute(PROJECTS.update().where(PROJECTS.c.id == project_id).values(active_draft_id=None))

    def release_stuck(self) -> int:
        """Release drafts left ``publishing`` longer than ``publishing_stuck_s``
        (only an older release could leave one: publish is one transaction now)."""
        now = utcnow()
        with self.db.tx(read_only=True) as conn:
            stuck = conn.execute(sa.select(DRAFTS.c.id, DRAFTS.c.status_changed_at).where(
                DRAFTS.c.status == DraftStatus.PUBLISHING.value, DRAFTS.c.closed_at.is_(None))).all()
        released = 0
        for draft_id, changed in stuck:
            if (now - aware(changed)).total_seconds() <= self.settings.publishing_stuck_s:  # type: ignore[operator]
                continue
            with self.db.tx() as conn:
                released += conn.execute(DRAFTS.update().where(
                    DRAFTS.c.id == draft_id, DRAFTS.c.status == DraftStatus.PUBLISHING.value,
                    DRAFTS.c.closed_at.is_(None),
                ).values(status=DraftStatus.INTERRUPTED, status_changed_at=now)).rowcount
        return released
