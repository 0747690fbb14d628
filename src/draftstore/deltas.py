"""Assistant text deltas of a running turn: streamed to its SSE buffer, never a row per delta.

A backend running a turn sends the model's text as it comes (``append``).
Each delta is one event (``assistant.delta``) in the turn's buffer; the text
so far is kept in this process and written to ``partial_response_json`` (of
the turn and of its draft) at most once every ``flush_interval_s`` and when
the turn is interrupted. It is a UI cache, never model context: deltas of one
turn are expected from one process (the one running the turn). A delta is in
the buffer when ``append`` returns (it is recorded nowhere else): a process
killed after acknowledging it loses nothing, and a coordinator that refuses it
makes ``append`` raise (``backend.unavailable``), so the sender can retry.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from . import errors as E
from . import validation as check
from .backends import Backends
from .db.tables import D, T
from .records import TurnStatus

__all__ = ["Deltas"]

MAX_DELTA_CHARS = 64 * 1024


@dataclass
class _Partial:
    text: list[str] = field(default_factory=list)
    size: int = 0
    flushed_at: float = 0.0
    dirty: bool = False


class Deltas:
    def __init__(self, b: Backends, flush_interval_s: float = 1.0) -> None:
        self.b = b
        self.flush_interval_s = flush_interval_s
        self._partials: dict[str, _Partial] = {}
        self._lock = threading.Lock()
        self._status = sa.select(T.c.status).where(T.c.id == sa.bindparam("turn_id"))

    def append(self, turn_id: str, text: Any) -> None:
        """Add assistant text to a running turn's stream. Raises ``turn.not_running``."""
        check.turn_id(turn_id)
        text = check.text("text", text, max_chars=MAX_DELTA_CHARS)
        # one primary-key read per delta (never a write): text for a turn that ended
        # elsewhere, by another process, a sweep or a discard, is refused at once
        with self.b.statement(read_only=True) as conn:
            status = conn.execute(self._status, {"turn_id": turn_id}).scalar()
        if status is None:
            raise E.TurnNotFound(f"no turn {turn_id!r}", turn_id=turn_id)
        if status != TurnStatus.RUNNING:
            self.take(turn_id)
            raise E.TurnNotRunning(f"turn {turn_id} is {status}; it takes no more text",
                                   turn_id=turn_id, status=status)
        with self._lock:
            partial = self._partials.setdefault(turn_id, _Partial(flushed_at=time.monotonic()))
        with self._lock:
            if partial.size + len(text) > self.b.limits.max_json_state_bytes // 2:
                raise E.PayloadTooLarge("the turn's partial response is too large", field="text",
                                        limit=self.b.limits.max_json_state_bytes // 2)
            partial.text.append(text)
            partial.size += len(text)
            partial.dirty = True
            due = time.monotonic() - partial.flushed_at >= self.flush_interval_s
        # in the buffer before this returns: a delta lives nowhere else (see events.append_now)
        self.b.append_now(f"turn:{turn_id}", "assistant.delta", {"turn_id": turn_id, "text": text})
        if due:
            self._flush(turn_id, partial)

    def _flush(self, turn_id: str, partial: _Partial) -> None:
        with self._lock:
            if not partial.dirty:
                return
            value = {"text": "".join(partial.text)}
            partial.dirty, partial.flushed_at = False, time.monotonic()
        doc = check.json_value("partial_response", value, self.b.limits.max_json_state_bytes)
        with self.b.tx() as conn:
            row = conn.execute(T.update().where(T.c.id == turn_id, T.c.status == TurnStatus.RUNNING.value)
                               .values(partial_response_json=doc).returning(T.c.draft_id)).first()
            if row is not None:
                conn.execute(D.update().where(D.c.id == row.draft_id).values(partial_response_json=doc))
        if row is None:
            self.take(turn_id)
            raise E.TurnNotRunning(f"turn {turn_id} is no longer running", turn_id=turn_id)

    def take(self, turn_id: str) -> dict[str, str] | None:
        """The text so far (``{"text": ...}``), forgetting it: the turn is ending."""
        with self._lock:
            partial = self._partials.pop(turn_id, None)
        return None if partial is None or not partial.text else {"text": "".join(partial.text)}
