"""Turns: begin (start or continue), end (complete, interrupt, fail), heartbeats, recovery.

A turn ends in ONE transaction: its status, its messages, the seal of its
writes (``end_root``), the state of characters and world settings at its end,
and its compacted tool history commit together. A worker killed at any moment
leaves the turn either running (the recovery sweep interrupts it, which is
such an end) or fully ended; never ended with its writes unsealed.

The objects of a turn's boundary states (characters + world settings) are
stored before the rows are locked, from the draft as read just before: a
begin stores its start state first, an end starts its end state's upload
beside the ending transaction's statements (as the seal's tree objects are).
A slow blob store then never holds a project's rows. If the draft changed
between the read and the lock, the state under the lock is stored there.

Heartbeats live in the coordinator, which every store on the same data shares
(Redis, or the SQLite coordinator file of the embedded default). The recovery
sweep interrupts a running turn whose heartbeat lapsed.

Lock order, the same in every operation, so transactions never deadlock:
project row -> draft row -> turn row(s) -> overlay / tool-call rows.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection

from . import errors as E
from . import faults
from . import validation as check
from .coordination import Coordination
from .database import Database
from .db.tables import DRAFTS, TURNS, VERSIONS, utcnow
from .deferred import awaited, retry_unlocked
from .deltas import Deltas
from .digest import Digest, digest_of
from .drafts import Drafts
from .ids import new_id
from .objects import Objects
from .projects import Projects
from .records import DraftStatus, Page, Turn, TurnEndReason, TurnStatus, aware, end_reason_of
from .sealing import Fold, Sealing
from .settings import Settings
from .toolcalls import ToolCalls

__all__ = ["Turns", "turn_record"]

log = logging.getLogger("draftstore")

_RUNNING = TurnStatus.RUNNING.value
# a project's running turn, and the state a turn would start from: its draft's, else its head's
_RUNNING_AND_STATE = tuple(
    sa.select(sa.select(TURNS.c.id).where(TURNS.c.project_id == sa.bindparam("project_id"), TURNS.c.status == _RUNNING)
              .scalar_subquery().label("running"), src.c.characters_json, src.c.world_settings_json)
    .where(src.c.id == sa.bindparam("key"))
    for src in (DRAFTS, VERSIONS))
# the state a turn would end with, read with its fold (``Turns.end``; ``key``: the turn id)
_END_STATE = (sa.select(DRAFTS.c.characters_json, DRAFTS.c.world_settings_json, TURNS.c.start_state_digest)
              .select_from(TURNS.join(DRAFTS, DRAFTS.c.id == TURNS.c.draft_id))
              .where(TURNS.c.id == sa.bindparam("key")))
# every column but the compacted history: what a list of turns needs
_SUMMARY = [c for c in TURNS.c if c.name != "tool_calls_json"]


def turn_record(r: Any, calls: tuple[Any, ...] = ()) -> Turn:
    return Turn(
        id=r.id, project_id=r.project_id, draft_id=r.draft_id, number=r.number,
        continues_turn_id=r.continues_turn_id, base_version_id=r.base_version_id, actor=r.actor,
        status=TurnStatus(r.status), user_message=r.user_message_json, assistant_message=r.assistant_message_json,
        error=r.error_json, partial_response=r.partial_response_json, start_root=r.start_root,
        end_root=r.end_root, started_at=aware(r.started_at), ended_at=aware(r.ended_at),  # type: ignore[arg-type]
        tool_calls=calls, end_reason=None if r.end_reason is None else TurnEndReason(r.end_reason),
        reverted_at=aware(r.reverted_at), reverted_by=r.reverted_by,
    )


def state_blob(characters: Any, world_settings: Any) -> bytes:
    """Characters + world settings as one immutable object (a turn boundary's state)."""
    return json.dumps({"characters": characters, "world_settings": world_settings}, ensure_ascii=False,
                      sort_keys=True, separators=(",", ":")).encode("utf-8")


class Turns:
    def __init__(self, db: Database, objects: Objects, coordination: Coordination, settings: Settings,
                 projects: Projects, drafts: Drafts, sealing: Sealing, toolcalls: ToolCalls, deltas: Deltas) -> None:
        self.db = db
        self.objects = objects
        self.coordination = coordination
        self.settings = settings
        self.limits = settings.limits
        self.deltas = deltas
        self.projects = projects
        self.drafts = drafts
        self.sealing = sealing
        self.toolcalls = toolcalls

    # -- begin -------------------------------------------------------------------------------
    def begin(self, project_id: str, user_message: Any, actor: str | None, require_draft: bool,
              from_turn_id: str | None = None) -> Turn:
        """Start a turn (``require_draft``: continue the open draft). ``from_turn_id``
        names the turn continued (default: the draft's last turn); it must be an
        ended turn of the draft, else ``turn.conflict`` (checked under the lock)."""
        check.project_id(project_id)
        if from_turn_id is not None:
            check.turn_id(from_turn_id)
        message = check.message("user_message", user_message, self.limits)
        actor = check.actor(actor)
        with self.db.tx(read_only=True) as conn:
            project = self.projects.load(conn, project_id)
            running, start = self._running_and_start_state(conn, project)
        if running is not None and running == from_turn_id:
            raise E.TurnConflict(f"turn {running} is still running; only an ended turn can be continued",
                                 turn_id=running, status=_RUNNING)
        if running is not None:  # refuse before doing any work (re-checked under the lock below)
            raise E.TurnAlreadyRunning(f"turn {running} of project {project_id} is still running", turn_id=running)
        if project.active_draft_id is None and require_draft:
            raise E.DraftNone(f"project {project_id} has no draft to continue", project_id=project_id)
        if project.active_draft_id is not None:
            # writes an older release's dead worker left unsealed (turn ends seal their own)
            self.sealing.seal(project.active_draft_id)
        # the start state's object is stored before the rows are locked (never a blob-store request
        # while they are held); stored again even if it exists, so garbage collection's grace period
        # covers it until the turn row that names it commits
        stored = self.objects.raw.put(start)
        now = utcnow()
        tid = new_id()
        try:
            with self.db.tx() as conn:
                project = self.projects.load(conn, project_id, lock=True)
                draft = self.drafts.active(conn, project, lock=True)
                if draft is None:
                    if require_draft:
                        raise E.DraftNone(f"project {project_id} has no draft to continue", project_id=project_id)
                    draft = self.drafts.derive(conn, project, now)
                if draft.status == DraftStatus.PUBLISHING:
                    raise E.DraftBusy(f"draft {draft.id} is being published", draft_id=draft.id)
                if from_turn_id is not None:  # before the running check: naming the running turn is this error
                    self._check_continued(conn, from_turn_id, draft.id)
                running = self._running(conn, project_id)
                if running is not None:
                    raise E.TurnAlreadyRunning(f"turn {running} of project {project_id} is still running",
                                               turn_id=running)
                number = (conn.execute(sa.select(sa.func.max(TURNS.c.number)).where(TURNS.c.project_id == project_id))
                          .scalar() or 0) + 1
                blob = state_blob(draft.characters_json, draft.world_settings_json)
                state = digest_of(blob)
                if state != stored:  # the draft changed since it was read (a publish or a discard between): rare
                    self.objects.raw.put(blob)
                conn.execute(TURNS.insert().values(
                    id=tid, project_id=project_id, draft_id=draft.id, number=number,
                    continues_turn_id=from_turn_id or draft.last_turn_id, base_version_id=draft.base_version_id, actor=actor,
                    status=_RUNNING, user_message_json=message, start_root=draft.code_manifest_key,
                    start_state_digest=state, started_at=now,
                ))
                conn.execute(DRAFTS.update().where(DRAFTS.c.id == draft.id).values(
                    status=DraftStatus.RUNNING, last_turn_id=tid, status_changed_at=now,
                    revision=DRAFTS.c.revision + 1))
                row = conn.execute(sa.select(*_SUMMARY).where(TURNS.c.id == tid)).one()
        except sa_exc.IntegrityError as exc:
            # the partial unique indexes caught a race the checks above could not see
            raise E.TurnAlreadyRunning(f"another turn of project {project_id} started first") from exc
        self._beat(tid)
        # in the buffer before the caller is answered: a subscriber connecting at once finds it (events.py)
        self.coordination.publisher.emit_now(f"turn:{tid}", "turn.started", {"turn_id": tid, "project_id": project_id})
        self.coordination.emit(f"project:{project_id}", "turn.started", {"turn_id": tid})
        return turn_record(row)

    @staticmethod
    def _check_continued(conn: Connection, turn_id: str, draft_id: str) -> None:
        """The turn a continue names must be an ended turn of the draft it continues, not reverted
        out of it (a reverted turn's work is no longer in the draft)."""
        row = conn.execute(sa.select(TURNS.c.draft_id, TURNS.c.status, TURNS.c.reverted_at)
                           .where(TURNS.c.id == turn_id)).first()
        if row is None or row.draft_id != draft_id or row.reverted_at is not None:
            raise E.TurnConflict(f"turn {turn_id} is not a turn of the project's draft {draft_id}",
                                 turn_id=turn_id, draft_id=draft_id)
        if row.status == _RUNNING:
            raise E.TurnConflict(f"turn {turn_id} is still running; only an ended turn can be continued",
                                 turn_id=turn_id, status=row.status)

    @staticmethod
    def _running_and_start_state(conn: Connection, project: Any) -> tuple[str | None, bytes]:
        """In one statement: the project's running turn (or None), and the state object
        a turn of it would start from, as it reads now: its draft's characters and world
        settings, else its head's (the draft begin derives)."""
        if project.active_draft_id is not None:
            stmt, key = _RUNNING_AND_STATE[0], project.active_draft_id
        elif project.current_version_id is not None:
            stmt, key = _RUNNING_AND_STATE[1], project.current_version_id
        else:
            return Turns._running(conn, project.id), state_blob({}, {})
        row = conn.execute(stmt, {"project_id": project.id, "key": key}).first()
        if row is None:  # gone since the project row was read: the lock re-reads it all
            return Turns._running(conn, project.id), state_blob({}, {})
        return row.running, state_blob(row.characters_json, row.world_settings_json)

    @staticmethod
    def _running(conn: Connection, project_id: str) -> str | None:
        return conn.execute(sa.select(TURNS.c.id).where(TURNS.c.project_id == project_id,
                                                        TURNS.c.status == _RUNNING)).scalar()

    # -- end -----------------------------------------------------------------------------------
    def complete(self, turn_id: str, assistant_message: Any) -> Turn:
        check.turn_id(turn_id)
        message = check.message("assistant_message", assistant_message, self.limits)
        turn = self.end(turn_id, TurnStatus.COMPLETED, DraftStatus.PAUSED, {"assistant_message_json": message})
        return turn

    def interrupt(self, turn_id: str, partial_response: Any = None,
                  reason: TurnEndReason | None = None) -> Turn:
        """Interrupt; ``partial_response`` defaults to the text streamed so far (deltas)."""
        check.turn_id(turn_id)
        values: dict[str, Any] = {"end_reason": reason}
        # the streamed text is read, not taken: if the end fails, a retry finds it still there
        partial = partial_response if partial_response is not None else self.deltas.peek(turn_id)
        if partial is not None:
            values["partial_response_json"] = check.json_value(
                "partial_response", partial, self.limits.max_json_state_bytes)
        turn = self.end(turn_id, TurnStatus.INTERRUPTED, DraftStatus.INTERRUPTED, values)
        return turn

    def fail(self, turn_id: str, error: Any) -> Turn:
        check.turn_id(turn_id)
        turn = self.end(turn_id, TurnStatus.FAILED, DraftStatus.INTERRUPTED,
                        {"error_json": check.message("error", error, self.limits)})
        return turn

    def end(self, turn_id: str, status: TurnStatus, draft_status: DraftStatus, values: dict[str, Any]) -> Turn:
        """End a running turn and seal its writes, in one transaction (see the module docstring)."""
        fold = self.sealing.prepare_turn(turn_id, also=_END_STATE)
        if fold.draft_id is None:
            raise E.turn_not_found(turn_id)
        if fold.turn_status != _RUNNING:
            raise E.turn_refused(turn_id, fold.turn_status)
        ending = self._upload_end_state(fold.also)
        now = utcnow()

        def attempt() -> Turn:
            with self.db.tx() as conn:
                draft = self.sealing.lock(conn, fold.draft_id)
                turn = self.finish(conn, turn_id, draft, fold, status, now, values, ending)
                partial = values.get("partial_response_json")
                conn.execute(DRAFTS.update().where(DRAFTS.c.id == draft.id).values(
                    status=draft_status, status_changed_at=now, revision=DRAFTS.c.revision + 1,
                    **({"partial_response_json": partial} if partial is not None else {})))
                faults.point("turn.end.before_commit")
            return turn

        try:
            turn = retry_unlocked(attempt)
        finally:
            fold.settle()
            if ending is not None and ending[1] is not None:
                ending[1].exception()  # never leave an upload running past the call
        faults.point("turn.end.after_commit")
        self.ended(turn)
        return turn

    def _upload_end_state(self, row: Any) -> tuple[Digest, Future[Any] | None] | None:
        """The state the turn would end with, as its draft read (``_END_STATE``, read with
        the fold), and the upload of its object started (None: it is the start state's
        object, stored already), so the ending transaction waits for an upload under
        way, never makes one. None: no such turn."""
        if row is None:
            return None
        blob = state_blob(row.characters_json, row.world_settings_json)
        state = digest_of(blob)
        return state, (None if state == row.start_state_digest else self.objects.upload(self.objects.raw.put, blob))

    def finish(self, conn: Connection, turn_id: str, draft: Any, fold: Fold, status: TurnStatus, now: Any,
               values: dict[str, Any], ending: tuple[Digest, Future[Any] | None] | None = None) -> Turn:
        """Within the caller's transaction, with ``draft`` (the turn's draft row)
        locked: end the running turn ``turn_id`` as ``status``, seal the draft's
        overlay (``fold``, prepared before) into its end root, record the end
        state (``ending``: its object's upload, prepared before) and compact its
        history. Raises ``turn.not_running`` (rolling the caller's transaction back);
        the caller runs its transaction under ``deferred.retry_unlocked``."""
        row = conn.execute(self.db.for_update(sa.select(TURNS.c.status, TURNS.c.start_state_digest)
                                             .where(TURNS.c.id == turn_id))).first()
        if row is None or row.status != _RUNNING:
            raise E.turn_refused(turn_id, None if row is None else row.status)
        root, _ = self.sealing.apply(conn, fold, draft)
        blob = state_blob(draft.characters_json, draft.world_settings_json)
        state = digest_of(blob)
        if ending is not None and ending[0] == state:
            if ending[1] is not None:
                awaited(ending[1])  # stored beside this transaction's statements (raises its failure)
        elif state != row.start_state_digest:
            # not prepared (a discard ending the turn), or a patch raced the end: stored here, rarely.
            # The start state's object needs no second PUT: stored when the turn started, and named
            # by this committed row since (so garbage collection keeps it)
            self.objects.raw.put(blob)
        calls = self.toolcalls.compact(conn, turn_id, now)
        row = conn.execute(TURNS.update().where(TURNS.c.id == turn_id).values(
            status=status, ended_at=now, end_root=root, end_state_digest=state, tool_calls_json=calls, **values,
        ).returning(*TURNS.c)).one()
        calls_read, _ = self.toolcalls.read(conn, row)
        return turn_record(row, calls_read)

    def ended(self, turn: Turn) -> None:
        """After the ending transaction committed: drop the heartbeat and the streamed text, tell SSE
        (a coordinator that cannot be reached now leaves them to their TTLs; the end stands)."""
        for drop in (lambda: self.deltas.forget(turn.id), lambda: self.coordination.coord.forget(f"turn:{turn.id}")):
            try:
                drop()
            except E.DraftstoreError:
                pass
        stream = f"turn:{turn.id}"
        reason = end_reason_of(turn.status, turn.end_reason)  # a cancel told from a crash without a read
        self.coordination.emit(stream, f"turn.{turn.status}", {"turn_id": turn.id, "end_root": turn.end_root,
                                                    "end_reason": reason})
        self.coordination.emit(f"project:{turn.project_id}", f"turn.{turn.status}",
                               {"turn_id": turn.id, "end_reason": reason})
        self.coordination.expire_stream(stream)

    # -- heartbeats ---------------------------------------------------------------------------
    def heartbeat(self, turn_id: str) -> None:
        check.turn_id(turn_id)
        with self.db.statement(read_only=True) as conn:
            status = conn.execute(sa.select(TURNS.c.status).where(TURNS.c.id == turn_id)).scalar()
        if status != _RUNNING:
            raise E.turn_refused(turn_id, status)
        self._beat(turn_id)

    def _beat(self, turn_id: str) -> None:
        try:
            self.coordination.coord.beat(f"turn:{turn_id}", self.settings.heartbeat_ttl_s)
        except E.DraftstoreError as exc:
            log.warning("heartbeat for turn %s not recorded: %s", turn_id, exc)

    # -- reading ---------------------------------------------------------------------------------
    def get(self, turn_id: str) -> Turn:
        check.turn_id(turn_id)
        with self.db.tx(read_only=True) as conn:
            row = conn.execute(sa.select(TURNS).where(TURNS.c.id == turn_id)).first()
            if row is None:
                raise E.turn_not_found(turn_id)
            calls, row = self.toolcalls.read(conn, row)
        return turn_record(row, calls)

    def list(self, project_id: str) -> list[Turn]:
        with self.db.tx(read_only=True) as conn:
            self.projects.load(conn, project_id)
            rows = conn.execute(sa.select(*_SUMMARY).where(TURNS.c.project_id == project_id)
                                .order_by(TURNS.c.number)).all()
        return [turn_record(r) for r in rows]

    def page(self, project_id: str, cursor: str | None, limit: int | None, newest_first: bool = False) -> Page[Turn]:
        return self.projects.numbered_page("turns", TURNS, TURNS.c.number, turn_record, project_id, cursor, limit,
                                           newest_first, columns=_SUMMARY)

    def summary(self, turn_id: str) -> Turn:
        """A turn without its tool calls (see ``ToolCalls.page`` for them)."""
        check.turn_id(turn_id)
        with self.db.statement(read_only=True) as conn:
            row = conn.execute(sa.select(*_SUMMARY).where(TURNS.c.id == turn_id)).first()
        if row is None:
            raise E.turn_not_found(turn_id)
        return turn_record(row)

    def durable_events(self, turn_id: str) -> list[tuple[str, dict[str, Any]]]:
        """The turn's history as the events it emitted, rebuilt from the database
        (for a stream whose buffer was lost): turn start, every tool call's
        steps, the end. Text deltas are not durable and are not rebuilt."""
        turn = self.get(turn_id)
        out: list[tuple[str, dict[str, Any]]] = [
            ("turn.started", {"turn_id": turn.id, "project_id": turn.project_id})]
        for c in turn.tool_calls:
            base = {"turn_id": turn.id, "seq": c.seq}
            first = "tool.awaiting_approval" if c.approval is not None or c.status in ("awaiting_approval", "expired") \
                else "tool.started"
            out.append((first, {**base, "tool_name": c.tool_name}))
            if c.approval is not None:
                out.append(("tool.approved" if c.approval.get("approved") else "tool.denied",
                            {**base, "reason": c.approval.get("reason")}))
            if c.status in ("completed", "failed"):
                out.append((f"tool.{c.status}", base))
        if turn.status != TurnStatus.RUNNING:
            out.append((f"turn.{turn.status}", {"turn_id": turn.id, "end_root": turn.end_root,
                                                "end_reason": end_reason_of(turn.status, turn.end_reason)}))
        return out

    # -- recovery -------------------------------------------------------------------------------
    def reap(self) -> tuple[int, int]:
        """Interrupt every running turn older than the heartbeat TTL whose
        heartbeat lapsed (which seals its writes). Returns (reaped, failed):
        a turn that cannot be ended now (a backend error) is logged and left
        for the next sweep; it never stops the others from being reaped."""
        ttl = self.settings.heartbeat_ttl_s
        try:
            since = self.coordination.coord.since()
        except E.DraftstoreError as exc:  # who is alive cannot be known: reap nobody
            log.warning("sweep reaps no turn: the coordinator is unavailable (%s)", exc)
            return 0, 0
        if time.time() - since < ttl:
            # the coordinator's state is younger than a heartbeat TTL (it was just created,
            # flushed or restarted): live workers have not beaten into it yet. Grace.
            return 0, 0
        now = utcnow()
        with self.db.tx(read_only=True) as conn:
            running = conn.execute(sa.select(TURNS.c.id, TURNS.c.started_at).where(TURNS.c.status == _RUNNING)).all()
        reaped = failed = 0
        for tid, started in running:
            age = (now - aware(started)).total_seconds()  # type: ignore[operator]
            try:
                if age <= self.settings.heartbeat_ttl_s or self.coordination.coord.alive(f"turn:{tid}"):
                    continue
                if time.time() - self.coordination.coord.since() < ttl:
                    # the coordinator lost its state after the sweep began (a flush, a restart):
                    # the missing heartbeat may be a live worker's. Grace, as above.
                    break
                self.end(tid, TurnStatus.INTERRUPTED, DraftStatus.INTERRUPTED,
                         {"end_reason": TurnEndReason.HEARTBEAT_LAPSED})
                reaped += 1
            except E.TurnNotRunning:
                pass  # ended meanwhile (by its worker, or by another sweeper)
            except E.DraftstoreError as exc:
                failed += 1
                log.warning("sweep could not interrupt turn %s (left for the next sweep): %s", tid, exc)
        return reaped, failed
