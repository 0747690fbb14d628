"""Turns: start, continue, end, heartbeats; tool calls and approvals; draft writes; text deltas."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import JsonValue
from ..threads import run_sync
from starlette.responses import Response

from ... import errors as E
from ...records import ContinuedTurn, Draft, Page, ResumeContext, ToolCall, Turn
from ..auth import AGENT, DECIDERS, TURN_READERS, Allow, Principal, StoreDep, project_scope, turn_scope
from ..responses import JSON
from ..schemas import (Approval, Changes, Complete, Delta, Fail, Interrupt, Move, Patch, Payload, StartTurn,
                       ToolComplete, ToolFail, ToolStart, TurnDetail, decode_files)
from .projects import Cursor, Limit, Order

router = APIRouter(prefix="/v1", tags=["turns"])

NoContent = Response(status_code=204)


def _scoped(request: Request, principal: Principal, store: Any, turn_id: str) -> None:
    turn_scope(principal, store, turn_id, request.app.state.turn_projects)


# Routes match in the order they are declared: the requests an agent sends most (tool calls,
# writes, heartbeats, deltas) come first.
# -- tool calls ---------------------------------------------------------------------------
# read from the request rather than declared as a Header() parameter: the fast lane
# (fastlane.py) calls this function with the arguments it knows; the document names it here
IDEMPOTENCY_KEY = {"name": "Idempotency-Key", "in": "header", "required": False, "schema": {
    "type": "string", "minLength": 1, "maxLength": 200, "pattern": "^[\\x21-\\x7e]+$"},
    "description": "Makes a retry safe: while the turn runs, a start with a key the turn already recorded "
                   "answers that call (same seq, 201) and records nothing; the same key with another "
                   "tool_name, args or needs_approval is 409 idempotency.conflict."}


@router.post("/turns/{turn_id}/tool-calls", status_code=201, response_model=ToolCall, response_class=JSON,
             openapi_extra={"parameters": [IDEMPOTENCY_KEY]})
def tool_started(turn_id: str, body: ToolStart, request: Request, store: StoreDep,
                 principal: Principal = Allow(*AGENT)) -> JSON:
    """Record a call's start; send an ``Idempotency-Key`` to make a retry safe."""
    _scoped(request, principal, store, turn_id)
    call = store.tool_started(turn_id, body.tool_name, body.args, needs_approval=body.needs_approval,
                              idempotency_key=request.headers.get("idempotency-key"))
    return JSON(call, status_code=201)


@router.post("/turns/{turn_id}/tool-calls/{seq}/complete", status_code=204)
def tool_completed(turn_id: str, seq: int, body: ToolComplete, request: Request, store: StoreDep,
                   principal: Principal = Allow(*AGENT)) -> Response:
    _scoped(request, principal, store, turn_id)
    store.tool_completed(turn_id, seq, body.result)
    return Response(status_code=204)


@router.post("/turns/{turn_id}/tool-calls/{seq}/fail", status_code=204)
def tool_failed(turn_id: str, seq: int, body: ToolFail, request: Request, store: StoreDep,
                principal: Principal = Allow(*AGENT)) -> Response:
    _scoped(request, principal, store, turn_id)
    store.tool_failed(turn_id, seq, body.error)
    return Response(status_code=204)


@router.post("/turns/{turn_id}/tool-calls/{seq}/approval", response_model=ToolCall, response_class=JSON)
def approval(turn_id: str, seq: int, body: Approval, request: Request, store: StoreDep,
             principal: Principal = Allow(*DECIDERS)) -> JSON:
    """Approve (the call becomes ``started``) or deny (``denied``; not a turn failure). A person's
    decision: an admin's, or an approver's (the backend relaying a click); never an agent's."""
    _scoped(request, principal, store, turn_id)
    return JSON(store.decide_tool_call(turn_id, seq, body.approved, body.reason, actor=body.actor or principal.actor))


# -- draft writes ---------------------------------------------------------------------------
@router.put("/turns/{turn_id}/files/{path:path}", status_code=204,
            openapi_extra={"requestBody": {"content": {"application/octet-stream": {"schema": {
                "type": "string", "format": "binary"}}}, "required": True}})
async def write_file(turn_id: str, path: str, request: Request, principal: Principal = Allow(*AGENT)) -> Response:
    """Write one file; the body is its raw content."""
    store = request.app.state.store
    limit = store.limits.max_file_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise E.PayloadTooLarge(f"{path!r} is larger than {limit} bytes", path=path[:200], limit=limit)
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise E.PayloadTooLarge(f"{path!r} is larger than {limit} bytes", path=path[:200], limit=limit)
    # the general pool, not the turn pool: there, under load, writes lengthened the tool-call records' tail
    await run_sync(_write, request, principal, store, turn_id, path, bytes(data))
    return Response(status_code=204)


