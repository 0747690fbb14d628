"""Bad input is a typed error, the same on both stacks, and changes nothing.

PostgreSQL and SQLite disagree on what they accept (a NUL character, an
over-long string, an id that is not an id); the caller never sees that: every
case below is the same error class and ``code`` on the embedded and the real
stack, and a snapshot of the project taken before is equal to one taken after.
"""

from __future__ import annotations

import threading

import pytest

from draftstore import (
    InvalidInput,
    PatchInvalid,
    PathDenied,
    PatternInvalid,
    ProjectNotFound,
    Store,
    ToolCallAlreadyFinished,
    ToolCallNotFound,
    TurnNotFound,
    VersionNotFound,
)

NUL = "\x00"
SURROGATE = "\ud800"
LONG_ACTOR = "a" * 201


@pytest.fixture
def store(shared_store: Store) -> Store:
    """One store per flavour for this module (``shared_store``): each test makes its own project,
    and every check compares a snapshot of that project (and the list of projects) before and after."""
    return shared_store


def new_project(store: Store):
    return store.create_project("errors", files={"main.py": "print(1)\n", "a.py": "a = 1\n"},
                                characters={"hero": {"hp": 10}}, world_settings={"era": "bronze"})


def snapshot(store: Store, project_id: str) -> dict:
    """Everything a caller can read about a project (and which projects exist)."""
    project = store.get_project(project_id)
    turns = store.list_turns(project_id)
    view = store.view(project_id)
    return {
        "projects": sorted(x.id for x in store.list_projects()),
        "project": project,
        "turns": turns,
        "tool_calls": {t.id: store.get_turn(t.id).tool_calls for t in turns},
        "draft": store.get_draft(project_id) if project.active_draft_id else None,
        "files": {path: view.read_file(path) for path in view.list_files()},
        "characters": view.characters,
        "world_settings": view.world_settings,
        "versions": store.list_versions(project_id),
        "head_moves": store.head_moves(project_id),
    }


def refused(exc_info, cls: type, code: str) -> None:
    """Exactly this error class (not a parent, not a raw driver error) and code."""
    assert type(exc_info.value) is cls, repr(exc_info.value)
    assert exc_info.value.code == code


@pytest.fixture
def running(store):
    """A project with a running turn that has written a file and recorded a call."""
    p = new_project(store)
    t = store.start_turn(p.id, "work")
    store.write_file(t.id, "b.py", "b = 2\n")
    call = store.tool_started(t.id, "view_file", {"path": "a.py"})
    return p, t, call


@pytest.fixture
def paused(store):
    """A project whose draft holds a completed turn (ready to publish or discard)."""
    p = new_project(store)
    t = store.start_turn(p.id, "work")
    store.write_file(t.id, "b.py", "b = 2\n")
    store.complete_turn(t.id, "done")
    return p, t


# -- actors ----------------------------------------------------------------------------------------
ACTOR_CALLS = {
    "start_turn": lambda s, p, actor: s.start_turn(p.id, "x", actor=actor),
    "continue_turn": lambda s, p, actor: s.continue_turn(p.id, "x", actor=actor),
    "publish": lambda s, p, actor: s.publish(p.id, "x", actor=actor),
    "discard_draft": lambda s, p, actor: s.discard_draft(p.id, actor=actor),
    "rollback_to": lambda s, p, actor: s.rollback_to(p.id, s.list_versions(p.id)[0].id, actor=actor),
    "revert_draft": lambda s, p, actor: s.revert_draft(p.id, s.list_turns(p.id)[-1].id, actor=actor),
    "create_project": lambda s, p, actor: s.create_project("another", files={"x.py": "x"}, actor=actor),
    "fork_project": lambda s, p, actor: s.fork_project(p.current_version_id, "fork", actor=actor),
}


