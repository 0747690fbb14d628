"""Reverting a draft to a turn boundary: undo the draft's last turns, keep their record.

Rollback happens at turn granularity only. Discarding the draft goes back to
its base version, moving head goes back to an older version; a revert is the
third case, inside a draft of several turns: the draft's code tree, characters
and world settings become exactly what they were when turn ``T`` started. Each
turn records that state when it begins (``start_root``, and the digest of its
characters + world settings object, ``start_state_digest``), so the revert reads
it back instead of replaying anything.

The undone turns (``T`` and every later turn of the draft) keep their rows,
tool history and boundary states; they are marked ``reverted_at`` /
``reverted_by``, and the resume context leaves them out. The revert itself is
recorded as a ``head_move`` row of reason ``revert`` (head stays where it was;
``turn_id`` names ``T``), so ``draftstore log`` and the admin page's history
show who reverted to which turn, and when.

One transaction: project row, then draft row, then the turn rows are locked
(the order every operation uses); the draft changes by compare-and-swap on its
revision, and a refused revert changes nothing. The state object is read from
the blob store before any row is locked.
"""

from __future__ import annotations

import json

import sqlalchemy as sa

from . import errors as E
from . import validation as check
from .coordination import Coordination
from .database import Database
from .db.tables import DRAFTS, DRAFT_CHANGES, HEAD_MOVES, SNAPSHOTS, TURNS, utcnow
from .digest import Digest
from .drafts import Drafts, draft_record
from .objects import Objects
from .projects import Projects
from .records import Draft, DraftStatus, HeadMoveReason, TurnStatus

__all__ = ["Reverting"]

_BOUNDARY = sa.select(TURNS.c.project_id, TURNS.c.draft_id, TURNS.c.number, TURNS.c.continues_turn_id,
                      TURNS.c.start_root, TURNS.c.start_state_digest, TURNS.c.pruned_at)


class Reverting:
    def __init__(self, db: Database, objects: Objects, coordination: Coordination, projects: Projects,
                 drafts: Drafts) -> None:
        self.db = db
        self.objects = objects
        self.coordination = coordination
        self.projects = projects
        self.drafts = drafts

    def revert(self, project_id: str, to_turn_id: str, actor: str | None) -> Draft:
        check.project_id(project_id)
        check.turn_id(to_turn_id)
        actor = check.actor(actor)
        with self.db.statement(read_only=True) as conn:
            self.projects.load(conn, project_id)  # project.not_found first, as every project operation
            turn = conn.execute(_BOUNDARY.where(TURNS.c.id == to_turn_id)).first()
        if turn is None or turn.project_id != project_id:
            # another project's turn is not found, exactly as an unknown one: ids do not leak across projects
            raise E.turn_not_found(to_turn_id, project_id)
        if turn.pruned_at is not None or turn.start_root is None or turn.start_state_digest is None:
            raise E.StateNotFound(f"turn {to_turn_id}'s start state is no longer kept", turn_id=to_turn_id)
        # read before any row is locked (a boundary's objects never change: no need to re-read under the lock)
        state = json.loads(self.objects.raw.get(Digest(turn.start_state_digest)))
        files = self.objects.trees.count(Digest(turn.start_root))

        with self.db.tx() as conn:
            project = self.projects.load(conn, project_id, lock=True)
            now = utcnow()  # after the lock: stamped in the order it happens, as head moves are
            draft = self.drafts.lock_open(conn, project, "revert")
            if draft.status in (DraftStatus.RUNNING, DraftStatus.PUBLISHING):
                raise E.DraftBusy(f"draft {draft.id} is {draft.status}; a revert waits for the turn to end"
                                  if draft.status == DraftStatus.RUNNING else f"draft {draft.id} is being published",
                                  draft_id=draft.id, status=draft.status)
            undone = conn.execute(self.db.for_update(
                sa.select(TURNS.c.id, TURNS.c.status)
                .where(TURNS.c.draft_id == draft.id, TURNS.c.number >= turn.number, TURNS.c.reverted_at.is_(None))
                .order_by(TURNS.c.number))).all()
            if turn.draft_id != draft.id or not undone or undone[0].id != to_turn_id:
                raise E.TurnConflict(
                    f"turn {to_turn_id} is not a turn of draft {draft.id} still standing (an earlier draft's "
                    f"turn, or reverted already): its start is no boundary of the current draft",
                    turn_id=to_turn_id, draft_id=draft.id)
            if any(t.status == TurnStatus.RUNNING for t in undone):  # the draft's status said so; never trust one
                raise E.DraftBusy(f"a turn of draft {draft.id} is running", draft_id=draft.id)
            swapped = conn.execute(DRAFTS.update().where(DRAFTS.c.id == draft.id,
                                                         DRAFTS.c.revision == draft.revision).values(
                code_manifest_key=turn.start_root, file_count=files, characters_json=state["characters"],
                world_settings_json=state["world_settings"], last_turn_id=turn.continues_turn_id,
                # the partial response and the snapshot were of the undone state
                partial_response_json=None, snapshot_id=None,
                status=DraftStatus.PAUSED, status_changed_at=now, revision=DRAFTS.c.revision + 1)).rowcount
            if swapped != 1:  # unreachable while the row is locked; the compare-and-swap says what is assumed
                raise E.DraftConflict(f"draft {draft.id} changed during the revert", draft_id=draft.id)
            # writes a dead worker of an older release left unsealed belong to the undone turns
            conn.execute(DRAFT_CHANGES.delete().where(DRAFT_CHANGES.c.draft_id == draft.id))
            conn.execute(SNAPSHOTS.update().where(SNAPSHOTS.c.project_id == project_id,
                                                  SNAPSHOTS.c.source_kind == "draft",
                                                  SNAPSHOTS.c.source_id == draft.id, SNAPSHOTS.c.status == "ready",
                                                  SNAPSHOTS.c.root != turn.start_root).values(status="stale"))
            conn.execute(TURNS.update().where(TURNS.c.id.in_([t.id for t in undone])).values(
                reverted_at=now, reverted_by=actor))
            conn.execute(HEAD_MOVES.insert().values(
                project_id=project_id, from_version_id=project.current_version_id,
                to_version_id=project.current_version_id, reason=HeadMoveReason.REVERT, actor=actor,
                turn_id=to_turn_id, at=now))
            result = draft_record(conn.execute(sa.select(DRAFTS).where(DRAFTS.c.id == draft.id)).one())
        self.coordination.emit(f"project:{project_id}", "draft.reverted",
                    {"draft_id": result.id, "to_turn_id": to_turn_id, "reverted": [t.id for t in undone]})
        return result
