"""The resume context: what a backend needs to rebuild the model's context for a turn of a draft.

A continued turn is a new turn on the same draft (never the old process), so
the model's context must be rebuilt from what the store kept: the draft's
earlier turns since its base version (messages, or the partial response of a
turn cut short; how and why each ended; its tool history with the calls that
never finished flagged) and what the draft changed since its base. Without it
a backend reads the previous turn, pages its tool calls and guesses; with it
the rebuild is one call (``continue_turn`` answers the first page inline).

Bounded, because a draft may hold many long turns: a page holds at most
``max_turns`` turns and ends once its turns reach ``max_bytes`` as JSON (one
turn at least, so paging always advances; a single turn's size is bounded by
its calls, whose big args/results are offloaded to the blob store with a
preview). Pages go oldest first; ``cursor`` names the last turn given.

Turns reverted out of the draft leave the context (``_not_reverted``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import sqlalchemy as sa

from . import errors as E
from . import paging
from . import validation as check
from .database import Database
from .db.tables import TURNS
from .diff import diff_views
from .digest import EMPTY_TREE
from .records import (
    ContinuedTurn,
    DraftChanges,
    ResumeContext,
    ResumeToolCall,
    ResumeTurn,
    ToolCall,
    ToolCallStatus,
    Turn,
    TurnStatus,
    aware,
    end_reason_of,
    json_default,
)
from .settings import Settings
from .states import States
from .toolcalls import ToolCalls
from .trees import TreeReader
from .view import View

__all__ = ["MAX_TURNS_LIMIT", "Resume"]

MAX_TURNS_LIMIT = 1000  # the most turns one page may be asked for
_CURSOR = "resume"
log = logging.getLogger("draftstore")
_UNFINISHED = (ToolCallStatus.INTERRUPTED, ToolCallStatus.EXPIRED)


def _not_reverted(stmt: sa.Select[Any]) -> sa.Select[Any]:
    """The turns still part of the draft: a turn an admin reverted the draft past
    (``reverted_at`` set) leaves the resume context."""
    return stmt.where(TURNS.c.reverted_at.is_(None))


def _call(c: ToolCall) -> ResumeToolCall:
    return ResumeToolCall(
        seq=c.seq, tool_name=c.tool_name, status=c.status, unfinished=c.status in _UNFINISHED, args=c.args,
        args_digest=c.args_digest, args_preview=c.args_preview, result=c.result, result_digest=c.result_digest,
        result_preview=c.result_preview, error=c.error, approval=c.approval, started_at=c.started_at,
        ended_at=c.ended_at)


def _turn(r: Any, calls: tuple[ToolCall, ...]) -> ResumeTurn:
    ended = r.status != TurnStatus.RUNNING.value
    return ResumeTurn(
        id=r.id, number=r.number, continues_turn_id=r.continues_turn_id, status=TurnStatus(r.status),
        end_reason=end_reason_of(r.status, r.end_reason) if ended else None, user_message=r.user_message_json,
        assistant_message=r.assistant_message_json, partial_response=r.partial_response_json, error=r.error_json,
        started_at=aware(r.started_at), ended_at=aware(r.ended_at),  # type: ignore[arg-type]
        tool_calls=tuple(_call(c) for c in calls))


def _bound(name: str, value: Any, default: int, low: int, high: int | None) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        raise E.InvalidInput(f"{name} is an integer from {low}" + (f" to {high}" if high else ""), field=name)
    return value


class Resume:
    def __init__(self, db: Database, trees: TreeReader, settings: Settings, states: States,
                 toolcalls: ToolCalls) -> None:
        self.db = db
        self.trees = trees
        self.settings = settings
        self.limits = settings.limits
        self.states = states
        self.toolcalls = toolcalls

    def context(self, turn_id: str, max_turns: int | None = None, max_bytes: int | None = None,
                cursor: str | None = None) -> ResumeContext:
        """One page of the resume context of ``turn_id`` (module docstring). Reads only."""
        check.turn_id(turn_id)
        n = _bound("max_turns", max_turns, self.settings.resume_max_turns, 1, MAX_TURNS_LIMIT)
        budget = _bound("max_bytes", max_bytes, self.settings.resume_max_bytes, 1, None)
        key = paging.decode(_CURSOR, cursor, (int,))
        with self.db.tx(read_only=True) as conn:
            turn = conn.execute(sa.select(TURNS.c.id, TURNS.c.project_id, TURNS.c.draft_id, TURNS.c.number,
                                          TURNS.c.base_version_id)
                                .where(TURNS.c.id == turn_id)).first()
            if turn is None:
                raise E.turn_not_found(turn_id)
            rows = conn.execute(_not_reverted(
                sa.select(TURNS).where(TURNS.c.draft_id == turn.draft_id, TURNS.c.number < turn.number,
                                       TURNS.c.number > (key[0] if key else 0))
                .order_by(TURNS.c.number).limit(n + 1))).all()
            turns: list[ResumeTurn] = []
            used = 0
            for r in rows[:n]:
                calls, r = self.toolcalls.read(conn, r)
                one = _turn(r, calls)
                size = len(json.dumps(one, default=json_default, ensure_ascii=False).encode("utf-8"))
                if turns and used + size > budget:
                    break
                turns.append(one)
                used += size
            last = conn.execute(sa.select(TURNS.c.id).where(TURNS.c.draft_id == turn.draft_id)
                                .order_by(TURNS.c.number.desc()).limit(1)).scalar()
        truncated = len(turns) < len(rows)
        return ResumeContext(
            turn_id=turn.id, project_id=turn.project_id, draft_id=turn.draft_id,
            base_version_id=turn.base_version_id, turns=tuple(turns),
            changes=self._changes(turn.project_id, turn.draft_id, turn.base_version_id, last or turn.id),
            truncated=truncated, cursor=paging.encode(_CURSOR, (turns[-1].number,)) if truncated else None)

    def continued(self, turn: Turn) -> ContinuedTurn:
        """A turn just begun by a continue, with the first page of its resume context (read after
        the turn's row committed: the context is of the turns before it, which no one changes).
        The turn has started whatever happens here: a context that cannot be read now (a backend
        error) leaves ``context`` None rather than fail a call whose retry would find the turn
        running; ``Store.resume_context`` reads it later."""
        try:
            context: ResumeContext | None = self.context(turn.id)
        except E.DraftstoreError as exc:
            log.warning("turn %s started without its resume context: %s", turn.id, exc)
            context = None
        return ContinuedTurn(**{f.name: getattr(turn, f.name) for f in dataclasses.fields(turn)}, context=context)

    def _changes(self, project_id: str, draft_id: str, base_version_id: str | None, last_turn_id: str) -> DraftChanges:
        """Paths the draft added, modified, deleted since its base (a tree diff: cost grows
        with the change), and whether characters or world settings differ."""
        draft = self.states.view(project_id)
        if draft.draft_id != draft_id:  # published or discarded since: the draft as its last turn left it
            draft = self.states.view_at_turn(last_turn_id, "end")
        base = (self.states.view_at(project_id, base_version_id) if base_version_id is not None else
                View(trees=self.trees, project_id=project_id, kind="empty", root=EMPTY_TREE, overlay={},
                     characters={}, world_settings={}, limits=self.limits, search=self.states.search))
        d = diff_views(base, draft, text=False, detect_renames=False)
        by: dict[str, list[str]] = {"added": [], "modified": [], "deleted": []}
        for f in d.files:
            by.setdefault(f.status, []).append(f.path)
        return DraftChanges(added=tuple(sorted(by["added"])), modified=tuple(sorted(by["modified"])),
                            deleted=tuple(sorted(by["deleted"])), characters_changed=bool(d.characters),
                            world_settings_changed=bool(d.world_settings))
