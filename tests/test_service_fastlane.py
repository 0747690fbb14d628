"""The service's fast lane answers exactly what FastAPI's routes answer.

The same sequence of requests (valid ones, and every kind of bad input,
token and state) goes to an app with the fast lane and to one without, each
on its own project of one store; the answers must be equal once each app's
own ids are named alike. The fast lane must also have served the valid
requests itself (else this would compare FastAPI with itself). Every answer
is one ``/openapi.json`` documents: its status is listed for the operation
and its body is valid for the schema given there (the typed client's models).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import jsonschema
from starlette.testclient import TestClient

from fastapi import FastAPI
from fastapi.routing import APIRoute

from draftstore import Store
from draftstore.service import fastlane
from draftstore.service.app import create_app
from draftstore.service.auth import AGENT, Allow, Principal
from draftstore.service.threads import TURN

JSON = {"content-type": "application/json"}


def _counting(app: Any) -> Counter[str]:
    """Count, per fast route, the requests it served itself (not handed over to FastAPI)."""
    served: Counter[str] = Counter()
    lane = app.fast_lane
    assert isinstance(lane, fastlane.FastLane)
    serve, hand_over = lane.serve, lane.hand_over

    async def counted(endpoint: Any, scope: Any, receive: Any, send: Any) -> None:
        served[endpoint.api_route.path] += 1
        await serve(endpoint, scope, receive, send)

    async def handed_over(scope: Any, receive: Any, send: Any) -> None:
        hit = lane.match(scope["method"], scope["path"])
        assert hit is not None
        served[hit[0].api_route.path] -= 1
        await hand_over(scope, receive, send)

    lane.serve, lane.hand_over = counted, handed_over
    return served


def _requests(pid: str, tid: str, other_tid: str, tokens: dict[str, str]) -> Iterator[tuple[str, str, Any, dict[str, str]]]:
    """(method, url, body bytes, headers) in order; ``tid`` is a running turn of ``pid``."""
    agent = {"authorization": f"Bearer {tokens['agent']}"}
    auth = {**JSON, **agent}
    t = f"/v1/turns/{tid}"
    for url, good, bad in [
        (f"{t}/tool-calls", b'{"tool_name": "view_file", "args": {"path": "main.py"}}',
         [b'{"tool_name": ["x"]}', b'{"tool_name": "x", "needs_approval": "yes please"}', b'{"tool_name": "x", "args": NaN}',
          b'{"tool_name": "x", "args": 1e999}', b'{"tool_name": "x", "extra": 1}']),
        (f"{t}/tool-calls/1/complete", b'{"result": {"ok": true}}', [b'{"result": 1, "colour": 2}']),
        (f"{t}/tool-calls", b'{"tool_name": "search_code"}', []),
        (f"{t}/tool-calls/2/fail", b'{"error": "boom"}', [b'{}']),
        (f"{t}/tool-calls/2/complete", b'{"result": null}', []),  # already failed: a state conflict
        (f"{t}/tool-calls/99/complete", b'{"result": null}', []),  # no such call
        (f"{t}/tool-calls/one/complete", b'{"result": null}', []),  # not an int
        (f"{t}/tool-calls/-1/complete", b'{"result": null}', []),
        (f"{t}/deltas", b'{"text": "Hel"}', [b'{"text": 5}']),
        (f"{t}/heartbeat", None, []),
        (f"/v1/projects/{pid}/turns", b'{"user_message": "again"}',  # a turn is running: a conflict
         [b'{"user_message": "x", "continue": "maybe"}', b'{"user_message": "x", "continue_": true}', b"{}"]),
        (f"/v1/turns/{other_tid}/deltas", b'{"text": "x"}', []),  # another project's turn
        ("/v1/turns/nope/tool-calls", b'{"tool_name": "x"}', []),
    ]:
        yield "POST", url, good, auth
        for body in bad + [b"", b'{"tool_name": ', b"[]", b'"\xff\xfe"', b"[" * 5000 + b"]" * 5000]:
            if good is not None:
                yield "POST", url, body, auth
        if good is not None:
            yield "POST", url, good, {**agent, "content-type": "text/plain"}
            yield "POST", url, good, {**agent, "content-type": "application/json; charset=utf-8"}
            yield "POST", url, good, {**agent, "content-type": "application/vnd.x+json"}
            yield "POST", url, good, agent  # no content type
        for who in ("none", "bad", "observer", "scoped_other"):
            headers = dict(JSON)
            if who == "bad":
                headers["authorization"] = "Bearer dst_nope_nope"
            elif who != "none":
                headers["authorization"] = f"Bearer {tokens[who]}"
            yield "POST", url, good, headers
        yield "GET", url, None, auth  # a method the fast lane does not serve here
    for path, body in [("src/a.py", b"print(1)\n"), ("src/a.py", b""), ("a%00b.py", b"x"), ("%2E%2E/escape.py", b"x"),
                       ("dir/", b"x"), ("big.bin", b"\x00" * 10)]:
        yield "PUT", f"{t}/files/{path}", body, agent
        yield "PUT", f"{t}/files/{path}", body, {"authorization": f"Bearer {tokens['observer']}"}
    yield "DELETE", f"{t}/files/src/a.py", None, agent
    yield "POST", f"{t}/complete", b'{"assistant_message": "done"}', auth
    yield "POST", f"{t}/complete", b'{"assistant_message": "again"}', auth  # ended: a conflict
    yield "PUT", f"{t}/files/late.py", b"x", agent  # a late write: refused
    yield "POST", f"{t}/tool-calls", b'{"tool_name": "late"}', auth
    yield "POST", f"/v1/projects/{pid}/turns", b'{"user_message": "next", "continue": true}', auth
    yield "POST", f"/v1/projects/{pid}/turns", b'{"user_message": "next"}', {**JSON, "authorization": f"Bearer {tokens['admin']}"}


def _answer(response: Any, names: dict[str, str]) -> tuple[int, Any]:
    text = re.sub(r"\d{4}-\d\d-\d\dT[\d:.]+\+00:00", "<time>", response.text)
    for real, alias in names.items():
        text = text.replace(real, alias)
    text = re.sub(r"\b[0-9a-f]{32}\b", "<id>", text)  # the ids of drafts, versions, ... of each run
    try:
        body = json.loads(text)
    except ValueError:
        return response.status_code, text
    if isinstance(body, dict):  # a record: its identity and times differ between the two runs
        body = {k: v for k, v in body.items() if k not in ("id", "started_at", "ended_at", "created_at",
                                                           "heartbeat_at", "updated_at", "draft_id", "base_version_id")}
    return response.status_code, body


def _operation(doc: dict[str, Any], method: str, url: str) -> dict[str, Any] | None:
    """The operation of the document that ``method`` ``url`` is a request of (None: no such operation)."""
    path = url.partition("?")[0]
    for template, ops in doc["paths"].items():
        pattern = re.sub(r"\\{(\w+)\\}", lambda m: ".+" if m.group(1) == "path" else "[^/]+", re.escape(template))
        if re.fullmatch(pattern, path) and method.lower() in ops:
            return ops[method.lower()]
    return None


def _undocumented(doc: dict[str, Any], method: str, url: str, response: Any) -> str | None:
    """Why ``response`` is not an answer the document describes for the request (None: it is)."""
    op = _operation(doc, method, url)
    if op is None:  # a method the route does not have: not an operation of the contract
        return None
    documented = op["responses"].get(str(response.status_code))
    if documented is None:
        return f"{method} {url}: {response.status_code} is not documented"
    content = documented.get("content", {})
    if not content:
        return None if not response.content else f"{method} {url}: a body where the document has none"
    media = response.headers["content-type"].partition(";")[0]
    if media not in content:
        return f"{method} {url}: {media} is not documented for {response.status_code}"
    if media == "application/json":
        try:
            jsonschema.validate(response.json(), {**content[media]["schema"], "components": doc["components"]})
        except jsonschema.ValidationError as exc:
            return f"{method} {url}: {response.status_code} body is not the documented schema: {exc.message}"
    return None


def test_the_fast_lane_answers_what_fastapi_answers(store: Store) -> None:
    answers = []
    undocumented: list[str] = []
    served: Counter[str] = Counter()
    for fast in (False, True):
        app = create_app(store, fast_lane=fast)
        if fast:
            served = _counting(app)
        pid = store.create_project(f"p-{fast}", files={"main.py": b"x = 1\n"}).id
        other = store.create_project(f"other-{fast}").id
        tid = store.start_turn(pid, "hello").id
        other_tid = store.start_turn(other, "hi").id
        tokens = {"agent": store.tokens.create("agent", project_id=pid)[1],
                  "observer": store.tokens.create("observer", project_id=pid)[1],
                  "scoped_other": store.tokens.create("agent", project_id=other)[1],
                  "admin": store.tokens.create("admin")[1]}
        names = {tid: "<turn>", other_tid: "<other-turn>", pid: "<project>", other: "<other-project>"}
        got = []
        doc = app.openapi()
        with TestClient(app, raise_server_exceptions=False) as client:
            for method, url, body, headers in _requests(pid, tid, other_tid, tokens):
                response = client.request(method, url, content=body, headers=headers)
                got.append(((method, url.replace(tid, "<turn>").replace(pid, "<project>")), _answer(response, names)))
                if (why := _undocumented(doc, method, url, response)) is not None:
                    undocumented.append(why)
        answers.append(got)
    slow, fast_ = answers
    assert len(slow) == len(fast_) > 150
    for (what, a), (_, b) in zip(slow, fast_):
        assert a == b, what
        assert a[0] < 500, what
    assert not undocumented, "\n".join(undocumented)
    statuses = Counter(status for _, (status, _) in slow)
    assert {200, 201, 204, 401, 403, 404, 405, 409, 422} <= set(statuses), statuses
    # the fast lane served the valid requests of each hot route itself
    for _, path, _ in fastlane.HOT:
        assert served[path] > 0, (path, served)


def _sync_endpoint(turn_id: str, principal: Principal = Allow(*AGENT)) -> None: ...


async def _async_endpoint(turn_id: str, principal: Principal = Allow(*AGENT)) -> None: ...


def test_a_hot_route_names_a_lane_exactly_when_its_endpoint_is_sync(store: Store) -> None:
    """A lane given to an async endpoint would be ignored (it awaits a pool of its own),
    and a sync endpoint without one would have no pool: both are refused when the
    lane is built, and the app's own table passes the check."""
    app = FastAPI()
    sync_route = APIRoute("/v1/turns/{turn_id}/x", _sync_endpoint, methods=["POST"])
    async_route = APIRoute("/v1/turns/{turn_id}/y", _async_endpoint, methods=["POST"])
    fastlane.FastLane(app, [("POST", sync_route, TURN), ("POST", async_route, None)])
    for route, lane in ((sync_route, None), (async_route, TURN)):
        try:
            fastlane.FastLane(app, [("POST", route, lane)])
        except TypeError as exc:
            assert route.path in str(exc)
        else:
            raise AssertionError(f"{route.path} with lane {lane} was accepted")
    assert isinstance(create_app(store).fast_lane, fastlane.FastLane)  # HOT itself passes
