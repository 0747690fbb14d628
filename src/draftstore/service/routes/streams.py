"""Event streams over SSE, with ``Last-Event-ID`` replay.

An event's SSE id is ``<epoch>:<n>``: ``n`` is its id in the turn's (or
project's) buffer, ``epoch`` the buffer's identity. A client reconnecting with
``Last-Event-ID`` (or ``?after=`` with the same id) receives exactly the events
it missed, then live ones. A bare number as ``after`` names an event of the
buffer as it is now: after a loss it cannot tell, so clients send the id. If the buffer it knew is gone (the coordinator was flushed or
restarted, the buffer expired, or events it had not seen were trimmed), the
stream says so with a ``stream.rebuilt`` event and then sends the durable
events rebuilt from the database, after which live events follow: a turn's
status changes and tool calls (text deltas are not durable and may be
missing: ``deltas_missing``), or a project's last ``PROJECT_REBUILD`` committed
events (publishes, rollbacks, discarded drafts; an observer's, without the
drafts). A client treats ``stream.rebuilt`` as "replace what you had". A
buffered event that the rebuild already sent (it reached the buffer after the
rebuild's snapshot) is not sent again: an event with only an ``id:`` line moves
the client's ``Last-Event-ID`` past it (EventSource dispatches nothing for it).
A rebuild made while no buffer exists leaves the id ``-:<n>``: a client back
with it once a buffer exists gets the history rebuilt again (the new buffer
may hold events the rebuild sent, and which is not known), never one twice.

A turn's stream ends (``stream.end``) after the turn's end event, once
``AFTER_END_S`` has passed with nothing more to send: each process appends
the events it emitted itself, within about 10 ms, so an event of the turn
sent through another process just before the turn ended can reach the buffer
just after the end event, and it is still sent. A process killed between a
commit and its append loses that event from the buffer (never from the
database); if it was the turn's end, a stream idle for ``IDLE_CHECK_S`` finds
the turn ended in the database and, ``END_GRACE_S`` later, still no end event
in the buffer: it sends the history rebuilt (``stream.rebuilt``) and ends. A
client that reconnects once the turn has ended gets ``stream.end`` when nothing is left to send
(after ``END_GRACE_S``, time for a just-emitted end event to reach the
buffer). A stream outlives a coordinator outage: it waits for the
coordinator, then goes on (or is rebuilt, if the buffer was lost).

Idle streams get a keep-alive comment (a line starting with ``:``) every
``DRAFTSTORE_SSE_KEEPALIVE_S`` seconds (15; ``Settings.sse_keepalive_s``).

With ``Accept: application/json`` the route returns one page of buffered
events instead: ids in ``(after, before)``, the oldest ``limit`` of them, or
with ``before`` alone the newest ``limit`` (paging backwards);
``has_more_before`` / ``has_more_after`` tell whether the buffer holds events
before the page / after it, and ``next_after`` / ``next_before`` are what to
pass for the next page either way (a window holding only events this reader
may not see, say a project's turn events, gives an empty page: the next one
starts past it). Where SSE would send ``stream.rebuilt`` the page is rebuilt
too: a turn's page asked for from its start (no ``after``) whose buffer no
longer holds the turn's start, or a page after an id of a buffer that is gone
(or trimmed past it), lists the durable events from the database (with
``"id": null``), then what the buffer got since that they do not hold, and
says so in ``rebuilt``: ``{"reason", "deltas_missing"}`` (null on a page of
the buffer). ``next_after`` continues in the buffer. A bare number as
``after`` reads the buffer as it is now, never a rebuild. Unlike a stream, a
page keeps nothing between requests: an event the rebuild listed that reaches
the buffer only after the page was read (appended off its operation's path,
within about 10 ms) comes again on the next page; a reader tells a turn's
events apart by type and ``seq``.
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
from ...events import MAX_PAGE
from ...records import TurnStatus
from ...store import Store
from ..auth import ANY, TURN_READERS, Allow, Principal, StoreDep, project_scope, turn_scope
from ..responses import JSON, dumps
from ..schemas import EventPage

router = APIRouter(prefix="/v1", tags=["events"])


MAX_EVENT_ID = 2**62  # ids count one stream's events: anything above names no event (and fits every backend)
POLL_S = 0.2
END_GRACE_S = 1.0
IDLE_CHECK_S = 10.0  # a running turn's stream idle this long asks the database whether the turn has ended
AFTER_END_S = 0.5  # after the end event: fifty times the bound on another process's late append
MAX_RETRY_S = 2.0  # longest wait between attempts to reach an unreachable coordinator
BATCH = 500
PROJECT_REBUILD = 1000  # a project stream rebuilt from the database: its newest committed events
TURN_END = {"turn.completed", "turn.interrupted", "turn.failed", "turn.rolled_back"}
COMMITTED = {"version.published", "head.moved", "draft.discarded", "draft.reverted"}
PUBLISHED = {"version.published", "head.moved"}  # what an observer may learn: no draft, ever


def _hidden(type_: str, data: Any) -> bool:
    """An event about a draft (one that names a draft id): never sent to an observer."""
    return type_.startswith("draft.") or (isinstance(data, dict) and "draft_id" in data)


def _shown(types: set[str] | None, no_drafts: bool, type_: str, data: Any) -> bool:
    """Whether a reader of the stream sees this event: one of its ``types`` (None: every
    type), and none about a draft for an observer (``no_drafts``)."""
    return (types is None or type_ in types) and not (no_drafts and _hidden(type_, data))


def _event_id(value: str, field: str) -> tuple[str | None, int]:
    """An event id as a client sends it back: ``<epoch>:<n>`` as sent, or a bare ``n``."""
    epoch, sep, n = value.rpartition(":")
    if not (n.isascii() and n.isdigit()) or (sep and not epoch) or len(value) > 100 or int(n) > MAX_EVENT_ID:
        raise E.InvalidInput(f"{field} is not an id this stream sent", field=field)
    return (epoch if sep else None), int(n)


def _position(last_event_id: str | None, after: str | None) -> tuple[str | None, int] | None:
    """(epoch or None if the client gave a bare number, n), or None for a fresh client."""
    if last_event_id:
        epoch, n = _event_id(last_event_id, "Last-Event-ID")
        if epoch is None:
            raise E.InvalidInput("Last-Event-ID is not an id this stream sent", field="Last-Event-ID")
        return epoch, n
    if after is not None:
        return _event_id(after, "after")
    return None


def _key(of_turn: bool, type_: str, data: Any) -> tuple[str, Any]:
    """What tells a rebuilt event's buffered copy: a turn's by its call's ``seq`` (one
    event of a type per call, or per turn), a project's by its content (each names its
    version, draft, or head move's time: no two are alike)."""
    return (type_, data.get("seq")) if of_turn else (type_, dumps(data))