@pytest.mark.parametrize("bad", ["long", "nul", "surrogate", "not_a_string"])
@pytest.mark.parametrize("call", list(ACTOR_CALLS))
def test_a_bad_actor_is_refused_and_changes_nothing(store, paused, call, bad):
    p, _ = paused
    if call == "rollback_to":  # give rollback somewhere to go: a second version
        store.publish(p.id, "v2")
        t = store.start_turn(p.id, "again")
        store.complete_turn(t.id, "ok")
    actor = {"long": LONG_ACTOR, "nul": "ali" + NUL + "ce", "surrogate": "ali" + SURROGATE, "not_a_string": 7}[bad]
    before = snapshot(store, p.id)
    with pytest.raises(InvalidInput) as exc:
        ACTOR_CALLS[call](store, p, actor)
    refused(exc, InvalidInput, "input.invalid")
    assert snapshot(store, p.id) == before


def test_an_actor_of_exactly_200_characters_is_accepted(store):
    actor = "b" * 200
    p = store.create_project("edge", files={"x.py": "x"}, actor=actor)
    t = store.start_turn(p.id, "x", actor=actor)
    store.complete_turn(t.id, "ok")
    v = store.publish(p.id, "v2", actor=actor)
    assert store.get_turn(t.id).actor == actor and v.created_by == actor
    assert [m.actor for m in store.head_moves(p.id)] == [actor, actor]


# -- NUL characters and lone surrogates in stored text ----------------------------------------------
@pytest.mark.parametrize("bad", [NUL, SURROGATE])
def test_a_project_name_with_a_nul_or_a_lone_surrogate_is_refused(store, bad):
    p = new_project(store)
    before = snapshot(store, p.id)
    with pytest.raises(InvalidInput) as exc:
        store.create_project("na" + bad + "me", files={"x.py": "x"})
    refused(exc, InvalidInput, "input.invalid")
    with pytest.raises(InvalidInput) as exc:
        store.fork_project(p.current_version_id, "fo" + bad + "rk")
    refused(exc, InvalidInput, "input.invalid")
    assert snapshot(store, p.id) == before


@pytest.mark.parametrize("field", ["characters", "world_settings", "characters_key"])
@pytest.mark.parametrize("bad", [NUL, SURROGATE])
def test_initial_documents_with_a_nul_or_a_lone_surrogate_are_refused(store, field, bad):
    p = new_project(store)
    before = snapshot(store, p.id)
    doc = {"hero": {"name": "Dra" + bad + "co"}}
    kwargs = {"characters_key": {"characters": {"he" + bad + "ro": 1}}, "characters": {"characters": doc},
              "world_settings": {"world_settings": doc}}[field]
    with pytest.raises(InvalidInput) as exc:
        store.create_project("docs", files={"x.py": "x"}, **kwargs)
    refused(exc, InvalidInput, "input.invalid")
    assert snapshot(store, p.id) == before


@pytest.mark.parametrize("bad", [NUL, SURROGATE])
@pytest.mark.parametrize("where", ["string", "nested", "key"])
def test_a_message_with_a_nul_or_a_lone_surrogate_is_refused(store, where, bad):
    p = new_project(store)
    message = {"string": "hi" + bad, "nested": {"role": "user", "content": [{"type": "text", "text": "h" + bad}]},
               "key": {"ro" + bad + "le": "user"}}[where]
    before = snapshot(store, p.id)
    with pytest.raises(InvalidInput) as exc:
        store.start_turn(p.id, message)
    refused(exc, InvalidInput, "input.invalid")
    assert snapshot(store, p.id) == before  # no turn, no draft

    t = store.start_turn(p.id, "fine")
    store.complete_turn(t.id, "ok")
    before = snapshot(store, p.id)
    with pytest.raises(InvalidInput) as exc:
        store.continue_turn(p.id, message)
    refused(exc, InvalidInput, "input.invalid")
    assert snapshot(store, p.id) == before

    t2 = store.continue_turn(p.id, "again")
    before = snapshot(store, p.id)
    for end in (lambda: store.complete_turn(t2.id, message), lambda: store.fail_turn(t2.id, message),
                lambda: store.interrupt_turn(t2.id, partial_response=message)):
        with pytest.raises(InvalidInput) as exc:
            end()
        refused(exc, InvalidInput, "input.invalid")
        assert snapshot(store, p.id) == before
    assert store.get_turn(t2.id).status == "running"


