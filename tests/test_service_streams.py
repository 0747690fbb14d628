"""Event streams of the HTTP service, as a browser's EventSource and an agent UI use them.

Every story runs a real service (uvicorn in a subprocess, tests/service_fixtures.py)
on both stacks: embedded (SQLite, blob directory, the SQLite coordinator file) and
real (PostgreSQL, S3, Redis). Stories about a lost buffer start a Redis server of
their own (``PrivateRedis``: flushed or killed with ``kill -9`` without touching the
shared one) and point the service's coordinator at it.

The client is written here: HTTP/1.1 over a raw socket (h11 does the framing only)
and an event-stream parser that follows the WHATWG rules ("interpreting an event
stream", HTML §9.2.6): lines end in CRLF, LF or CR; a blank line dispatches; an
event without ``id:`` keeps the last event id; a block with no ``data:`` dispatches
nothing but still sets the last event id; comments start with ``:``. What a browser
would send as ``Last-Event-ID`` when it reconnects is ``EventSource.last_event_id``.

tests/test_service_processes.py imports the client from here.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import collections
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import h11
import httpx
import pytest
import sqlalchemy as sa

from service_fixtures import Service, free_port
from services import PrivateRedis

TURN_END = {"turn.completed", "turn.interrupted", "turn.failed", "turn.rolled_back"}
DURABLE = {"turn.started", "tool.started", "tool.awaiting_approval", "tool.approved", "tool.denied",
           "tool.completed", "tool.failed"} | TURN_END
SSE_ID = re.compile(r"^([0-9a-f]{16}|-):(\d+)$")


@pytest.fixture
def service(shared_service_per_test: Service) -> Service:
    """One service per flavour for this module's tests (``shared_service``): each test makes its
    own projects and tokens and looks only at those. Tests that change the service's settings,
    lose its Redis buffer or count its resources start their own (``service_factory``)."""
    return shared_service_per_test


# == the client: an EventSource over a raw socket ===========================================
@dataclass(frozen=True)
class SseEvent:
    """One dispatched event: its type, data, and the source's last event id when it was dispatched."""

    type: str
    data: str
    last_event_id: str

    @property
    def json(self) -> Any:
        return json.loads(self.data)

    @property
    def epoch(self) -> str:
        return self.last_event_id.rpartition(":")[0]

    @property
    def n(self) -> int:
        return int(self.last_event_id.rpartition(":")[2])

    @property
    def key(self) -> tuple[str, Any]:
        """(type, tool call seq or None): what identifies a durable event of a turn."""
        data = self.json
        return self.type, data.get("seq") if isinstance(data, dict) else None


@dataclass(frozen=True)
class SseComment:
    text: str


class EventStreamParser:
    """The WHATWG event-stream interpretation, fed bytes as they arrive (any split)."""

    _EOL = re.compile(r"\r\n|\r|\n")

    def __init__(self, last_event_id: str = "") -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""
        self._started = False
        self.last_event_id = last_event_id  # the EventSource's "last event ID string" (kept across reconnects)
        self._id_buffer = last_event_id  # kept across events: an event without id: keeps the previous one
        self._type = ""
        self._data: list[str] = []
        self.retry_ms: int | None = None

    def feed(self, chunk: bytes, final: bool = False) -> list[SseEvent | SseComment]:
        self._text += self._decoder.decode(chunk, final)
        if not self._started and self._text:
            self._started = True
            self._text = self._text.removeprefix("\ufeff")
        out: list[SseEvent | SseComment] = []
        pos = 0
        for m in self._EOL.finditer(self._text):
            if m.group() == "\r" and m.end() == len(self._text) and not final:
                break  # a CR ending this chunk may be the first half of a CRLF
            out += self._line(self._text[pos:m.start()])
            pos = m.end()
        # at the end of the stream an unterminated line and an undispatched event are discarded
        self._text = "" if final else self._text[pos:]
        return out

    def _line(self, line: str) -> list[SseEvent | SseComment]:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return [SseComment(line[1:])]
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._type = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            if "\0" not in value:
                self._id_buffer = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                self.retry_ms = int(value)
        return []

    def _dispatch(self) -> list[SseEvent | SseComment]:
        self.last_event_id = self._id_buffer
        if not self._data:
            self._type = ""
            return []
        event = SseEvent(self._type or "message", "\n".join(self._data), self.last_event_id)
        self._type, self._data = "", []
        return [event]


class EventSource:
    """One connection: sends what a browser's EventSource sends, parses what comes back.

    ``status`` and ``headers`` (lower-case names) are the response's; ``body`` is
    the parsed JSON of a non-200 answer. ``raw`` is every body byte received (chunked
    framing removed). ``ended``: the server ended the response; ``aborted``: the
    connection broke mid-response.
    """

    def __init__(self, base_url: str, path: str, *, token: str | None = None, last_event_id: str | None = None,
                 accept: str = "text/event-stream", timeout: float = 15.0) -> None:
        url = urlsplit(base_url)
        self.sock = socket.create_connection((url.hostname, url.port), timeout=timeout)
        self.conn = h11.Connection(h11.CLIENT)
        headers = [("Host", url.netloc), ("Accept", accept), ("Cache-Control", "no-cache")]
        if token:
            headers.append(("Authorization", f"Bearer {token}"))
        if last_event_id:
            headers.append(("Last-Event-ID", last_event_id.encode("latin-1")))  # as bytes: any octet may come
        self.sock.sendall(self.conn.send(h11.Request(method="GET", target=path, headers=headers))
                          + self.conn.send(h11.EndOfMessage()))
        self.parser = EventStreamParser(last_event_id or "")
        self.pending: collections.deque[SseEvent | SseComment] = collections.deque()
        self.events: list[SseEvent] = []
        self.comments: list[SseComment] = []
        self.raw = bytearray()
        self.ended = self.aborted = False
        deadline = time.monotonic() + timeout
        response = self._h11_event(deadline)
        assert isinstance(response, h11.Response), response
        self.status = response.status_code
        self.headers = {k.decode().lower(): v.decode() for k, v in response.headers}
        self.body: Any = None
        if self.status != 200:
            while not self.ended:
                self._receive(deadline)
            self.body = json.loads(bytes(self.raw)) if self.raw else None

    @property
    def last_event_id(self) -> str:
        return self.parser.last_event_id

    def _h11_event(self, deadline: float) -> Any:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                raise TimeoutError from None
            except ConnectionError:
                data = b""
            self.conn.receive_data(data)

    def _receive(self, deadline: float) -> None:
        try:
            event = self._h11_event(deadline)
        except h11.RemoteProtocolError:  # the connection closed inside the response
            self.pending.extend(self.parser.feed(b"", final=True))
            self.ended = self.aborted = True
            return
        if isinstance(event, h11.Data):
            self.raw += event.data
            self.pending.extend(self.parser.feed(bytes(event.data)))
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            self.pending.extend(self.parser.feed(b"", final=True))
            self.ended = True

    def next(self, timeout: float = 15.0) -> SseEvent | SseComment | None:
        """The next event or comment; None once the response has ended."""
        deadline = time.monotonic() + timeout
        while not self.pending:
            if self.ended:
                return None
            try:
                self._receive(deadline)
            except TimeoutError:
                raise AssertionError(f"nothing arrived within {timeout}s after "
                                     f"{[(e.type, e.last_event_id) for e in self.events[-5:]]}") from None
        item = self.pending.popleft()
        (self.events if isinstance(item, SseEvent) else self.comments).append(item)  # type: ignore[arg-type]
        return item

    def next_event(self, timeout: float = 15.0) -> SseEvent | None:
        """The next event (comments are kept in ``comments``); None once the response has ended."""
        deadline = time.monotonic() + timeout
        while True:
            item = self.next(max(0.0, deadline - time.monotonic()))
            if not isinstance(item, SseComment):
                return item

    def poll(self, timeout: float) -> SseEvent | None:
        """The next event if one arrives within ``timeout`` (or is buffered), else None."""
        deadline = time.monotonic() + timeout
        while True:
            while not self.pending and not self.ended:
                try:
                    self._receive(deadline)
                except TimeoutError:
                    return None
            if not self.pending:
                return None
            item = self.next(0)
            if isinstance(item, SseEvent):
                return item

    def read_until(self, done: Callable[[SseEvent], bool], timeout: float = 15.0) -> list[SseEvent]:
        """Events up to and including the first one ``done`` accepts."""
        deadline = time.monotonic() + timeout
        out: list[SseEvent] = []
        while True:
            event = self.next_event(max(0.0, deadline - time.monotonic()))
            assert event is not None, f"the stream ended before the awaited event; got {[e.type for e in out]}"
            out.append(event)
            if done(event):
                return out

    def read_n(self, n: int, timeout: float = 15.0) -> list[SseEvent]:
        got: list[SseEvent] = []
        return self.read_until(lambda e: got.append(e) or len(got) >= n, timeout)

    def read_to_end(self, timeout: float = 15.0) -> list[SseEvent]:
        """Every event until the server ends the response."""
        deadline = time.monotonic() + timeout
        out: list[SseEvent] = []
        while (event := self.next_event(max(0.0, deadline - time.monotonic()))) is not None:
            out.append(event)
        return out

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "EventSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def sse(svc: Service, path: str, token: str | None = "admin", **kwargs: Any) -> EventSource:
    return EventSource(svc.url, path, token=svc.admin if token == "admin" else token, **kwargs)