def _write(request: Request, principal: Principal, store: Any, turn_id: str, path: str, data: bytes) -> None:
    """The scope check and the write in one thread-pool hop."""
    _scoped(request, principal, store, turn_id)
    store.write_file(turn_id, path, data)


@router.delete("/turns/{turn_id}/files/{path:path}", status_code=204)
def delete_file(turn_id: str, path: str, request: Request, store: StoreDep,
                principal: Principal = Allow(*AGENT)) -> Response:
    _scoped(request, principal, store, turn_id)
    store.delete_file(turn_id, path)
    return Response(status_code=204)


@router.post("/turns/{turn_id}/changes", status_code=204)
def apply_changes(turn_id: str, body: Changes, request: Request, store: StoreDep,
                  principal: Principal = Allow(*AGENT)) -> Response:
    """One atomic batch: ``{"changes": {path: base64 | null}}`` (null deletes)."""
    _scoped(request, principal, store, turn_id)
    store.apply_changes(turn_id, decode_files(body.changes, "changes"))
    return Response(status_code=204)


@router.post("/turns/{turn_id}/move", status_code=204)
def move_file(turn_id: str, body: Move, request: Request, store: StoreDep,
              principal: Principal = Allow(*AGENT)) -> Response:
    _scoped(request, principal, store, turn_id)
    store.move_file(turn_id, body.src, body.dst, overwrite=body.overwrite)
    return Response(status_code=204)


@router.post("/turns/{turn_id}/heartbeat", status_code=204)
def heartbeat(turn_id: str, request: Request, store: StoreDep, principal: Principal = Allow(*AGENT)) -> Response:
    """Keep a running turn alive; 409 ``turn.not_running`` once it was ended elsewhere."""
    _scoped(request, principal, store, turn_id)
    store.heartbeat(turn_id)
    return Response(status_code=204)


@router.post("/turns/{turn_id}/deltas", status_code=204)
def delta(turn_id: str, body: Delta, request: Request, store: StoreDep,
          principal: Principal = Allow(*AGENT)) -> Response:
    """Assistant text to the turn's stream (``assistant.delta``); not a row per delta."""
    _scoped(request, principal, store, turn_id)
    store.append_delta(turn_id, body.text)
    return Response(status_code=204)


# -- turns ----------------------------------------------------------------------------------
@router.post("/projects/{project_id}/turns", status_code=201, response_model=ContinuedTurn, response_class=JSON)
def start_turn(project_id: str, body: StartTurn, store: StoreDep, principal: Principal = Allow(*AGENT)) -> JSON:
    """Start a turn (a draft is derived from head if none is open); ``continue: true``
    continues on the existing draft (``draft.none`` if there is none) and answers the
    turn with ``context``, the first page of its resume context (a plain start has none).
    ``from_turn_id`` (with ``continue``) names the ended turn continued, else ``turn.conflict``."""
    project_scope(principal, project_id)
    actor = body.actor or principal.actor
    if body.continue_:
        turn = store.continue_turn(project_id, body.user_message, actor=actor, from_turn_id=body.from_turn_id)
    elif body.from_turn_id is not None:
        raise E.InvalidInput("from_turn_id names the turn a continue continues: it needs continue: true",
                             field="from_turn_id")
    else:
        turn = store.start_turn(project_id, body.user_message, actor=actor)
    return JSON(turn, status_code=201)


@router.get("/turns/{turn_id}/resume-context", response_model=ResumeContext, response_class=JSON)
def resume_context(turn_id: str, request: Request, store: StoreDep, cursor: Cursor = None,
                   max_turns: Annotated[int | None, Query(ge=1)] = None,
                   max_bytes: Annotated[int | None, Query(ge=1)] = None,
                   principal: Principal = Allow(*AGENT)) -> JSON:
    """What a backend needs to rebuild the model's context for the turn: the draft's earlier
    turns (oldest first; unfinished tool calls flagged), what the draft changed since its
    base; ``truncated`` and ``cursor`` for the next page. Offloaded args and results come
    as digest and preview."""
    _scoped(request, principal, store, turn_id)
    return JSON(store.resume_context(turn_id, max_turns=max_turns, max_bytes=max_bytes, cursor=cursor))


@router.get("/projects/{project_id}/turns", response_model=Page[Turn], response_class=JSON)
def list_turns(project_id: str, store: StoreDep, cursor: Cursor = None, limit: Limit = None,
               order: Order = "oldest", principal: Principal = Allow(*TURN_READERS)) -> JSON:
    """The project's turns, without their tool calls (``GET /turns/{turn_id}`` pages those)."""
    project_scope(principal, project_id)
    page = store.page_turns(project_id, cursor, limit, newest_first=order == "newest")
    return JSON(Page([_summary(t) for t in page.items], page.next_cursor))