@pytest.mark.parametrize("bad", [NUL, SURROGATE])
def test_a_summary_with_a_nul_or_a_lone_surrogate_is_refused(store, paused, bad):
    p, _ = paused
    before = snapshot(store, p.id)
    with pytest.raises(InvalidInput) as exc:
        store.publish(p.id, "sum" + bad + "mary")
    refused(exc, InvalidInput, "input.invalid")
    assert snapshot(store, p.id) == before
    assert store.publish(p.id, "summary").number == 2  # the draft is still publishable


@pytest.mark.parametrize("bad", [NUL, SURROGATE])
def test_a_tool_name_or_tool_error_with_a_nul_or_a_lone_surrogate_is_refused(store, running, bad):
    p, t, call = running
    before = snapshot(store, p.id)
    with pytest.raises(InvalidInput) as exc:
        store.tool_started(t.id, "view" + bad + "file", {"path": "a.py"})
    refused(exc, InvalidInput, "input.invalid")
    assert snapshot(store, p.id) == before
    for error in ("disk" + bad + "full", {"type": "IOError", "detail": ["x" + bad]}):
        with pytest.raises(InvalidInput) as exc:
            store.tool_failed(t.id, call.seq, error)
        refused(exc, InvalidInput, "input.invalid")
        assert snapshot(store, p.id) == before
    # the call can still finish, and the next one gets the next seq
    store.tool_failed(t.id, call.seq, "disk full")
    assert store.tool_started(t.id, "view_file", {"path": "b.py"}).seq == call.seq + 1


PATCHES = {
    "merge": lambda bad: {"hero": {"name": "Dra" + bad + "co"}},
    "merge_key": lambda bad: {"he" + bad + "ro": 1},
    "json_patch": lambda bad: [{"op": "add", "path": "/villain", "value": "x" + bad}],
}


@pytest.mark.parametrize("document", ["characters", "world_settings"])
@pytest.mark.parametrize("kind", list(PATCHES))
@pytest.mark.parametrize("bad", [NUL, SURROGATE])
def test_a_patch_with_a_nul_or_a_lone_surrogate_is_refused_as_an_invalid_patch(store, running, document, kind,
                                                                                 bad):
    p, t, _ = running
    patch = getattr(store, f"patch_{document}")
    before = snapshot(store, p.id)
    with pytest.raises(InvalidInput) as exc:
        patch(t.id, PATCHES[kind](bad))
    # the patch itself is not JSON the store can keep: the patch's fault
    refused(exc, PatchInvalid, "patch.invalid")
    assert isinstance(exc.value, InvalidInput)
    assert snapshot(store, p.id) == before


@pytest.mark.parametrize("document", ["characters", "world_settings"])
@pytest.mark.parametrize("value", ["object", "nan", "inf", "set", "bytes"])
@pytest.mark.parametrize("kind", ["merge", "json_patch"])
def test_a_patch_holding_a_non_json_value_is_refused(store, running, document, value, kind):
    p, t, _ = running
    v = {"object": object(), "nan": float("nan"), "inf": float("inf"), "set": {1, 2}, "bytes": b"x"}[value]
    body = {"a": v} if kind == "merge" else [{"op": "add", "path": "/a", "value": v}]
    before = snapshot(store, p.id)
    with pytest.raises(PatchInvalid) as exc:
        getattr(store, f"patch_{document}")(t.id, body)
    refused(exc, PatchInvalid, "patch.invalid")
    assert snapshot(store, p.id) == before
    assert getattr(store, f"patch_{document}")(t.id, {"a": 1})["a"] == 1  # a good patch still applies


def nested(depth: int) -> dict:
    """An object ``depth`` levels deep (objects and arrays in turn)."""
    value: object = "leaf"
    for i in range(depth):
        value = {"k": value} if i % 2 else [value]
    return value if isinstance(value, dict) else {"k": value}


DEEP = {
    "create_project": (InvalidInput, lambda s, p, t, doc: s.create_project("deep", characters={"a": doc})),
    "merge_patch": (PatchInvalid, lambda s, p, t, doc: s.patch_characters(t.id, {"deep": doc})),
    "json_patch": (PatchInvalid, lambda s, p, t, doc: s.patch_world_settings(
        t.id, [{"op": "add", "path": "/deep", "value": doc}])),
    "tool_args": (InvalidInput, lambda s, p, t, doc: s.tool_started(t.id, "x", doc)),
    "user_message": (InvalidInput, lambda s, p, t, doc: s.start_turn(p.id, doc)),
}