# == helpers: the API as an agent calls it ====================================================
def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def new_project(c: httpx.Client, name: str = "streams") -> str:
    r = c.post("/v1/projects", json={"name": f"{name}-{secrets.token_hex(3)}", "files": {"main.py": b64("print(1)\n")},
                                     "characters": {}, "world_settings": {}})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def start_turn(c: httpx.Client, project_id: str, message: str = "work", *, cont: bool = False) -> str:
    r = c.post(f"/v1/projects/{project_id}/turns", json={"user_message": message, "continue": cont})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def tool_call(c: httpx.Client, turn_id: str, name: str = "view_file", *, finish: bool = True) -> int:
    r = c.post(f"/v1/turns/{turn_id}/tool-calls", json={"tool_name": name, "args": {"path": "main.py"}})
    assert r.status_code == 201, r.text
    seq = r.json()["seq"]
    if finish:
        r = c.post(f"/v1/turns/{turn_id}/tool-calls/{seq}/complete", json={"result": {"ok": seq}})
        assert r.status_code == 204, r.text
    return seq


def delta(c: httpx.Client, turn_id: str, text: str) -> None:
    r = c.post(f"/v1/turns/{turn_id}/deltas", json={"text": text})
    assert r.status_code == 204, r.text


def complete(c: httpx.Client, turn_id: str) -> None:
    r = c.post(f"/v1/turns/{turn_id}/complete", json={"assistant_message": "done"})
    assert r.status_code == 200, r.text


