"""The HTTP service, over real HTTP: user stories, paging, the error table, probes.

Every test talks to a real uvicorn subprocess (``service``) on the embedded and
on the real stack, with httpx; ``service.store`` only sets up bulk state or
checks what the service wrote. Open mode runs on a dedicated embedded stack
(``TestOpenMode``): it needs a database with no token at all.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from draftstore import errors as E
from draftstore.service.auth import AUTH_CACHE_S
from service_fixtures import Service, free_port
from services import token as random_token

Json = Any


@pytest.fixture
def service(shared_service_per_test: Service) -> Service:
    """One service per flavour for this module's tests (``shared_service``): each test makes its
    own projects and tokens and looks only at those."""
    return shared_service_per_test


# -- helpers -------------------------------------------------------------------------------
def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def ok(r: httpx.Response, status: int = 200) -> Json:
    """The body of a successful answer (None for 204), after checking its status."""
    assert r.status_code == status, f"{r.request.method} {r.request.url} -> {r.status_code}: {r.text[:500]}"
    if status == 204:
        assert r.content == b""
        return None
    return r.json()


def created(r: httpx.Response) -> Json:
    return ok(r, 201)


def err(r: httpx.Response, status: int, code: str) -> dict[str, Json]:
    """An error answer: the status, and the body every error has: code, message, details, retryable."""
    assert r.status_code == status, f"{r.request.method} {r.request.url} -> {r.status_code}: {r.text[:500]}"
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"code", "message", "details", "retryable"}, body
    assert body["retryable"] is (code in {"backend.unavailable", "draft.busy", "lock.timeout"}), body
    assert isinstance(body["message"], str) and body["message"], body
    assert isinstance(body["details"], dict), body
    assert body["code"] == code, f"{r.request.method} {r.request.url}: expected {code}, got {body}"
    return body


def walk_find(c: httpx.Client, project_id: str, limit: int) -> list[str]:
    """Every path /view/find lists, ``limit`` at a time through its cursors."""
    out: list[str] = []
    cursor = None
    for _ in range(100):
        page = ok(c.get(f"/v1/projects/{project_id}/view/find",
                        params={"limit": limit, **({"cursor": cursor} if cursor else {})}))
        out += page["paths"]
        cursor = page["next_cursor"]
        if cursor is None:
            return out
    raise AssertionError("paging did not end")


def walk(c: httpx.Client, url: str, limit: int, **params: Any) -> list[Json]:
    """Every item of a paged list, following ``next_cursor``; no page is over ``limit``."""
    items: list[Json] = []
    cursor = None
    for _ in range(10_000):
        page = ok(c.get(url, params={**params, "limit": limit, **({"cursor": cursor} if cursor else {})}))
        assert set(page) == {"items", "next_cursor"} and len(page["items"]) <= limit
        items += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            return items
        assert page["items"], "a page that says there is more holds something"
    raise AssertionError(f"{url} never ran out of pages")


def eventually(check: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.05)


def new_project(c: httpx.Client, **files: str) -> Json:
    return created(c.post("/v1/projects", json={
        "name": f"game-{random_token(3)}", "files": {p: b64(v) for p, v in (files or {"main.py": "print(1)\n"}).items()},
        "characters": {"hero": {"hp": 10}}, "world_settings": {"era": "bronze"}}))


# -- a turn's whole life ----------------------------------------------------------------------
def test_a_turn_from_first_message_to_a_forked_copy(service: Service) -> None:
    c = service.client()
    logo = bytes(range(256)) + b"\x00\xff\xfe"  # binary: no UTF-8, a NUL
    project = created(c.post("/v1/projects", json={
        "name": "dragon game", "files": {"main.py": b64("print('hello')\n"), "assets/logo.png": b64(logo)},
        "characters": {"hero": {"hp": 10}}, "world_settings": {"era": "bronze"}, "actor": "alice"}))
    pid, v1 = project["id"], project["current_version_id"]
    assert project["name"] == "dragon game" and v1 is not None and project["active_draft_id"] is None

    # the user asks, in a structured chat message
    message = {"role": "user", "content": [{"type": "text", "text": "add a dragon"}]}
    turn = created(c.post(f"/v1/projects/{pid}/turns", json={"user_message": message, "actor": "worker-7"}))
    tid = turn["id"]
    assert (turn["status"], turn["number"], turn["user_message"], turn["actor"]) == ("running", 1, message, "worker-7")
    assert turn["base_version_id"] == v1 and turn["end_root"] is None
    one = ok(c.get(f"/v1/projects/{pid}"))  # with its head and its active draft
    assert one["active_draft_id"] == turn["draft_id"] and one["draft"]["id"] == turn["draft_id"]
    assert (one["draft"]["status"], one["draft"]["base_version_id"]) == ("running", v1)
    assert one["head"]["id"] == v1 and one["head"]["number"] == 1 and one["head"]["characters"] == {"hero": {"hp": 10}}

    # tool calls: one plain, one approved, one denied (a denial is no failure: the turn goes on)
    look = created(c.post(f"/v1/turns/{tid}/tool-calls", json={"tool_name": "view_file", "args": {"path": "main.py"}}))
    assert (look["seq"], look["status"], look["args"]) == (1, "started", {"path": "main.py"})
    ok(c.post(f"/v1/turns/{tid}/tool-calls/1/complete", json={"result": {"content": "print('hello')\n"}}), 204)
    write = created(c.post(f"/v1/turns/{tid}/tool-calls", json={
        "tool_name": "write_file", "args": {"path": "src/dragon.py"}, "needs_approval": True}))
    assert (write["seq"], write["status"]) == (2, "awaiting_approval")
    err(c.post(f"/v1/turns/{tid}/tool-calls/2/complete", json={"result": "too early"}), 409,
        "toolcall.awaiting_approval")
    approved = ok(c.post(f"/v1/turns/{tid}/tool-calls/2/approval",
                         json={"approved": True, "reason": "looks safe", "actor": "bob"}))
    assert approved["status"] == "started" and approved["ended_at"] is None
    assert {k: approved["approval"][k] for k in ("approved", "reason", "by")} == {
        "approved": True, "reason": "looks safe", "by": "bob"}
    created(c.post(f"/v1/turns/{tid}/tool-calls", json={
        "tool_name": "delete_everything", "args": {"path": "."}, "needs_approval": True}))
    denied = ok(c.post(f"/v1/turns/{tid}/tool-calls/3/approval", json={"approved": False, "reason": "no way"}))
    assert denied["status"] == "denied" and denied["ended_at"] is not None
    err(c.post(f"/v1/turns/{tid}/tool-calls/3/approval", json={"approved": True}), 409,
        "toolcall.not_awaiting_approval")
    assert ok(c.get(f"/v1/turns/{tid}"))["status"] == "running"

    # one file, raw both ways; the binary one survived base64 in and raw out
    dragon = b"class Dragon:\n    hp = 100\n"
    ok(c.put(f"/v1/turns/{tid}/files/src/dragon.py", content=dragon,
             headers={"content-type": "application/octet-stream"}), 204)
    ok(c.post(f"/v1/turns/{tid}/tool-calls/2/complete", json={"result": "wrote src/dragon.py"}), 204)
    got = c.get(f"/v1/projects/{pid}/view/files/src/dragon.py")
    assert got.status_code == 200 and got.content == dragon
    assert got.headers["content-type"] == "application/octet-stream"
    assert got.headers["x-draftstore-digest"] == hashlib.sha256(dragon).hexdigest()
    assert c.get(f"/v1/projects/{pid}/view/files/assets/logo.png").content == logo

    # a batch (two files in, one out), a move, a delete, and both JSON documents patched
    ok(c.post(f"/v1/turns/{tid}/changes", json={"changes": {
        "src/egg.py": b64("EGG = 1\n"), "notes/todo.txt": b64("TODO: hatch the egg\n"), "main.py": None}}), 204)
    ok(c.post(f"/v1/turns/{tid}/move", json={"src": "src/egg.py", "dst": "src/nest/egg.py"}), 204)
    ok(c.delete(f"/v1/turns/{tid}/files/notes/todo.txt"), 204)
    characters = ok(c.patch(f"/v1/turns/{tid}/characters", json={"patch": [
        {"op": "add", "path": "/dragon", "value": {"hp": 100}}, {"op": "replace", "path": "/hero/hp", "value": 12}]}))
    assert characters == {"hero": {"hp": 12}, "dragon": {"hp": 100}}
    world = ok(c.patch(f"/v1/turns/{tid}/world-settings", json={"patch": {"era": "iron", "weather": "storm"}}))
    assert world == {"era": "iron", "weather": "storm"}

    # the agent's view of the draft
    state = ok(c.get(f"/v1/projects/{pid}/view"))
    assert (state["kind"], state["draft_id"], state["characters"], state["world_settings"]) == (
        "draft", turn["draft_id"], characters, world)
    assert ok(c.get(f"/v1/projects/{pid}/view/find", params={"glob": "**/*.py"})) == {
        "paths": ["src/dragon.py", "src/nest/egg.py"], "truncated": False, "next_cursor": None}
    assert [(e["name"], e["kind"]) for e in ok(c.get(f"/v1/projects/{pid}/view/list"))["items"]] == [
        ("assets", "dir"), ("src", "dir")]
    listed = ok(c.get(f"/v1/projects/{pid}/view/list", params={"dir": "src"}))
    assert [(e["path"], e["kind"]) for e in listed["items"]] == [("src/dragon.py", "file"), ("src/nest", "dir")]
    assert listed["next_cursor"] is None
    found = ok(c.get(f"/v1/projects/{pid}/view/search",
                     params={"q": r"hp = \d+", "regex": "true", "glob": "src/**", "context": 1}))
    assert [(m["path"], m["line_number"], m["line"], m["before"]) for m in found["matches"]] == [
        ("src/dragon.py", 2, "    hp = 100", ["class Dragon:"])]
    assert found["truncated"] is False
    assert ok(c.get(f"/v1/projects/{pid}/view/stat/src/dragon.py")) == {
        "path": "src/dragon.py", "size": len(dragon), "digest": hashlib.sha256(dragon).hexdigest(), "executable": False}
    err(c.get(f"/v1/projects/{pid}/view/files/main.py"), 404, "path.not_found")  # deleted in the batch

    # ... and of the state the turn started from
    at_start = {"at": f"turn:{tid}:start"}
    start = ok(c.get(f"/v1/projects/{pid}/view", params=at_start))
    assert (start["kind"], start["root"], start["characters"]) == ("turn_start", turn["start_root"], {"hero": {"hp": 10}})
    assert c.get(f"/v1/projects/{pid}/view/files/main.py", params=at_start).content == b"print('hello')\n"
    assert ok(c.get(f"/v1/projects/{pid}/view/find", params=at_start))["paths"] == ["assets/logo.png", "main.py"]
    err(c.get(f"/v1/projects/{pid}/view", params={"at": f"turn:{tid}:end"}), 409, "turn.already_running")

    # the answer streams as deltas, then the turn completes
    for piece in ("Here ", "be ", "dragons."):
        ok(c.post(f"/v1/turns/{tid}/deltas", json={"text": piece}), 204)

    def deltas() -> list[str]:
        page = ok(c.get(f"/v1/turns/{tid}/events", headers={"accept": "application/json"}))
        return [e["data"]["text"] for e in page["events"] if e["type"] == "assistant.delta"]

    assert eventually(lambda: deltas() == ["Here ", "be ", "dragons."], what="the deltas in the turn's stream")
    answer = {"role": "assistant", "content": [{"type": "text", "text": "Here be dragons."}]}
    done = ok(c.post(f"/v1/turns/{tid}/complete", json={"assistant_message": answer}))
    assert (done["status"], done["assistant_message"], done["end_reason"]) == ("completed", answer, None)
    end = ok(c.get(f"/v1/projects/{pid}/view", params={"at": f"turn:{tid}:end"}))
    assert end["root"] == done["end_root"] and end["characters"] == characters

    history = ok(c.get(f"/v1/turns/{tid}"))
    assert [(t["seq"], t["tool_name"], t["status"]) for t in history["tool_calls"]] == [
        (1, "view_file", "completed"), (2, "write_file", "completed"), (3, "delete_everything", "denied")]
    assert history["tool_calls"][0]["result"] == {"content": "print('hello')\n"}
    assert history["tool_calls"][1]["approval"]["approved"] is True
    assert history["tool_calls"][2]["approval"]["approved"] is False
    assert history["tool_calls"][2]["approval"]["reason"] == "no way"
    assert history["tool_calls_next_cursor"] is None

    # publish, diff the versions, roll back, fork
    v2 = created(c.post(f"/v1/projects/{pid}/publish", json={"summary": "a dragon", "actor": "carol"}))
    assert (v2["number"], v2["parent_version_id"], v2["created_by_turn_id"], v2["summary"], v2["created_by"]) == (
        2, v1, tid, "a dragon", "carol")
    assert v2["root"] == done["end_root"] and v2["file_count"] == 3 and v2["characters"] == characters
    project = ok(c.get(f"/v1/projects/{pid}"))
    assert project["current_version_id"] == v2["id"] and project["active_draft_id"] is None
    assert project["head"] == v2 and project["draft"] is None

    diff = ok(c.get(f"/v1/projects/{pid}/diff", params={"a": f"version:{v1}", "b": f"version:{v2['id']}"}))
    assert {f["path"]: f["status"] for f in diff["files"]} == {
        "main.py": "deleted", "src/dragon.py": "added", "src/nest/egg.py": "added"}
    added = next(f for f in diff["files"] if f["path"] == "src/dragon.py")
    assert "+class Dragon:" in added["unified"] and added["new_digest"] == hashlib.sha256(dragon).hexdigest()
    assert {op["path"] for op in diff["characters"]} == {"/dragon", "/hero/hp"}

    back = ok(c.post(f"/v1/projects/{pid}/rollback", json={"version_id": v1, "actor": "alice"}))
    assert back["current_version_id"] == v1
    assert c.get(f"/v1/projects/{pid}/view/files/main.py", params={"at": "head"}).content == b"print('hello')\n"
    moves = ok(c.get(f"/v1/projects/{pid}/head-moves"))["items"]
    assert [(m["reason"], m["from_version_id"], m["to_version_id"], m["actor"]) for m in moves] == [
        ("create", None, v1, "alice"), ("publish", v1, v2["id"], "carol"), ("rollback", v2["id"], v1, "alice")]
    assert [v["number"] for v in ok(c.get(f"/v1/projects/{pid}/versions"))["items"]] == [1, 2]  # none deleted
    assert ok(c.get(f"/v1/projects/{pid}/versions/{v2['id']}")) == v2

    copy = created(c.post(f"/v1/projects/{pid}/fork", json={"name": "dragon game, the sequel",
                                                             "version_id": v2["id"]}))
    assert copy["id"] != pid and copy["forked_from_version_id"] == v2["id"] and copy["active_draft_id"] is None
    assert c.get(f"/v1/projects/{copy['id']}/view/files/src/dragon.py", params={"at": "head"}).content == dragon
    head_copy = created(c.post(f"/v1/projects/{pid}/fork", json={"name": "back to basics"}))  # default: the head
    assert head_copy["forked_from_version_id"] == v1
    assert ok(c.get(f"/v1/projects/{copy['id']}/view/find", params={"at": "head"}))["paths"] == [
        "assets/logo.png", "src/dragon.py", "src/nest/egg.py"]


def test_an_interrupted_turn_refuses_late_writes_and_a_new_turn_continues_its_draft(service: Service) -> None:
    c = service.client()
    pid = new_project(c)["id"]
    first = created(c.post(f"/v1/projects/{pid}/turns", json={"user_message": "start a level"}))
    ok(c.put(f"/v1/turns/{first['id']}/files/level1.txt", content=b"#####\n"), 204)
    call = created(c.post(f"/v1/turns/{first['id']}/tool-calls", json={"tool_name": "think"}))
    err(c.post(f"/v1/projects/{pid}/turns", json={"user_message": "me too"}), 409, "turn.already_running")

    stopped = ok(c.post(f"/v1/turns/{first['id']}/interrupt", json={"partial_response": {"text": "I was dra"}}))
    assert stopped["status"] == "interrupted" and stopped["partial_response"] == {"text": "I was dra"}
    assert stopped["end_reason"] is None and stopped["end_root"] is not None

    # the old worker wakes up: everything it tries is refused, nothing changes
    late = f"/v1/turns/{first['id']}"
    for r in (c.put(f"{late}/files/level1.txt", content=b"overwritten\n"),
              c.put(f"{late}/files/level2.txt", content=b"new\n"),
              c.delete(f"{late}/files/main.py"),
              c.post(f"{late}/changes", json={"changes": {"x.txt": b64("x")}}),
              c.post(f"{late}/move", json={"src": "main.py", "dst": "moved.py"}),
              c.patch(f"{late}/characters", json={"patch": {"villain": {}}}),
              c.patch(f"{late}/world-settings", json={"patch": {"era": "late"}}),
              c.post(f"{late}/tool-calls", json={"tool_name": "too_late"}),
              c.post(f"{late}/tool-calls/{call['seq']}/complete", json={"result": 1}),
              c.post(f"{late}/deltas", json={"text": "still here"}),
              c.post(f"{late}/heartbeat"),
              c.post(f"{late}/complete", json={"assistant_message": "done after all"}),
              c.post(f"{late}/cancel")):
        err(r, 409, "turn.not_running")
    assert sorted(ok(c.get(f"/v1/projects/{pid}/view/find"))["paths"]) == ["level1.txt", "main.py"]
    assert c.get(f"/v1/projects/{pid}/view/files/level1.txt").content == b"#####\n"

    # a new turn continues on the same draft, from where the first one stopped
    second = created(c.post(f"/v1/projects/{pid}/turns", json={"user_message": "go on", "continue": True}))
    assert (second["number"], second["continues_turn_id"], second["draft_id"]) == (2, first["id"], first["draft_id"])
    assert second["start_root"] == stopped["end_root"]
    ok(c.put(f"/v1/turns/{second['id']}/files/level2.txt", content=b"=====\n"), 204)
    ok(c.post(f"/v1/turns/{second['id']}/heartbeat"), 204)
    ok(c.post(f"/v1/turns/{second['id']}/complete", json={"assistant_message": "two levels"}))
    turns = ok(c.get(f"/v1/projects/{pid}/turns"))["items"]
    assert [(t["number"], t["status"]) for t in turns] == [(1, "interrupted"), (2, "completed")]
    # the earlier turn stays readable; the call it left running ended with it
    assert ok(c.get(late))["tool_calls"][0]["status"] == "interrupted"

    version = created(c.post(f"/v1/projects/{pid}/publish", json={"summary": "levels"}))
    assert version["file_count"] == 3
    # nothing left to continue
    err(c.post(f"/v1/projects/{pid}/turns", json={"user_message": "more", "continue": True}), 404, "draft.none")


def test_cancel_ends_a_turn_interrupted_not_failed(service: Service) -> None:
    c = service.client()
    pid = new_project(c)["id"]
    turn = created(c.post(f"/v1/projects/{pid}/turns", json={"user_message": "paint the walls"}))
    ok(c.put(f"/v1/turns/{turn['id']}/files/walls.css", content=b"body { color: red }\n"), 204)

    cancelled = ok(c.post(f"/v1/turns/{turn['id']}/cancel"))
    assert (cancelled["status"], cancelled["end_reason"], cancelled["error"]) == ("interrupted", "cancelled", None)
    err(c.post(f"/v1/turns/{turn['id']}/heartbeat"), 409, "turn.not_running")  # how the worker learns to stop
    err(c.post(f"/v1/turns/{turn['id']}/cancel"), 409, "turn.not_running")
    assert ok(c.get(f"/v1/turns/{turn['id']}"))["end_reason"] == "cancelled"
    assert c.get(f"/v1/projects/{pid}/view/files/walls.css").content == b"body { color: red }\n"  # writes stay
    assert ok(c.get(f"/v1/projects/{pid}/draft"))["status"] == "interrupted"

    # a failure is something else: status failed, with its error
    retry = created(c.post(f"/v1/projects/{pid}/turns", json={"user_message": "again", "continue": True}))
    failed = ok(c.post(f"/v1/turns/{retry['id']}/fail", json={"error": {"type": "Timeout", "after_s": 30}}))
    assert (failed["status"], failed["error"], failed["end_reason"]) == ("failed", {"type": "Timeout", "after_s": 30},
                                                                         None)
    assert [t["status"] for t in ok(c.get(f"/v1/projects/{pid}/turns"))["items"]] == ["interrupted", "failed"]


def test_lists_and_turn_ends_leave_the_tool_history_out_rather_than_show_it_empty(service: Service) -> None:
    c = service.client()
    pid = new_project(c)["id"]
    turns = []
    for end in ("complete", "interrupt", "fail", "cancel"):
        t = created(c.post(f"/v1/projects/{pid}/turns", json={"user_message": end, "continue": bool(turns)}))
        seq = created(c.post(f"/v1/turns/{t['id']}/tool-calls", json={"tool_name": "view_file", "args": {}}))["seq"]
        ok(c.post(f"/v1/turns/{t['id']}/tool-calls/{seq}/complete", json={"result": "x"}), 204)
        body = {"complete": {"assistant_message": "done"}, "fail": {"error": "boom"}}.get(end)
        ended = ok(c.post(f"/v1/turns/{t['id']}/{end}", json=body))
        assert "tool_calls" not in ended and ended["id"] == t["id"], ended  # not an empty list: it had one
        turns.append(t["id"])
    listed = ok(c.get(f"/v1/projects/{pid}/turns"))["items"]
    assert [t["id"] for t in listed] == turns and not any("tool_calls" in t for t in listed)
    for turn_id in turns:  # the one place with the history, paged
        assert [x["tool_name"] for x in ok(c.get(f"/v1/turns/{turn_id}"))["tool_calls"]] == ["view_file"]


# -- paging ---------------------------------------------------------------------------------------
def test_directory_listings_diffs_and_snapshots_are_paged_too(service: Service) -> None:
    c, store = service.client(), service.store
    names = [f"f{i:03d}.txt" for i in range(230)]
    p = store.create_project(f"wide-{random_token(4)}", files={f"many/{n}": f"{n}\n" for n in names},
                             characters={"hero": {"hp": 1}})
    url = f"/v1/projects/{p.id}/view/list"
    assert [e["name"] for e in walk(c, url, limit=100, dir="many")] == names
    assert [e["name"] for e in walk(c, url, limit=1, at="head")] == ["many"]
    first = ok(c.get(url, params={"dir": "many"}))
    assert len(first["items"]) == 50 and first["next_cursor"]  # a default page, never the whole directory
    for bad in ({"limit": 201}, {"limit": 0}, {"cursor": "bogus"},
                {"cursor": ok(c.get(f"/v1/projects/{p.id}/versions", params={"limit": 1}))["next_cursor"] or "x"}):
        err(c.get(url, params={"dir": "many", **bad}), 422, "input.invalid")

    # find: a cut answer goes on from its cursor, each path once, in order
    found, cursor = [], None
    for _ in range(10):
        page = ok(c.get(f"/v1/projects/{p.id}/view/find", params={"glob": "many/*.txt", "limit": 100,
                                                               **({"cursor": cursor} if cursor else {})}))
        assert len(page["paths"]) <= 100 and page["truncated"] == (page["next_cursor"] is not None)
        found += page["paths"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert found == [f"many/{n}" for n in names]
    err(c.get(f"/v1/projects/{p.id}/view/find", params={"cursor": first["next_cursor"]}), 422, "input.invalid")

    # search: a cut answer goes on from its cursor, each match once, in file then line order
    search_url = f"/v1/projects/{p.id}/view/search"
    whole = ok(c.get(search_url, params={"q": "txt", "max_results": 10_000}))
    assert len(whole["matches"]) == 230 and not whole["truncated"] and whole["next_cursor"] is None
    got, cursor = [], None
    for _ in range(40):
        page = ok(c.get(search_url, params={"q": "txt", "max_results": 7, **({"cursor": cursor} if cursor else {})}))
        assert len(page["matches"]) <= 7 and page["truncated"] == (page["next_cursor"] is not None)
        got += page["matches"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert got == whole["matches"]
    forged = base64.urlsafe_b64encode(b'["search","many/f000.txt",-1]').decode().rstrip("=")
    for bad in (first["next_cursor"], forged, "x" * 9000):
        err(c.get(search_url, params={"q": "txt", "cursor": bad}), 422, "input.invalid")

    # the longest paths page too (a cursor holds the last path: 1,024 bytes of UTF-8)
    deep = "/".join(["\u00e9" * 100] * 5)  # 1,000 bytes in 5 segments of 200
    long_names = [f"{deep}/{i:02d}\U0001f600" for i in range(5)]
    q = store.create_project(f"long-{random_token(4)}", files={n: f"{n} hit\n" for n in long_names})
    assert [x for x in walk_find(c, q.id, limit=2)] == sorted(long_names)
    paged = ok(c.get(f"/v1/projects/{q.id}/view/search", params={"q": "hit", "max_results": 2}))
    assert paged["next_cursor"]
    rest = ok(c.get(f"/v1/projects/{q.id}/view/search", params={"q": "hit", "cursor": paged["next_cursor"]}))
    assert [m["path"] for m in paged["matches"] + rest["matches"]] == sorted(long_names)

    # a diff of 230 changed files (and the characters): in pages, contents read for the page only
    t = store.start_turn(p.id, "touch them all")
    store.apply_changes(t.id, {f"many/{n}": f"{n} changed\n" for n in names})
    store.patch_characters(t.id, {"hero": {"hp": 2}})
    store.complete_turn(t.id, "ok")
    diff_url = f"/v1/projects/{p.id}/diff"
    pages, cursor = [], None
    while True:
        page = ok(c.get(diff_url, params={"a": "head", "b": "draft", "limit": 100, **({"cursor": cursor} if cursor else {})}))
        pages.append(page)
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert [len(pg["files"]) for pg in pages] == [100, 100, 30]
    assert [f["path"] for pg in pages for f in pg["files"]] == [f"many/{n}" for n in names]
    assert all("+f" in f["unified"] for pg in pages for f in pg["files"])
    assert pages[0]["characters"] and not pages[1]["characters"] and not pages[2]["characters"]
    assert len(ok(c.get(diff_url, params={"a": "head", "b": "draft"}))["files"]) == 50
    err(c.get(diff_url, params={"a": "head", "b": "draft", "limit": 500}), 422, "input.invalid")
    whole = store.diff(f"head:{p.id}", f"draft:{p.id}")  # the library, unpaged: everything
    assert len(whole.files) == 230 and whole.next_cursor is None

    made = [store.record_snapshot(p.id, "head", f"ext:{i}").id for i in range(5)]
    assert [s["id"] for s in walk(c, f"/v1/projects/{p.id}/snapshots", limit=2)] == made
    assert [s.id for s in store.page_snapshots(p.id, limit=3).items] == made[:3]


def test_every_list_pages_without_gaps_or_repeats(service: Service) -> None:
    c, store = service.client(), service.store
    tag = f"paged-{random_token(4)}"
    mine = [store.create_project(f"{tag}-{i}", files={"a.txt": f"{i}\n"}).id for i in range(5)]

    everyone = [p["id"] for p in walk(c, "/v1/projects", limit=200)]  # the real stack's database is shared
    assert len(everyone) == len(set(everyone)), "a project came twice"
    assert [i for i in everyone if i in mine] == mine  # all of ours, oldest first
    small = max(2, len(everyone) // 100)  # many pages, however full the shared database is
    assert [p["id"] for p in walk(c, "/v1/projects", limit=small)] == everyone

    pid = mine[0]
    turn_ids = []
    for i in range(5):
        t = store.start_turn(pid, f"turn {i}")
        store.write_file(t.id, "a.txt", f"turn {i}\n")
        store.complete_turn(t.id, "ok")
        store.publish(pid, f"v{i + 2}")
        turn_ids.append(t.id)
    versions = store.list_versions(pid)
    store.rollback_to(pid, versions[0].id)

    assert [t["id"] for t in walk(c, f"/v1/projects/{pid}/turns", limit=2)] == turn_ids
    assert [v["number"] for v in walk(c, f"/v1/projects/{pid}/versions", limit=4)] == [1, 2, 3, 4, 5, 6]
    assert [v["id"] for v in walk(c, f"/v1/projects/{pid}/versions", limit=200)] == [v.id for v in versions]
    moves = walk(c, f"/v1/projects/{pid}/head-moves", limit=2)
    assert [m["reason"] for m in moves] == ["create"] + ["publish"] * 5 + ["rollback"]
    assert len({m["id"] for m in moves}) == 7
    # newest first: the same items reversed, for every page size (a UI reads only the pages it shows)
    for url, oldest in ((f"/v1/projects/{pid}/turns", turn_ids), (f"/v1/projects/{pid}/versions", [v.id for v in versions]),
                        (f"/v1/projects/{pid}/head-moves", [m["id"] for m in moves])):
        for limit in (1, 2, 3, 200):
            assert [x["id"] for x in walk(c, url, limit=limit, order="newest")] == oldest[::-1], (url, limit)
        first = ok(c.get(url, params={"order": "newest", "limit": 2}))
        assert [x["id"] for x in first["items"]] == oldest[::-1][:2]
        # a cursor belongs to the order it came from
        err(c.get(url, params={"cursor": first["next_cursor"]}), 422, "input.invalid")
        err(c.get(url, params={"order": "oldest", "cursor": first["next_cursor"]}), 422, "input.invalid")
        oldest_cursor = ok(c.get(url, params={"limit": 2}))["next_cursor"]
        err(c.get(url, params={"order": "newest", "cursor": oldest_cursor}), 422, "input.invalid")
        for bad in ("latest", "NEWEST", "", "1"):
            err(c.get(url, params={"order": bad}), 422, "input.invalid")
    # the library: the same order, the same refusals
    assert [t.id for t in store.page_turns(pid, limit=200, newest_first=True).items] == turn_ids[::-1]
    page = store.page_versions(pid, limit=4, newest_first=True)
    assert [v.number for v in page.items] == [6, 5, 4, 3]
    assert [v.number for v in store.page_versions(pid, page.next_cursor, 4, newest_first=True).items] == [2, 1]
    with pytest.raises(E.InvalidInput):
        store.page_versions(pid, page.next_cursor, 4)
    with pytest.raises(E.InvalidInput):
        store.page_head_moves(pid, newest_first="yes")  # type: ignore[arg-type]

    turn = store.start_turn(pid, "many tools")
    for i in range(7):
        store.tool_started(turn.id, f"tool_{i}", {"i": i})
    for ended in (False, True):  # rows while it runs; the compacted history once it ended
        calls = walk(c, f"/v1/turns/{turn.id}/tool-calls", limit=3)
        assert [(t["seq"], t["tool_name"]) for t in calls] == [(i + 1, f"tool_{i}") for i in range(7)]
        first = ok(c.get(f"/v1/turns/{turn.id}", params={"tool_calls_limit": 3}))
        assert [t["seq"] for t in first["tool_calls"]] == [1, 2, 3]
        rest = walk(c, f"/v1/turns/{turn.id}/tool-calls", limit=3, cursor=first["tool_calls_next_cursor"])
        assert [t["seq"] for t in rest] == [4, 5, 6, 7]
        if not ended:
            store.complete_turn(turn.id, "done")


def test_a_bad_cursor_or_limit_is_refused(service: Service) -> None:
    c, store = service.client(), service.store
    p = store.create_project("paging", files={"a.txt": "a"})
    t = store.start_turn(p.id, "x")
    for _ in range(3):
        store.tool_started(t.id, "x")
    lists = ["/v1/projects", f"/v1/projects/{p.id}/turns", f"/v1/projects/{p.id}/versions",
             f"/v1/projects/{p.id}/head-moves", f"/v1/turns/{t.id}/tool-calls", "/v1/tokens"]
    for url in lists:
        for limit in (0, 201, -1, "ten", 10**30):
            err(c.get(url, params={"limit": limit}), 422, "input.invalid")
        for cursor in ("garbage", "!!!", "x" * 9000, b64('["projects"]'), b64("[1, 2]"), b64("not json")):
            err(c.get(url, params={"cursor": cursor}), 422, "input.invalid")
        assert len(ok(c.get(url, params={"limit": 200}))["items"]) <= 200
        ok(c.get(url, params={"limit": 1}))
    err(c.get(f"/v1/turns/{t.id}", params={"tool_calls_limit": 0}), 422, "input.invalid")
    # a forged key no list hands out (text no database takes) is refused, not a server error
    for kind, url in (("projects", "/v1/projects"), ("tokens", "/v1/tokens"),
                      ("snapshots", f"/v1/projects/{p.id}/snapshots")):
        for bad_id in ("\udc80", "a\x00b"):
            raw = json.dumps([kind, "2020-01-01T00:00:00+00:00", bad_id]).encode()
            forged = base64.urlsafe_b64encode(raw).decode().rstrip("=")
            err(c.get(url, params={"cursor": forged}), 422, "input.invalid")
        deep = base64.urlsafe_b64encode(b"[" * 6000).decode().rstrip("=")  # too deep for any JSON parser
        err(c.get(url, params={"cursor": deep}), 422, "input.invalid")
    # a cursor is bound to its list
    cursor = ok(c.get(f"/v1/turns/{t.id}/tool-calls", params={"limit": 1}))["next_cursor"]
    assert cursor is not None
    err(c.get(f"/v1/projects/{p.id}/versions", params={"cursor": cursor}), 422, "input.invalid")
    err(c.get(f"/v1/projects/{p.id}/head-moves", params={"cursor": cursor}), 422, "input.invalid")


# -- the error table ------------------------------------------------------------------------------
def test_unknown_or_malformed_ids_are_not_found(service: Service) -> None:
    c = service.client()
    project = new_project(c)
    pid = project["id"]
    turn = created(c.post(f"/v1/projects/{pid}/turns", json={"user_message": "x"}))
    tid = turn["id"]
    for missing in ("0" * 32, "nope", "NOT-AN-ID", "x" * 100, "%00", "%FF", "..%2F..%2Fetc"):
        for method, url, body, code in [
            ("GET", f"/v1/projects/{missing}", None, "project.not_found"),
            ("GET", f"/v1/projects/{missing}/versions", None, "project.not_found"),
            ("GET", f"/v1/projects/{missing}/view", None, "project.not_found"),
            ("GET", f"/v1/projects/{missing}/view/files/main.py", None, "project.not_found"),
            ("POST", f"/v1/projects/{missing}/turns", {"user_message": "x"}, "project.not_found"),
            ("POST", f"/v1/projects/{missing}/publish", {}, "project.not_found"),
            ("GET", f"/v1/projects/{pid}/versions/{missing}", None, "version.not_found"),
            ("POST", f"/v1/projects/{pid}/rollback", {"version_id": missing}, "version.not_found"),
            ("POST", f"/v1/projects/{pid}/fork", {"name": "f", "version_id": missing}, "version.not_found"),
            ("GET", f"/v1/projects/{pid}/view?at=version:{missing}", None, "version.not_found"),
            ("GET", f"/v1/projects/{pid}/view?at=turn:{missing}:start", None, "turn.not_found"),
            ("GET", f"/v1/projects/{pid}/diff?a=head&b=version:{missing}", None, "version.not_found"),
            ("GET", f"/v1/turns/{missing}", None, "turn.not_found"),
            ("GET", f"/v1/turns/{missing}/tool-calls", None, "turn.not_found"),
            ("POST", f"/v1/turns/{missing}/complete", {"assistant_message": "x"}, "turn.not_found"),
            ("POST", f"/v1/turns/{missing}/heartbeat", None, "turn.not_found"),
            ("POST", f"/v1/turns/{missing}/tool-calls", {"tool_name": "x"}, "turn.not_found"),
            ("PUT", f"/v1/turns/{missing}/files/a.txt", None, "turn.not_found"),
            ("DELETE", f"/v1/tokens/{missing}", None, "token.not_found"),
        ]:
            r = c.request(method, url, json=body) if body is not None else c.request(method, url)
            if r.status_code == 404 and r.json()["code"] == "route.not_found":
                continue  # "..%2F..%2F" may leave no route at all: also a 404, never a 500
            err(r, 404, code)
    for seq in (0, 99, -1, 2**31, 10**30):
        err(c.post(f"/v1/turns/{tid}/tool-calls/{seq}/complete", json={"result": 1}), 404, "toolcall.not_found")
        err(c.post(f"/v1/turns/{tid}/tool-calls/{seq}/approval", json={"approved": True}), 404, "toolcall.not_found")
    err(c.get(f"/v1/projects/{pid}/view/files/nope.py"), 404, "path.not_found")
    err(c.get(f"/v1/projects/{pid}/view/stat/nope.py"), 404, "path.not_found")
    err(c.get(f"/v1/projects/{pid}/view/list", params={"dir": "nope"}), 404, "path.not_found")
    err(c.delete(f"/v1/turns/{tid}/files/nope.py"), 404, "path.not_found")
    err(c.post(f"/v1/turns/{tid}/move", json={"src": "nope.py", "dst": "b.py"}), 404, "path.not_found")
    err(c.get("/v1/no-such-route"), 404, "route.not_found")
    err(c.delete("/v1/projects"), 405, "method.not_allowed")


def test_state_conflicts_are_409(service: Service) -> None:
    c = service.client()
    pid = new_project(c)["id"]
    v1 = ok(c.get(f"/v1/projects/{pid}"))["current_version_id"]
    t1 = created(c.post(f"/v1/projects/{pid}/turns", json={"user_message": "one"}))
    err(c.post(f"/v1/projects/{pid}/turns", json={"user_message": "two"}), 409, "turn.already_running")
    err(c.post(f"/v1/projects/{pid}/publish", json={}), 409, "draft.busy")
    err(c.put(f"/v1/turns/{t1['id']}/files/main.py/inner.py", content=b"x"), 409, "path.conflict")
    created(c.post(f"/v1/turns/{t1['id']}/tool-calls", json={"tool_name": "x"}))
    ok(c.post(f"/v1/turns/{t1['id']}/tool-calls/1/complete", json={"result": "first"}), 204)
    err(c.post(f"/v1/turns/{t1['id']}/tool-calls/1/complete", json={"result": "again"}), 409,
        "toolcall.already_finished")
    err(c.post(f"/v1/turns/{t1['id']}/tool-calls/1/fail", json={"error": "late"}), 409, "toolcall.already_finished")
    err(c.post(f"/v1/turns/{t1['id']}/tool-calls/1/approval", json={"approved": True}), 409,
        "toolcall.not_awaiting_approval")
    ok(c.put(f"/v1/turns/{t1['id']}/files/one.txt", content=b"1"), 204)
    ok(c.put(f"/v1/turns/{t1['id']}/files/uno.txt", content=b"uno"), 204)
    err(c.post(f"/v1/turns/{t1['id']}/move", json={"src": "uno.txt", "dst": "one.txt"}), 409, "path.conflict")
    ok(c.post(f"/v1/turns/{t1['id']}/move", json={"src": "uno.txt", "dst": "one.txt", "overwrite": True}), 204)
    assert c.get(f"/v1/projects/{pid}/view/files/one.txt").content == b"uno"
    ok(c.post(f"/v1/turns/{t1['id']}/complete", json={"assistant_message": "ok"}))
    err(c.post(f"/v1/turns/{t1['id']}/complete", json={"assistant_message": "twice"}), 409, "turn.not_running")
    v2 = created(c.post(f"/v1/projects/{pid}/publish", json={"summary": "one"}))

    # a draft whose base is no longer head: a conflict, unless forced
    t2 = created(c.post(f"/v1/projects/{pid}/turns", json={"user_message": "two"}))
    ok(c.put(f"/v1/turns/{t2['id']}/files/two.txt", content=b"2"), 204)
    ok(c.post(f"/v1/turns/{t2['id']}/complete", json={"assistant_message": "ok"}))
    ok(c.post(f"/v1/projects/{pid}/rollback", json={"version_id": v1}))
    body = err(c.post(f"/v1/projects/{pid}/publish", json={"summary": "two"}), 409, "draft.conflict")
    assert ok(c.get(f"/v1/projects/{pid}"))["current_version_id"] == v1, body  # nothing published
    v3 = created(c.post(f"/v1/projects/{pid}/publish", json={"summary": "two, forced", "force": True}))
    assert v3["parent_version_id"] == v1 and v3["id"] != v2["id"]


def test_a_file_over_the_size_limit_is_413_and_changes_nothing(service_factory: Callable[..., Service]) -> None:
    svc = service_factory(env={"DRAFTSTORE_MAX_FILE_BYTES": "1024"})
    c = svc.client()
    err(c.post("/v1/projects", json={"name": "big", "files": {"big.bin": b64(b"x" * 1025)}}), 413, "payload.too_large")
    pid = new_project(c)["id"]
    tid = created(c.post(f"/v1/projects/{pid}/turns", json={"user_message": "x"}))["id"]

    ok(c.put(f"/v1/turns/{tid}/files/fits.bin", content=b"x" * 1024), 204)
    body = err(c.put(f"/v1/turns/{tid}/files/big.bin", content=b"x" * 1025), 413, "payload.too_large")
    assert body["details"]["limit"] == 1024

    def chunked() -> Iterator[bytes]:  # no Content-Length: the service counts as it reads
        for _ in range(64):
            yield b"y" * 1024

    err(c.put(f"/v1/turns/{tid}/files/streamed.bin", content=chunked()), 413, "payload.too_large")
    err(c.post(f"/v1/turns/{tid}/changes", json={"changes": {"small.txt": b64("ok"), "big.bin": b64(b"x" * 1025)}}),
        413, "payload.too_large")
    assert ok(c.get(f"/v1/projects/{pid}/view/find"))["paths"] == ["fits.bin", "main.py"]  # the batch was atomic
    ok(c.post(f"/v1/turns/{tid}/heartbeat"), 204)  # the turn is fine


def test_bodies_and_parameters_the_service_cannot_read_are_422(service: Service) -> None:
    c = service.client()
    pid = new_project(c)["id"]
    tid = created(c.post(f"/v1/projects/{pid}/turns", json={"user_message": "x"}))["id"]
    json_type = {"content-type": "application/json"}
    for method, url, raw, code in [
        ("POST", "/v1/projects", b'{"name": "x",', "input.invalid"),  # not JSON
        ("POST", "/v1/projects", b"[]", "input.invalid"),  # not an object
        ("POST", "/v1/projects", b"", "input.invalid"),  # no body
        ("POST", "/v1/projects", b'{"name": "\xff\xfe"}', "input.invalid"),  # not UTF-8
        ("POST", "/v1/projects", b'{"name": ' + b"[" * 5000 + b"]" * 5000 + b"}", "input.invalid"),  # too deep
        ("POST", "/v1/projects", b'{"name": "x", "colour": "red"}', "input.invalid"),  # unknown field
        ("POST", "/v1/projects", b'{"name": 5}', "input.invalid"),  # wrong type
        ("POST", "/v1/projects", b'{"name": "x", "files": {"a.txt": "not base64!"}}', "input.invalid"),
        ("POST", "/v1/projects", b'{"name": "x", "files": {"../up.txt": "eA=="}}', "path.denied"),
        ("POST", "/v1/projects", b'{"name": "\\u0000"}', "input.invalid"),
        ("POST", "/v1/projects", b'{"name": "\\ud800"}', "input.invalid"),  # a lone surrogate
        ("POST", f"/v1/projects/{pid}/turns", b'{"user_message": "x", "continue": "maybe"}', "input.invalid"),
        ("POST", f"/v1/projects/{pid}/turns", b'{"user_message": "x", "continue_": true}', "input.invalid"),
        ("POST", f"/v1/projects/{pid}/turns", b'{}', "input.invalid"),
        ("POST", f"/v1/turns/{tid}/tool-calls", b'{"tool_name": "x", "args": NaN}', "input.invalid"),
        ("POST", f"/v1/turns/{tid}/tool-calls", b'{"tool_name": "x", "args": 1e999}', "input.invalid"),
        ("POST", f"/v1/turns/{tid}/tool-calls", b'{"tool_name": ["x"]}', "input.invalid"),
        ("POST", f"/v1/turns/{tid}/tool-calls", b'{"tool_name": "x", "needs_approval": "yes please"}',
         "input.invalid"),
        ("POST", f"/v1/turns/{tid}/tool-calls/one/complete", b"{}", "input.invalid"),
        ("POST", f"/v1/turns/{tid}/changes", b'{"changes": {"a.txt": "%%%"}}', "input.invalid"),
        ("POST", f"/v1/turns/{tid}/changes", b'{"changes": ["a.txt"]}', "input.invalid"),
        ("POST", f"/v1/turns/{tid}/changes", b'{"changes": {"a.txt": 7}}', "input.invalid"),
        ("POST", f"/v1/turns/{tid}/move", b'{"src": "main.py"}', "input.invalid"),
        ("PATCH", f"/v1/turns/{tid}/characters", b'{"patch": [{"op": "explode"}]}', "patch.invalid"),
        ("PATCH", f"/v1/turns/{tid}/characters", b'{"patch": 5}', "patch.invalid"),
        ("PATCH", f"/v1/turns/{tid}/world-settings", b'{"patch": [{"op": "remove", "path": "/nope"}]}',
         "patch.invalid"),
        ("POST", f"/v1/turns/{tid}/deltas", b'{"text": 5}', "input.invalid"),
        ("POST", f"/v1/turns/{tid}/fail", b'{}', "input.invalid"),
        ("POST", f"/v1/projects/{pid}/rollback", b'{"version": "x"}', "input.invalid"),
        ("POST", "/v1/tokens", b'{"role": "root"}', "input.invalid"),
    ]:
        err(c.request(method, url, content=raw, headers=json_type), 422, code)
    for method, url, code in [
        ("PUT", f"/v1/turns/{tid}/files/a%00b.py", "path.denied"),
        ("PUT", f"/v1/turns/{tid}/files/%2E%2E/escape.py", "path.denied"),
        ("GET", f"/v1/projects/{pid}/view/search?q=", "pattern.invalid"),
        ("GET", f"/v1/projects/{pid}/view/search?q=(unclosed&regex=true", "pattern.invalid"),
        ("GET", f"/v1/projects/{pid}/view/search?q=(a)\\1&regex=true", "pattern.invalid"),  # a backreference
        ("GET", f"/v1/projects/{pid}/view/search?q=x&context=-1", "input.invalid"),
        ("GET", f"/v1/projects/{pid}/view/find?glob=[abc", "pattern.invalid"),
        ("GET", f"/v1/projects/{pid}/view/find?glob=**&limit=0", "input.invalid"),
        ("GET", f"/v1/projects/{pid}/view?at=", "input.invalid"),
        ("GET", f"/v1/projects/{pid}/view?at=turn:{tid}:middle", "input.invalid"),
        ("GET", f"/v1/projects/{pid}/diff?a=head", "input.invalid"),
        ("GET", f"/v1/projects/{pid}/view/list?dir=%00", "path.denied"),
    ]:
        err(c.request(method, url, content=b"x" if method == "PUT" else None), 422, code)
    assert ok(c.get(f"/v1/projects/{pid}/view/find"))["paths"] == ["main.py"]  # none of it wrote anything


def test_valid_but_unusual_json_round_trips_and_odd_input_is_never_a_500(service: Service) -> None:
    """orjson refuses some valid JSON (integers over 64 bits, lone surrogates); the service
    must still answer, and answer the same value back. Nesting as deep as the library takes
    (200 levels) round-trips; deeper is refused, typed, wherever it is sent."""
    c = service.client()
    pid = new_project(c)["id"]
    tid = created(c.post(f"/v1/projects/{pid}/turns", json={"user_message": "x"}))["id"]
    huge = 2**70
    deep: Json = "core"
    for _ in range(200):
        deep = [deep]
    for args in ({"n": huge, "m": -huge}, deep):
        call = created(c.post(f"/v1/turns/{tid}/tool-calls", json={"tool_name": "odd", "args": args}))
        assert call["args"] == args
    assert [t["args"] for t in ok(c.get(f"/v1/turns/{tid}"))["tool_calls"]] == [{"n": huge, "m": -huge}, deep]
    deeper = {"k": deep}
    for deepest in (deeper, {"k": [deeper] * 3}, [[[[deeper]]]] * 600):
        err(c.post(f"/v1/turns/{tid}/tool-calls", json={"tool_name": "odd", "args": deepest}), 422, "input.invalid")
        err(c.patch(f"/v1/turns/{tid}/characters", json={"patch": {"deep": deepest}}), 422, "patch.invalid")
        err(c.patch(f"/v1/turns/{tid}/world-settings",
                    json={"patch": [{"op": "add", "path": "/deep", "value": deepest}]}), 422, "patch.invalid")
        err(c.post("/v1/projects", json={"name": "deep", "characters": {"a": deepest}}), 422, "input.invalid")
    ok(c.patch(f"/v1/turns/{tid}/characters", json={"patch": {"d": deep[0][0]}}))  # 199 levels under a key: taken
    assert ok(c.get(f"/v1/projects/{pid}/view", params={"at": "draft"}))["characters"]["d"] == deep[0][0]
    assert ok(c.get(f"/v1/projects/{pid}/diff", params={"a": "head", "b": "draft"}))["characters"]
    assert ok(c.post(f"/v1/turns/{tid}/complete", json={"assistant_message": {"tokens": huge}}))[
        "assistant_message"] == {"tokens": huge}
    # error details that echo what the client sent
    json_type = {"content-type": "application/json"}
    body = err(c.post(f"/v1/projects/{pid}/rollback", content=b'{"version_id": "\\ud800"}', headers=json_type),
               404, "version.not_found")
    assert body["details"]["version_id"] == "\ud800"
    err(c.post(f"/v1/turns/{tid}/tool-calls/{10**25}/fail", json={"error": "x"}), 404, "toolcall.not_found")
    err(c.post("/v1/tokens", content=b'{"role": "agent", "project_id": "\\udfff"}', headers=json_type),
        404, "project.not_found")
    # and the service is still well: a 500 would have closed this connection
    ok(c.get(f"/v1/projects/{pid}"))


# -- the API's description and the probes ------------------------------------------------------
SPEC_ROUTES = {
    ("POST", "/v1/projects"), ("GET", "/v1/projects"), ("GET", "/v1/projects/{project_id}"),
    ("POST", "/v1/projects/{project_id}/turns"), ("GET", "/v1/projects/{project_id}/turns"),
    ("GET", "/v1/turns/{turn_id}"), ("GET", "/v1/turns/{turn_id}/tool-calls"),
    *{("POST", f"/v1/turns/{{turn_id}}/{action}") for action in
      ("complete", "interrupt", "fail", "cancel", "heartbeat", "deltas", "tool-calls", "changes", "move")},
    *{("POST", f"/v1/turns/{{turn_id}}/tool-calls/{{seq}}/{action}") for action in ("complete", "fail", "approval")},
    ("PUT", "/v1/turns/{turn_id}/files/{path}"), ("DELETE", "/v1/turns/{turn_id}/files/{path}"),
    ("PATCH", "/v1/turns/{turn_id}/characters"), ("PATCH", "/v1/turns/{turn_id}/world-settings"),
    ("GET", "/v1/projects/{project_id}/view"), ("GET", "/v1/projects/{project_id}/view/files/{path}"),
    ("GET", "/v1/projects/{project_id}/view/list"), ("GET", "/v1/projects/{project_id}/view/find"),
    ("GET", "/v1/projects/{project_id}/view/search"), ("GET", "/v1/projects/{project_id}/view/stat/{path}"),
    ("GET", "/v1/projects/{project_id}/diff"),
    *{("POST", f"/v1/projects/{{project_id}}/{action}") for action in ("publish", "discard", "rollback", "fork")},
    ("GET", "/v1/projects/{project_id}/versions"), ("GET", "/v1/projects/{project_id}/versions/{version_id}"),
    ("GET", "/v1/projects/{project_id}/head-moves"), ("GET", "/v1/projects/{project_id}/draft"),
    ("POST", "/v1/tokens"), ("GET", "/v1/tokens"), ("DELETE", "/v1/tokens/{token_id}"),
    ("GET", "/healthz"), ("GET", "/readyz"),
}


def test_the_openapi_document_lists_every_route_and_the_docs_are_served(service: Service) -> None:
    anonymous = service.client(token=None)
    doc = ok(anonymous.get("/openapi.json"))
    listed = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    assert SPEC_ROUTES <= listed, f"missing from /openapi.json: {sorted(SPEC_ROUTES - listed)}"
    assert all(path == "/healthz" or path == "/readyz" or path.startswith("/v1/") for _, path in listed)
    put = doc["paths"]["/v1/turns/{turn_id}/files/{path}"]["put"]
    assert "application/octet-stream" in put["requestBody"]["content"]  # raw content, documented as such
    docs = anonymous.get("/docs")
    assert docs.status_code == 200 and "text/html" in docs.headers["content-type"] and "openapi.json" in docs.text


def test_probes_say_live_and_ready(service: Service) -> None:
    anonymous = service.client(token=None)
    assert ok(anonymous.get("/healthz")) == {"status": "ok"}
    assert ok(anonymous.get("/readyz")) == {"status": "ready",
                                            "checks": {"database": "ok", "blobs": "ok", "coordinator": "ok"}}


def test_readyz_names_the_coordinator_when_it_is_down(service_factory: Callable[..., Service]) -> None:
    nothing_listens = f"redis://127.0.0.1:{free_port()}/0"
    svc = service_factory(env={"DRAFTSTORE_COORD_URL": nothing_listens})
    anonymous = svc.client(token=None)
    assert ok(anonymous.get("/healthz")) == {"status": "ok"}  # alive, not ready
    r = anonymous.get("/readyz")
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["status"] == "unavailable" and body["code"] == "backend.unavailable"
    assert set(body["details"]) == {"coordinator"} and "coordinator" in body["message"]
    assert body["checks"]["database"] == "ok" and body["checks"]["blobs"] == "ok"
    assert body["checks"]["coordinator"] != "ok"
    ok(svc.client().get("/v1/projects"))  # the database still answers reads


# -- open mode: no token at all ---------------------------------------------------------------------
class TestOpenMode:
    """With no token in the database the service answers loopback clients, each as an admin.

    These need a database with no token at all, which the real stack's shared
    PostgreSQL never is: ``stack`` is overridden here by a fresh embedded one.
    """

    @pytest.fixture
    def stack(self, tmp_path: Any) -> dict[str, str]:
        return {"database_url": f"sqlite:///{tmp_path}/open.db", "blob_url": f"file://{tmp_path}/blobs"}

    def test_loopback_clients_are_admins_until_the_first_token_exists(
            self, service_factory: Callable[..., Service]) -> None:
        svc = service_factory(with_admin=False)
        anonymous = svc.client(token=None)
        project = created(anonymous.post("/v1/projects", json={"name": "open", "files": {"a.txt": b64("a")}}))
        turn = created(anonymous.post(f"/v1/projects/{project['id']}/turns", json={"user_message": "hi"}))
        ok(anonymous.put(f"/v1/turns/{turn['id']}/files/b.txt", content=b"b"), 204)
        ok(anonymous.get("/v1/tokens"))

        # a remote client behind a proxy on this machine is not a loopback client
        err(anonymous.get("/v1/projects", headers={"x-forwarded-for": "203.0.113.7"}), 401, "auth.required")
        # a token that is sent is checked, open mode or not
        err(anonymous.get("/v1/projects", headers={"authorization": f"Bearer dst_{'0' * 32}_{'A' * 43}"}),
            401, "auth.invalid")

        secret = created(anonymous.post("/v1/tokens", json={"role": "admin", "name": "first"}))["token"]
        started = time.monotonic()
        eventually(lambda: anonymous.get("/v1/projects").status_code == 401, timeout=AUTH_CACHE_S + 5,
                   what="open mode ends once a token exists")
        assert time.monotonic() - started <= AUTH_CACHE_S + 2
        err(anonymous.get("/v1/projects"), 401, "auth.required")
        ok(svc.client(token=secret).get(f"/v1/projects/{project['id']}"))


def test_a_snapshot_is_built_and_listed_over_http_and_an_external_one_recorded(service: Service) -> None:
    c = service.client()
    files = {"main.py": base64.b64encode(b"print(1)\n").decode(), "bin/run": base64.b64encode(b"#!/bin/sh\n").decode()}
    p = c.post("/v1/projects", json={"name": "sandboxed", "files": files}).json()
    built = c.post(f"/v1/projects/{p['id']}/snapshots", json={"source": "head"})
    assert built.status_code == 201, built.text
    snap = built.json()
    assert (snap["status"], snap["source_kind"], snap["source_id"], snap["files"]) == (
        "ready", "version", p["current_version_id"], 2)
    assert snap["bundle_key"] and snap["size_bytes"] > 0
    ext = c.post(f"/v1/projects/{p['id']}/snapshots", json={"source": "head", "external_ref": "e2b:snap-42"}).json()
    assert ext["status"] == "ready" and ext["external_ref"] == "e2b:snap-42" and ext["bundle_key"] is None
    listed = c.get(f"/v1/projects/{p['id']}/snapshots").json()
    assert [s["id"] for s in listed["items"]] == [snap["id"], ext["id"]] and listed["next_cursor"] is None
    r = c.post(f"/v1/projects/{p['id']}/snapshots", json={"source": "draft"})  # no draft: the head, as a view
    assert r.status_code == 201 and r.json()["source_kind"] == "version"
    t = c.post(f"/v1/projects/{p['id']}/turns", json={"user_message": "edit"}).json()
    c.put(f"/v1/turns/{t['id']}/files/new.py", content=b"x = 1\n")
    r = c.post(f"/v1/projects/{p['id']}/snapshots", json={"source": "draft"})  # a turn is writing
    assert (r.status_code, r.json()["code"]) == (409, "draft.busy")
    r = c.post(f"/v1/projects/{p['id']}/snapshots", json={"source": "f" * 32})
    assert (r.status_code, r.json()["code"]) == (404, "version.not_found")