@pytest.mark.parametrize("call", list(DEEP))
def test_json_nested_past_the_depth_limit_is_refused_and_changes_nothing(store, call):
    """Arrays and objects more than 200 deep would overflow the stack of whatever walks them
    later (a JSON Patch, a copy, a reader): refused up front, typed; 200 levels are fine."""
    p = new_project(store)
    t = store.start_turn(p.id, "work") if call != "user_message" else None
    cls, do = DEEP[call]
    before = snapshot(store, p.id)
    for depth in (201, 600, 5000):
        with pytest.raises(InvalidInput) as exc:
            do(store, p, t, nested(depth))
        refused(exc, cls, cls.code)
    assert snapshot(store, p.id) == before
    do(store, p, t if t is not None else None, nested(195))  # well inside the limit: taken


def test_a_json_patch_that_nests_its_result_too_deep_is_an_invalid_patch(store):
    """Each ``copy`` of a deep branch into its own deepest point doubles the depth: the result
    is refused as the patch's fault, however deep the copies make it (no stack overflow)."""
    p = new_project(store)
    t = store.start_turn(p.id, "work")
    branch: dict = {}
    for _ in range(150):
        branch = {"k": branch}
    store.patch_characters(t.id, {"d": branch})  # 151 levels: taken
    deepest = "/d" + "/k" * 150
    before = snapshot(store, p.id)
    for copies in (1, 4):
        ops = [{"op": "copy", "from": "/d", "path": deepest + "/k" * (i * 150) + "/x"} for i in range(copies)]
        with pytest.raises(PatchInvalid) as exc:
            store.patch_characters(t.id, ops)
        refused(exc, PatchInvalid, "patch.invalid")
    assert snapshot(store, p.id) == before


def test_depth_is_measured_on_the_text_as_a_walk_of_the_value_would_measure_it():
    """The depth check reads the JSON text (numpy, a chunk at a time): brackets inside strings,
    escaped quotes and backslash runs, across chunk edges of any size, never fool it."""
    import json
    import random

    from draftstore import validation

    def walked(x):
        if isinstance(x, dict):
            return 1 + max((walked(c) for c in x.values()), default=0)
        if isinstance(x, list):
            return 1 + max((walked(c) for c in x), default=0)
        return 0

    rng = random.Random(7)
    texts = ['a"b', "\\", '\\"[', "]]", "{", "x\\\\", 1, None, "\u00e9[", '"', "\\\\\\", '\\\\"']

    def gen(depth=0):
        r = rng.random()
        if depth > 12 or r < 0.3:
            return rng.choice(texts)
        if r < 0.65:
            return [gen(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["k", "[", '"{', "\\"]) + str(i): gen(depth + 1) for i in range(rng.randint(0, 3))}

    chunk = validation._DEPTH_CHUNK
    try:
        for size in (chunk, 1, 2, 3, 7, 64):
            validation._DEPTH_CHUNK = size
            for _ in range(400):
                value = gen()
                text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
                assert validation._depth(text) == walked(value), (size, text)
    finally:
        validation._DEPTH_CHUNK = chunk


def test_the_depth_limit_is_exactly_200_levels():
    from draftstore import validation

    value: object = 1
    for _ in range(200):
        value = [value]
    assert validation.json_text("v", value, 10**6)[0].startswith("[" * 200)
    with pytest.raises(InvalidInput) as exc:
        validation.json_text("v", [value], 10**6)
    refused(exc, InvalidInput, "input.invalid")


# -- file content and paths ----------------------------------------------------------------------------
def test_file_content_with_a_lone_surrogate_is_refused(store, running):
    p, t, _ = running
    before = snapshot(store, p.id)
    with pytest.raises(InvalidInput) as exc:
        store.write_file(t.id, "a.py", SURROGATE)
    refused(exc, InvalidInput, "input.invalid")
    with pytest.raises(InvalidInput) as exc:
        store.apply_changes(t.id, {"c.py": "ok", "a.py": "x" + SURROGATE})
    refused(exc, InvalidInput, "input.invalid")
    assert snapshot(store, p.id) == before
    assert store.view(p.id).read_text("a.py") == "a = 1\n"