def _durable(store: Store, turn_id: str | None, project_id: str | None, types: set[str] | None,
             no_drafts: bool) -> list[tuple[str, Any]]:
    """A stream's durable events, rebuilt from the database: a turn's whole history, or a
    project's newest ``PROJECT_REBUILD`` committed events (what this reader may see)."""
    if turn_id:
        return store.durable_events(turn_id)
    return [(t, d) for t, d in store.durable_project_events(project_id, PROJECT_REBUILD)
            if _shown(types, no_drafts, t, d)]


def _sse(epoch: str | None, event: Any) -> ServerSentEvent:
    return ServerSentEvent(dumps(event.data).decode(), event=event.type, id=f"{epoch or '-'}:{event.id}")


class _Stream:
    """One subscriber's cursor over one buffer: yields what it has not seen."""

    def __init__(self, store: Store, stream: str, turn_id: str | None, types: set[str] | None,
                 turn_ended: bool = False, no_drafts: bool = False, project_id: str | None = None) -> None:
        self.store, self.stream, self.turn_id, self.types = store, stream, turn_id, types
        self.project_id = project_id  # a project's stream (turn_id None)
        self.no_drafts = no_drafts  # an observer's stream: no event about a draft
        self.epoch: str | None = None
        self.after = 0
        # the turn had ended when the client connected: once nothing is left to send, the stream ends
        self.end_by = time.monotonic() + END_GRACE_S if turn_ended else None
        self.rebuilt_keys: set[tuple[str, Any]] = set()  # durable events the last rebuild sent
        self.checked_at = time.monotonic()  # when the stream last sent an event or asked the database
        self.ended_seen_at: float | None = None  # when the database said the turn had ended, its end unseen

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

    def _key(self, type_: str, data: Any) -> tuple[str, Any]:
        return _key(bool(self.turn_id), type_, data)

    async def rebuilt(self, reason: str) -> AsyncIterator[ServerSentEvent]:
        """The ``stream.rebuilt`` marker and the durable events; live events follow from the buffer's end."""
        tail = await self.tail(MAX_EVENT_ID)  # only the position: where live events will continue
        self.epoch, self.after = tail.epoch, tail.last_id
        cursor = f"{self.epoch or '-'}:{self.after}"
        events = await run_sync(_durable, self.store, self.turn_id, self.project_id, self.types, self.no_drafts)
        self.rebuilt_keys = {self._key(type_, data) for type_, data in events}
        yield ServerSentEvent(dumps({"reason": reason, "deltas_missing": bool(self.turn_id)}).decode(),
                              event="stream.rebuilt", id=cursor if not events else None)
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
            # the whole history is buffered: from the turn's start (a buffer created anew after a loss
            # also starts at 1, with the turn's later events)
            if tail.epoch is not None and tail.first_id <= 1 and tail.events and tail.events[0].type == "turn.started":
                self.epoch, self.after = tail.epoch, 0
            else:
                async for e in self.rebuilt("the buffer no longer holds this stream's whole history"):
                    yield e
            return
        epoch, n = position
        if epoch == "-" and tail.epoch is not None:
            # the buffer was created after the client's rebuilt snapshot: it may hold events that snapshot
            # sent already (appended off their operation's path, after it) and which ones is not known
            # here, so the client gets the history rebuilt again rather than an event twice
            async for e in self.rebuilt("the buffer was created after this client's rebuilt history"):
                yield e
            return
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
                if self.rebuilt_keys and self._key(event.type, event.data) in self.rebuilt_keys:
                    # appended after the rebuild's snapshot but already sent by it: only move the client's cursor
                    yield ServerSentEvent(id=f"{self.epoch or '-'}:{event.id}")
                elif _shown(self.types, self.no_drafts, event.type, event.data):
                    yield _sse(self.epoch, event)
                if self.turn_id and event.type in TURN_END and self.end_by is None:
                    self.end_by = time.monotonic() + AFTER_END_S  # then: what other processes append late
            if tail.events:
                self.checked_at = time.monotonic()
            else:
                now = time.monotonic()
                if self.end_by is not None and now >= self.end_by:
                    break  # the turn has ended, and the client has everything
                if await self._end_lost(now):
                    async for e in self.rebuilt("the turn ended but its end event never reached the buffer"):
                        yield e
                    continue
                await asyncio.sleep(POLL_S if self.end_by is None else min(POLL_S, self.end_by - now))
        yield ServerSentEvent("{}", event="stream.end")

    async def _end_lost(self, now: float) -> bool:
        """Whether the turn ended in the database at least ``END_GRACE_S`` ago while its
        end event never reached the buffer: the process that emitted it died between its
        commit and the append (its events go to the buffer off the request's path). A
        running turn's stream asks after ``IDLE_CHECK_S`` without events, so an idle
        subscriber costs one read of the turn's row per interval."""
        if self.turn_id is None or self.end_by is not None:
            return False
        if self.ended_seen_at is not None:
            if now - self.ended_seen_at < END_GRACE_S:
                return False
            self.ended_seen_at, self.checked_at = None, now  # one rebuild; asked again only after another interval
            return True
        if now - self.checked_at < IDLE_CHECK_S:
            return False
        self.checked_at = now
        try:
            turn = await run_sync(self.store.get_turn, self.turn_id, tool_calls=False)
        except E.DraftstoreError:
            return False  # the database is unreachable, or the turn is gone: the next interval asks again
        if turn.status != TurnStatus.RUNNING:
            self.ended_seen_at = now
        return False


