"""The admin web page (``/admin``), in a real browser and over plain HTTP.

Browser tests drive Debian's headless Chromium (``/usr/bin/chromium``, or
``DRAFTSTORE_CHROMIUM``) through Playwright against the real service started
by ``service_factory``. They run on the **embedded stack only**: the page
talks to nothing but the HTTP API, which the service tests cover on both
stacks, and one stack keeps this file well inside its time budget. Without
Chromium (or Playwright) they skip, except with ``DRAFTSTORE_REQUIRE_REAL=1``
(CI), where that is a failure.

Screenshots of the main pages go to ``test-artifacts/admin/`` at the repo root.

The route test (no browser) runs on both stacks: the page and its assets are
served with the right content types, without a token, and the page's first
API call works in open loopback mode.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from draftstore.service.admin import STATIC_DIR
from service_fixtures import Service, _wait_ready, stack_env
from services import require_real

CHROMIUM = os.environ.get("DRAFTSTORE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "admin"
WAIT_MS = 15_000  # a loaded 2-core machine: generous, only ever reached on failure

# one worker runs the whole file (parallel runs, tests/alone.py): one browser, launched once
pytestmark = pytest.mark.xdist_group("admin_web")

EMBEDDED = pytest.mark.parametrize("stack", ["embedded"], indirect=True)

MARKUP = "add a dragon [/x] <script>window.__xss = 1</script><img src=x onerror=\"window.__xss = 2\">"


def _unavailable(why: str) -> None:
    if require_real():
        pytest.fail(f"the browser tests need Chromium and Playwright (DRAFTSTORE_REQUIRE_REAL=1): {why}")
    pytest.skip(f"browser tests: {why}")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).is_file():
        _unavailable(f"no Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:  # pragma: no cover - a test dependency
        _unavailable(f"playwright is not installed ({exc})")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh tab (own sessionStorage); any uncaught script error fails the test."""
    from playwright.sync_api import expect

    expect.set_options(timeout=WAIT_MS)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(WAIT_MS)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def login(page: Any, service: Service, secret: str | None) -> None:
    from playwright.sync_api import expect

    page.goto(f"{service.url}/admin")
    expect(page.locator("#login-form")).to_be_visible()
    page.fill("#token", secret or "")
    page.click("#login-submit")
    expect(page.locator("#projects")).to_be_visible()


def confirm(page: Any, **fields: str) -> None:
    from playwright.sync_api import expect

    dialog = page.locator("dialog#confirm")
    expect(dialog).to_be_visible()
    for name, value in fields.items():
        dialog.locator(f"#confirm-{name}").fill(value)
    dialog.locator("#confirm-ok").click()
    expect(dialog).to_be_hidden()


def call_row(page: Any, seq: int) -> Any:
    return page.locator(f"#tool-calls li.call[data-seq='{seq}']")


