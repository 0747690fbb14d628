"""Sealing: folding a draft's staging overlay into tree objects.

A seal runs inside the caller's transaction (a turn's end, a publish, a
discard), so the new root, the cleared overlay and whatever the caller records
with them (the turn's end root, a version) commit together or not at all:
there is no moment at which a turn has ended but its writes are not sealed.

To keep the slow part (uploading tree objects) out of the transaction, a seal
is prepared first: the draft's sealed root, revision and overlay are read in
one statement, the new tree objects are planned and their upload starts. In
the transaction, with the draft row locked, the prepared fold is applied if
the draft is still at that root and revision (every overlay write bumps the
revision); otherwise the overlay is read again under the lock and folded there.
The transaction commits only after the tree objects are stored, so a committed
root is always complete in the blob store. It waits for them under its locks
for ``LOCKED_WAIT_S`` at most: past that it rolls back and its operation runs
again once they are stored (``draftstore.deferred``). A fold made again under
the lock uploads the same way, and the prepared fold becomes that one, so the
next attempt finds it ready.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import errors as E
from . import faults
from .database import Database
from .db.tables import DRAFTS, DRAFT_CHANGES, PROJECTS, SNAPSHOTS, TURNS
from .deferred import awaited, retry_unlocked
from .digest import EMPTY_TREE, Digest
from .objects import Objects
from .records import TurnStatus
from .trees import FileEntry, SealPlan, file_entry

__all__ = ["Sealing", "Fold"]


@dataclass
class Fold:
    """A prepared seal: the overlay as read at (``root``, ``revision``), its plan
    and the upload of the plan's tree objects (running)."""

    draft_id: str | None  # None: no draft was found (the caller's transaction will say why)
    root: Digest
    revision: int
    paths: int
    plan: SealPlan | None
    upload: Future[Any] | None
    turn_status: str | None = None  # for ``prepare_turn``: the turn's status as read
    superseded: list[Future[Any]] = field(default_factory=list)  # uploads of the folds it replaced
    also: Any = None  # the first row of the statement the caller asked to be read with the overlay

    def settle(self) -> None:
        """Let its uploads finish (after the transaction: stray objects are harmless)."""
        for upload in (*self.superseded, self.upload):
            if upload is not None:
                upload.exception()

    def adopt(self, other: "Fold") -> None:
        """Become ``other`` (a fold made again under the lock), keeping the turn status read;
        the replaced fold's upload is left running (``settle`` waits for it, unlocked)."""
        if self.upload is not None:
            self.superseded.append(self.upload)
        self.draft_id, self.root, self.revision = other.draft_id, other.root, other.revision
        self.paths, self.plan, self.upload = other.paths, other.plan, other.upload


def _overlay_of(draft: Any, *extra: Any) -> Any:
    """The sealed root, revision and overlay rows of the draft ``draft`` selects."""
    return (sa.select(DRAFTS.c.id, DRAFTS.c.code_manifest_key, DRAFTS.c.revision, DRAFT_CHANGES.c.path,
                      DRAFT_CHANGES.c.digest, DRAFT_CHANGES.c.size, DRAFT_CHANGES.c.executable, *extra)
            .select_from(DRAFTS.outerjoin(DRAFT_CHANGES, DRAFT_CHANGES.c.draft_id == DRAFTS.c.id))
            .where(DRAFTS.c.id == draft))