@pytest.mark.parametrize("char", [SURROGATE, NUL])
@pytest.mark.parametrize("call", ["write_file", "delete_file", "move_src", "move_dst", "apply_changes", "read"])
def test_a_path_with_a_lone_surrogate_or_a_nul_is_denied(store, running, call, char):
    p, t, _ = running
    bad = "dir/" + char + ".py"
    before = snapshot(store, p.id)
    with pytest.raises(PathDenied) as exc:
        {
            "write_file": lambda: store.write_file(t.id, bad, "x"),
            "delete_file": lambda: store.delete_file(t.id, bad),
            "move_src": lambda: store.move_file(t.id, bad, "ok.py"),
            "move_dst": lambda: store.move_file(t.id, "a.py", bad),
            "apply_changes": lambda: store.apply_changes(t.id, {"ok.py": "x", bad: "y"}),
            "read": lambda: store.view(p.id).read_file(bad),
        }[call]()
    refused(exc, PathDenied, "path.denied")
    assert snapshot(store, p.id) == before


def test_writing_none_as_content_is_refused_and_deletes_nothing(store, running):
    p, t, _ = running
    before = snapshot(store, p.id)
    with pytest.raises(InvalidInput) as exc:
        store.write_file(t.id, "a.py", None)
    refused(exc, InvalidInput, "input.invalid")
    with pytest.raises(InvalidInput) as exc:
        store.write_file(t.id, "b.py", None)  # written by this turn: still not deleted
    refused(exc, InvalidInput, "input.invalid")
    for odd in (12, ["a"], {"a": 1}):
        with pytest.raises(InvalidInput) as exc:
            store.write_file(t.id, "a.py", odd)
        refused(exc, InvalidInput, "input.invalid")
    assert snapshot(store, p.id) == before
    view = store.view(p.id)
    assert view.read_text("a.py") == "a = 1\n" and view.read_text("b.py") == "b = 2\n"


# -- globs and search patterns ----------------------------------------------------------------------------
@pytest.mark.parametrize("glob", ["[", "a[", "src/[!", "**/*.py[", "a" + NUL])
def test_an_unclosed_glob_class_or_a_nul_is_an_invalid_pattern(store, running, glob):
    p, t, _ = running
    before = snapshot(store, p.id)
    view = store.view(p.id)
    with pytest.raises(PatternInvalid) as exc:
        view.find_files(glob)
    refused(exc, PatternInvalid, "pattern.invalid")
    with pytest.raises(PatternInvalid) as exc:
        view.search_code("a", glob=glob)
    refused(exc, PatternInvalid, "pattern.invalid")
    assert view.find_files("*.py") == ["a.py", "b.py", "main.py"]
    assert snapshot(store, p.id) == before


@pytest.mark.parametrize("glob", ["a" + SURROGATE, "src/" + SURROGATE + "*.py"])
def test_a_glob_with_a_lone_surrogate_is_an_invalid_pattern(store, running, glob):
    p, _, _ = running
    before = snapshot(store, p.id)
    view = store.view(p.id)
    with pytest.raises(PatternInvalid) as exc:
        view.find_files(glob)
    refused(exc, PatternInvalid, "pattern.invalid")
    with pytest.raises(PatternInvalid) as exc:
        view.search_code("a", glob=glob)
    refused(exc, PatternInvalid, "pattern.invalid")
    assert snapshot(store, p.id) == before


@pytest.mark.parametrize("pattern", [r"(a)\1", r"(?=x)", r"(?<=a)b", r"(?!x)y", "(", "a{2,1}", "x" + SURROGATE])
def test_a_regex_that_needs_backtracking_or_is_malformed_is_an_invalid_pattern(store, running, pattern):
    p, _, _ = running
    before = snapshot(store, p.id)
    view = store.view(p.id)
    with pytest.raises(PatternInvalid) as exc:
        view.search_code(pattern, regex=True)
    refused(exc, PatternInvalid, "pattern.invalid")
    assert snapshot(store, p.id) == before
    assert [m.path for m in view.search_code(r"a = \d", regex=True)] == ["a.py"]


