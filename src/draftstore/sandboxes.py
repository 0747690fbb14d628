"""Sandbox sessions: which sandbox runs on which state of a project, and whether it lives.

A session is metadata only: a provider (``e2b``, ``docker``, ``local``, ...) runs the
sandbox under its own id (``external_id``); draftstore records which state it was
opened on (the draft or a version: exactly one, the database checks it too), for
which turn, from which snapshot, its status and its latest heartbeat.

Statuses: ``starting``, ``ready`` and ``paused`` are open and move freely among
themselves (``starting`` is only ever a session's first status); ``closed`` (its
owner closed it) and ``lost`` (its heartbeat lapsed: the recovery sweep; or its
provider lost it) are final: any later change is ``sandbox.conflict`` and changes
nothing. Each change is one transaction over the session's row, locked, so two
racing changes are applied one after the other, and a final status is never left.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import errors as E
from . import paging
from . import validation as check
from .database import Database
from .db.tables import PROJECTS, SANDBOX_SESSIONS, SNAPSHOTS, TURNS, utcnow
from .ids import new_id
from .records import Page, SandboxSession, SandboxStatus, aware
from .view import View

__all__ = ["FINAL", "OPEN", "Sandboxes", "session_record"]

OPEN = frozenset({SandboxStatus.STARTING, SandboxStatus.READY, SandboxStatus.PAUSED})
FINAL = frozenset({SandboxStatus.CLOSED, SandboxStatus.LOST})
MAX_PROVIDER_CHARS = 64
MAX_EXTERNAL_ID_CHARS = 1024


def session_record(r: Any) -> SandboxSession:
    return SandboxSession(
        id=r.id, project_id=r.project_id, draft_id=r.draft_id, version_id=r.version_id, turn_id=r.turn_id,
        provider=r.provider, external_id=r.external_id, snapshot_id=r.snapshot_id, status=SandboxStatus(r.status),
        created_at=aware(r.created_at), updated_at=aware(r.updated_at), last_seen_at=aware(r.last_seen_at))


def _status(value: Any, allowed: frozenset[SandboxStatus]) -> SandboxStatus:
    names = ", ".join(sorted(allowed))
    if not isinstance(value, str) or value not in SandboxStatus.__members__.values():
        raise E.InvalidInput(f"status is one of {names}", field="status")
    status = SandboxStatus(value)
    if status not in allowed:
        raise E.InvalidInput(f"status is one of {names} here", field="status", status=status.value)
    return status


class Sandboxes:
    def __init__(self, db: Database, resolve: Callable[[str, str], tuple[View, str, str]], *,
                 heartbeat_ttl_s: float) -> None:
        self.db = db
        self.heartbeat_ttl_s = heartbeat_ttl_s
        # (project_id, state) -> (view, source kind, source id), as snapshots name states
        self._resolve = resolve

    def open(self, project_id: str, state: str, provider: str, external_id: str, turn_id: str | None,
             snapshot_id: str | None, status: str) -> SandboxSession:
        check.project_id(project_id)
        provider = check.name("provider", provider)
        if len(provider) > MAX_PROVIDER_CHARS:
            raise E.InvalidInput(f"provider is longer than {MAX_PROVIDER_CHARS} characters", field="provider")
        external_id = check.text("external_id", external_id, max_chars=MAX_EXTERNAL_ID_CHARS)
        if not external_id:
            raise E.InvalidInput("external_id must not be empty", field="external_id")
        first = _status(status, frozenset(OPEN))
        if not isinstance(state, str):
            raise E.InvalidInput("state must be a string: draft, head or a version id", field="state")
        # resolved before the insert's transaction (it reads a view): a publish in between leaves the
        # session on the draft it was opened on, which is what the sandbox runs
        _, kind, source_id = self._resolve(project_id, state)  # project.not_found, version.not_found, ...
        now = utcnow()
        sid = new_id()
        with self.db.tx() as conn:
            if turn_id is not None:
                self._turn_of(conn, project_id, check.turn_id(turn_id))
            if snapshot_id is not None:
                self._snapshot_of(conn, project_id, snapshot_id)
            conn.execute(SANDBOX_SESSIONS.insert().values(
                id=sid, project_id=project_id, draft_id=source_id if kind == "draft" else None,
                version_id=source_id if kind == "version" else None, turn_id=turn_id, provider=provider,
                external_id=external_id, snapshot_id=snapshot_id, status=first.value, created_at=now,
                updated_at=now, last_seen_at=now))
            return session_record(conn.execute(sa.select(SANDBOX_SESSIONS).where(SANDBOX_SESSIONS.c.id == sid)).one())

    @staticmethod
    def _turn_of(conn: Connection, project_id: str, turn_id: str) -> None:
        if conn.execute(sa.select(TURNS.c.id).where(TURNS.c.id == turn_id,
                                                    TURNS.c.project_id == project_id)).first() is None:
            raise E.turn_not_found(turn_id, project_id)

    @staticmethod
    def _snapshot_of(conn: Connection, project_id: str, snapshot_id: Any) -> None:
        sid = check.snapshot_id(snapshot_id)
        if conn.execute(sa.select(SNAPSHOTS.c.id).where(SNAPSHOTS.c.id == sid,
                                                        SNAPSHOTS.c.project_id == project_id)).first() is None:
            raise E.SnapshotNotFound(f"no snapshot {sid!r} in project {project_id}", snapshot_id=sid)

    def get(self, session_id: str, project_id: str | None) -> SandboxSession:
        sid = check.session_id(session_id)
        if project_id is not None:
            check.project_id(project_id)
        with self.db.statement(read_only=True) as conn:
            row = conn.execute(sa.select(SANDBOX_SESSIONS).where(SANDBOX_SESSIONS.c.id == sid)).first()
        if row is None or (project_id is not None and row.project_id != project_id):
            raise E.SandboxNotFound(f"no sandbox session {sid!r}", session_id=sid)
        return session_record(row)

    def page(self, project_id: str, status: str | None, cursor: str | None, limit: int | None
             ) -> Page[SandboxSession]:
        check.project_id(project_id)
        n = paging.limit(limit)
        wanted = None if status is None else _status(status, frozenset(SandboxStatus))
        stmt = (paging.by_creation(SANDBOX_SESSIONS, "sandbox_sessions", cursor, n)
                .where(SANDBOX_SESSIONS.c.project_id == project_id))
        if wanted is not None:
            stmt = stmt.where(SANDBOX_SESSIONS.c.status == wanted.value)
        with self.db.tx(read_only=True) as conn:
            if conn.execute(sa.select(PROJECTS.c.id).where(PROJECTS.c.id == project_id)).first() is None:
                raise E.ProjectNotFound(f"no project {project_id!r}", project_id=project_id)
            rows = conn.execute(stmt).all()
        return paging.page("sandbox_sessions", rows, n, lambda r: (r.created_at, r.id), session_record)

    def change(self, session_id: str, project_id: str | None, status: str | None,
               allowed: frozenset[SandboxStatus]) -> SandboxSession:
        """Record a heartbeat (``last_seen_at``), and ``status`` if given (one of ``allowed``)."""
        sid = check.session_id(session_id)
        new = None if status is None else _status(status, allowed)
        with self.db.tx() as conn:
            row = conn.execute(self.db.for_update(sa.select(SANDBOX_SESSIONS)
                                                  .where(SANDBOX_SESSIONS.c.id == sid))).first()
            if row is None or (project_id is not None and row.project_id != project_id):
                raise E.SandboxNotFound(f"no sandbox session {sid!r}", session_id=sid)
            current = SandboxStatus(row.status)
            if current in FINAL:
                raise E.SandboxConflict(f"sandbox session {sid} is {current.value}: that is final",
                                        session_id=sid, status=current.value)
            if new == SandboxStatus.STARTING and current != SandboxStatus.STARTING:
                raise E.SandboxConflict(f"sandbox session {sid} is {current.value}: it cannot be starting again",
                                        session_id=sid, status=current.value)
            now = utcnow()
            values: dict[str, Any] = {"updated_at": now, "last_seen_at": now}
            if new is not None:
                values["status"] = new.value
            conn.execute(SANDBOX_SESSIONS.update().where(SANDBOX_SESSIONS.c.id == sid).values(**values))
            return session_record(conn.execute(sa.select(SANDBOX_SESSIONS).where(SANDBOX_SESSIONS.c.id == sid)).one())

    def close(self, session_id: str, project_id: str | None) -> SandboxSession:
        """Close the session; closing a closed one returns it unchanged (a retried close), a
        lost one is ``sandbox.conflict``."""
        try:
            return self.change(session_id, project_id, SandboxStatus.CLOSED.value,
                               frozenset({SandboxStatus.CLOSED}))
        except E.SandboxConflict as exc:
            if exc.details.get("status") == SandboxStatus.CLOSED.value:
                return self.get(session_id, project_id)
            raise

    def mark_lost(self) -> int:
        """The sweep: every open session not seen for ``sandbox_heartbeat_ttl_s`` becomes
        ``lost``. One statement, so a heartbeat that commits first keeps its session open.
        Returns how many."""
        now = utcnow()
        cutoff = now - timedelta(seconds=self.heartbeat_ttl_s)
        with self.db.tx() as conn:
            return conn.execute(SANDBOX_SESSIONS.update().where(
                SANDBOX_SESSIONS.c.status.in_([s.value for s in OPEN]), SANDBOX_SESSIONS.c.last_seen_at < cutoff,
            ).values(status=SandboxStatus.LOST.value, updated_at=now)).rowcount