class Sealing:
    def __init__(self, db: Database, objects: Objects) -> None:
        self.db = db
        self.objects = objects
        key = sa.bindparam("key")
        self._overlay = _overlay_of(sa.bindparam("draft_id"))
        self._of_draft = _overlay_of(key)
        self._of_project = _overlay_of(
            sa.select(PROJECTS.c.active_draft_id).where(PROJECTS.c.id == key).scalar_subquery())
        self._of_turn = _overlay_of(
            sa.select(TURNS.c.draft_id).where(TURNS.c.id == key).scalar_subquery(),
            sa.select(TURNS.c.status).where(TURNS.c.id == key).scalar_subquery().label("status"))
        self._lock = db.for_update(
            sa.select(DRAFTS.c.id, DRAFTS.c.project_id, DRAFTS.c.code_manifest_key, DRAFTS.c.revision,
                      DRAFTS.c.status, DRAFTS.c.file_count, DRAFTS.c.closed_at, DRAFTS.c.characters_json,
                      DRAFTS.c.world_settings_json)
            .where(DRAFTS.c.id == sa.bindparam("draft_id")))

    def lock(self, conn: Connection, draft_id: str) -> Any:
        """Lock the draft row for the rest of the transaction (None if there is no such draft)."""
        return conn.execute(self._lock, {"draft_id": draft_id}).first()

    def _prepare(self, stmt: Any, key: str, also: Any = None) -> Fold:
        """Read the overlay (one statement, one snapshot), plan its fold, start the upload.
        ``also``: a statement on ``key`` run on the same connection (its first row: ``Fold.also``)."""
        with self.db.statement(read_only=True) as conn:
            rows = conn.execute(stmt, {"key": key}).all()
            extra = conn.execute(also, {"key": key}).first() if also is not None else None
        if not rows:
            return Fold(None, EMPTY_TREE, -1, 0, None, None, also=extra)
        status = getattr(rows[0], "status", None)
        if status is not None and status != TurnStatus.RUNNING:
            return Fold(rows[0].id, Digest(rows[0].code_manifest_key), rows[0].revision, 0, None, None, status,
                        also=extra)
        fold = self._plan(rows[0].id, rows)
        fold.turn_status, fold.also = status, extra
        return fold

    def prepare(self, draft_id: str) -> Fold:
        """A prepared fold of draft ``draft_id`` (``draft_id`` None if there is none)."""
        return self._prepare(self._of_draft, draft_id)

    def prepare_open(self, project_id: str) -> Fold:
        """A prepared fold of the project's open draft (``draft_id`` None if it has none)."""
        return self._prepare(self._of_project, project_id)

    def prepare_turn(self, turn_id: str, also: Any = None) -> Fold:
        """A prepared fold of the draft of turn ``turn_id``, with the turn's status
        (nothing planned unless it is running; ``draft_id`` None if there is no turn);
        ``also``: a statement on the turn id (bind parameter ``key``) read beside it."""
        return self._prepare(self._of_turn, turn_id, also)

    def _plan(self, draft_id: str, rows: list[Any]) -> Fold:
        root, revision = Digest(rows[0].code_manifest_key), rows[0].revision
        changes: Mapping[str, FileEntry | None] = {
            r.path: file_entry(r.digest, r.size, r.executable) for r in rows if r.path is not None}
        if not changes:
            return Fold(draft_id, root, revision, 0, None, None)
        plan = self.objects.trees.plan(root, changes)
        upload = self.objects.upload(self.objects.trees.store, plan)
        return Fold(draft_id, root, revision, len(changes), plan, upload)

    def apply(self, conn: Connection, fold: Fold, locked: Any) -> tuple[Digest, int]:
        """Within the caller's transaction, with ``locked`` (the draft row, from
        ``lock`` or any ``SELECT ... FOR UPDATE`` of it) held: fold the overlay
        into the draft's root and clear it.

        Returns (root, files in it). Waits for the tree objects to be stored
        (an upload failure raises and so rolls the transaction back), for
        ``LOCKED_WAIT_S`` at most: the caller runs its transaction under
        ``deferred.retry_unlocked``, which waits for the rest with nothing locked.
        """
        if (locked.id, locked.code_manifest_key, locked.revision) != (fold.draft_id, fold.root, fold.revision):
            # stale: a write landed since (or another draft is open): fold again under the lock, and keep
            # that fold (its upload running), for an attempt made again after the upload is done
            rows = conn.execute(self._overlay, {"draft_id": locked.id}).all()
            fold.adopt(self._plan(locked.id, rows))
        if fold.plan is None:
            return fold.root, locked.file_count
        new, files = fold.plan.root, fold.plan.files
        faults.point("seal.before_swap")
        # a new tree: the draft's snapshot (of the old one) no longer restores it
        conn.execute(DRAFTS.update().where(DRAFTS.c.id == locked.id).values(code_manifest_key=new, file_count=files,
                                                                            snapshot_id=None))
        conn.execute(DRAFT_CHANGES.delete().where(DRAFT_CHANGES.c.draft_id == locked.id))
        # the draft moved on: its snapshots of another tree are stale from now on
        conn.execute(SNAPSHOTS.update().where(SNAPSHOTS.c.project_id == locked.project_id,
                                              SNAPSHOTS.c.source_kind == "draft", SNAPSHOTS.c.source_id == locked.id,
                                              SNAPSHOTS.c.status == "ready", SNAPSHOTS.c.root != new)
                     .values(status="stale"))
        if fold.upload is not None:
            awaited(fold.upload)  # the caller runs its transaction with ``deferred.retry_unlocked``
        return new, files

    def seal(self, draft_id: str) -> Digest:
        """Seal the draft's overlay in a transaction of its own (a no-op if it is
        empty). Used to fold what a dead worker of an older release left behind."""
        fold = self.prepare(draft_id)
        if fold.draft_id is None:
            raise E.DraftNone(f"no draft {draft_id!r}", draft_id=draft_id)
        if fold.plan is None:
            return fold.root

        def attempt() -> Digest:
            with self.db.tx() as conn:
                locked = self.lock(conn, draft_id)
                if locked is None:
                    raise E.DraftNone(f"no draft {draft_id!r}", draft_id=draft_id)
                root, _ = self.apply(conn, fold, locked)
                return root

        try:
            return retry_unlocked(attempt)
        finally:
            fold.settle()
