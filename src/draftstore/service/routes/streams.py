"""Event streams over SSE, with ``Last-Event-ID`` replay.

An event's SSE id is ``<epoch>:<n>``: ``n`` is its id in the turn's (or
project's) buffer, ``epoch`` the buffer's identity. A client reconnecting with
``Last-Event-ID`` (or ``?after=``) receives exactly the events it missed, then
live ones. If the buffer it knew is gone (the coordinator was flushed or
restarted, the buffer expired, or events it had not seen were trimmed), the
stream says so with a ``stream.rebuilt`` event and then sends the turn's
durable events rebuilt from the database (turn status changes, tool calls;
text deltas are not durable and may be missing), after which live events
follow. A client treats ``stream.rebuilt`` as "replace what you had". A
buffered event that the rebuild already sent (it reached the buffer after the
rebuild's snapshot) is not sent again: an event with only an ``id:`` line moves
the client's ``Last-Event-ID`` past it (EventSource dispatches nothing for it).

A turn's stream ends (``stream.end``) after the turn's end event, once
``AFTER_END_S`` has passed with nothing more to send: each process appends
the events it emitted itself, within about 10 ms, so an event of the turn
sent through another process just before the turn ended can reach the buffer
just after the end event, and it is still sent. A client that reconnects
once the turn has ended gets ``stream.end`` when nothing is left to send
(after ``END_GRACE_S``, time for a just-emitted end event to reach the
buffer). A stream outlives a coordinator outage: it waits for the
coordinator, then goes on (or is rebuilt, if the buffer was lost).

Idle streams get a keep-alive comment (a line starting with ``:``) every
``DRAFTSTORE_SSE_KEEPALIVE_S`` seconds (15; ``Settings.sse_keepalive_s``).

With ``Accept: application/json`` the route returns one page of buffered
events instead: ids in ``(after, before)``, the oldest ``limit`` of them, or
with ``before`` alone the newest ``limit`` (paging backwards);
``has_more_before`` / ``has_more_after`` tell whether the buffer holds events
before the page / after it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from sse_starlette import EventSourceResponse, ServerSentEvent
from ..threads import run_sync

from ... import errors as E
from ...coord import Tail
from ...records import Role, TurnStatus
from ...store import Store
from ..auth import AGENT, ANY, Allow, Principal, StoreDep, project_scope, turn_scope
from ..responses import JSON, dumps

router = APIRouter(prefix="/v1", tags=["events"])


MAX_EVENT_ID = 2**62  # ids count one stream's events: anything above names no event (and fits every backend)
POLL_S = 0.2
END_GRACE_S = 1.0
AFTER_END_S = 0.5  # after the end event: fifty times the bound on another process's late append
MAX_RETRY_S = 2.0  # longest wait between attempts to reach an unreachable coordinator
BATCH = 500
TURN_END = {"turn.completed", "turn.interrupted", "turn.failed", "turn.rolled_back"}
COMMITTED = {"version.published", "head.moved", "draft.discarded"}
PUBLISHED = {"version.published", "head.moved"}  # what an observer may learn: no draft, ever


def _hidden(event: Any) -> bool:
    """An event about a draft (one that names a draft id): never sent to an observer."""
    return event.type.startswith("draft.") or (isinstance(event.data, dict) and "draft_id" in event.data)


def _position(last_event_id: str | None, after: int | None) -> tuple[str | None, int] | None:
    """(epoch or None if the client gave a bare number, n), or None for a fresh client."""
    if last_event_id:
        epoch, sep, n = last_event_id.rpartition(":")
        if not sep or not (n.isascii() and n.isdigit()) or not epoch or len(last_event_id) > 100 or int(n) > MAX_EVENT_ID:
            raise E.InvalidInput("Last-Event-ID is not an id this stream sent", field="Last-Event-ID")
        return epoch, int(n)
    if after is not None:
        return None, after
    return None


def _sse(epoch: str | None, event: Any) -> ServerSentEvent:
    return ServerSentEvent(dumps(event.data).decode(), event=event.type, id=f"{epoch or '-'}:{event.id}")


class _Stream:
    """One subscriber's cursor over one buffer: yields what it has not seen."""

    def __init__(self, store: Store, stream: str, turn_id: str | None, types: set[str] | None,
                 turn_ended: bool = False, no_drafts: bool = False) -> None:
        self.store, self.stream, self.turn_id, self.types = store, stream, turn_id, types
        self.no_drafts = no_drafts  # an observer's stream: no event about a draft
        self.epoch: str | None = None
        self.after = 0
        # the turn had ended when the client connected: once nothing is left to send, the stream ends
        self.end_by = time.monotonic() + END_GRACE_S if turn_ended else None
        self.rebuilt_keys: set[tuple[str, Any]] = set()  # durable events the last rebuild sent

    async def tail(self, after: int) -> Tail:
        """The buffer from ``after``. While the coordinator is unreachable the stream waits for it (keep-alive
        comments go on; a client that leaves cancels the wait) instead of breaking: once it is back, a lost
        buffer shows as another epoch and the stream is rebuilt."""
        delay = POLL_S
        while True:
            try:
                return await run_sync(self.store.coord.tail, self.stream, after, BATCH)
            except E.BackendUnavailable:
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_S)

    async def rebuilt(self, reason: str) -> AsyncIterator[ServerSentEvent]:
        """The ``stream.rebuilt`` marker and the durable events; live events follow from the buffer's end."""
        tail = await self.tail(MAX_EVENT_ID)  # only the position: where live events will continue
        self.epoch, self.after = tail.epoch, tail.last_id
        cursor = f"{self.epoch or '-'}:{self.after}"
        events = await run_sync(self.store.durable_events, self.turn_id) if self.turn_id else []
        self.rebuilt_keys = {(type_, data.get("seq")) for type_, data in events}
        yield ServerSentEvent(dumps({"reason": reason, "deltas_missing": True}).decode(), event="stream.rebuilt",
                              id=cursor if not events else None)
        for i, (type_, data) in enumerate(events):
            if type_ in TURN_END and self.end_by is None:
                # not the end of the stream yet: the buffer may still receive these very events (appended
                # off the request's path, after this snapshot); the stream reads on, moving the client's
                # cursor past them, so a reconnect with it repeats nothing
                self.end_by = time.monotonic() + AFTER_END_S
            yield ServerSentEvent(dumps(data).decode(), event=type_, id=cursor if i == len(events) - 1 else None)

    async def start(self, position: tuple[str | None, int] | None) -> AsyncIterator[ServerSentEvent]:
        tail = await self.tail(0 if position is None else position[1])
        if position is None and self.turn_id is None:
            self.epoch, self.after = tail.epoch, tail.last_id  # a project's subscriber wants what happens next
            return
        if position is None:
            if tail.epoch is not None and tail.first_id <= 1:
                self.epoch, self.after = tail.epoch, 0  # the whole history is buffered
            else:
                async for e in self.rebuilt("the buffer no longer holds this stream's whole history"):
                    yield e
            return
        epoch, n = position
        if epoch == "-" and tail.epoch is not None:
            tail = await self.tail(0)  # the buffer was created after the client's rebuilt snapshot
            n = 0
            epoch = tail.epoch
        if (epoch is None or epoch == tail.epoch) and tail.epoch is not None and tail.first_id <= n + 1 \
                and n <= tail.last_id:
            self.epoch, self.after = tail.epoch, n
            return
        if epoch == "-" and tail.epoch is None:
            self.epoch, self.after = None, 0
            return
        async for e in self.rebuilt("the buffer this client read from was lost or trimmed"):
            yield e

    async def events(self, request: Request) -> AsyncIterator[ServerSentEvent]:
        while True:
            if await request.is_disconnected():
                return
            tail = await self.tail(self.after)
            if tail.epoch != self.epoch and (tail.epoch is not None or self.epoch is not None):
                if self.epoch is None and tail.first_id <= 1:
                    self.epoch = tail.epoch  # the buffer appeared (first events after a rebuild)
                else:
                    async for e in self.rebuilt("the buffer was lost while streaming"):
                        yield e
                    continue
            elif tail.epoch is not None and tail.first_id > self.after + 1:
                async for e in self.rebuilt("events were trimmed before this client read them"):
                    yield e
                continue
            for event in tail.events:
                self.after = event.id
                if (event.type, event.data.get("seq")) in self.rebuilt_keys:
                    # appended after the rebuild's snapshot but already sent by it: only move the client's cursor
                    yield ServerSentEvent(id=f"{self.epoch or '-'}:{event.id}")
                elif (self.types is None or event.type in self.types) and not (self.no_drafts and _hidden(event)):
                    yield _sse(self.epoch, event)
                if self.turn_id and event.type in TURN_END and self.end_by is None:
                    self.end_by = time.monotonic() + AFTER_END_S  # then: what other processes append late
            if not tail.events:
                now = time.monotonic()
                if self.end_by is not None and now >= self.end_by:
                    break  # the turn has ended, and the client has everything
                await asyncio.sleep(POLL_S if self.end_by is None else min(POLL_S, self.end_by - now))
        yield ServerSentEvent("{}", event="stream.end")


