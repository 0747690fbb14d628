"""A turn's tool-call history: recording, offloading, compaction, and the one reader.

While a turn runs, each call is a row keyed (turn_id, seq): recording one is a
single-statement insert or update, O(1) however long the history. The
transaction that ends the turn compacts the rows into the turn's
``tool_calls_json`` (one JSON array, in seq order) and deletes them. The rows
are deleted rather than kept because two copies of one history could only
ever disagree: after the end the column is the single truth, the row table
holds only running turns (small, so its inserts stay fast), and a reader never
merges two sources.

A start may carry an idempotency key, kept on its row with the SHA-256 of what
the start asked; a unique index on (turn_id, idempotency_key) makes a repeated
start (its answer lost) find the first call instead of recording a second. The
key is not compacted: once the turn has ended no start is recorded anyway.

Args and results larger than ``inline_payload_bytes`` (or holding a NUL
character, which PostgreSQL's JSONB cannot store) live in the blob store,
referenced by digest with a preview; compaction keeps the reference.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from hashlib import sha256
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection

from . import errors as E
from . import paging
from . import validation as check
from .coordination import Coordination
from .database import Database
from .db.tables import TOOL_CALLS, TURNS, utcnow
from .digest import Digest
from .objects import Objects
from .records import Page, ToolCall, ToolCallStatus, TurnStatus, aware
from .settings import Limits

__all__ = ["ToolCalls"]

_RUNNING = TurnStatus.RUNNING.value


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else aware(ts).isoformat()  # type: ignore[union-attr]


def _from_row(turn_id: str, r: Any) -> ToolCall:
    return ToolCall(
        turn_id=turn_id, seq=r.seq, tool_name=r.tool_name, status=ToolCallStatus(r.status),
        args=None if r.args_json is None else json.loads(r.args_json), args_digest=r.args_digest,
        args_preview=r.args_preview,
        result=None if r.result_json is None else json.loads(r.result_json), result_digest=r.result_digest,
        result_preview=r.result_preview, error=None if r.error_json is None else json.loads(r.error_json),
        started_at=aware(r.started_at), ended_at=aware(r.ended_at),  # type: ignore[arg-type]
        approval=None if r.approval_json is None else json.loads(r.approval_json),
    )


# The compacted entry, in the design's keys: ``seq, tool_name, args, status, result,
# started_at, finished_at``, plus ``args_digest``/``args_preview``,
# ``result_digest``/``result_preview`` and ``approval``. ``args``/``result`` are
# null when offloaded (the digest is set) or, for ``result``, not finished; a call
# that did not complete keeps its error at ``result.error``. ``_compact`` writes
# it and ``_from_compact`` reads it: nothing else in the code does (gc and fsck
# only read the digests), and migration 0008 converted the entries of 0007.
def _from_compact(turn_id: str, c: dict[str, Any]) -> ToolCall:
    status = ToolCallStatus(c["status"])
    result: Any = c["result"]
    error: Any = None
    if status != ToolCallStatus.COMPLETED and isinstance(result, dict):
        result, error = None, result.get("error")
    finished = c["finished_at"]
    return ToolCall(
        turn_id=turn_id, seq=c["seq"], tool_name=c["tool_name"], status=status,
        args=c["args"], args_digest=c.get("args_digest"), args_preview=c.get("args_preview"),
        result=result, result_digest=c.get("result_digest"), result_preview=c.get("result_preview"),
        error=error, started_at=datetime.fromisoformat(c["started_at"]),
        ended_at=None if finished is None else datetime.fromisoformat(finished), approval=c.get("approval"),
    )


# a call its turn's end finds unfinished -> what it becomes: no worker can finish it any more
# (recording needs a running turn), so a status that still said "in progress" would be a lie
_UNFINISHED = {ToolCallStatus.STARTED.value: ToolCallStatus.INTERRUPTED.value,
               ToolCallStatus.AWAITING_APPROVAL.value: ToolCallStatus.EXPIRED.value}


def _compact(r: Any, ended_at: datetime) -> str:
    """One call (a ``tool_call`` row) as compacted JSON text. Stored payload
    texts are embedded as they are (already checked JSON). A call still
    unfinished is written ``interrupted`` or ``expired``, finished at
    ``ended_at`` (the turn's end)."""
    dump = json.dumps
    status = _UNFINISHED.get(r.status, r.status)
    finished = r.ended_at if status == r.status else ended_at
    if r.result_json is not None:
        result = r.result_json
    elif r.error_json is not None:
        result = '{"error":' + r.error_json + "}"
    else:
        result = "null"
    return "".join([
        '{"seq":', str(r.seq), ',"tool_name":', dump(r.tool_name, ensure_ascii=False), ',"status":', dump(status),
        ',"args":', "null" if r.args_json is None else r.args_json, ',"args_digest":', dump(r.args_digest),
        ',"args_preview":', dump(r.args_preview, ensure_ascii=False),
        ',"result":', result, ',"result_digest":', dump(r.result_digest),
        ',"result_preview":', dump(r.result_preview, ensure_ascii=False),
        ',"approval":', "null" if r.approval_json is None else r.approval_json,
        ',"started_at":', dump(_iso(r.started_at)), ',"finished_at":', dump(_iso(finished)), "}"])


def request_digest(tool_name: str, args: Any, needs_approval: bool) -> str:
    """What an idempotent tool-call start asked, as a SHA-256 hex digest: the tool, its
    arguments and whether it needs approval, in canonical JSON (keys sorted), so a retry
    that sends the same arguments in another key order is the same request. ``args``
    must already be valid JSON (``validation.json_text``)."""
    text = json.dumps([tool_name, args, needs_approval], sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"), allow_nan=False)
    return sha256(text.encode("utf-8")).hexdigest()


def _stored_form_digest(tool_name: str, args_json: str | None, args_digest: str | None,
                        needs_approval: bool) -> str:
    """The request digest of releases before ``request_digest``: over the arguments as
    stored (inline JSON text or blob digest), so key order counted."""
    return sha256(json.dumps([tool_name, args_json, args_digest, needs_approval]).encode()).hexdigest()


class ToolCalls:
    def __init__(self, db: Database, objects: Objects, coordination: Coordination, limits: Limits) -> None:
        self.db = db
        self.objects = objects
        self.coordination = coordination
        self.limits = limits
        # binds are prefixed p_: SQLAlchemy reserves column names in INSERT/UPDATE
        next_seq = (sa.select(sa.func.coalesce(sa.func.max(TOOL_CALLS.c.seq), 0) + 1)
                    .where(TOOL_CALLS.c.turn_id == sa.bindparam("p_turn_id")).scalar_subquery())
        source = sa.select(
            TURNS.c.id, next_seq, sa.bindparam("p_tool_name", type_=sa.String),
            sa.bindparam("p_status", type_=sa.String),
            sa.bindparam("p_args_json", type_=sa.Text), sa.bindparam("p_args_digest", type_=sa.String),
            sa.bindparam("p_args_preview", type_=sa.Text), sa.bindparam("p_now", type_=sa.DateTime(timezone=True)),
            sa.bindparam("p_idempotency_key", type_=sa.String), sa.bindparam("p_request_digest", type_=sa.String),
        ).where(TURNS.c.id == sa.bindparam("p_turn_id"), TURNS.c.status == _RUNNING)
        if not db.sqlite:
            # wait for, then re-check, a concurrent status change of the turn
            source = source.with_for_update(read=True, of=TURNS)
        self._started = db.one_shot(TOOL_CALLS.insert().from_select(
            ["turn_id", "seq", "tool_name", "status", "args_json", "args_digest", "args_preview", "started_at",
             "idempotency_key", "request_digest"],
            source).returning(TOOL_CALLS.c.seq))
        self._by_key = sa.select(TOOL_CALLS).where(TOOL_CALLS.c.turn_id == sa.bindparam("p_turn_id"),
                                                   TOOL_CALLS.c.idempotency_key == sa.bindparam("p_idempotency_key"))
        running = sa.exists().where(TURNS.c.id == sa.bindparam("p_turn_id"), TURNS.c.status == _RUNNING)
        finish = TOOL_CALLS.update().where(TOOL_CALLS.c.turn_id == sa.bindparam("p_turn_id"),
                                           TOOL_CALLS.c.seq == sa.bindparam("p_seq"),
                                           TOOL_CALLS.c.status == ToolCallStatus.STARTED.value, running)
        self._completed = db.one_shot(finish.values(
            status=ToolCallStatus.COMPLETED.value, ended_at=sa.bindparam("p_now"),
            result_json=sa.bindparam("p_result_json"), result_digest=sa.bindparam("p_result_digest"),
            result_preview=sa.bindparam("p_result_preview")))
        self._failed = db.one_shot(finish.values(
            status=ToolCallStatus.FAILED.value, ended_at=sa.bindparam("p_now"),
            error_json=sa.bindparam("p_error_json")))
        self._decided = TOOL_CALLS.update().where(
            TOOL_CALLS.c.turn_id == sa.bindparam("p_turn_id"), TOOL_CALLS.c.seq == sa.bindparam("p_seq"),
            TOOL_CALLS.c.status == ToolCallStatus.AWAITING_APPROVAL.value, running,
        ).values(status=sa.bindparam("p_status"), approval_json=sa.bindparam("p_approval_json"),
                 ended_at=sa.bindparam("p_ended_at"))
        self._rows = (sa.select(TOOL_CALLS).where(TOOL_CALLS.c.turn_id == sa.bindparam("turn_id"))
                      .order_by(TOOL_CALLS.c.seq))

    # -- recording -------------------------------------------------------------------------
    def _payload(self, field: str, value: Any) -> tuple[str | None, str | None, str | None]:
        """(inline JSON, blob digest, preview): big payloads go to the blob store."""
        limits = self.limits
        text, nul = check.json_text(field, value, limits.max_payload_bytes)
        if not nul and len(text) <= limits.inline_payload_bytes and len(text.encode()) <= limits.inline_payload_bytes:
            return text, None, None
        digest = self.objects.raw.put(text.encode("utf-8"))
        return None, digest, text[: limits.payload_preview_chars]

    def started(self, turn_id: str, tool_name: str, args: Any, needs_approval: bool = False,
                idempotency_key: str | None = None) -> ToolCall:
        """Record a call's start (see ``Store.tool_started``). With ``idempotency_key``, a
        start the turn already recorded under that key is answered with that call as it
        stands (nothing recorded, no event); the same key with another request raises
        ``idempotency.conflict``. The unique index (turn_id, idempotency_key) decides
        between racing starts: the loser reads the winner's call."""
        check.turn_id(turn_id)
        tool_name = check.name("tool_name", tool_name)
        check.flag("needs_approval", needs_approval)
        key = check.idempotency_key(idempotency_key)
        args_json, args_digest, args_preview = self._payload("args", args)
        # no read ahead of the insert: a first start (the usual case) costs what it did
        request = None if key is None else request_digest(tool_name, args, needs_approval)
        now = utcnow()
        status = ToolCallStatus.AWAITING_APPROVAL if needs_approval else ToolCallStatus.STARTED
        params = {"p_turn_id": turn_id, "p_tool_name": tool_name, "p_args_json": args_json, "p_status": status.value,
                  "p_args_digest": args_digest, "p_args_preview": args_preview, "p_now": now,
                  "p_idempotency_key": key, "p_request_digest": request}
        for attempt in range(20):
            try:
                row, _ = self.db.run(self._started, params, (turn_id, 0))
                break
            except sa_exc.IntegrityError:
                if key is not None:
                    # an earlier or concurrent start with the same key: its call is the answer
                    earlier = self._repeat(turn_id, key, request, (tool_name, args_json, args_digest, needs_approval))
                    if earlier is not None:
                        return earlier
                # two recorders raced for the same seq: take the next one
                if attempt == 19:
                    raise
                time.sleep(0.001 * (attempt + 1))
        if row is None:
            raise self._why_not(turn_id, None)
        seq = row[0]
        self.coordination.emit(f"turn:{turn_id}", f"tool.{status}",
                               {"turn_id": turn_id, "seq": seq, "tool_name": tool_name})
        return ToolCall(turn_id=turn_id, seq=seq, tool_name=tool_name, status=status,
                        args=None if args_digest else args, args_digest=args_digest, args_preview=args_preview,
                        result=None, result_digest=None, result_preview=None, error=None,
                        started_at=now, ended_at=None)

    def _repeat(self, turn_id: str, key: str, request: str | None,
                stored: tuple[str, str | None, str | None, bool]) -> ToolCall | None:
        """The call a start with ``key`` recorded in this running turn, or None; raises
        ``idempotency.conflict`` if that start asked something else than ``request``.
        ``stored`` (tool name, args as stored, args' blob digest, needs_approval) also
        matches a start recorded by a release that digested the stored form (a replica
        not yet upgraded, during a rolling deploy)."""
        with self.db.tx(read_only=True) as conn:
            row = conn.execute(self._by_key, {"p_turn_id": turn_id, "p_idempotency_key": key}).first()
        if row is None:
            return None
        if row.request_digest != request and row.request_digest != _stored_form_digest(*stored):
            raise E.IdempotencyConflict(
                f"Idempotency-Key {key!r} of turn {turn_id} recorded another request (tool call {row.seq})",
                turn_id=turn_id, seq=row.seq, idempotency_key=key)
        return _from_row(turn_id, row)

    def decide(self, turn_id: str, seq: int, approved: bool, reason: Any, actor: str | None) -> ToolCall:
        """Record the approval decision of a call awaiting one: approved, it is
        ``started`` (its worker runs it); denied, it is ``denied`` (final; the
        turn goes on). Raises ``toolcall.not_awaiting_approval``, ``turn.not_running``."""
        check.turn_id(turn_id)
        seq = check.seq(turn_id, seq)
        check.flag("approved", approved)
        if reason is not None:
            check.json_value("reason", reason, self.limits.max_message_bytes)
        now = utcnow()
        approval = {"approved": approved, "reason": reason, "by": check.actor(actor), "at": now.isoformat()}
        status = ToolCallStatus.STARTED if approved else ToolCallStatus.DENIED
        with self.db.tx() as conn:
            updated = conn.execute(self._decided, {
                "p_turn_id": turn_id, "p_seq": seq, "p_status": status.value,
                "p_approval_json": check.dump_json(approval), "p_ended_at": None if approved else now}).rowcount
            row = conn.execute(sa.select(TOOL_CALLS).where(TOOL_CALLS.c.turn_id == turn_id,
                                                           TOOL_CALLS.c.seq == seq)).first()
        if updated != 1:
            raise self._why_not(turn_id, seq, deciding=True)
        self.coordination.emit(f"turn:{turn_id}", "tool.approved" if approved else "tool.denied",
                    {"turn_id": turn_id, "seq": seq, "reason": reason})
        return _from_row(turn_id, row)

    def completed(self, turn_id: str, seq: int, result: Any) -> None:
        check.turn_id(turn_id)
        seq = check.seq(turn_id, seq)
        result_json, result_digest, result_preview = self._payload("result", result)
        self._finish(turn_id, seq, ToolCallStatus.COMPLETED, self._completed, {
            "p_result_json": result_json, "p_result_digest": result_digest, "p_result_preview": result_preview})

    def failed(self, turn_id: str, seq: int, error: Any) -> None:
        check.turn_id(turn_id)
        seq = check.seq(turn_id, seq)
        error_json = check.message("error", error, self.limits)
        self._finish(turn_id, seq, ToolCallStatus.FAILED, self._failed, {"p_error_json": error_json})

    def _finish(self, turn_id: str, seq: int, status: ToolCallStatus, stmt: Any, values: dict[str, Any]) -> None:
        _, updated = self.db.run(stmt, {"p_turn_id": turn_id, "p_seq": seq, "p_now": utcnow(), **values},
                                (turn_id, seq))
        if updated != 1:
            raise self._why_not(turn_id, seq)
        self.coordination.emit(f"turn:{turn_id}", f"tool.{status}", {"turn_id": turn_id, "seq": seq})

    def _why_not(self, turn_id: str, seq: int | None, deciding: bool = False) -> E.DraftstoreError:
        """Why recording was refused: the turn is missing or ended, or the call is
        missing or already finished (read after the fact; the statement decided)."""
        with self.db.tx(read_only=True) as conn:
            turn = conn.execute(sa.select(TURNS.c.status).where(TURNS.c.id == turn_id)).first()
            if turn is None or turn.status != _RUNNING:
                return E.turn_refused(turn_id, None if turn is None else turn.status,
                                      "only a running turn records tool calls")
            call = conn.execute(sa.select(TOOL_CALLS.c.status).where(TOOL_CALLS.c.turn_id == turn_id,
                                                                     TOOL_CALLS.c.seq == seq)).first()
        if call is None:
            return E.ToolCallNotFound(f"turn {turn_id} has no tool call {seq}", turn_id=turn_id, seq=seq)
        if deciding:
            return E.ToolCallNotAwaitingApproval(f"tool call {seq} of turn {turn_id} is {call.status}, not awaiting "
                                                 "approval", turn_id=turn_id, seq=seq, status=call.status)
        if call.status == ToolCallStatus.AWAITING_APPROVAL:
            return E.ToolCallAwaitingApproval(f"tool call {seq} of turn {turn_id} still awaits its approval",
                                              turn_id=turn_id, seq=seq, status=call.status)
        return E.ToolCallAlreadyFinished(f"tool call {seq} of turn {turn_id} already {call.status}",
                                         turn_id=turn_id, seq=seq, status=call.status)

    def read_payload(self, digest: str) -> Any:
        return json.loads(self.objects.raw.get(Digest(digest)).decode("utf-8"))

    def payload(self, turn_id: str, seq: int, part: str) -> Any:
        """The whole ``args`` or ``result`` of one call, inline or offloaded: reached through
        the turn (whose readers may read it), never by a bare digest, which would let a
        reader of one project name another's payload."""
        check.turn_id(turn_id)
        seq = check.seq(turn_id, seq)
        if part not in ("args", "result"):
            raise E.InvalidInput('part is "args" or "result"', field="part")
        with self.db.tx(read_only=True) as conn:
            turn = conn.execute(sa.select(TURNS.c.id, TURNS.c.tool_calls_json).where(TURNS.c.id == turn_id)).first()
            if turn is None:
                raise E.turn_not_found(turn_id)
            calls, _ = self.read(conn, turn, seq - 1, 1)
        if not calls or calls[0].seq != seq:
            raise E.ToolCallNotFound(f"turn {turn_id} has no tool call {seq}", turn_id=turn_id, seq=seq)
        call = calls[0]
        digest = call.args_digest if part == "args" else call.result_digest
        return self.read_payload(digest) if digest is not None else getattr(call, part)

    # -- compaction and reading -------------------------------------------------------------
    def compact(self, conn: Connection, turn_id: str, ended_at: datetime) -> check.JSONText:
        """Within the transaction that ends the turn (at ``ended_at``): the history
        as one JSON array (to store in ``tool_calls_json``); the rows are deleted.
        Calls left ``started`` become ``interrupted``, calls left ``awaiting_approval``
        become ``expired``, both finished at ``ended_at`` (every end goes through here:
        complete, interrupt, cancel, fail, the sweep's reap, a discard)."""
        rows = conn.execute(self._rows, {"turn_id": turn_id}).all()
        if rows:
            conn.execute(TOOL_CALLS.delete().where(TOOL_CALLS.c.turn_id == turn_id))
        return check.JSONText("[" + ",".join(_compact(r, ended_at) for r in rows) + "]")

    def read(self, conn: Connection, turn: Any, after: int = 0,
             limit: int | None = None) -> tuple[tuple[ToolCall, ...], Any]:
        """The history of ``turn`` (a row with ``id``, ``status``, ``tool_calls_json``),
        in seq order (calls with seq > ``after``, at most ``limit``): the
        compacted column of an ended turn, the rows of a running one.

        Returns (calls, turn row): if the turn ended between reading its row and
        its rows (which the end deletes in the transaction that fills the
        column), the row is read again and its column used.
        """
        if turn.tool_calls_json is None:
            stmt = self._rows if not after and limit is None else (
                sa.select(TOOL_CALLS).where(TOOL_CALLS.c.turn_id == turn.id, TOOL_CALLS.c.seq > after)
                .order_by(TOOL_CALLS.c.seq).limit(limit))
            rows = conn.execute(stmt, {"turn_id": turn.id}).all()
            if rows or conn.execute(sa.select(TURNS.c.tool_calls_json.is_(None)).where(TURNS.c.id == turn.id)).scalar():
                return tuple(_from_row(turn.id, r) for r in rows), turn
            turn = conn.execute(sa.select(TURNS).where(TURNS.c.id == turn.id)).one()
        calls = [c for c in turn.tool_calls_json if c["seq"] > after]
        if limit is not None:
            calls = calls[:limit]
        return tuple(_from_compact(turn.id, c) for c in calls), turn

    def page(self, turn_id: str, cursor: str | None, limit: int | None) -> Page[ToolCall]:
        """One page of a turn's history, in seq order."""
        check.turn_id(turn_id)
        n = paging.limit(limit)
        key = paging.decode("tool_calls", cursor, (int,))
        with self.db.tx(read_only=True) as conn:
            turn = conn.execute(sa.select(TURNS.c.id, TURNS.c.tool_calls_json).where(TURNS.c.id == turn_id)).first()
            if turn is None:
                raise E.turn_not_found(turn_id)
            calls, _ = self.read(conn, turn, key[0] if key else 0, n + 1)
        return paging.page("tool_calls", list(calls), n, lambda c: (c.seq,), lambda c: c)