def _response(request: Request, stream: _Stream, position: tuple[str | None, int] | None) -> EventSourceResponse:
    async def gen() -> AsyncIterator[ServerSentEvent]:
        async for e in stream.start(position):
            yield e
        async for e in stream.events(request):
            yield e

    ping = request.app.state.store.settings.sse_keepalive_s
    return EventSourceResponse(gen(), ping=ping, headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _lost(store: Store, stream: str, head: Tail, position: tuple[str | None, int] | None,
          of_turn: bool) -> str | None:
    """Why a JSON page reader must get its stream rebuilt from the database (as SSE's
    ``stream.rebuilt`` says), or None: the buffer serves it. A bare number reads the buffer
    as it is now, whatever it holds (never a rebuild: it names no buffer)."""
    if position is None:
        if not of_turn:
            return None  # a project's page from its buffer's start: a window, never the whole history
        first = store.coord.tail(stream, 0, 1)
        whole = first.epoch is not None and first.first_id <= 1 and first.events \
            and first.events[0].type == "turn.started"
        return None if whole else "the buffer no longer holds this stream's whole history"
    epoch, n = position
    if epoch is None:
        return None
    if epoch == "-":
        return None if head.epoch is None else "the buffer was created after this client's rebuilt history"
    if epoch != head.epoch or head.first_id > n + 1 or n > head.last_id:
        return "the buffer this client read from was lost or trimmed"
    return None


def _rebuilt_page(store: Store, stream: str, head: Tail, reason: str, limit: int, types: set[str] | None,
                  no_drafts: bool, turn_id: str | None, project_id: str | None) -> JSON:
    """The page SSE's ``stream.rebuilt`` would send: the durable events (no buffer id: they are
    the database's), then what the buffer got after ``head`` that they do not already hold.
    ``next_after`` continues from there in the buffer."""
    durable = _durable(store, turn_id, project_id, types, no_drafts)
    keys = {_key(bool(turn_id), t, d) for t, d in durable}
    more = store.coord.tail(stream, head.last_id, limit) if head.epoch is not None else head
    if more.epoch != head.epoch:  # lost again meanwhile: the next page finds that out
        more = head
    late = [e for e in more.events if _key(bool(turn_id), e.type, e.data) not in keys]
    last = more.events[-1].id if more.events else head.last_id
    events = [{"id": None, "type": t, "data": d} for t, d in durable] + [
        {"id": f"{head.epoch}:{e.id}", "type": e.type, "data": e.data}
        for e in late if _shown(types, no_drafts, e.type, e.data)]
    return JSON({"events": events, "epoch": head.epoch,
                 "rebuilt": {"reason": reason, "deltas_missing": bool(turn_id)},
                 "has_more_before": False, "has_more_after": last < more.last_id,
                 "next_after": f"{head.epoch or '-'}:{last}", "next_before": last + 1})


def _page(store: Store, stream: str, position: tuple[str | None, int] | None, before: int | None, limit: int,
          types: set[str] | None, no_drafts: bool = False, turn_id: str | None = None,
          project_id: str | None = None) -> JSON:
    head = store.coord.tail(stream, MAX_EVENT_ID, 0)  # the buffer's epoch and id range, once
    if before is None and (reason := _lost(store, stream, head, position, turn_id is not None)):
        return _rebuilt_page(store, stream, head, reason, limit, types, no_drafts, turn_id, project_id)
    after = None if position is None else position[1]
    if position is not None and position[0] is not None and position[0] != head.epoch:
        after = 0  # a rebuilt history's "-:n" while still no buffer exists: from its start (there is none)
    if after is None:
        after = 0
        if before is not None:  # paging backwards: the newest ``limit`` events before ``before``
            end = min(before, head.last_id + 1)
            after = max(0, end - 1 - limit)
    tail = store.coord.tail(stream, after, limit if before is None else max(0, min(limit, before - after - 1)))
    if tail.epoch != head.epoch:  # the buffer was lost between the two reads: nothing of it to page
        tail = store.coord.tail(stream, MAX_EVENT_ID, 0)
    events = [e for e in tail.events if before is None or e.id < before]
    shown = [{"id": f"{tail.epoch}:{e.id}", "type": e.type, "data": e.data}
             for e in events if _shown(types, no_drafts, e.type, e.data)]
    last = events[-1].id if events else after
    first = events[0].id if events else (before if before is not None else after + 1)
    # whether the buffer holds events before the page's first id / after its last (whatever the window asked);
    # where the window ended (a page of events this reader may not see is empty, and the next one is there)
    return JSON({"events": shown, "epoch": tail.epoch, "rebuilt": None,
                 "has_more_before": tail.first_id > 0 and tail.first_id <= after,
                 "has_more_after": last < tail.last_id,
                 "next_after": f"{tail.epoch or '-'}:{last}", "next_before": first})


def _wants_json(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return "application/json" in accept and "text/event-stream" not in accept


Limit = Annotated[int, Query(ge=1, le=MAX_PAGE)]  # as Store.events
# the SSE stream beside the JSON page (the model): one operation, two media types
EVENTS: dict[int | str, Any] = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}
AccessToken = Annotated[str | None, Query(description=(
    "the bearer token, for a client that cannot send an Authorization header (a browser's EventSource); "
    "a token in a URL can end up in a proxy's logs: prefer the header"))]
After = Annotated[str | None, Query(max_length=100, description=(
    "the id of the last event received, as sent (``<epoch>:<n>``), or its number ``n`` alone"))]
LastEventId = Annotated[str | None, Header(alias="Last-Event-ID", description=(
    "SSE: the id of the last event received (what a browser's EventSource sends when it reconnects); "
    "the stream continues after it"))]


@router.get("/turns/{turn_id}/events", response_model=EventPage, responses=EVENTS)
async def turn_events(turn_id: str, request: Request, store: StoreDep,
                      after: After = None,
                      before: Annotated[int | None, Query(ge=1, le=MAX_EVENT_ID)] = None, limit: Limit = 100,
                      last_event_id: LastEventId = None, access_token: AccessToken = None,
                      principal: Principal = Allow(*TURN_READERS)) -> Any:
    """The turn's events: SSE (replay with ``Last-Event-ID``), or with ``Accept:
    application/json`` one page ``{events, has_more_before, has_more_after}``."""
    await run_sync(turn_scope, principal, store, turn_id, request.app.state.turn_projects)
    turn = await run_sync(store.get_turn, turn_id, tool_calls=False)  # turn.not_found before streaming
    if _wants_json(request):
        return await run_sync(_page, store, f"turn:{turn_id}", _position(None, after), before, limit, None,
                              turn_id=turn_id)
    position = _position(last_event_id, after)
    ended = turn.status != TurnStatus.RUNNING
    return _response(request, _Stream(store, f"turn:{turn_id}", turn_id, None, turn_ended=ended), position)


@router.get("/projects/{project_id}/events", response_model=EventPage, responses=EVENTS)
async def project_events(project_id: str, request: Request, store: StoreDep,
                         after: After = None,
                         before: Annotated[int | None, Query(ge=1, le=MAX_EVENT_ID)] = None, limit: Limit = 100,
                         last_event_id: LastEventId = None, access_token: AccessToken = None,
                         principal: Principal = Allow(*ANY)) -> Any:
    """Committed events of the project only: ``version.published``, ``head.moved``, ``draft.discarded``.
    An observer never learns of a draft: its stream carries ``version.published`` and ``head.moved`` only,
    and no event that names a draft."""
    project_scope(principal, project_id)
    await run_sync(store.get_project, project_id)
    observer = principal.published_only
    types = PUBLISHED if observer else COMMITTED
    if _wants_json(request):
        return await run_sync(_page, store, f"project:{project_id}", _position(None, after), before, limit, types,
                              observer, project_id=project_id)
    position = _position(last_event_id, after)
    return _response(request, _Stream(store, f"project:{project_id}", None, types, no_drafts=observer,
                                      project_id=project_id), position)
