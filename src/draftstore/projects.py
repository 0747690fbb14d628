"""Projects and their refs: the head (current version), the versions, the head moves.

A version is immutable; nothing deletes one. The head moves on create,
publish and rollback, and every move is recorded (who, when, from, to, why)
in the same transaction that moves it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import errors as E
from . import packing as packing_module
from . import paging
from . import validation as check
from .coordination import Coordination
from .database import Database
from .db.tables import DRAFTS, HEAD_MOVES, PACKS, PROJECTS, TURNS, VERSIONS, utcnow
from .digest import EMPTY_TREE, Digest
from .ids import new_id
from .packing import Packing
from .records import HeadMove, HeadMoveReason, Page, Project, Version, aware
from .settings import Limits

__all__ = ["Projects", "project_record", "version_record"]

log = logging.getLogger("draftstore")
_PACK_ATTEMPTS = 5


def project_record(r: Any) -> Project:
    return Project(r.id, r.name, r.current_version_id, r.active_draft_id, r.forked_from_version_id,
                   aware(r.created_at))


def version_record(r: Any) -> Version:
    return Version(
        id=r.id, project_id=r.project_id, number=r.number, parent_version_id=r.parent_version_id,
        root=r.code_manifest_key, file_count=r.file_count, characters=r.characters_json,
        world_settings=r.world_settings_json, summary=r.summary, created_by_turn_id=r.created_by_turn_id,
        created_by=r.created_by, created_at=aware(r.created_at),
    )


def _head_move_record(r: Any) -> HeadMove:
    return HeadMove(r.id, r.project_id, r.from_version_id, r.to_version_id, HeadMoveReason(r.reason), r.actor,
                    r.turn_id, aware(r.at))


class Projects:
    def __init__(self, db: Database, coordination: Coordination, limits: Limits, packing: Packing) -> None:
        self.db = db
        self.coordination = coordination
        self.limits = limits
        self.packing = packing
        self._unpackable: set[str] = set()  # draft trees whose packing failed in this process

    # -- rows, for the other components ------------------------------------------------
    def load(self, conn: Connection, project_id: str, lock: bool = False) -> Any:
        """The project row (locked if asked). Raises ``project.not_found``."""
        check.project_id(project_id)
        stmt = sa.select(PROJECTS).where(PROJECTS.c.id == project_id)
        row = conn.execute(self.db.for_update(stmt) if lock else stmt).first()
        if row is None:
            raise E.ProjectNotFound(f"no project {project_id!r}", project_id=project_id)
        return row

    def load_version(self, conn: Connection, version_id: str, project_id: str | None = None) -> Any:
        """A version row (of ``project_id`` if given). Raises ``version.not_found``."""
        check.version_id(version_id)
        row = conn.execute(sa.select(VERSIONS).where(VERSIONS.c.id == version_id)).first()
        if row is None or (project_id is not None and row.project_id != project_id):
            where = f" in project {project_id!r}" if project_id else ""
            raise E.VersionNotFound(f"no version {version_id!r}{where}", version_id=version_id)
        return row

    def insert_version(self, conn: Connection, project: Any, *, root: str, file_count: int, characters: Any,
                       world_settings: Any, summary: str, turn_id: str | None, actor: str | None, now: datetime,
                       reason: HeadMoveReason, packed: bool = False) -> Version:
        """Within the caller's transaction (project row locked): add the next
        version, make it head, record the head move. ``packed``: its packs exist
        already (else the background job writes them)."""
        number = (conn.execute(sa.select(sa.func.max(VERSIONS.c.number)).where(VERSIONS.c.project_id == project.id))
                  .scalar() or 0) + 1
        vid = new_id()
        values = dict(id=vid, project_id=project.id, number=number, parent_version_id=project.current_version_id,
                      code_manifest_key=root, file_count=file_count, characters_json=characters,
                      world_settings_json=world_settings, summary=summary, created_by_turn_id=turn_id,
                      created_by=actor, created_at=now)
        conn.execute(VERSIONS.insert().values(**values, packed_at=now if packed else None))
        self.move_head(conn, project.id, project.current_version_id, vid, reason, actor, now, turn_id=turn_id)
        values.update(characters_json=check.as_value(characters), world_settings_json=check.as_value(world_settings))
        return version_record(SimpleNamespace(**values))

    def move_head(self, conn: Connection, project_id: str, from_id: str | None, to_id: str,
                  reason: HeadMoveReason, actor: str | None, now: datetime, turn_id: str | None = None) -> None:
        conn.execute(PROJECTS.update().where(PROJECTS.c.id == project_id).values(current_version_id=to_id))
        conn.execute(HEAD_MOVES.insert().values(project_id=project_id, from_version_id=from_id, to_version_id=to_id,
                                                reason=reason, actor=actor, turn_id=turn_id, at=now))

    # -- the public operations -------------------------------------------------------------
    def create(self, name: str, files: Mapping[str, bytes | str] | None, characters: Any, world_settings: Any,
               actor: str | None, executable: Any = ()) -> Project:
        name = check.name("name", name)
        actor = check.actor(actor)
        limits = self.limits
        has_content = files is not None or characters is not None or world_settings is not None
        chars = check.json_value("characters", {} if characters is None else characters, limits.max_json_state_bytes)
        world = check.json_value("world_settings", {} if world_settings is None else world_settings,
                                 limits.max_json_state_bytes)
        cleaned: dict[str, bytes | None] = {}
        if files:
            cleaned = check.batch(files, limits.max_files_per_draft, "files", limits)
            if any(v is None for v in cleaned.values()):
                raise E.InvalidInput("initial files cannot be deletions (None)", field="files")
        modes = check.executables(executable, cleaned)
        # the files go into packs (a few PUTs), not one PUT each
        root, count = (self.packing.import_tree(cleaned, modes)[:2]  # type: ignore[arg-type]
                       if cleaned else (EMPTY_TREE, 0))
        now = utcnow()
        pid = new_id()
        with self.db.tx() as conn:
            conn.execute(PROJECTS.insert().values(id=pid, name=name, created_at=now))
            if has_content:
                project = self.load(conn, pid, lock=True)
                self.insert_version(conn, project, root=root, file_count=count, characters=chars,
                                    world_settings=world, summary="initial content", turn_id=None, actor=actor,
                                    now=now, reason=HeadMoveReason.CREATE, packed=True)
            return project_record(self.load(conn, pid))

    def fork(self, version_id: str, name: str, actor: str | None) -> Project:
        name = check.name("name", name)
        actor = check.actor(actor)
        now = utcnow()
        pid = new_id()
        with self.db.tx() as conn:
            src = self.load_version(conn, version_id)
            conn.execute(PROJECTS.insert().values(id=pid, name=name, created_at=now, forked_from_version_id=src.id))
            project = self.load(conn, pid, lock=True)
            self.insert_version(conn, project, root=src.code_manifest_key, file_count=src.file_count,
                                characters=src.characters_json, world_settings=src.world_settings_json,
                                summary=f"forked from version {src.id}", turn_id=None, actor=actor, now=now,
                                reason=HeadMoveReason.CREATE, packed=src.packed_at is not None)
            return project_record(self.load(conn, pid))

    def get(self, project_id: str) -> Project:
        with self.db.tx(read_only=True) as conn:
            return project_record(self.load(conn, project_id))

    def list(self) -> list[Project]:
        with self.db.tx(read_only=True) as conn:
            rows = conn.execute(sa.select(PROJECTS).order_by(PROJECTS.c.created_at, PROJECTS.c.id)).all()
        return [project_record(r) for r in rows]

    def get_version(self, version_id: str, project_id: str | None = None) -> Version:
        with self.db.tx(read_only=True) as conn:
            return version_record(self.load_version(conn, version_id, project_id))

    def list_versions(self, project_id: str) -> list[Version]:
        with self.db.tx(read_only=True) as conn:
            self.load(conn, project_id)
            rows = conn.execute(sa.select(VERSIONS).where(VERSIONS.c.project_id == project_id)
                                .order_by(VERSIONS.c.number)).all()
        return [version_record(r) for r in rows]

    def head_moves(self, project_id: str) -> list[HeadMove]:
        with self.db.tx(read_only=True) as conn:
            self.load(conn, project_id)
            rows = conn.execute(sa.select(HEAD_MOVES).where(HEAD_MOVES.c.project_id == project_id)
                                .order_by(HEAD_MOVES.c.id)).all()
        return [_head_move_record(r) for r in rows]

    def pack_pending(self, limit: int = 10) -> int:
        """Write the packs of up to ``limit`` versions that have none yet (published
        since); returns how many versions were packed. Off every request's path.
        A version that fails is logged and tried again later, at most
        ``_PACK_ATTEMPTS`` times; it never keeps the others waiting."""
        with self.db.tx(read_only=True) as conn:
            rows = conn.execute(sa.select(VERSIONS.c.id, VERSIONS.c.code_manifest_key)
                                .where(VERSIONS.c.packed_at.is_(None), VERSIONS.c.pack_attempts < _PACK_ATTEMPTS)
                                .order_by(VERSIONS.c.pack_attempts, VERSIONS.c.created_at).limit(limit)).all()
        packed = 0
        for r in rows:  # one packer per version at a time, across processes
            with self.coordination.try_lock(f"pack:{r.id}", 600, busy=E.DraftstoreError) as held:
                if not held:
                    continue
                try:
                    self.packing.write(Digest(r.code_manifest_key))
                    with self.db.tx() as conn:
                        conn.execute(VERSIONS.update().where(VERSIONS.c.id == r.id).values(packed_at=utcnow()))
                    packed += 1
                except E.DraftstoreError as exc:
                    log.warning("packing version %s failed (attempt left for later): %s", r.id, exc)
                    with self.db.tx() as conn:
                        conn.execute(VERSIONS.update().where(VERSIONS.c.id == r.id)
                                     .values(pack_attempts=VERSIONS.c.pack_attempts + 1))
        return packed

    def pack_open_drafts(self, limit: int = 10) -> int:
        """Write the packs of up to ``limit`` open drafts' sealed trees that have none
        (a turn's end folded writes into a subtree: its new tree is packed and indexed
        here, so a cold search of the draft reads indexes instead of scanning that
        subtree). Only trees of more than ``MAX_PACK_FILES`` files: below that a tree is
        one pack, rewritten whole at every turn's end, and a scan of it is short.
        Returns how many trees were packed. A tree that fails for a reason other than
        an unavailable backend is logged and skipped for the rest of this process's
        life (the draft reads file by file meanwhile)."""
        with self.db.tx(read_only=True) as conn:
            roots = conn.execute(
                sa.select(DRAFTS.c.code_manifest_key).distinct()
                .where(DRAFTS.c.closed_at.is_(None), DRAFTS.c.code_manifest_key != EMPTY_TREE,
                       DRAFTS.c.file_count > packing_module.MAX_PACK_FILES,
                       DRAFTS.c.code_manifest_key.not_in(sorted(self._unpackable)),
                       ~sa.exists().where(PACKS.c.tree == DRAFTS.c.code_manifest_key))
                .limit(limit)).scalars().all()
        packed = 0
        for root in roots:  # one packer per tree at a time, across processes
            with self.coordination.try_lock(f"pack-tree:{root}", 600, busy=E.DraftstoreError) as held:
                if not held:
                    continue
                try:
                    self.packing.write(Digest(root))
                    packed += 1
                except E.BackendUnavailable as exc:  # passing: the next run tries again
                    log.warning("packing draft tree %s failed (tried again later): %s", root[:12], exc)
                except E.DraftstoreError as exc:
                    log.warning("packing draft tree %s failed (not tried again by this process): %s",
                                root[:12], exc)
                    self._unpackable.add(root)
        return packed

    def page(self, cursor: str | None, limit: int | None) -> Page[Project]:
        n = paging.limit(limit)
        with self.db.tx(read_only=True) as conn:
            rows = conn.execute(paging.by_creation(PROJECTS, "projects", cursor, n)).all()
        return paging.page("projects", rows, n, lambda r: (aware(r.created_at), r.id), project_record)

    def versions_page(self, project_id: str, cursor: str | None, limit: int | None,
                      newest_first: bool = False) -> Page[Version]:
        return self.numbered_page("versions", VERSIONS, VERSIONS.c.number, version_record, project_id, cursor, limit,
                                  newest_first)

    def head_moves_page(self, project_id: str, cursor: str | None, limit: int | None,
                        newest_first: bool = False) -> Page[HeadMove]:
        return self.numbered_page("head_moves", HEAD_MOVES, HEAD_MOVES.c.id, _head_move_record, project_id, cursor,
                                  limit, newest_first)

    def numbered_page(self, kind: str, table: sa.Table, order: Any, record: Callable[[Any], Any], project_id: str,
                      cursor: str | None, limit: int | None, newest_first: bool,
                      columns: Sequence[Any] | None = None) -> Page[Any]:
        """A page of a project's rows of ``table`` (``columns`` of them, default all) in the
        order of the integer column ``order``; ``project.not_found`` if there is no such project."""
        n = paging.limit(limit)
        kind, after, order_by = paging.numbered(kind, order, cursor, newest_first)
        with self.db.tx(read_only=True) as conn:
            self.load(conn, project_id)
            rows = conn.execute(sa.select(*(columns or [table])).where(table.c.project_id == project_id, after)
                                .order_by(order_by).limit(n + 1)).all()
        return paging.page(kind, rows, n, lambda r: (getattr(r, order.name),), record)

    def durable_events(self, project_id: str, limit: int) -> list[tuple[str, dict[str, Any]]]:
        """The project's committed events rebuilt from the database, as its stream carried
        them (``(type, data)``, oldest first, the newest ``limit``): each publish
        (``version.published``), each rollback (``head.moved``), each discarded draft
        (``draft.discarded``), each revert of the draft to a turn's start
        (``draft.reverted``). For a stream whose buffer was lost."""
        with self.db.tx(read_only=True) as conn:
            self.load(conn, project_id)
            moves = conn.execute(
                sa.select(HEAD_MOVES.c.reason, HEAD_MOVES.c.to_version_id, HEAD_MOVES.c.at, VERSIONS.c.number)
                .select_from(HEAD_MOVES.outerjoin(VERSIONS, VERSIONS.c.id == HEAD_MOVES.c.to_version_id))
                .where(HEAD_MOVES.c.project_id == project_id,
                       HEAD_MOVES.c.reason.in_([HeadMoveReason.PUBLISH.value, HeadMoveReason.ROLLBACK.value]))
                .order_by(HEAD_MOVES.c.id.desc()).limit(limit)).all()
            discarded = conn.execute(
                sa.select(DRAFTS.c.id, DRAFTS.c.closed_at)
                .where(DRAFTS.c.project_id == project_id, DRAFTS.c.closed_reason == "discarded")
                .order_by(DRAFTS.c.closed_at.desc()).limit(limit)).all()
            reverts = [(aware(m.at), ("draft.reverted", self._reverted(conn, m.turn_id, m.at))) for m in conn.execute(
                sa.select(HEAD_MOVES.c.turn_id, HEAD_MOVES.c.at)
                .where(HEAD_MOVES.c.project_id == project_id, HEAD_MOVES.c.reason == HeadMoveReason.REVERT.value)
                .order_by(HEAD_MOVES.c.id.desc()).limit(limit)).all()]
        events: list[tuple[datetime, tuple[str, dict[str, Any]]]] = [
            (aware(m.at), ("version.published", {"version_id": m.to_version_id, "number": m.number})
             if m.reason == HeadMoveReason.PUBLISH
             else ("head.moved", {"to_version_id": m.to_version_id,
                                  "at": aware(m.at).astimezone(timezone.utc).isoformat()}))
            for m in reversed(moves)]
        events += [(aware(d.closed_at), ("draft.discarded", {"draft_id": d.id})) for d in reversed(discarded)]
        events += reversed(reverts)
        events.sort(key=lambda e: e[0])  # stable: moves keep their order within one instant
        return [e for _, e in events[-limit:]]

    @staticmethod
    def _reverted(conn: Connection, to_turn_id: str, at: datetime) -> dict[str, Any]:
        """A revert's event as it was emitted: the draft, the turn it went back to, and the
        turns it undid (those of that draft stamped reverted at the revert's own instant)."""
        draft_id = conn.execute(sa.select(TURNS.c.draft_id).where(TURNS.c.id == to_turn_id)).scalar_one()
        undone = conn.execute(sa.select(TURNS.c.id).where(TURNS.c.draft_id == draft_id, TURNS.c.reverted_at == at)
                              .order_by(TURNS.c.number)).scalars().all()
        return {"draft_id": draft_id, "to_turn_id": to_turn_id, "reverted": list(undone)}

    def rollback_to(self, project_id: str, version_id: str, actor: str | None) -> Project:
        actor = check.actor(actor)
        with self.db.tx() as conn:
            project = self.load(conn, project_id, lock=True)
            now = utcnow()  # after the lock: head moves are stamped in the order they happen
            version = self.load_version(conn, version_id, project_id)
            moved = project.current_version_id != version.id
            if moved:
                self.move_head(conn, project_id, project.current_version_id, version.id, HeadMoveReason.ROLLBACK,
                               actor, now)
            result = project_record(self.load(conn, project_id))
        if moved:  # a rollback to the head itself moves nothing, and says nothing
            # ``at`` (the head move's own time) tells two moves to the same version apart
            self.coordination.emit(f"project:{project_id}", "head.moved",
                                   {"to_version_id": version_id, "at": now.isoformat()})
        return result