# -- the whole story, as an admin ---------------------------------------------------------
@EMBEDDED
def test_an_admin_watches_a_turn_live_publishes_diffs_and_rolls_back(service: Service, page: Any) -> None:
    from playwright.sync_api import expect

    store = service.store
    project = store.create_project("game <b>one</b>", files={"main.py": "print(1)\n", "src/util.py": "X = 1\n"},
                                   characters={"hero": {"hp": 10}}, world_settings={"era": "bronze"})
    v1 = project.current_version_id
    turn = store.start_turn(project.id, MARKUP, actor="agent-7")
    store.tool_started(turn.id, "view_file", {"path": "main.py"})
    store.tool_completed(turn.id, 1, {"content": "<b>print(1)</b>"})
    api = service.client()
    actor = f"admin-web:{api.get('/v1/whoami').json()['token_id']}"  # what the page records on what it does

    # log in: a wrong token shows its code, the admin token shows the projects
    page.goto(f"{service.url}/admin")
    expect(page.locator("#login-form")).to_be_visible()
    shot(page, "01-login")
    page.fill("#token", "dst_not_a_token")
    page.click("#login-submit")
    expect(page.locator("#login-form .error .errcode")).to_have_text("auth.invalid")
    page.fill("#token", service.admin or "")
    page.click("#login-submit")
    link = page.locator("#projects a.project-link", has_text="game")
    expect(link).to_have_text("game <b>one</b>")  # stored text, shown as text
    assert page.evaluate("sessionStorage.getItem('draftstore.admin.token')") == service.admin
    expect(page.locator("#who-role")).to_have_text("admin")
    expect(page.locator("#who-scope")).to_have_text("every project")
    shot(page, "02-projects")

    # the project: head v1, a running draft, the turn
    link.click()
    expect(page.locator("#head-number")).to_have_text("v1")
    expect(page.locator("#draft-status")).to_contain_text("running")
    expect(page.locator("#turns-table tbody tr")).to_have_count(1)
    page.locator(f"#turns-table tr[data-turn='{turn.id}'] a").click()

    # the timeline: what is recorded so far, then what a backend records while the page is open
    expect(page.locator("#user-message pre")).to_have_text(MARKUP)
    expect(call_row(page, 1)).to_have_attribute("data-status", "completed")
    expect(page.locator("#stream-state")).to_have_attribute("data-state", "live")
    page.evaluate("window.__sameDocument = true")

    r = api.post(f"/v1/turns/{turn.id}/tool-calls", json={"tool_name": "write_file", "args": {"path": "dragon.py"}})
    assert r.status_code == 201 and r.json()["seq"] == 2
    expect(call_row(page, 2)).to_have_attribute("data-status", "started")
    expect(call_row(page, 2).locator(".tool")).to_have_text("write_file")
    assert api.put(f"/v1/turns/{turn.id}/files/dragon.py", content=b"class Dragon:\n    hp = 99\n").status_code == 204
    assert api.post(f"/v1/turns/{turn.id}/tool-calls/2/complete", json={"result": {"ok": True}}).status_code == 204
    expect(call_row(page, 2)).to_have_attribute("data-status", "completed")
    expect(call_row(page, 2).locator(".took")).to_contain_text("s")  # a duration (ms or s)

    # a call that needs approval: approved from the page
    r = api.post(f"/v1/turns/{turn.id}/tool-calls",
                 json={"tool_name": "rm", "args": {"path": "src/util.py"}, "needs_approval": True})
    assert r.json()["seq"] == 3
    expect(call_row(page, 3)).to_have_attribute("data-status", "awaiting_approval")
    call_row(page, 3).locator("button.approve").click()
    confirm(page, reason="fine <i>by me</i>")
    expect(call_row(page, 3)).to_have_attribute("data-status", "started")
    expect(call_row(page, 3).locator(".approval")).to_contain_text("approved")
    expect(call_row(page, 3).locator(".approval")).to_contain_text("fine <i>by me</i>")
    expect(call_row(page, 3).locator(".approval")).to_contain_text(f"by {actor}")
    assert api.post(f"/v1/turns/{turn.id}/tool-calls/3/complete", json={"result": "<script>x</script>"}).status_code == 204
    expect(call_row(page, 3)).to_have_attribute("data-status", "completed")

    # a failed call, patched documents and streamed assistant text, recorded through the store directly
    seq = store.tool_started(turn.id, "run_tests", {"cmd": "pytest"}).seq
    store.tool_failed(turn.id, seq, "1 failed: <b>test_dragon</b>")
    expect(call_row(page, 4)).to_have_attribute("data-status", "failed")
    expect(call_row(page, 4).locator("details.err pre")).to_have_text("1 failed: <b>test_dragon</b>")
    store.patch_characters(turn.id, {"hero": {"hp": 12}, "dragon": {"hp": 99}})
    store.patch_world_settings(turn.id, {"era": "iron"})
    for text in ("A dragon ", "now lives ", "here."):
        assert api.post(f"/v1/turns/{turn.id}/deltas", json={"text": text}).status_code == 204
    expect(page.locator("#live-text pre")).to_have_text("A dragon now lives here.")
    call_row(page, 1).locator("details[data-part='result'] summary").click()
    expect(call_row(page, 1).locator("details[data-part='result'] pre")).to_contain_text("<b>print(1)</b>")
    shot(page, "03-turn-live")

    assert api.post(f"/v1/turns/{turn.id}/complete", json={"assistant_message": "Added a <dragon>."}).status_code == 200
    expect(page.locator("#turn-status")).to_have_text("completed")
    expect(page.locator("#assistant-message")).to_have_text("Added a <dragon>.")
    expect(page.locator("#stream-state")).to_have_attribute("data-state", "ended")
    expect(page.locator("#tool-calls li.call")).to_have_count(4)
    assert page.evaluate("window.__sameDocument") is True  # updated in place, never reloaded
    shot(page, "04-turn-completed")

    # publish from the project page
    page.locator(".crumbs a").nth(1).click()
    expect(page.locator("#draft-status")).to_contain_text("paused")
    page.click("#publish")
    confirm(page, summary="a dragon")
    expect(page.locator("#action-status .notice")).to_have_text("Published version 2.")
    expect(page.locator("#head-number")).to_have_text("v2")
    expect(page.locator("#draft-status")).to_have_text("No open draft.")
    v2 = store.get_project(project.id).current_version_id
    assert v2 != v1
    assert api.get(f"/v1/projects/{project.id}/versions/{v2}").json()["created_by"] == actor

    # the diff v1 -> v2, side by side
    page.locator(f"#versions-table tr[data-version='{v2}'] a", has_text="diff vs parent").click()
    expect(page.locator("#diff-summary")).to_contain_text("1 file changed (1 added)")
    added = page.locator("#diff-files .file[data-path='dragon.py']")
    expect(added.locator("td.add")).to_have_text(["class Dragon:", "    hp = 99"])
    chars = page.locator("#diff-characters")
    expect(chars.locator("td.del")).to_contain_text(['"hp": 10'])
    expect(chars.locator("td.add")).to_contain_text(['"hp": 12'])
    expect(chars.locator("td.add", has_text='"dragon": {')).to_have_count(1)
    expect(page.locator("#diff-world td.del")).to_have_text(['  "era": "bronze"'])
    expect(page.locator("#diff-world td.add")).to_have_text(['  "era": "iron"'])
    shot(page, "05-diff")

    # roll back to v1 while a new draft (based on v2) is open; publishing it then is a conflict, shown by code
    more = store.start_turn(project.id, "more dragons")
    store.write_file(more.id, "dragon2.py", "class Dragon2: ...\n")
    store.complete_turn(more.id, "two dragons")
    page.locator(".crumbs a").nth(1).click()
    expect(page.locator("#draft-status")).to_contain_text("paused")
    page.locator(f"#versions-table tr[data-version='{v1}'] button.rollback").click()
    confirm(page)
    expect(page.locator("#action-status .notice")).to_have_text("Head is now v1.")
    expect(page.locator("#head-number")).to_have_text("v1")
    expect(page.locator("#moves-table tbody tr").first).to_have_attribute("data-reason", "rollback")
    assert store.get_project(project.id).current_version_id == v1
    moves = api.get(f"/v1/projects/{project.id}/head-moves").json()["items"]
    assert [(m["reason"], m["actor"]) for m in moves[-2:]] == [("publish", actor), ("rollback", actor)]
    page.click("#publish")
    confirm(page, summary="stale")
    expect(page.locator("#action-status .error .errcode")).to_have_text("draft.conflict")
    assert store.get_project(project.id).current_version_id == v1
    shot(page, "06-project-conflict")

    # discard: the draft is gone
    page.click("#discard")
    confirm(page)
    expect(page.locator("#action-status .notice")).to_have_text("The draft was discarded.")
    expect(page.locator("#draft-status")).to_have_text("No open draft.")


