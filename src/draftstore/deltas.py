"""Assistant text deltas of a running turn: streamed to its SSE buffer, never a row per delta.

A backend running a turn sends the model's text as it comes (``append``).
Each delta is one event (``assistant.delta``) in the turn's buffer, and is
appended to the turn's text in the coordinator, which every process shares:
a service with several workers receives one turn's deltas on any of them. The
text so far is written to ``partial_response_json`` (of the turn and of its
draft) at most once every ``flush_interval_s`` across all processes (the one
that takes the coordinator's short-lived flush lock writes it), and when the
turn is interrupted. It is a UI cache, never model context. A delta is in the
buffer and in the text when ``append`` returns (it is recorded nowhere else):
a process killed after acknowledging it loses nothing, and a coordinator that
refuses it makes ``append`` raise (``backend.unavailable``), so the sender can
retry. The text is dropped once the turn's end is committed, never before: an
end that fails leaves it for the retry.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import sqlalchemy as sa

from . import errors as E
from . import validation as check
from .coordination import Coordination
from .database import Database
from .db.tables import DRAFTS, TURNS
from .records import TurnStatus
from .settings import Limits

__all__ = ["Deltas"]

MAX_DELTA_CHARS = 64 * 1024
TEXT_TTL_S = 24 * 3600.0  # a running turn's text in the coordinator: renewed by each delta, dropped at the end


def _text_key(turn_id: str) -> str:
    return f"partial:{turn_id}"


class Deltas:
    def __init__(self, db: Database, coordination: Coordination, limits: Limits,
                 flush_interval_s: float = 1.0) -> None:
        self.db = db
        self.coordination = coordination
        self.limits = limits
        self.flush_interval_s = flush_interval_s
        # turn -> when this process last flushed its text, or tried (monotonic): it asks for
        # the coordinator's flush lock at most once an interval per turn
        self._flushed: dict[str, float] = {}
        self._lock = threading.Lock()
        self._status = sa.select(TURNS.c.status).where(TURNS.c.id == sa.bindparam("turn_id"))

    def append(self, turn_id: str, text: Any) -> None:
        """Add assistant text to a running turn's stream. Raises ``turn.not_running``."""
        check.turn_id(turn_id)
        text = check.text("text", text, max_chars=MAX_DELTA_CHARS)
        # one primary-key read per delta (never a write): text for a turn that ended
        # elsewhere, by another process, a sweep or a discard, is refused at once
        with self.db.statement(read_only=True) as conn:
            status = conn.execute(self._status, {"turn_id": turn_id}).scalar()
        if status != TurnStatus.RUNNING:
            if status is not None:
                self.forget(turn_id)
            raise E.turn_refused(turn_id, status, "it takes no more text")
        cap = self.limits.max_json_state_bytes // 2
        if self.coordination.coord.append_text(_text_key(turn_id), text, TEXT_TTL_S, cap) < 0:
            raise E.PayloadTooLarge("the turn's partial response is too large", field="text", limit=cap)
        # in the buffer before this returns: a delta lives nowhere else (see events.append_now)
        self.coordination.append_now(f"turn:{turn_id}", "assistant.delta", {"turn_id": turn_id, "text": text})
        now = time.monotonic()
        with self._lock:
            last = self._flushed.setdefault(turn_id, now)
            due = now - last >= self.flush_interval_s
            if due:
                self._flushed[turn_id] = now
        if due:
            self._flush(turn_id)

    def _flush(self, turn_id: str) -> None:
        try:  # held for one interval and never released: one flush an interval, whichever process
            self.coordination.coord.acquire(f"partial-flush:{turn_id}", ttl_s=self.flush_interval_s, timeout_s=0)
        except E.LockTimeout:
            return
        value = self.peek(turn_id)
        if value is None:
            return
        doc = check.json_value("partial_response", value, self.limits.max_json_state_bytes)
        with self.db.tx() as conn:
            row = conn.execute(TURNS.update().where(TURNS.c.id == turn_id, TURNS.c.status == TurnStatus.RUNNING.value)
                               .values(partial_response_json=doc).returning(TURNS.c.draft_id)).first()
            if row is not None:
                conn.execute(DRAFTS.update().where(DRAFTS.c.id == row.draft_id).values(partial_response_json=doc))
        if row is None:
            self.forget(turn_id)
            raise E.TurnNotRunning(f"turn {turn_id} is no longer running", turn_id=turn_id)

    def peek(self, turn_id: str) -> dict[str, str] | None:
        """The text so far (``{"text": ...}``), from every process's deltas; None if none."""
        text = self.coordination.coord.get_text(_text_key(turn_id))
        return {"text": text} if text else None

    def forget(self, turn_id: str) -> None:
        """The turn has ended (committed): drop its text."""
        with self._lock:
            self._flushed.pop(turn_id, None)
        self.coordination.coord.drop_text(_text_key(turn_id))