def test_a_catastrophic_regex_over_a_long_line_completes(store):
    p = new_project(store)
    t = store.start_turn(p.id, "a long line")
    store.write_file(t.id, "long.txt", "a" * 50_000 + "b\n")
    view = store.view(p.id)
    outcome: dict = {}

    def search() -> None:
        try:
            outcome["miss"] = view.search_code(r"(a+)+$", regex=True, glob="long.txt")
            outcome["hit"] = view.search_code(r"(a+)+b$", regex=True, glob="long.txt")
        except BaseException as exc:  # reported below
            outcome["error"] = exc

    worker = threading.Thread(target=search, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "search_code hung on (a+)+$ (backtracking)"
    assert "error" not in outcome, outcome.get("error")
    assert outcome["miss"].matches == [] and outcome["miss"].files_searched == 1
    assert [(m.path, m.line_number) for m in outcome["hit"].matches] == [("long.txt", 1)]


# -- tool-call bookkeeping ------------------------------------------------------------------------------------
def test_finishing_a_tool_call_twice_is_refused(store, running):
    p, t, call = running
    store.tool_completed(t.id, call.seq, {"content": "a = 1\n"})
    before = snapshot(store, p.id)
    for again in (lambda: store.tool_completed(t.id, call.seq, "second"),
                  lambda: store.tool_failed(t.id, call.seq, "too late")):
        with pytest.raises(ToolCallAlreadyFinished) as exc:
            again()
        refused(exc, ToolCallAlreadyFinished, "toolcall.already_finished")
        assert snapshot(store, p.id) == before
    failed = store.tool_started(t.id, "run", {})
    store.tool_failed(t.id, failed.seq, "boom")
    before = snapshot(store, p.id)
    with pytest.raises(ToolCallAlreadyFinished) as exc:
        store.tool_completed(t.id, failed.seq, "rescued")
    refused(exc, ToolCallAlreadyFinished, "toolcall.already_finished")
    assert snapshot(store, p.id) == before


@pytest.mark.parametrize("seq", [0, -1, 2**31, 2**40, -(2**63), 7])
@pytest.mark.parametrize("finish", ["tool_completed", "tool_failed"])
def test_finishing_a_tool_call_that_was_never_started_is_refused(store, running, seq, finish):
    p, t, call = running
    assert call.seq == 1
    before = snapshot(store, p.id)
    with pytest.raises(ToolCallNotFound) as exc:
        getattr(store, finish)(t.id, seq, "x")
    refused(exc, ToolCallNotFound, "toolcall.not_found")
    assert snapshot(store, p.id) == before


@pytest.mark.parametrize("seq", ["1", True, 1.0, None, b"1"])
@pytest.mark.parametrize("finish", ["tool_completed", "tool_failed"])
def test_a_seq_that_is_not_an_integer_is_refused(store, running, seq, finish):
    p, t, call = running
    before = snapshot(store, p.id)
    with pytest.raises(InvalidInput) as exc:
        getattr(store, finish)(t.id, seq, "x")
    refused(exc, InvalidInput, "input.invalid")
    assert snapshot(store, p.id) == before
    assert store.get_turn(t.id).tool_calls[0].status == "started"


def test_a_tool_payload_with_a_nul_is_kept_in_the_blob_store(store):
    p = new_project(store)
    t = store.start_turn(p.id, "binary-ish tool output")
    args = {"x": "a\x00b"}
    result = ["line\x00one", {"k\x00": 1}]
    call = store.tool_started(t.id, "read_raw", args)
    assert call.args_offloaded and call.args is None
    assert NUL not in call.args_preview
    assert store.read_payload(call.args_digest) == args
    store.tool_completed(t.id, call.seq, result)
    small = store.tool_started(t.id, "stat", {"x": "ab"})  # the same size without a NUL stays inline
    store.tool_completed(t.id, small.seq, {"size": 2})

    running_calls = store.get_turn(t.id).tool_calls
    first = running_calls[0]
    assert first.args_offloaded and first.result_offloaded and first.args is None and first.result is None
    assert store.read_payload(first.result_digest) == result
    assert not running_calls[1].args_offloaded and running_calls[1].args == {"x": "ab"}

    store.complete_turn(t.id, "done")
    ended = store.get_turn(t.id).tool_calls
    assert ended == running_calls
    assert store.read_payload(ended[0].args_digest) == args and store.read_payload(ended[0].result_digest) == result


# -- ids that cannot exist ------------------------------------------------------------------------------------------
BAD_IDS = ["", "abc", "x" * 32, "0" * 16 + NUL + "0" * 15, "0" * 32, "A" * 32, "0" * 31 + SURROGATE,
           "0" * 33, " " + "0" * 31, 12345, None]


def _id_calls(p, t, v):
    """(what, expected not-found class, call taking the bad id)."""
    return {
        "get_project": (ProjectNotFound, lambda s, x: s.get_project(x)),
        "get_draft": (ProjectNotFound, lambda s, x: s.get_draft(x)),
        "list_turns": (ProjectNotFound, lambda s, x: s.list_turns(x)),
        "list_versions": (ProjectNotFound, lambda s, x: s.list_versions(x)),
        "head_moves": (ProjectNotFound, lambda s, x: s.head_moves(x)),
        "view": (ProjectNotFound, lambda s, x: s.view(x)),
        "start_turn": (ProjectNotFound, lambda s, x: s.start_turn(x, "hi")),
        "continue_turn": (ProjectNotFound, lambda s, x: s.continue_turn(x, "hi")),
        "publish": (ProjectNotFound, lambda s, x: s.publish(x, "v")),
        "discard_draft": (ProjectNotFound, lambda s, x: s.discard_draft(x)),
        "rollback_to project": (ProjectNotFound, lambda s, x: s.rollback_to(x, v)),
        "rollback_to version": (VersionNotFound, lambda s, x: s.rollback_to(p.id, x)),
        "revert_draft project": (ProjectNotFound, lambda s, x: s.revert_draft(x, t.id)),
        "revert_draft turn": (TurnNotFound, lambda s, x: s.revert_draft(p.id, x)),
        "view_at version": (VersionNotFound, lambda s, x: s.view_at(p.id, x)),
        "get_version": (VersionNotFound, lambda s, x: s.get_version(x)),
        "fork_project": (VersionNotFound, lambda s, x: s.fork_project(x, "fork")),
        "get_turn": (TurnNotFound, lambda s, x: s.get_turn(x)),
        "view_at_turn": (TurnNotFound, lambda s, x: s.view_at_turn(x, "start")),
        "heartbeat": (TurnNotFound, lambda s, x: s.heartbeat(x)),
        "write_file": (TurnNotFound, lambda s, x: s.write_file(x, "a.py", "x")),
        "delete_file": (TurnNotFound, lambda s, x: s.delete_file(x, "a.py")),
        "patch_characters": (TurnNotFound, lambda s, x: s.patch_characters(x, {"a": 1})),
        "tool_started": (TurnNotFound, lambda s, x: s.tool_started(x, "view_file", {})),
        "tool_completed": (TurnNotFound, lambda s, x: s.tool_completed(x, 1, "r")),
        "complete_turn": (TurnNotFound, lambda s, x: s.complete_turn(x, "done")),
        "interrupt_turn": (TurnNotFound, lambda s, x: s.interrupt_turn(x)),
        "fail_turn": (TurnNotFound, lambda s, x: s.fail_turn(x, "e")),
    }


ID_CALLS = list(_id_calls(None, None, None))


@pytest.mark.parametrize("call", ID_CALLS)
def test_an_id_that_cannot_exist_is_not_found_never_a_database_error(store, running, call):
    p, t, _ = running
    v = p.current_version_id
    missing, fn = _id_calls(p, t, v)[call]
    before = snapshot(store, p.id)
    for bad in BAD_IDS:
        with pytest.raises((missing, InvalidInput)) as exc:
            fn(store, bad)
        if isinstance(bad, str):
            refused(exc, missing, missing.code)
        else:
            refused(exc, InvalidInput, "input.invalid")
    assert snapshot(store, p.id) == before