# -- the stream survives a restart of the service ------------------------------------------
def restart_on_same_port(svc: Service, stack: dict[str, str]) -> None:
    """Kill the service (its streams break mid-read) and start it again on the same address."""
    svc.proc.kill()
    svc.proc.wait(timeout=20)
    port = svc.url.rsplit(":", 1)[1]
    cmd = [sys.executable, "-m", "uvicorn", "draftstore.service.app:create_app", "--factory", "--host", "127.0.0.1",
           "--port", port, "--log-level", "warning", "--no-access-log"]
    svc.proc = subprocess.Popen(cmd, env=stack_env(stack), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _wait_ready(svc.url, svc.proc)


@EMBEDDED
def test_the_timeline_reconnects_with_last_event_id_and_the_token_in_a_header(
        service: Service, stack: dict[str, str], page: Any) -> None:
    """On the embedded stack the event buffers live in the coordinator file, so a restarted
    service still holds them: the page resumes after the last event it saw, and catches up."""
    from playwright.sync_api import expect

    store = service.store
    project = store.create_project("restarts")
    turn = store.start_turn(project.id, "keep going")
    store.tool_started(turn.id, "first", {})
    streams: list[dict[str, str]] = []
    page.on("request", lambda req: streams.append(req.all_headers())
            if req.url.endswith(f"/v1/turns/{turn.id}/events") else None)

    login(page, service, service.admin)
    page.goto(f"{service.url}/admin#/t/{turn.id}")
    expect(call_row(page, 1)).to_have_attribute("data-status", "started")
    expect(page.locator("#stream-state")).to_have_attribute("data-state", "live")
    page.evaluate("window.__sameDocument = true")

    restart_on_same_port(service, stack)
    store.tool_completed(turn.id, 1, "done while the page was away")
    store.tool_started(turn.id, "second", {"n": 2})
    expect(call_row(page, 1)).to_have_attribute("data-status", "completed")
    expect(call_row(page, 2)).to_have_attribute("data-status", "started")
    expect(page.locator("#stream-state")).to_have_attribute("data-state", "live")
    assert page.evaluate("window.__sameDocument") is True

    assert len(streams) >= 2, streams
    first, *again = streams
    assert "last-event-id" not in first
    assert first["authorization"] == f"Bearer {service.admin}"
    assert all(h["authorization"] == f"Bearer {service.admin}" for h in again)
    assert all(re.fullmatch(r"[^:]+:\d+", h.get("last-event-id", "")) for h in again), again
    assert all(service.admin not in url for url in page.evaluate("performance.getEntries().map(e => e.name)"))


# -- an observer, an agent: the page offers only what the role may do -----------------------
def api_from_page(page: Any, path: str) -> dict[str, Any]:
    """A call made by the page's own code, with the tab's token: what the API itself answers."""
    return page.evaluate("""async (path) => {
        const {get} = await import('/admin/static/api.js');
        try { return {status: 200, body: await get(path)}; } catch (e) { return {status: e.status, code: e.code}; }
    }""", path)


@EMBEDDED
def test_an_observer_sees_published_versions_and_no_draft_turns_or_admin_buttons(service: Service, page: Any) -> None:
    from playwright.sync_api import expect

    store = service.store
    project = store.create_project("watched", files={"a.txt": "one\n"})
    first = store.start_turn(project.id, "two")
    store.write_file(first.id, "a.txt", "two\n")
    store.complete_turn(first.id, "done")
    v2 = store.publish(project.id, "second").id
    turn = store.start_turn(project.id, "secret work")
    store.write_file(turn.id, "secret.txt", "draft only\n")
    requested: list[str] = []
    page.on("request", lambda req: requested.append(req.url))

    secret = service.token("observer")
    login(page, service, secret)
    expect(page.locator("#who-role")).to_have_text("observer")
    expect(page.locator("#who-scope")).to_have_text("every project")
    expect(page.locator("#projects thead th", has_text="draft")).to_have_count(0)
    page.locator("#projects a.project-link", has_text="watched").click()
    expect(page.locator("#head-number")).to_have_text("v2")
    expect(page.locator("#versions-table tbody tr")).to_have_count(2)
    expect(page.locator("#moves-table tbody tr")).to_have_count(2)
    expect(page.locator("#observer-note")).to_have_text("observers see published versions and their diffs")
    for absent in ("#draft", "#turns", "#publish", "#discard", "#diff-draft", "button.rollback", ".error",
                   "a.turn-ref"):
        expect(page.locator(absent)).to_have_count(0)
    expect(page.locator("code.turn-ref")).to_have_count(2)  # the turn that published v2, as an id only
    # not offered, and not even asked for
    assert not [u for u in requested if re.search(r"/draft$|/turns(\?|$)", u)], requested
    shot(page, "07-observer-project")

    # the API still refuses what the page no longer offers
    assert api_from_page(page, f"/v1/projects/{project.id}/draft") == {"status": 403, "code": "auth.forbidden"}
    r = service.client(token=secret).post(f"/v1/projects/{project.id}/rollback",
                                                json={"version_id": project.current_version_id})
    assert (r.status_code, r.json()["code"]) == (403, "auth.forbidden")
    assert store.get_project(project.id).current_version_id == v2

    # published versions diff fine; the draft is not among the states to pick, and a link to it is denied
    page.locator(f"#versions-table tr[data-version='{v2}'] a", has_text="diff vs parent").click()
    expect(page.locator("#diff-files td.del")).to_have_text(["one"])
    expect(page.locator("#diff-files td.add")).to_have_text(["two"])
    expect(page.locator("#state-a option[value='draft']")).to_have_count(0)
    page.goto(f"{service.url}/admin#/p/{project.id}/diff?a=head&b=draft")
    expect(page.locator("#diff-result .error .errcode")).to_have_text("auth.forbidden")
    assert page.locator("text=secret.txt").count() == 0
    shot(page, "08-observer-diff-denied")

    # the turn's timeline is not an observer's either
    page.goto(f"{service.url}/admin#/t/{turn.id}")
    expect(page.locator("#main .error .errcode")).to_have_text("auth.forbidden")
    assert page.locator("#tool-calls").count() == 0


@EMBEDDED
def test_an_agent_sees_the_draft_and_turns_but_no_admin_buttons(service: Service, page: Any) -> None:
    from playwright.sync_api import expect

    store = service.store
    project = store.create_project("worked on", files={"a.txt": "one\n"})
    first = store.start_turn(project.id, "two")
    store.write_file(first.id, "a.txt", "two\n")
    store.complete_turn(first.id, "done")
    store.publish(project.id, "second")
    store.complete_turn(store.start_turn(project.id, "more").id, "paused")

    login(page, service, service.token("agent", project.id))
    expect(page.locator("#who-role")).to_have_text("agent")
    expect(page.locator("#who-scope")).to_have_text(f"project {project.id[:8]}")
    page.locator("#projects a.project-link", has_text="worked on").click()
    expect(page.locator("#draft-status")).to_contain_text("paused")
    expect(page.locator("#turns-table tbody tr")).to_have_count(2)
    expect(page.locator("#diff-draft")).to_be_visible()
    expect(page.locator("#versions-table tbody tr")).to_have_count(2)
    for absent in ("#publish", "#discard", "button.rollback", "#observer-note"):
        expect(page.locator(absent)).to_have_count(0)
    # the API still refuses an agent's publish
    assert page.evaluate("""async (base) => {
        const {post} = await import('/admin/static/api.js');
        try { await post(`${base}/publish`, {summary: "x"}); return "published"; } catch (e) { return e.code; }
    }""", f"/v1/projects/{project.id}") == "auth.forbidden"
    assert store.get_project(project.id).active_draft_id is not None


@EMBEDDED
def test_an_approver_decides_a_call_from_the_turn_page_and_the_agent_is_offered_no_decision(
        service: Service, page: Any) -> None:
    from playwright.sync_api import expect

    store = service.store
    project = store.create_project("guarded", files={"a.txt": "one\n"})
    turn = store.start_turn(project.id, "clean up")
    store.tool_started(turn.id, "run_shell", {"cmd": "rm -rf build"}, needs_approval=True)

    # the agent sees the call waiting, and no button to decide it
    login(page, service, service.token("agent", project.id))
    page.goto(f"{service.url}/admin#/t/{turn.id}")
    expect(call_row(page, 1).locator(".approval")).to_contain_text("an admin or an approver decides")
    expect(call_row(page, 1).locator("button.approve")).to_have_count(0)
    page.locator("#logout").click()

    # the approver: the project's turns (no draft), the turn, and the decision
    login(page, service, service.token("approver", project.id))
    expect(page.locator("#who-role")).to_have_text("approver")
    expect(page.locator("#projects thead th", has_text="draft")).to_have_count(0)
    page.locator("#projects a.project-link", has_text="guarded").click()
    expect(page.locator("#turns-table tbody tr")).to_have_count(1)
    for absent in ("#draft", "#publish", "#discard", "button.rollback", "#diff-draft", ".error"):
        expect(page.locator(absent)).to_have_count(0)
    page.locator("#turns-table tbody a").first.click()
    call_row(page, 1).locator("button.approve").click()
    confirm(page, reason="Alice said yes")
    expect(call_row(page, 1).locator(".approval")).to_contain_text("approved")
    shot(page, "09-approver-decided")
    call = store.get_turn(turn.id).tool_calls[0]
    assert call.status == "started" and call.approval["reason"] == "Alice said yes"


# -- leaving a page: nothing of it survives -------------------------------------------------
SLOW_VERSIONS = """(() => { const f = window.fetch; window.fetch = async (u, i) => {
  if (window.__slow && String(u).includes('/versions?')) await new Promise(r => setTimeout(r, 600));
  return f(u, i); }; })()"""


@EMBEDDED
def test_leaving_a_loading_page_leaks_no_stream_and_a_bad_address_is_an_error(service: Service, page: Any) -> None:
    """A project page left while it loads opens no event stream: after more such leaves than the
    browser's six connections per host, the next project page still loads."""
    from playwright.sync_api import expect

    project = service.store.create_project("left early", files={"a.txt": "1\n"})
    streams: list[str] = []
    page.on("request", lambda req: streams.append(req.url) if req.url.endswith("/events") else None)
    page.add_init_script(SLOW_VERSIONS)
    login(page, service, service.admin)
    page.evaluate("window.__slow = true")
    for i in range(7):
        page.evaluate(f"location.hash = '#/p/{project.id}'")
        page.wait_for_timeout(150)  # the versions are still on their way
        page.evaluate(f"location.hash = '#/?x={i}'")
        expect(page.locator("#projects")).to_be_visible()
    page.wait_for_timeout(700)  # every slowed read has come back to a page that is gone
    assert streams == []
    page.evaluate("window.__slow = false")
    page.evaluate(f"location.hash = '#/p/{project.id}'")
    expect(page.locator("#head-number")).to_have_text("v1", timeout=6000)
    for _ in range(50):  # the stream opens just after the page is drawn
        if streams:
            break
        page.wait_for_timeout(100)
    assert len(streams) == 1, streams

    # a bad percent escape in the address: an error on the page, not an uncaught exception
    page.evaluate("location.hash = '#/p/%E0'")
    expect(page.locator("#main .error .errcode")).to_have_text("route.invalid")


@EMBEDDED
def test_a_question_does_not_outlive_its_page(service: Service, page: Any) -> None:
    """A confirmation open when the page is left (the back button, say) is cancelled: its OK can
    never act on the project the user has since left. Its title names the project."""
    from playwright.sync_api import expect

    store = service.store
    a = store.create_project("AAA", files={"a.txt": "1\n"})
    t = store.start_turn(a.id, "x")
    store.write_file(t.id, "a.txt", "2\n")
    store.complete_turn(t.id, "ok")
    v1 = a.current_version_id
    v2 = store.publish(a.id, "v2").id
    b = store.create_project("BBB", files={"b.txt": "1\n"})
    login(page, service, service.admin)
    page.evaluate(f"location.hash = '#/p/{a.id}'")
    page.locator(f"#versions-table tr[data-version='{v1}'] button.rollback").click()
    expect(page.locator("dialog#confirm")).to_be_visible()
    expect(page.locator("#confirm-title")).to_have_text("Roll AAA back to v1?")
    page.evaluate(f"location.hash = '#/p/{b.id}'")
    expect(page.locator("#project-name")).to_contain_text("BBB")
    expect(page.locator("dialog#confirm")).to_be_hidden()
    page.wait_for_timeout(300)
    assert store.get_project(a.id).current_version_id == v2
    assert page.locator("#action-status").text_content() == ""

    # the draft's questions name the project too
    t = store.start_turn(b.id, "y")
    store.complete_turn(t.id, "ok")
    page.reload()
    expect(page.locator("#draft-status")).to_contain_text("paused")
    page.click("#publish")
    expect(page.locator("#confirm-title")).to_have_text("Publish the draft of BBB?")
    page.locator("#confirm-cancel").click()
    page.click("#discard")
    expect(page.locator("#confirm-title")).to_have_text("Discard the draft of BBB?")
    page.locator("#confirm-cancel").click()
    expect(page.locator("dialog#confirm")).to_be_hidden()
    assert store.get_project(b.id).active_draft_id is not None


@EMBEDDED
def test_a_revert_of_the_draft_shows_in_the_history_and_marks_the_undone_turns(service: Service, page: Any) -> None:
    from playwright.sync_api import expect

    store = service.store
    project = store.create_project("reverted", files={"n.txt": "0\n"})
    turns = []
    for n in (1, 2, 3):
        turn = store.start_turn(project.id, f"turn {n}") if n == 1 else store.continue_turn(project.id, f"turn {n}")
        store.write_file(turn.id, "n.txt", f"{n}\n")
        store.complete_turn(turn.id, "ok")
        turns.append(turn)
    store.revert_draft(project.id, turns[1].id, actor="alice")

    login(page, service, service.admin)
    page.goto(f"{service.url}/admin#/p/{project.id}")
    revert = page.locator("#moves-table tbody tr").first
    expect(revert).to_have_attribute("data-reason", "revert")
    expect(revert).to_contain_text("draft → start of turn")
    expect(revert).to_contain_text("alice")
    for turn, undone in zip(turns, (False, True, True)):
        expect(page.locator(f"#turns-table tr[data-turn='{turn.id}'] .reverted")).to_have_count(1 if undone else 0)
    expect(page.locator(f"#turns-table tr[data-turn='{turns[2].id}'] .reverted")).to_have_attribute(
        "title", re.compile(r"reverted .* by alice"))


@EMBEDDED
def test_long_lists_show_their_newest_items_and_say_older_ones_are_not_shown(service: Service, page: Any) -> None:
    """Lists longer than the page's caps (lowered here) show the newest items, read newest first
    (only the pages that hold them), and say older ones are left out; head's version is shown
    even when it is older than every version listed."""
    from playwright.sync_api import expect

    store = service.store
    project = store.create_project("long", files={"n.txt": "0\n"})
    v1 = project.current_version_id
    for n in range(1, 7):  # v2 .. v7, six turns
        turn = store.start_turn(project.id, f"turn {n}")
        store.write_file(turn.id, "n.txt", f"{n}\n")
        store.complete_turn(turn.id, "ok")
        store.publish(project.id, f"number {n + 1}")
    store.rollback_to(project.id, v1)  # head moves: create, 6 publishes, this rollback

    login(page, service, service.admin)
    lists: list[str] = []  # the list requests the page sends
    page.on("request", lambda r: lists.append(r.url) if re.search(r"/(versions|turns|head-moves)\?", r.url) else None)
    page.evaluate("""async () => {
        const {LIMITS} = await import('/admin/static/project.js');
        Object.assign(LIMITS, {versions: 3, moves: 4, turns: 2, page: 2});
    }""")
    page.evaluate(f"location.hash = '#/p/{project.id}'")
    expect(page.locator("#versions-table tbody tr")).to_have_count(3)
    numbers = page.locator("#versions-table tbody tr").evaluate_all("rows => rows.map(r => r.dataset.number)")
    assert numbers == ["7", "6", "5"]
    expect(page.locator("#versions-older")).to_have_text("Showing the newest 3 versions; older ones are not shown.")
    expect(page.locator("#head-number")).to_have_text("v1")  # read by id: older than the versions shown
    expect(page.locator("#moves-table tbody tr")).to_have_count(4)
    expect(page.locator("#moves-table tbody tr").first).to_have_attribute("data-reason", "rollback")
    expect(page.locator("#moves-table tbody tr").first).to_contain_text("v7 → v1")
    expect(page.locator("#moves-older")).to_have_text("Showing the newest 4 head moves; older ones are not shown.")
    expect(page.locator("#turns-table tbody tr")).to_have_count(2)
    expect(page.locator("#turns-table tbody tr").first).to_contain_text("turn 6")
    expect(page.locator("#turns-older")).to_have_text("Showing the newest 2 turns; older ones are not shown.")
    # every list is read newest first, and no further than the items shown: the 2 newest turns are
    # one page of 2 (never a second page), the 3 newest versions a page of 2 and one of 1
    assert lists and all("order=newest" in u for u in lists), lists
    turns = [u for u in lists if "/turns?" in u]
    assert turns and all("limit=2" in u and "cursor=" not in u for u in turns), turns
    versions = [u for u in lists if "/versions?" in u]
    assert all("limit=2" in u and "cursor=" not in u or "limit=1" in u and "cursor=" in u for u in versions), versions
    shot(page, "09-long-lists")

    # lists within their caps have no such line; the diff page names head by its number all the same
    page.evaluate("""async () => {
        const {LIMITS} = await import('/admin/static/project.js');
        Object.assign(LIMITS, {versions: 5000, moves: 2000, turns: 1000, page: 200});
    }""")
    page.evaluate(f"location.hash = '#/p/{project.id}/diff?a=head&b=head'")
    expect(page.locator("#diff-summary")).to_contain_text("head (v1)")
    page.evaluate(f"location.hash = '#/p/{project.id}'")
    expect(page.locator("#versions-table tbody tr")).to_have_count(7)
    for older in ("#versions-older", "#moves-older", "#turns-older"):
        expect(page.locator(older)).to_have_count(0)


@EMBEDDED
def test_the_stream_reader_backs_off_and_resets_once_live(service_factory: Any, page: Any) -> None:
    """``follow()`` against a fake fetch: failures back off (0.5, 1, 2 s …); a connection that went
    live and delivered events resets the wait to 0.5 s; 200 answers that end without an event back
    off as failures do; an answer that is not an event stream ends the stream (no retry)."""
    svc = service_factory(with_admin=False)
    page.goto(f"{svc.url}/admin")
    got = page.evaluate("""async () => {
      const {follow} = await import('/admin/static/api.js');
      const t0 = performance.now();
      const calls = {flaky: [], empty: [], html: []};
      const enc = new TextEncoder();
      window.fetch = async (url, init) => {
        const kind = url.split('/').pop();
        calls[kind].push(Math.round(performance.now() - t0));
        const n = calls[kind].length;
        if (kind === 'flaky') {
          if (n <= 2) throw new TypeError('Failed to fetch');
          const body = new ReadableStream({start(c) {
            c.enqueue(enc.encode('id: e:' + n + '\\r\\nevent: x\\r\\ndata: {}\\r\\n\\r\\n'));
            setTimeout(() => c.error(new TypeError('network error')), 100);
          }});
          return new Response(body, {status: 200, headers: {'content-type': 'text/event-stream'}});
        }
        if (kind === 'empty') return new Response('', {status: 200, headers: {'content-type': 'text/event-stream'}});
        return new Response('<html>a proxy</html>', {status: 200, headers: {'content-type': 'text/html'}});
      };
      const states = {flaky: [], empty: [], html: []};
      const streams = Object.keys(calls).map((k) => follow('/x/' + k, {onEvent: () => {}, onState: (s, e) => states[k].push(e && e.code ? `${s}:${e.code}` : s)}));
      await new Promise((r) => setTimeout(r, 4300));
      streams.forEach((s) => s.close());
      return {calls, states};
    }""")
    gaps = {k: [b - a for a, b in zip(v, v[1:])] for k, v in got["calls"].items()}
    flaky = gaps["flaky"]
    # two failures (0.5 s, 1 s), then every live connection (events, then a break after 0.1 s) waits 0.5 s again
    assert 400 <= flaky[0] < 900 and 900 <= flaky[1] < 1500, flaky
    assert len(flaky) >= 4 and all(550 <= g < 1000 for g in flaky[2:]), flaky
    # empty 200 answers: 0.5, 1, 2 s … not a 0.5 s loop
    empty = gaps["empty"]
    assert len(empty) >= 2 and 400 <= empty[0] < 900 and 900 <= empty[1] < 1500, empty
    assert len(got["calls"]["empty"]) <= 4, got["calls"]["empty"]
    # not an event stream: asked once, refused for good
    assert len(got["calls"]["html"]) == 1
    assert got["states"]["html"] == ["connecting", "denied:stream.not_sse"]


# -- open loopback mode and the SSE parser, in the browser ----------------------------------
@EMBEDDED
def test_open_mode_needs_no_login_and_the_sse_parser_handles_split_lines(service_factory: Any, page: Any) -> None:
    from playwright.sync_api import expect

    svc = service_factory(with_admin=False)
    svc.store.create_project("open <project>")
    page.goto(f"{svc.url}/admin")
    expect(page.locator("#open-mode")).to_be_visible()
    expect(page.locator("#who-role")).to_have_text("admin")
    expect(page.locator("#projects a.project-link")).to_have_text("open <project>")
    assert page.locator("#login-form").count() == 0

    # CRLF split across chunks, comments, an id-only event, multi-line data
    got = page.evaluate("""async () => {
        const {SSEParser} = await import('/admin/static/api.js');
        const events = [], ids = [];
        const p = new SSEParser((e) => events.push(e), (id) => ids.push(id));
        for (const chunk of [': ping\\r', '\\n\\r\\nid: e:1\\r\\nevent: tool.started\\r', '\\ndata: {"seq"',
                             ': 1}\\r\\n\\r', '\\nid: e:2\\r\\n\\r\\n', 'data: a\\ndata: b\\n\\n']) p.push(chunk);
        return {events, ids};
    }""")
    assert got["events"] == [{"type": "tool.started", "data": '{"seq": 1}', "id": "e:1"},
                             {"type": "message", "data": "a\nb", "id": "e:2"}]
    assert got["ids"] == ["e:1", "e:2"]


# -- the routes, without a browser ----------------------------------------------------------
def test_the_page_and_its_assets_are_served_with_their_types_and_no_token(service_factory: Any) -> None:
    svc = service_factory(with_admin=False)  # open loopback mode: no token exists
    c = svc.client(token=None)
    for path in ("/admin", "/admin/"):
        r = c.get(path)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "text/html; charset=utf-8"
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"
        assert '<script type="module" src="/admin/static/app.js">' in r.text

    types = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
             ".html": "text/html; charset=utf-8"}
    names = sorted(p.name for p in STATIC_DIR.iterdir() if p.is_file())
    assert {"index.html", "app.js", "admin.css"} <= set(names)
    for name in names:
        r = c.get(f"/admin/static/{name}")
        assert r.status_code == 200, name
        assert r.headers["content-type"] == types[Path(name).suffix], name
        assert r.content == (STATIC_DIR / name).read_bytes()
    # every module the page imports is shipped, flat in the folder
    index = (STATIC_DIR / "index.html").read_text()
    referenced = set(re.findall(r'/admin/static/([\w.-]+)', index))
    for name in names:
        if name.endswith(".js"):
            referenced |= set(re.findall(r'from "\./([\w.-]+)"', (STATIC_DIR / name).read_text()))
    assert referenced <= set(names), referenced - set(names)

    # nothing but the shipped files: no other type, no paths, nothing hidden
    for bad in ("nope.js", "__init__.py", "..%2F__init__.py", ".hidden.js", "%2E%2E%2Fadmin%2F__init__.py"):
        r = c.get(f"/admin/static/{bad}")
        assert r.status_code == 404, bad
        assert r.json()["code"] == "route.not_found"
    # the path exactly as written (httpx would resolve the dots before sending it)
    host, port = svc.url.removeprefix("http://").rsplit(":", 1)
    for raw in ("../__init__.py", "%2e%2e/__init__.py", "..%2F__init__.py", "%2e%2e%2f__init__.py",
                "..%5C__init__.py", "../../routes/streams.py"):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("GET", f"/admin/static/{raw}")
            r = conn.getresponse()
            body = r.read()
        finally:
            conn.close()
        assert r.status == 404, (raw, r.status)
        assert b"from __future__" not in body and b"import" not in body, raw

    # the page's first call works without a token from loopback; the admin routes are not API
    assert c.get("/v1/projects?limit=1").status_code == 200
    assert not [p for p in httpx.get(f"{svc.url}/openapi.json").json()["paths"] if p.startswith("/admin")]