def _response(request: Request, stream: _Stream, position: tuple[str | None, int] | None) -> EventSourceResponse:
    async def gen() -> AsyncIterator[ServerSentEvent]:
        async for e in stream.start(position):
            yield e
        async for e in stream.events(request):
            yield e

    ping = request.app.state.store.settings.sse_keepalive_s
    return EventSourceResponse(gen(), ping=ping, headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _page(store: Store, stream: str, after: int | None, before: int | None, limit: int,
          types: set[str] | None, no_drafts: bool = False) -> JSON:
    if after is None:
        after = 0
        if before is not None:  # paging backwards: the newest ``limit`` events before ``before``
            end = min(before, store.coord.tail(stream, MAX_EVENT_ID, 0).last_id + 1)
            after = max(0, end - 1 - limit)
    tail = store.coord.tail(stream, after, limit if before is None else max(0, min(limit, before - after - 1)))
    events = [e for e in tail.events if before is None or e.id < before]
    shown = [{"id": f"{tail.epoch}:{e.id}", "type": e.type, "data": e.data}
             for e in events if (types is None or e.type in types) and not (no_drafts and _hidden(e))]
    last = events[-1].id if events else after
    # whether the buffer holds events before the page's first id / after its last (whatever the window asked)
    return JSON({"events": shown, "epoch": tail.epoch, "has_more_before": tail.first_id > 0 and tail.first_id <= after,
                 "has_more_after": last < tail.last_id})


def _wants_json(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return "application/json" in accept and "text/event-stream" not in accept


Limit = Annotated[int, Query(ge=1, le=1000)]
LastEventId = Annotated[str | None, Header(alias="Last-Event-ID", description=(
    "SSE: the id of the last event received (what a browser's EventSource sends when it reconnects); "
    "the stream continues after it"))]


@router.get("/turns/{turn_id}/events", responses={200: {"content": {"text/event-stream": {}}}})
async def turn_events(turn_id: str, request: Request, store: StoreDep,
                      after: Annotated[int | None, Query(ge=0, le=MAX_EVENT_ID)] = None,
                      before: Annotated[int | None, Query(ge=1, le=MAX_EVENT_ID)] = None, limit: Limit = 100,
                      last_event_id: LastEventId = None, principal: Principal = Allow(*AGENT)) -> Any:
    """The turn's events: SSE (replay with ``Last-Event-ID``), or with ``Accept:
    application/json`` one page ``{events, has_more_before, has_more_after}``."""
    await run_sync(turn_scope, principal, store, turn_id, request.app.state.turn_projects)
    turn = await run_sync(store.get_turn, turn_id, tool_calls=False)  # turn.not_found before streaming
    if _wants_json(request):
        return await run_sync(_page, store, f"turn:{turn_id}", after, before, limit, None)
    position = _position(last_event_id, after)
    ended = turn.status != TurnStatus.RUNNING
    return _response(request, _Stream(store, f"turn:{turn_id}", turn_id, None, turn_ended=ended), position)


@router.get("/projects/{project_id}/events", responses={200: {"content": {"text/event-stream": {}}}})
async def project_events(project_id: str, request: Request, store: StoreDep,
                         after: Annotated[int | None, Query(ge=0, le=MAX_EVENT_ID)] = None,
                         before: Annotated[int | None, Query(ge=1, le=MAX_EVENT_ID)] = None, limit: Limit = 100,
                         last_event_id: LastEventId = None, principal: Principal = Allow(*ANY)) -> Any:
    """Committed events of the project only: ``version.published``, ``head.moved``, ``draft.discarded``.
    An observer never learns of a draft: its stream carries ``version.published`` and ``head.moved`` only,
    and no event that names a draft."""
    project_scope(principal, project_id)
    await run_sync(store.get_project, project_id)
    observer = principal.role == Role.OBSERVER
    types = PUBLISHED if observer else COMMITTED
    if _wants_json(request):
        return await run_sync(_page, store, f"project:{project_id}", after, before, limit, types, observer)
    position = _position(last_event_id, after)
    return _response(request, _Stream(store, f"project:{project_id}", None, types, no_drafts=observer), position)