@router.get("/turns/{turn_id}", response_model=TurnDetail, response_class=JSON)
def get_turn(turn_id: str, request: Request, store: StoreDep, tool_calls_limit: Limit = None,
             principal: Principal = Allow(*TURN_READERS)) -> JSON:
    """The turn, with the first page of its tool calls (``tool_calls_next_cursor``
    for the rest, through ``/turns/{turn_id}/tool-calls``)."""
    _scoped(request, principal, store, turn_id)
    turn = store.get_turn(turn_id, tool_calls=False)
    calls = store.page_tool_calls(turn_id, None, tool_calls_limit)
    return JSON({**_summary(turn), "tool_calls": calls.items, "tool_calls_next_cursor": calls.next_cursor})


@router.get("/turns/{turn_id}/tool-calls", response_model=Page[ToolCall], response_class=JSON)
def list_tool_calls(turn_id: str, request: Request, store: StoreDep, cursor: Cursor = None, limit: Limit = None,
                    principal: Principal = Allow(*TURN_READERS)) -> JSON:
    _scoped(request, principal, store, turn_id)
    return JSON(store.page_tool_calls(turn_id, cursor, limit))


@router.get("/turns/{turn_id}/tool-calls/{seq}/payload", response_model=Payload, response_class=JSON)
def tool_call_payload(turn_id: str, seq: int, request: Request, store: StoreDep,
                      part: Annotated[Literal["args", "result"], Query()] = "args",
                      principal: Principal = Allow(*TURN_READERS)) -> JSON:
    """The whole args or result of a call, inline or offloaded: how a backend reads what a
    tool call or a resume context shows only as digest and preview."""
    _scoped(request, principal, store, turn_id)
    return JSON({"seq": seq, "part": part, "value": store.tool_call_payload(turn_id, seq, part)})


def _summary(turn: Turn) -> dict[str, Any]:
    """The turn's record without ``tool_calls``: a list of a turn has no room for every
    turn's history, and an empty list there would read as "no tool calls"."""
    return {f.name: getattr(turn, f.name) for f in dataclasses.fields(turn) if f.name != "tool_calls"}


def _ended(turn: Turn) -> JSON:
    # a turn's end answers its record without the history (unbounded); GET /turns/{turn_id} pages it
    return JSON(_summary(turn))


@router.post("/turns/{turn_id}/complete", response_model=Turn, response_class=JSON)
def complete(turn_id: str, body: Complete, request: Request, store: StoreDep,
             principal: Principal = Allow(*AGENT)) -> JSON:
    _scoped(request, principal, store, turn_id)
    return _ended(store.complete_turn(turn_id, body.assistant_message))


@router.post("/turns/{turn_id}/interrupt", response_model=Turn, response_class=JSON)
def interrupt(turn_id: str, request: Request, store: StoreDep, body: Interrupt | None = None,
              principal: Principal = Allow(*AGENT)) -> JSON:
    _scoped(request, principal, store, turn_id)
    return _ended(store.interrupt_turn(turn_id, body.partial_response if body else None))


@router.post("/turns/{turn_id}/fail", response_model=Turn, response_class=JSON)
def fail(turn_id: str, body: Fail, request: Request, store: StoreDep, principal: Principal = Allow(*AGENT)) -> JSON:
    _scoped(request, principal, store, turn_id)
    return _ended(store.fail_turn(turn_id, body.error))


@router.post("/turns/{turn_id}/cancel", response_model=Turn, response_class=JSON)
def cancel(turn_id: str, request: Request, store: StoreDep, principal: Principal = Allow(*AGENT)) -> JSON:
    """End the turn ``interrupted`` with ``end_reason: cancelled`` (not a failure)."""
    _scoped(request, principal, store, turn_id)
    return _ended(store.cancel_turn(turn_id))


@router.patch("/turns/{turn_id}/characters", response_model=JsonValue, response_class=JSON)
def patch_characters(turn_id: str, body: Patch, request: Request, store: StoreDep,
                     principal: Principal = Allow(*AGENT)) -> JSON:
    """Returns the new characters."""
    _scoped(request, principal, store, turn_id)
    return JSON(store.patch_characters(turn_id, body.patch))


@router.patch("/turns/{turn_id}/world-settings", response_model=JsonValue, response_class=JSON)
def patch_world_settings(turn_id: str, body: Patch, request: Request, store: StoreDep,
                         principal: Principal = Allow(*AGENT)) -> JSON:
    """Returns the new world settings."""
    _scoped(request, principal, store, turn_id)
    return JSON(store.patch_world_settings(turn_id, body.patch))


__all__ = ["router", "Draft"]