def _sse_events(client: httpx.Client, url: str, until: str) -> list[tuple[str, Any]]:
    """Read an SSE stream from its start until an event of type ``until``: [(type, data)]."""
    out: list[tuple[str, Any]] = []
    kind, data = "message", []
    with client.stream("GET", url, headers={"accept": "text/event-stream"}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
            elif line == "":
                if data:
                    out.append((kind, json.loads("\n".join(data))))
                    if kind == until:
                        return out
                kind, data = "message", []
    return out


def test_an_observer_s_project_stream_carries_no_draft_event(service: Service) -> None:
    """After turns, a discard and a publish, the project's stream (replayed from its start, and as a
    JSON page) gives an observer the published versions and head moves only: no draft event, and no
    event naming a draft. An admin's stream has the discard."""
    store = service.store
    project = store.create_project("watched stream", files={"a.txt": "1\n"})
    turn = store.start_turn(project.id, "thrown away")
    store.write_file(turn.id, "a.txt", "x\n")
    store.complete_turn(turn.id, "ok")
    admin = service.client()
    assert admin.post(f"/v1/projects/{project.id}/discard", json={}).status_code == 200
    turn = store.start_turn(project.id, "kept")
    store.write_file(turn.id, "a.txt", "2\n")
    store.complete_turn(turn.id, "ok")
    assert admin.post(f"/v1/projects/{project.id}/publish", json={"summary": "two"}).status_code == 201

    observer = service.client(token=service.token("observer"))
    url = f"/v1/projects/{project.id}/events?after=0"
    seen = _sse_events(observer, url, until="version.published")
    assert [t for t, _ in seen] == ["version.published"], seen
    assert not [d for _, d in seen if "draft_id" in d]
    page = observer.get(url, headers={"accept": "application/json"}).json()
    assert [e["type"] for e in page["events"]] == ["version.published"], page
    assert "draft" not in json.dumps(page["events"])

    mine = [t for t, _ in _sse_events(admin, url, until="version.published")]
    assert mine == ["draft.discarded", "version.published"], mine
    page = admin.get(url, headers={"accept": "application/json"}).json()
    assert [e["type"] for e in page["events"]] == ["draft.discarded", "version.published"], page


def test_no_stored_text_goes_through_innerHTML() -> None:
    """The page builds every node with textContent / createTextNode; markup sinks are not used at all."""
    sinks = re.compile(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function")
    for path in STATIC_DIR.glob("*.js"):
        assert not sinks.search(path.read_text()), path.name


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))


@EMBEDDED
def test_calls_a_turn_left_unfinished_show_interrupted_and_expired_not_running(service: Service, page: Any) -> None:
    from playwright.sync_api import expect

    store = service.store
    project = store.create_project("cut short", files={"a.txt": "one\n"})
    turn = store.start_turn(project.id, "clean up")
    store.tool_started(turn.id, "run_tests", {})
    store.tool_started(turn.id, "run_shell", {"cmd": "rm -rf build"}, needs_approval=True)
    store.interrupt_turn(turn.id)

    login(page, service, service.admin)
    page.goto(f"{service.url}/admin#/t/{turn.id}")
    expect(call_row(page, 1)).to_have_attribute("data-status", "interrupted")
    expect(call_row(page, 1).locator(".badge")).to_have_text("interrupted")
    expect(call_row(page, 1).locator(".unfinished")).to_contain_text("never finished")
    expect(call_row(page, 2)).to_have_attribute("data-status", "expired")
    expect(call_row(page, 2).locator(".badge")).to_have_text("expired")
    expect(call_row(page, 2).locator(".unfinished")).to_contain_text("no decision")
    expect(call_row(page, 2).locator("button.approve")).to_have_count(0)