def created(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 201, (r.status_code, r.text)
    return r.json()


def without_at(data: dict[str, Any]) -> dict[str, Any]:
    """An event's data but a head move's time (compared on its own)."""
    return {k: v for k, v in data.items() if k != "at"}


def page(c: httpx.Client, path: str, **params: Any) -> dict[str, Any]:
    r = c.get(path, params=params, headers={"accept": "application/json"})
    assert r.status_code == 200, r.text
    return r.json()


def buffered(c: httpx.Client, turn_id: str) -> list[dict[str, Any]]:
    """The turn's whole buffer, through the service's JSON page mode."""
    out: list[dict[str, Any]] = []
    while True:
        got = page(c, f"/v1/turns/{turn_id}/events", after=int(out[-1]["id"].rpartition(":")[2]) if out else 0,
                   limit=1000)
        out += got["events"]
        if not got["has_more_after"]:
            return out


def wait_buffered(c: httpx.Client, turn_id: str, done: Callable[[list[dict[str, Any]]], bool],
                  timeout: float = 15.0) -> list[dict[str, Any]]:
    """Poll the buffer until ``done(events)``: the service appends events off the request's path."""
    deadline = time.monotonic() + timeout
    while not done(events := buffered(c, turn_id)):
        assert time.monotonic() < deadline, f"the buffer never got there: {[e['type'] for e in events]}"
        time.sleep(0.02)
    return events


def ends_with(type_: str) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda events: bool(events) and events[-1]["type"] == type_


def keys(events: list[Any]) -> list[tuple[str, Any]]:
    """(type, seq) of SSE events or of JSON page events."""
    if events and isinstance(events[0], dict):
        return [(e["type"], e["data"].get("seq")) for e in events]
    return [e.key for e in events]


def durable_keys(svc: Service, turn_id: str) -> list[tuple[str, Any]]:
    return [(t, d.get("seq")) for t, d in svc.store.durable_events(turn_id)]


def assert_ids_increase(events: list[SseEvent]) -> None:
    for e in events:
        assert SSE_ID.match(e.last_event_id), e
    ns = [e.n for e in events]
    assert ns == sorted(set(ns)), f"ids do not strictly increase: {ns}"


# == the wire format =========================================================================
def test_the_wire_format_is_what_a_browsers_eventsource_reads(service: Service):
    c = service.client()
    p = new_project(c)
    t = start_turn(c, p)
    seq = tool_call(c, t, finish=False)
    delta(c, t, "Once upon\na time")  # a newline inside the data must not break the framing
    wait_buffered(c, t, lambda ev: len(ev) == 3)

    with sse(service, f"/v1/turns/{t}/events") as es:
        assert es.status == 200
        assert es.headers["content-type"].split(";")[0] == "text/event-stream"
        assert es.headers["cache-control"] == "no-store" and es.headers["x-accel-buffering"] == "no"
        assert "content-length" not in es.headers and es.headers.get("transfer-encoding") == "chunked"
        history = es.read_n(3)
        # live: an event reaches the open stream at once, not when the response ends
        sent = time.monotonic()
        r = c.post(f"/v1/turns/{t}/tool-calls/{seq}/complete", json={"result": "read"})
        assert r.status_code == 204
        live = es.read_n(1, timeout=5)
        assert time.monotonic() - sent < 3 and not es.ended
        complete(c, t)
        rest = es.read_to_end()
        assert es.ended and not es.aborted  # the server closes the response after stream.end

    events = history + live + rest
    assert [e.type for e in events] == ["turn.started", "tool.started", "assistant.delta", "tool.completed",
                                        "turn.completed", "stream.end"]
    assert events[0].json == {"turn_id": t, "project_id": p}
    assert events[2].json == {"turn_id": t, "text": "Once upon\na time"}
    assert all(e.json["turn_id"] == t for e in events[:-1]) and events[-1].json == {}
    assert_ids_increase(events[:-1])
    assert [e.n for e in events[:-1]] == [1, 2, 3, 4, 5] and len({e.epoch for e in events[:-1]}) == 1
    assert events[-1].last_event_id == events[-2].last_event_id  # stream.end has no id of its own

    # the bytes themselves: blocks of "field: value" lines, each block ended by a blank line
    text = es.raw.decode()
    assert text.endswith("\r\n\r\n")
    blocks = [b for b in re.split(r"\r\n\r\n", text) if b]
    assert len(blocks) == len(events)
    for block, event in zip(blocks, events):
        lines = block.split("\r\n")
        assert all(re.match(r"^(id|event|data): |^:", line) for line in lines), lines
        assert [ln for ln in lines if ln.startswith("event: ")] == [f"event: {event.type}"]
        assert len([ln for ln in lines if ln.startswith("data: ")]) == 1


def test_an_eventsource_which_cannot_send_headers_authenticates_with_access_token(service: Service):
    """A browser's EventSource sends no Authorization header: the event streams (and they alone)
    take the token as ``?access_token=``, with the same roles and scopes as the header."""
    c = service.client()
    p = new_project(c)
    t = start_turn(c, p)
    wait_buffered(c, t, lambda ev: len(ev) == 1)
    agent, observer = service.token("agent", p), service.token("observer", p)
    with sse(service, f"/v1/turns/{t}/events?access_token={agent}", token=None) as es:
        assert es.status == 200 and es.read_n(1)[0].type == "turn.started"
    with sse(service, f"/v1/projects/{p}/events?access_token={observer}", token=None) as es:
        assert es.status == 200
    for path, status, code in ((f"/v1/turns/{t}/events?access_token={observer}", 403, "auth.forbidden"),
                               (f"/v1/turns/{t}/events?access_token=dst_nope", 401, "auth.invalid"),
                               (f"/v1/turns/{t}/events", 401, "auth.required")):
        with sse(service, path, token=None) as es:
            assert (es.status, es.body["code"]) == (status, code), path
    other = service.token("agent", new_project(c, "other"))
    with sse(service, f"/v1/projects/{p}/events?access_token={other}", token=None) as es:
        assert (es.status, es.body["code"]) == (404, "project.not_found")
    # any other route: the header or nothing
    r = httpx.get(f"{service.url}/v1/projects/{p}", params={"access_token": agent})
    assert (r.status_code, r.json()["code"]) == (401, "auth.required")
    for path in ("view/files/docs/events", "view/stat/docs/events"):  # a file named like the route: no
        r = httpx.get(f"{service.url}/v1/projects/{p}/{path}", params={"access_token": agent})
        assert (r.status_code, r.json()["code"]) == (401, "auth.required"), path


@pytest.mark.parametrize("path,root,method,taken", [
    ("/v1/turns/t1/events", "", "GET", True),
    ("/v1/projects/p1/events", "", "GET", True),
    ("/v1/turns/t1/events", "/api", "GET", True),  # served under a root path (a proxy's prefix)
    ("/v1/turns/t1/events", "", "POST", False),
    ("/v1/projects/p1/view/files/v1/projects/x/events", "", "GET", False),  # a file path, not the route
    ("/v1/projects/p1/view/files/docs/events", "", "GET", False),
    ("/api/v1/projects/p1/events", "", "GET", False),  # a prefix the app was not told of
    ("/v1/projects/p1/events/x", "", "GET", False),
])
def test_access_token_is_read_on_the_event_routes_alone(path: str, root: str, method: str, taken: bool):
    from starlette.requests import Request

    from draftstore.service.auth import credential

    scope = {"type": "http", "method": method, "path": root + path, "root_path": root,
             "query_string": b"access_token=dst_x", "headers": []}
    assert credential(Request(scope)) == ("Bearer dst_x" if taken else None)
    with_header = {**scope, "headers": [(b"authorization", b"Bearer dst_header")]}
    assert credential(Request(with_header)) == "Bearer dst_header"  # the header always wins


def test_the_parser_follows_the_whatwg_rules_on_any_split_of_the_bytes():
    stream = ("\ufeff: hello\r\nid: a:1\r\nevent: one\r\ndata: x\r\n\r\n"  # BOM, comment, CRLF
              "data: y\ndata: z\n\n"  # no id: keeps a:1; two data lines join with LF
              "id: a:2\r\rdata:w\r\r"  # an id-only block dispatches nothing but sets the id; CR endings; no space
              "id\rdata: v\r\r"  # an empty id resets it
              "retry: 10\nid: bad\0id\nevent: two\ndata\n\n"  # an id with NUL is ignored; "data" alone is ""
              "data: never dispatched")  # the stream ends mid-event
    encoded = stream.encode()
    expected = [SseComment(" hello"), SseEvent("one", "x", "a:1"), SseEvent("message", "y\nz", "a:1"),
                SseEvent("message", "w", "a:2"), SseEvent("message", "v", ""), SseEvent("two", "", "")]
    for size in (1, 2, 3, 7, len(encoded)):
        parser = EventStreamParser()
        got: list[Any] = []
        for i in range(0, len(encoded), size):
            got += parser.feed(encoded[i:i + size])
        got += parser.feed(b"", final=True)
        assert got == expected, size
        assert parser.retry_ms == 10 and parser.last_event_id == ""


# == replay: nothing lost, nothing twice =====================================================
def test_a_client_that_keeps_reconnecting_with_last_event_id_misses_nothing_and_sees_nothing_twice(
        service: Service):
    c = service.client()
    p = new_project(c)
    t = start_turn(c, p)
    wait_buffered(c, t, ends_with("turn.started"))
    calls, sent_deltas, errors = 24, [], []
    writer_done = threading.Event()

    def writer() -> None:
        # odd calls through the service's HTTP API, even ones through the library on the same stack
        # (another process appending to the same buffer), with assistant text in between
        http = service.client()
        try:
            for i in range(1, calls + 1):
                if i % 2:
                    tool_call(http, t, f"http_{i}")
                    sent_deltas.append(f"text {i};")
                    delta(http, t, sent_deltas[-1])
                else:
                    call = service.store.tool_started(t, f"lib_{i}", {"i": i})
                    service.store.tool_completed(t, call.seq, {"i": i})
                time.sleep(0.03)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            writer_done.set()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    got: list[SseEvent] = []
    last_id: str | None = None
    mid_stream = connections = 0
    deadline = time.monotonic() + 45
    while connections < 4 or not writer_done.is_set():
        assert time.monotonic() < deadline, "the writer never finished"
        writing = not writer_done.is_set()
        with sse(service, f"/v1/turns/{t}/events", last_event_id=last_id) as es:
            connections += 1
            mid_stream += writing
            assert es.status == 200
            for _ in range(3 + connections % 4):  # a few events, then drop the connection
                if (item := es.poll(timeout=1.0)) is None:
                    break
                if got:
                    assert item.n == got[-1].n + 1, "a reconnect must continue right after the last event"
                got.append(item)
            last_id = es.last_event_id or last_id
        time.sleep(0.15)  # disconnected while the writer goes on
    thread.join(timeout=60)
    assert not errors, errors
    assert mid_stream >= 3, "the client should have reconnected several times while events were produced"
    service.store.events(f"turn:{t}", limit=1)  # the library's own events are in the buffer (flushed)
    complete(c, t)
    with sse(service, f"/v1/turns/{t}/events", last_event_id=got[-1].last_event_id) as es:
        rest = es.read_to_end(timeout=30)
    assert rest[-1].type == "stream.end"
    got += rest[:-1]

    assert "stream.rebuilt" not in [e.type for e in got]
    assert_ids_increase(got)
    assert [e.n for e in got] == list(range(1, len(got) + 1)) and len({e.epoch for e in got}) == 1
    assert keys(got) == keys(buffered(c, t))  # exactly the turn's history, in order
    assert collections.Counter(k for k in keys(got) if k[0] in DURABLE) == collections.Counter(durable_keys(service, t))
    assert [e.json["text"] for e in got if e.type == "assistant.delta"] == sent_deltas
    for seq in range(1, calls + 1):  # each call's steps in order, whichever process recorded it
        assert keys(got).index(("tool.started", seq)) < keys(got).index(("tool.completed", seq))
    assert got[-1].type == "turn.completed"


def test_after_works_like_last_event_id_and_a_malformed_id_is_refused(service: Service):
    c = service.client()
    p = new_project(c)
    t = start_turn(c, p)
    for _ in range(3):
        tool_call(c, t)
    history = wait_buffered(c, t, lambda ev: len(ev) == 7)
    epoch = history[0]["id"].rpartition(":")[0]

    with sse(service, f"/v1/turns/{t}/events?after=3") as by_query, \
            sse(service, f"/v1/turns/{t}/events", last_event_id=f"{epoch}:3") as by_header:
        for es in (by_query, by_header):
            got = es.read_n(4)
            assert [e.last_event_id for e in got] == [e["id"] for e in history[3:]]
            assert keys(got) == keys(history[3:])
            assert es.poll(timeout=0.5) is None  # and then nothing until something happens
        tool_call(c, t)
        for es in (by_query, by_header):  # live events follow the replay
            assert keys(es.read_n(2)) == [("tool.started", 4), ("tool.completed", 4)]

    for bad in ("nonsense", f"{epoch}:", ":5", f"{epoch}:-1", f"{epoch}:1.5", f"{epoch}:x", "x" * 200 + ":1",
                f"{epoch}:\u00b2", f"{epoch}:1\u00b9"):  # digits to str.isdigit, not to int()
        with sse(service, f"/v1/turns/{t}/events", last_event_id=bad) as es:
            assert es.status == 422, bad
            assert es.body["code"] == "input.invalid" and es.body["details"]["field"] == "Last-Event-ID"
    for bad in ("-1", "abc"):
        r = c.get(f"/v1/turns/{t}/events", params={"after": bad})
        assert r.status_code == 422 and r.json()["code"] == "input.invalid"

    # an id this buffer never sent (an older incarnation's, or past its end): the stream is rebuilt
    for stale in (f"{'0' * 16}:3", f"{epoch}:999"):
        with sse(service, f"/v1/turns/{t}/events", last_event_id=stale) as es:
            got = es.read_n(1 + len(durable_keys(service, t)))
            assert got[0].type == "stream.rebuilt" and got[0].last_event_id == stale
            assert keys(got[1:]) == durable_keys(service, t)
            assert got[-1].last_event_id == history[-1]["id"].rpartition(":")[0] + f":{got[-1].n}"
            assert got[-1].n >= 9  # rebuilt up to the buffer's end: live events continue from there
            assert es.poll(timeout=0.5) is None


def test_a_turns_stream_ends_after_its_end_event_and_a_late_subscriber_gets_the_whole_history(
        service: Service):
    c = service.client()
    p = new_project(c)
    t = start_turn(c, p)
    wait_buffered(c, t, ends_with("turn.started"))
    with sse(service, f"/v1/turns/{t}/events") as live:
        tool_call(c, t)
        delta(c, t, "done soon")
        complete(c, t)
        first = live.read_to_end()
        assert live.ended and not live.aborted
    assert [e.type for e in first] == ["turn.started", "tool.started", "tool.completed", "assistant.delta",
                                       "turn.completed", "stream.end"]

    with sse(service, f"/v1/turns/{t}/events") as late:  # the turn has ended: its history, from the buffer
        again = late.read_to_end()
    assert [(e.type, e.data, e.last_event_id) for e in again] == [(e.type, e.data, e.last_event_id) for e in first]

    # a client that lost the connection after the end event but before stream.end comes back:
    # it is told the stream is over (promptly), and gets nothing twice
    started = time.monotonic()
    with sse(service, f"/v1/turns/{t}/events", last_event_id=first[-2].last_event_id) as back:
        assert [e.type for e in back.read_to_end(timeout=10)] == ["stream.end"]
    assert time.monotonic() - started < 5


def test_after_the_buffers_ttl_a_new_subscriber_gets_the_history_rebuilt_from_the_database(service_factory):
    svc = service_factory(env={"DRAFTSTORE_EVENT_TTL_S": "1"})
    c = svc.client()
    p = new_project(c)
    t = start_turn(c, p)
    tool_call(c, t)
    delta(c, t, "text is not durable")
    seq = tool_call(c, t, finish=False)
    assert c.post(f"/v1/turns/{t}/tool-calls/{seq}/fail", json={"error": "boom"}).status_code == 204
    complete(c, t)
    before = wait_buffered(c, t, ends_with("turn.completed"))
    deadline = time.monotonic() + 20
    while buffered(c, t):  # the buffer expires a second after the turn ended
        assert time.monotonic() < deadline, "the ended turn's buffer never expired"
        time.sleep(0.2)

    expected = [("turn.started", None), ("tool.started", 1), ("tool.completed", 1), ("tool.started", 2),
                ("tool.failed", 2), ("turn.completed", None)]
    assert durable_keys(svc, t) == expected
    assert [k for k in keys(before) if k[0] != "assistant.delta"] == expected
    shown = page(c, f"/v1/turns/{t}/events")  # the JSON page too: rebuilt, and says so
    assert keys(shown["events"]) == expected and shown["rebuilt"]["deltas_missing"] is True
    for last_id in (None, before[3]["id"], before[-1]["id"]):  # a new client, one half-way, one at the end
        with sse(svc, f"/v1/turns/{t}/events", last_event_id=last_id) as es:
            got = es.read_to_end()
        assert got[0].type == "stream.rebuilt" and got[0].json["deltas_missing"] is True
        assert keys(got[1:-1]) == expected and got[-1].type == "stream.end"
        assert got[-2].json == {"turn_id": t, "end_root": c.get(f"/v1/turns/{t}").json()["end_root"],
                                "end_reason": "completed"}


def test_approvals_are_part_of_the_rebuilt_history(service: Service):
    c = service.client()
    p = new_project(c)
    t = start_turn(c, p)
    for approved in (True, False):
        r = c.post(f"/v1/turns/{t}/tool-calls", json={"tool_name": "rm", "needs_approval": True})
        assert r.status_code == 201, r.text
        seq = r.json()["seq"]
        r = c.post(f"/v1/turns/{t}/tool-calls/{seq}/approval", json={"approved": approved, "reason": "asked"})
        assert r.status_code == 200, r.text
    assert c.post(f"/v1/turns/{t}/tool-calls/1/complete", json={"result": 1}).status_code == 204
    complete(c, t)
    live = wait_buffered(c, t, ends_with("turn.completed"))
    expected = [("turn.started", None), ("tool.awaiting_approval", 1), ("tool.approved", 1),
                ("tool.awaiting_approval", 2), ("tool.denied", 2), ("tool.completed", 1), ("turn.completed", None)]
    assert keys(live) == expected
    with sse(service, f"/v1/turns/{t}/events", last_event_id=f"{'0' * 16}:3") as es:  # another buffer's id
        got = es.read_to_end()
    assert got[0].type == "stream.rebuilt" and got[-1].type == "stream.end"
    # rebuilt per call, in seq order: the same events (the order between calls may differ)
    assert sorted(keys(got[1:-1]), key=str) == sorted(expected, key=str)
    assert keys(got[1:-1])[:4] == [("turn.started", None), ("tool.awaiting_approval", 1), ("tool.approved", 1),
                                   ("tool.completed", 1)]


def test_a_client_subscribing_the_moment_a_turn_starts_gets_its_history_once_and_no_false_rebuild(
        service: Service):
    # the subscriber connects as soon as POST .../turns answers, fifty times: the buffer is there and
    # whole by then (turn.started is appended before the answer), so nothing is "rebuilt" although
    # nothing was lost, and reconnecting with the last id it got repeats nothing. Ten agents on ten
    # projects at once, five turns each: a stream ends only AFTER_END_S after its turn (and a
    # reconnect after END_GRACE_S), waits that would otherwise add up turn after turn
    agents, turns_each = 10, 5

    def agent(n: int) -> None:
        c = service.client()
        p = new_project(c, f"moment-{n}")
        for i in range(turns_each):
            t = start_turn(c, p, cont=i > 0)
            with sse(service, f"/v1/turns/{t}/events") as es:
                first = es.read_n(1)[0]
                assert first.type == "turn.started" and first.n == 1, (n, i, first)
                tool_call(c, t)
                complete(c, t)
                got = [first] + es.read_to_end()
            assert [e.type for e in got].count("stream.rebuilt") == 0, (n, i, [e.type for e in got])
            assert keys(got) == [("turn.started", None), ("tool.started", 1), ("tool.completed", 1),
                                 ("turn.completed", None), ("stream.end", None)], (n, i)
            assert_ids_increase(got[:-1])
            with sse(service, f"/v1/turns/{t}/events", last_event_id=got[-2].last_event_id) as back:
                assert [e.type for e in back.read_to_end()] == ["stream.end"], (n, i)

    with ThreadPoolExecutor(agents) as pool:
        for done in [pool.submit(agent, n) for n in range(agents)]:
            done.result()  # an agent's failed assertion fails the test


def test_a_client_back_with_the_id_of_a_history_rebuilt_before_its_buffer_existed_gets_nothing_twice(
        service_factory, private_redis: PrivateRedis):
    # a rebuild made while no buffer exists leaves the client the id "-:0"; the buffer created after
    # it may hold events the rebuild sent already (they are appended off their operation's path),
    # so a client back with that id gets the history rebuilt again, never an event of it twice
    svc = service_factory(env={"DRAFTSTORE_COORD_URL": private_redis.url('svc')})
    c = svc.client()
    p = new_project(c)
    t = start_turn(c, p)
    tool_call(c, t)
    wait_buffered(c, t, ends_with("tool.completed"))
    with private_redis.client() as r:
        r.flushall()
    with sse(svc, f"/v1/turns/{t}/events") as es:
        got = es.read_n(4)
    assert got[0].type == "stream.rebuilt" and got[-1].last_event_id == "-:0"
    seq = tool_call(c, t)  # its events create the buffer anew
    wait_buffered(c, t, ends_with("tool.completed"))
    with sse(svc, f"/v1/turns/{t}/events", last_event_id="-:0") as back:
        again = back.read_n(6)
        complete(c, t)
        rest = back.read_to_end()
    assert again[0].type == "stream.rebuilt"
    assert keys(again[1:]) == durable_keys(svc, t)[:5] == [
        ("turn.started", None), ("tool.started", 1), ("tool.completed", 1), ("tool.started", seq),
        ("tool.completed", seq)]
    assert keys(rest) == [("turn.completed", None), ("stream.end", None)]


# == keep-alive ==================================================================================
def test_an_idle_stream_gets_keep_alive_comments(service_factory):
    svc = service_factory(env={"DRAFTSTORE_SSE_KEEPALIVE_S": "0.3"})
    c = svc.client()
    p = new_project(c)
    t = start_turn(c, p)
    wait_buffered(c, t, ends_with("turn.started"))
    with sse(svc, f"/v1/turns/{t}/events") as es:
        assert es.read_n(1)[0].type == "turn.started"
        deadline = time.monotonic() + 10
        while len(es.comments) < 3:
            assert time.monotonic() < deadline, "no keep-alive comments on an idle stream"
            assert isinstance(es.next(timeout=5), SseComment)  # nothing but comments while idle
        tool_call(c, t)  # and the stream is alive after them
        assert keys(es.read_n(2)) == [("tool.started", 1), ("tool.completed", 1)]
    assert re.search(rb"(^|\r\n): [^\r\n]*\r\n\r\n", bytes(es.raw))  # a comment line on the wire


def test_a_keep_alive_interval_that_is_not_a_positive_number_stops_the_service_at_start(tmp_path):
    for bad in ("abc", "0", "-1", "nan"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTSTORE_")}
        env.update(DRAFTSTORE_SSE_KEEPALIVE_S=bad, DRAFTSTORE_HOME=str(tmp_path / "home"))
        proc = subprocess.run([sys.executable, "-m", "draftstore.cli", "serve", "--port", str(free_port())],
                              env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert proc.returncode == 4 and "DRAFTSTORE_SSE_KEEPALIVE_S" in proc.stderr, (bad, proc.stderr)


# == a lost buffer ================================================================================
@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.mark.parametrize("loss", ["flushall", "kill -9 and restart"])
def test_a_client_coming_back_after_the_buffer_was_lost_gets_the_durable_history_then_live_events(
        service_factory, private_redis: PrivateRedis, loss: str):
    svc = service_factory(env={"DRAFTSTORE_COORD_URL": private_redis.url('svc')})
    c = svc.client()
    p = new_project(c)
    t = start_turn(c, p)
    tool_call(c, t)
    delta(c, t, "text that only the buffer had")
    tool_call(c, t)
    wait_buffered(c, t, lambda ev: len(ev) == 6)
    with sse(svc, f"/v1/turns/{t}/events") as es:
        seen = es.read_n(6)
    last = seen[-1].last_event_id
    # a second client stays connected through the loss (it is streaming: it has just got the last event)
    watcher = sse(svc, f"/v1/turns/{t}/events", last_event_id=seen[-2].last_event_id)
    assert watcher.read_n(1)[0].last_event_id == last

    if loss == "flushall":
        with private_redis.client() as r:
            r.flushall()
    else:
        private_redis.kill()
        tool_call(c, t)  # the work goes on while the coordinator is down: this call's events reach no buffer
        private_redis.start()
    tool_call(c, t)  # after the loss: its events start a new buffer
    wait_buffered(c, t, ends_with("tool.completed"))
    calls = 3 if loss == "flushall" else 4
    expected = [("turn.started", None)] + [(k, s) for s in range(1, calls + 1) for k in ("tool.started",
                                                                                         "tool.completed")]
    assert durable_keys(svc, t) == expected

    with sse(svc, f"/v1/turns/{t}/events", last_event_id=last) as es:
        rebuilt = es.read_n(1 + len(expected))
        assert rebuilt[0].type == "stream.rebuilt"
        assert rebuilt[0].json["deltas_missing"] is True and rebuilt[0].json["reason"]
        assert keys(rebuilt[1:]) == expected
        # only the last rebuilt event carries an id (the new buffer's end): a client dropped half-way
        # through comes back with its old id and gets the whole rebuild again
        assert [e.last_event_id for e in rebuilt[:-1]] == [last] * (len(rebuilt) - 1)
        assert rebuilt[-1].epoch not in (seen[-1].epoch, "-")
        assert es.poll(timeout=0.5) is None  # the new buffer's events were part of the rebuild: not again

        seq = tool_call(c, t)
        delta(c, t, "new text")
        complete(c, t)
        live = es.read_to_end()
    assert keys(live) == [("tool.started", seq), ("tool.completed", seq), ("assistant.delta", None),
                          ("turn.completed", None), ("stream.end", None)]
    assert [e.n for e in live[:-1]] == list(range(rebuilt[-1].n + 1, rebuilt[-1].n + 5))
    assert {e.epoch for e in live[:-1]} == {rebuilt[-1].epoch}

    # the client that stayed connected (through the coordinator's outage, too) is told of the loss
    # on its open stream and ends up with the same durable history and live events
    with watcher:
        got = watcher.read_to_end(timeout=30)
    assert watcher.ended and not watcher.aborted and got[-1].type == "stream.end"
    assert [e.type for e in got].count("stream.rebuilt") == 1, [e.type for e in got]
    marker = [e.type for e in got].index("stream.rebuilt")
    assert got[marker].json["reason"] == "the buffer was lost while streaming"
    assert [k for k in keys(got[marker + 1:]) if k[0] in DURABLE] == durable_keys(svc, t)
    assert [e.json["text"] for e in got[marker + 1:] if e.type == "assistant.delta"] in (["new text"], [])


# == many idle subscribers ===========================================================================
def test_a_projects_stream_and_an_after_id_are_rebuilt_from_the_database_after_the_buffer_was_lost(
        service_factory, private_redis: PrivateRedis):
    """A project's subscriber that lost its buffer gets its committed events rebuilt (publishes,
    rollbacks, discarded drafts; an observer, without the drafts), then live ones; ``?after=`` with
    the id it last got is read as ``Last-Event-ID`` is, for turns too (the loss is told, not hidden)."""
    svc = service_factory(env={"DRAFTSTORE_COORD_URL": private_redis.url('svc')})
    c = svc.client()
    p = new_project(c)
    v1 = c.get(f"/v1/projects/{p}").json()["current_version_id"]
    observer = svc.token("observer", p)
    t = start_turn(c, p)
    assert c.put(f"/v1/turns/{t}/files/dragon.py", content=b"DRAGON = 1\n").status_code == 204
    complete(c, t)
    v2 = created(c.post(f"/v1/projects/{p}/publish", json={"summary": "dragon"}))["id"]
    start_turn(c, p)
    draft = c.post(f"/v1/projects/{p}/discard").json()["id"]
    deadline = time.monotonic() + 10
    while len(page(c, f"/v1/projects/{p}/events", after=0, limit=1000)["events"]) < 2:
        assert time.monotonic() < deadline, "the project's committed events never reached its buffer"
        time.sleep(0.02)
    with sse(svc, f"/v1/projects/{p}/events?after=0") as es:
        before = es.read_n(2)
    assert [e.type for e in before] == ["version.published", "draft.discarded"]
    turn_last = buffered(c, t)[-1]["id"]  # the turn's last event id, as a JSON page gives it

    with private_redis.client() as r:
        r.flushall()
    assert c.post(f"/v1/projects/{p}/rollback", json={"version_id": v1}).status_code == 200
    expected = [("version.published", {"version_id": v2, "number": 2}), ("draft.discarded", {"draft_id": draft}),
                ("head.moved", {"to_version_id": v1})]
    history = list(expected)  # every committed event so far, as the database holds them
    live_at: dict[int, str] = {}  # the n-th head move's time, as its live event gave it
    for token in (svc.admin, observer):
        for how in ({"last_event_id": before[-1].last_event_id}, {}):
            want = [x for x in history if token != observer or x[0] != "draft.discarded"]
            path = f"/v1/projects/{p}/events" + ("" if how else f"?after={before[-1].last_event_id}")
            with sse(svc, path, token=token, **how) as es:
                got = es.read_n(1 + len(want))
                assert got[0].type == "stream.rebuilt" and got[0].json["deltas_missing"] is False
                assert [(e.type, without_at(e.json)) for e in got[1:]] == want, (token == observer, how)
                # a head move is told apart by its time: the rebuild gives the time the live event gave
                assert all(e.json["at"] == live_at[i] for i, e in enumerate(m for m in got if m.type == "head.moved")
                           if i in live_at)
                assert es.poll(timeout=0.5) is None  # the rollback's own buffered copy is not sent twice
                assert c.post(f"/v1/projects/{p}/rollback", json={"version_id": v2}).status_code == 200
                moved = es.next_event()  # a new move to a version the rebuild named already: news all the same
                assert (moved.type, without_at(moved.json)) == ("head.moved", {"to_version_id": v2})
                live_at[sum(1 for x in history if x[0] == "head.moved")] = moved.json["at"]
            assert c.post(f"/v1/projects/{p}/rollback", json={"version_id": v1}).status_code == 200
            history += [("head.moved", {"to_version_id": v2}), ("head.moved", {"to_version_id": v1})]

    # a turn: ?after= with the id of a buffer that is gone is a rebuild, as Last-Event-ID is
    with sse(svc, f"/v1/turns/{t}/events?after={turn_last}") as es:
        got = es.read_to_end()
    assert got[0].type == "stream.rebuilt" and keys(got[1:-1]) == durable_keys(svc, t)
    # and the JSON page, given an id of a lost buffer, is rebuilt as the stream is: the committed
    # events from the database, then the buffer's from where the rebuild left it
    shown = page(c, f"/v1/projects/{p}/events", after=before[-1].last_event_id)
    assert shown["rebuilt"]["reason"] and shown["rebuilt"]["deltas_missing"] is False
    assert [(e["type"], without_at(e["data"])) for e in shown["events"]] == history
    assert all(e["id"] is None for e in shown["events"]) and shown["epoch"] != before[-1].epoch
    assert page(c, f"/v1/projects/{p}/events", after=shown["next_after"])["events"] == []
    for bad in (":3", "1:x", "-1", "9" * 30, "x" * 101):
        r = c.get(f"/v1/turns/{t}/events", params={"after": bad})
        assert r.status_code == 422 and r.json()["code"] == "input.invalid", bad


def test_the_json_page_of_a_turn_whose_buffer_was_flushed_lists_its_committed_events_rebuilt(
        service_factory, private_redis: PrivateRedis):
    """The JSON page mode reads what SSE reads: once the buffer is lost, the turn's committed
    events from the database, marked ``rebuilt`` as the stream's ``stream.rebuilt`` is."""
    svc = service_factory(env={"DRAFTSTORE_COORD_URL": private_redis.url('svc')})
    c = svc.client()
    p = new_project(c)
    t = start_turn(c, p)
    tool_call(c, t)
    delta(c, t, "text only the buffer had")
    seq = tool_call(c, t, finish=False)
    assert c.post(f"/v1/turns/{t}/tool-calls/{seq}/fail", json={"error": "boom"}).status_code == 204
    before = wait_buffered(c, t, ends_with("tool.failed"))
    assert page(c, f"/v1/turns/{t}/events")["rebuilt"] is None  # a whole buffer: read as it is
    with private_redis.client() as r:
        r.flushall()

    expected = [("turn.started", None), ("tool.started", 1), ("tool.completed", 1), ("tool.started", 2),
                ("tool.failed", 2)]
    for after in ({}, {"after": before[-1]["id"]}):  # a new reader, and one that had read it all
        got = page(c, f"/v1/turns/{t}/events", **after)
        assert got["rebuilt"]["deltas_missing"] is True and got["rebuilt"]["reason"], after
        assert keys(got["events"]) == expected and all(e["id"] is None for e in got["events"])
        assert got["epoch"] is None and got["next_after"] == "-:0" and got["has_more_after"] is False
    # the turn goes on: its next page holds what came after, once
    complete(c, t)
    wait_buffered(c, t, ends_with("turn.completed"))
    nxt = page(c, f"/v1/turns/{t}/events", after=got["next_after"])
    assert nxt["rebuilt"]["reason"] == "the buffer was created after this client's rebuilt history"
    assert keys(nxt["events"]) == expected + [("turn.completed", None)]
    last = page(c, f"/v1/turns/{t}/events", after=nxt["next_after"])
    assert (last["events"], last["rebuilt"], last["has_more_after"]) == ([], None, False)
    # a page is at most 1000 events, as Store.events reads (tests/test_events.py)
    r = c.get(f"/v1/turns/{t}/events", params={"limit": 1001}, headers={"accept": "application/json"})
    assert (r.status_code, r.json()["code"]) == (422, "input.invalid")


def test_a_fresh_subscriber_to_a_turn_whose_buffer_was_recreated_gets_the_rebuilt_history(
        service_factory, private_redis: PrivateRedis):
    """A buffer created anew after a loss also starts at id 1, but not at the turn's start: a
    client with no Last-Event-ID is sent the rebuilt history, not the new buffer's tail alone."""
    svc = service_factory(env={"DRAFTSTORE_COORD_URL": private_redis.url('svc')})
    c = svc.client()
    p = new_project(c)
    t = start_turn(c, p)
    tool_call(c, t)
    wait_buffered(c, t, ends_with("tool.completed"))
    with private_redis.client() as r:
        r.flushall()
    tool_call(c, t)
    wait_buffered(c, t, ends_with("tool.completed"))
    assert buffered(c, t)[0]["type"] == "tool.started"  # the new buffer: from the second call on
    with sse(svc, f"/v1/turns/{t}/events") as es:
        got = es.read_n(6)
    assert got[0].type == "stream.rebuilt"
    assert keys(got[1:]) == durable_keys(svc, t) == [("turn.started", None), ("tool.started", 1),
                                                     ("tool.completed", 1), ("tool.started", 2),
                                                     ("tool.completed", 2)]


def test_a_json_page_of_only_hidden_events_says_where_the_next_page_starts(service: Service):
    """A project's buffer holds its turns' events too, which its readers are not shown: a page
    whose whole window is such events is empty, and ``next_after`` goes on past it."""
    c = service.client()
    p = new_project(c)
    v1 = c.get(f"/v1/projects/{p}").json()["current_version_id"]
    for _ in range(3):  # turn.started, turn.completed: six events no reader of the project sees
        t = start_turn(c, p)
        complete(c, t)
    v2 = created(c.post(f"/v1/projects/{p}/publish", json={"summary": "x"}))["id"]
    assert c.post(f"/v1/projects/{p}/rollback", json={"version_id": v2}).status_code == 200  # the head: no event
    assert c.post(f"/v1/projects/{p}/rollback", json={"version_id": v1}).status_code == 200
    deadline = time.monotonic() + 10
    while page(c, f"/v1/projects/{p}/events", after=0, limit=1000)["events"][-1:] == [] or \
            page(c, f"/v1/projects/{p}/events", after=0, limit=1000)["events"][-1]["type"] != "head.moved":
        assert time.monotonic() < deadline, "the project's events never reached its buffer"
        time.sleep(0.02)
    first = page(c, f"/v1/projects/{p}/events", after=0, limit=2)
    assert first["events"] == [] and first["has_more_after"] and first["next_after"].endswith(":2")
    seen, after = [], "0"
    for _ in range(20):
        got = page(c, f"/v1/projects/{p}/events", after=after, limit=2)
        seen += got["events"]
        after = got["next_after"]
        if not got["has_more_after"]:
            break
    assert [(e["type"], without_at(e["data"])) for e in seen] == [
        ("version.published", {"version_id": v2, "number": 2}), ("head.moved", {"to_version_id": v1})]
    # backwards too: from the end, the page before goes on from where the window began
    last = page(c, f"/v1/projects/{p}/events", before=10**6, limit=2)
    assert [e["type"] for e in last["events"]] == ["version.published", "head.moved"]
    assert page(c, f"/v1/projects/{p}/events", before=last["next_before"], limit=2)["events"] == []


def usage(pid: int, port: int) -> dict[str, int]:
    """A service process, from /proc: threads, open file descriptors, resident memory (KiB), and
    ``clients``: the connections it accepted on ``port`` that it holds (its pools' sockets not counted)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            pass
    inodes = {t[len("socket:["):-1] for t in targets if t.startswith("socket:[")}
    clients = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()  # sl local_address rem_address st ... inode (10th)
            if int(fields[1].rpartition(":")[2], 16) == port and fields[3] != "0A" and fields[9] in inodes:
                clients += 1  # 0A: the listening socket
    return {"threads": int(status["Threads"]), "fds": len(targets), "clients": clients,
            "rss_kib": int(status["VmRSS"].split()[0])}


@pytest.mark.alone  # it bounds response times
def test_hundreds_of_idle_subscribers_neither_slow_the_service_down_nor_leak(service_factory):
    service = service_factory()  # a service of its own: its threads, descriptors and memory are counted
    subscribers = 300
    c = service.client()
    turns = [start_turn(c, new_project(c, f"idle{i}")) for i in range(3)]
    for t in turns:
        wait_buffered(c, t, ends_with("turn.started"))
    url = urlsplit(service.url)
    pid = service.proc.pid
    baseline = usage(pid, url.port)

    async def subscribe(turn_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        writer.write(f"GET /v1/turns/{turn_id}/events HTTP/1.1\r\nHost: {url.netloc}\r\nAccept: text/event-stream\r\n"
                     f"Authorization: Bearer {service.admin}\r\n\r\n".encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and b"text/event-stream" in head, head
        await read_until(reader, b"event: turn.started")
        return reader, writer

    async def read_until(reader: asyncio.StreamReader, marker: bytes) -> None:
        seen = b""
        while marker not in seen:
            chunk = await reader.read(65536)
            assert chunk, "the stream closed"
            seen = seen[-len(marker):] + chunk

    def probe() -> dict[str, float]:
        """How long the service takes to answer while the subscribers are connected."""
        with httpx.Client(base_url=service.url, headers={"authorization": f"Bearer {service.admin}"},
                          timeout=30) as h:
            timings = {}
            calls = {"healthz": lambda: h.get("/healthz"), "get turn": lambda: h.get(f"/v1/turns/{turns[1]}"),
                     "tool call": lambda: h.post(f"/v1/turns/{turns[0]}/tool-calls", json={"tool_name": "x"})}
            for name, call in calls.items():
                started = time.monotonic()
                r = call()
                timings[name] = time.monotonic() - started
                assert r.status_code in (200, 201), r.text
            return timings

    async def one_round() -> dict[str, Any]:
        started = time.monotonic()
        conns = await asyncio.wait_for(asyncio.gather(*(subscribe(turns[i % 3]) for i in range(subscribers))), 60)
        opened_s = time.monotonic() - started
        during = usage(pid, url.port)
        timings = await asyncio.to_thread(probe)
        # the subscribers are served, not only held: the tool call reaches every subscriber of its turn
        await asyncio.wait_for(asyncio.gather(*(read_until(r, b"event: tool.started")
                                                for i, (r, _) in enumerate(conns) if i % 3 == 0)), 30)
        for _, writer in conns:
            writer.close()
        await asyncio.gather(*(w.wait_closed() for _, w in conns), return_exceptions=True)
        return {"opened_s": opened_s, "during": during, "timings": timings}

    rounds = []
    for _ in range(2):
        result = asyncio.run(one_round())
        assert result["opened_s"] < 30, result
        assert all(seconds < 5 for seconds in result["timings"].values()), result
        assert result["during"]["clients"] >= subscribers  # all connected at once
        assert result["during"]["threads"] <= baseline["threads"] + 50, result  # no thread per subscriber
        # once they are gone, so are their sockets: the connections, then (each stream notices its
        # client left at its next poll, later on a loaded machine) the descriptors
        deadline = time.monotonic() + 20
        while ((after := usage(pid, url.port))["clients"] > baseline["clients"]
               or after["fds"] - baseline["fds"] >= subscribers):
            assert time.monotonic() < deadline, f"connections leaked: {baseline} -> {after}"
            time.sleep(0.2)
        assert after["threads"] <= baseline["threads"] + 50
        result["after"] = after
        rounds.append(result)
    # what stays open is the pools' connections (database, coordinator, blob store: bounded by the thread
    # pool), nothing per subscriber: a leak of one descriptor a subscriber would be 600 by now
    assert rounds[1]["after"]["fds"] - baseline["fds"] < subscribers, (baseline, rounds)
    assert rounds[1]["after"]["threads"] <= rounds[0]["after"]["threads"] + 5, rounds
    assert c.get("/healthz").status_code == 200
    with sse(service, f"/v1/turns/{turns[2]}/events") as es:
        assert es.read_n(1)[0].type == "turn.started"
        tool_call(c, turns[2])
        assert keys(es.read_n(2, timeout=5)) == [("tool.started", 1), ("tool.completed", 1)]
    print(f"baseline {baseline}, rounds {rounds}")


# == assistant text deltas =============================================================================
class PartialWrites:
    """Every UPDATE of one turn's ``partial_response_json``, timed by the database (a trigger of this test)."""

    def __init__(self, engine: sa.Engine, turn_id: str) -> None:
        assert re.fullmatch(r"[0-9a-f]{32}", turn_id)
        self.engine, self.name = engine, f"test_partial_writes_{secrets.token_hex(4)}"
        self.pg = engine.dialect.name == "postgresql"
        if self.pg:
            ddl = [f"CREATE TABLE {self.name} (at double precision NOT NULL)",
                   f"CREATE FUNCTION {self.name}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                   f"INSERT INTO {self.name} VALUES (extract(epoch FROM clock_timestamp())); RETURN NULL; END $$",
                   f"CREATE TRIGGER {self.name} AFTER UPDATE OF partial_response_json ON project_turn FOR EACH ROW "
                   f"WHEN (NEW.id = '{turn_id}') EXECUTE FUNCTION {self.name}()"]
        else:
            ddl = [f"CREATE TABLE {self.name} (at REAL NOT NULL)",
                   f"CREATE TRIGGER {self.name} AFTER UPDATE OF partial_response_json ON project_turn "
                   f"WHEN NEW.id = '{turn_id}' BEGIN INSERT INTO {self.name} "
                   f"VALUES ((julianday('now') - 2440587.5) * 86400.0); END"]
        with engine.begin() as conn:
            for statement in ddl:
                conn.exec_driver_sql(statement)

    def times(self) -> list[float]:
        with self.engine.connect() as conn:
            return [row[0] for row in conn.exec_driver_sql(f"SELECT at FROM {self.name} ORDER BY at")]

    def drop(self) -> None:
        with self.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TRIGGER {self.name}" + (" ON project_turn" if self.pg else ""))
            if self.pg:
                conn.exec_driver_sql(f"DROP FUNCTION {self.name}()")
            conn.exec_driver_sql(f"DROP TABLE {self.name}")


@pytest.mark.alone  # it counts writes a second
def test_deltas_reach_the_stream_one_by_one_but_the_partial_response_is_written_about_once_a_second(
        service_factory):
    service = service_factory()  # a database of its own: the triggers below count every turn-row write
    c = service.client()
    p = new_project(c)
    t = start_turn(c, p)
    wait_buffered(c, t, ends_with("turn.started"))
    pieces = [f"piece {i:03d}; " for i in range(200)]
    text = "".join(pieces)
    acked: list[tuple[float, int]] = []  # (when, characters acknowledged so far)
    samples: list[tuple[float, Any]] = []  # (when, the row's partial response)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            at = time.monotonic()
            samples.append((at, service.store.get_turn(t, tool_calls=False).partial_response))
            stop.wait(0.05)

    writes = PartialWrites(service.store.engine, t)
    try:
        with sse(service, f"/v1/turns/{t}/events") as es:
            assert es.read_n(1)[0].type == "turn.started"
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.monotonic()
            for piece in pieces:
                delta(c, t, piece)
                acked.append((time.monotonic(), (acked[-1][1] if acked else 0) + len(piece)))
                time.sleep(0.01)
            streaming_s = time.monotonic() - started
            stop.set()
            sampler.join(timeout=30)
            while_streaming = writes.times()
            r = c.post(f"/v1/turns/{t}/interrupt")
            assert r.status_code == 200 and r.json()["status"] == "interrupted"
            got = es.read_to_end()
        all_writes = writes.times()
    finally:
        writes.drop()

    # every delta is an event, in order, and then the interrupt ends the stream
    assert [e.json["text"] for e in got if e.type == "assistant.delta"] == pieces
    assert [e.type for e in got if e.type != "assistant.delta"] == ["turn.interrupted", "stream.end"]
    assert_ids_increase(got[:-1])
    # the row is not written per delta: about once a second while text streams, and once on the interrupt
    assert streaming_s > 2
    assert int(streaming_s) - 1 <= len(while_streaming) <= streaming_s + 1, (streaming_s, while_streaming)
    assert all(b - a >= 0.9 for a, b in zip(while_streaming, while_streaming[1:])), while_streaming
    assert len(all_writes) == len(while_streaming) + 1
    # meanwhile the row held a prefix of the text, never more than about a second behind
    for at, partial in samples:
        written = partial["text"] if partial is not None else ""
        assert text.startswith(written)
        behind = max((n for when, n in acked if when < at - 2.0), default=0)
        assert len(written) >= behind, (at - started, len(written), behind)
    assert any(partial is not None for _, partial in samples)
    # on the interrupt, the whole text
    assert service.store.get_turn(t).partial_response == {"text": text}
    assert c.get(f"/v1/turns/{t}").json()["partial_response"] == {"text": text}
    assert c.get(f"/v1/projects/{p}/draft").json()["partial_response"] == {"text": text}


# == a project's stream ================================================================================
def test_a_projects_stream_carries_committed_events_only_to_admins_agents_and_observers(service: Service):
    c = service.client()
    p = new_project(c)
    v1 = c.get(f"/v1/projects/{p}").json()["current_version_id"]
    tokens = {"admin": service.admin, "agent": service.token("agent"), "observer": service.token("observer", p)}
    t = start_turn(c, p)  # the project's first event (not a committed one) creates its buffer
    deadline = time.monotonic() + 10
    while page(c, f"/v1/projects/{p}/events")["epoch"] is None:
        assert time.monotonic() < deadline, "the project's buffer never appeared"
        time.sleep(0.02)
    # from the buffer's first event on (a fresh subscriber would start at what happens next)
    streams = {role: sse(service, f"/v1/projects/{p}/events?after=0", token=tok) for role, tok in tokens.items()}
    try:
        assert {role: es.status for role, es in streams.items()} == dict.fromkeys(tokens, 200)
        assert c.put(f"/v1/turns/{t}/files/dragon.py", content=b"DRAGON = 1\n").status_code == 204
        complete(c, t)
        r = c.post(f"/v1/projects/{p}/publish", json={"summary": "dragon"})
        assert r.status_code == 201
        v2 = r.json()["id"]
        assert c.post(f"/v1/projects/{p}/rollback", json={"version_id": v1}).status_code == 200
        t2 = start_turn(c, p)
        assert c.put(f"/v1/turns/{t2}/files/oops.py", content=b"oops\n").status_code == 204
        r = c.post(f"/v1/projects/{p}/discard")
        assert r.status_code == 200
        draft = r.json()["id"]
        assert c.post(f"/v1/projects/{p}/rollback", json={"version_id": v2}).status_code == 200

        expected = [("version.published", {"version_id": v2, "number": 2}), ("head.moved", {"to_version_id": v1}),
                    ("draft.discarded", {"draft_id": draft}), ("head.moved", {"to_version_id": v2})]
        published = [x for x in expected if x[0] != "draft.discarded"]  # an observer never learns of a draft
        seen = {}
        for role, es in streams.items():
            want = published if role == "observer" else expected
            seen[role] = es.read_n(len(want))
            assert [(e.type, without_at(e.json)) for e in seen[role]] == want, role
            assert all(isinstance(e.json["at"], str) for e in seen[role] if e.type == "head.moved")
            assert_ids_increase(seen[role])
            assert es.poll(timeout=0.3) is None  # turns' events (started, completed, rolled back) are not sent
        # ids are the buffer's: the turns' events (started, completed; started, rolled back) were skipped
        assert [e.n for e in seen["admin"]] == [3, 4, 7, 8]
        got = seen["observer"]
        assert [e.n for e in got] == [3, 4, 8]
    finally:
        for es in streams.values():
            es.close()

    # a reconnect with Last-Event-ID continues after it; the JSON page shows the same committed events
    with sse(service, f"/v1/projects/{p}/events", token=tokens["observer"], last_event_id=got[1].last_event_id) as es:
        assert [e.last_event_id for e in es.read_n(1)] == [e.last_event_id for e in got[2:]]
    shown = page(service.client(tokens["observer"]), f"/v1/projects/{p}/events", after=0, limit=1000)
    assert [(e["type"], without_at(e["data"]), e["id"]) for e in shown["events"]] == [
        (k, d, e.last_event_id) for (k, d), e in zip(published, got)]

    # an observer sees no turn, live or not; a token of another project sees no such project
    obs = service.client(tokens["observer"])
    for accept in ("text/event-stream", "application/json"):
        r = obs.get(f"/v1/turns/{t}/events", headers={"accept": accept})
        assert r.status_code == 403 and r.json()["code"] == "auth.forbidden"
    with sse(service, f"/v1/turns/{t}/events", token=tokens["observer"]) as es:
        assert es.status == 403
    other = service.token("observer", new_project(c, "other"))
    with sse(service, f"/v1/projects/{p}/events", token=other) as es:
        assert es.status == 404 and es.body["code"] == "project.not_found"
    with sse(service, f"/v1/turns/{t}/events", token=tokens["agent"]) as es:  # an agent may read the turn
        assert es.status == 200 and es.read_n(1)[0].type == "turn.started"


# == JSON page mode ======================================================================================
def test_the_json_page_mode_pages_through_a_turns_events_both_ways(service: Service):
    c = service.client()
    p = new_project(c)
    t = start_turn(c, p)
    for _ in range(6):
        tool_call(c, t)
    complete(c, t)
    history = wait_buffered(c, t, ends_with("turn.completed"))
    assert len(history) == 14
    path = f"/v1/turns/{t}/events"

    def ids(got: dict[str, Any]) -> list[int]:
        return [int(e["id"].rpartition(":")[2]) for e in got["events"]]

    def flags(got: dict[str, Any]) -> tuple[bool, bool]:
        return got["has_more_before"], got["has_more_after"]

    forward, after = [], 0
    while True:  # forwards, five at a time
        got = page(c, path, after=after, limit=5)
        forward.append((ids(got), flags(got)))
        if not got["has_more_after"]:
            break
        after = ids(got)[-1]
    assert forward == [([1, 2, 3, 4, 5], (False, True)), ([6, 7, 8, 9, 10], (True, True)),
                       ([11, 12, 13, 14], (True, False))]
    backward, before = [], 15
    while True:  # backwards from the end, five at a time
        got = page(c, path, before=before, limit=5)
        backward.append((ids(got), flags(got)))
        if not got["has_more_before"]:
            break
        before = ids(got)[0]
    assert backward == [([10, 11, 12, 13, 14], (True, False)), ([5, 6, 7, 8, 9], (True, True)),
                        ([1, 2, 3, 4], (False, True))]

    assert (ids(got := page(c, path, after=3, before=8, limit=10)), flags(got)) == ([4, 5, 6, 7], (True, True))
    assert (ids(got := page(c, path, after=3, before=8, limit=2)), flags(got)) == ([4, 5], (True, True))
    assert (ids(got := page(c, path, after=14)), flags(got)) == ([], (True, False))
    assert (ids(got := page(c, path, before=10**9, limit=3)), flags(got)) == ([12, 13, 14], (True, False))
    whole = page(c, path, limit=1000)
    assert whole["events"] == history and flags(whole) == (False, False)
    assert keys(whole["events"]) == [("turn.started", None)] + [
        (k, s) for s in range(1, 7) for k in ("tool.started", "tool.completed")] + [("turn.completed", None)]
    with sse(service, path) as es:  # the page's ids are the stream's
        assert [e.last_event_id for e in es.read_n(14)] == [e["id"] for e in history]
        assert whole["epoch"] == es.events[0].epoch
    for bad in ({"limit": 0}, {"limit": 1001}, {"after": -1}, {"before": 0}):
        r = c.get(path, params=bad, headers={"accept": "application/json"})
        assert r.status_code == 422 and r.json()["code"] == "input.invalid", bad
    # a client that accepts both gets the stream
    r = c.get(path, headers={"accept": "application/json, text/event-stream"})
    assert r.headers["content-type"].startswith("text/event-stream")
