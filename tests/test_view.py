"""The agent's read tools, on both stacks: they always see the newest state."""

from __future__ import annotations

import threading

import pytest

from draftstore import PathDenied, PathNotFound, PatternInvalid, Store, TurnAlreadyRunning, VersionNotFound


def _project(store: Store) -> tuple[str, str]:
    files = {f"src/pkg{i}/mod{j}.py": f"def f{j}():\n    return {i * j}\n# tag-{i}\n".encode()
             for i in range(4) for j in range(5)}
    files["assets/logo.png"] = b"\x89PNG\x00\x00tag-1 inside binary"
    files["README.md"] = b"# demo\nsee src/\n"
    p = store.create_project("view", files=files, characters={"hero": {"hp": 1}}, world_settings={"era": "iron"})
    return p.id, p.current_version_id


def test_find_files_supports_double_star_is_sorted_and_capped(store: Store) -> None:
    pid, _ = _project(store)
    view = store.view(pid)
    assert view.find_files("*.md") == ["README.md"]
    deep = view.find_files("**/mod1.py")
    assert deep == [f"src/pkg{i}/mod1.py" for i in range(4)] and not deep.truncated
    capped = view.find_files("src/**", limit=3)
    assert capped == ["src/pkg0/mod0.py", "src/pkg0/mod1.py", "src/pkg0/mod2.py"] and capped.truncated
    assert view.find_files("nothing/**") == []
    with pytest.raises(PatternInvalid):
        view.find_files("")


def test_list_dir_and_stat_describe_the_merged_draft(store: Store) -> None:
    pid, _ = _project(store)
    turn = store.start_turn(pid, "reorganise")
    store.write_file(turn.id, "src/new/x.py", b"x = 1\n")
    store.delete_file(turn.id, "src/pkg3/mod0.py")
    view = store.view(pid)
    top = {e.name: e.kind for e in view.list_dir("")}
    assert top == {"README.md": "file", "assets": "dir", "src": "dir"}
    src = {e.name: (e.kind, e.size) for e in view.list_dir("src")}
    assert src["new"] == ("dir", 1) and src["pkg3"] == ("dir", 4)
    st = view.stat("src/new/x.py")
    assert st.size == 6 and len(st.digest) == 64
    with pytest.raises(PathNotFound):
        view.list_dir("src/pkg3/mod1.py")
    with pytest.raises(PathNotFound):
        view.stat("src/pkg3/mod0.py")
    with pytest.raises(PathDenied):
        view.stat("../etc/passwd")


def test_search_code_finds_literals_with_context_and_skips_binaries(store: Store) -> None:
    pid, _ = _project(store)
    res = store.view(pid).search_code("tag-1", context=1)
    assert [m.path for m in res.matches] == [f"src/pkg1/mod{j}.py" for j in range(5)]
    first = res.matches[0]
    assert first.line_number == 3 and first.line == "# tag-1" and first.before == ("    return 0",)
    assert first.after == ()
    # the version's trigram index knows assets/logo.png is binary: it is never even read
    assert res.binary_files_skipped == 0 and not res.truncated
    # a binary written in the draft is read, recognised and skipped
    t = store.start_turn(pid, "add a binary")
    store.write_file(t.id, "assets/new.bin", b"\x00\x01tag-1")
    res = store.view(pid).search_code("tag-1")
    assert [m.path for m in res.matches] == [f"src/pkg1/mod{j}.py" for j in range(5)]
    assert res.binary_files_skipped == 1


def test_search_code_regex_glob_and_cap(store: Store) -> None:
    pid, _ = _project(store)
    view = store.view(pid)
    res = view.search_code(r"return 1\d", regex=True)
    assert sorted(m.line for m in res) == ["    return 12"]
    only = view.search_code("def f", glob="src/pkg2/**", max_results=3)
    assert len(only) == 3 and only.truncated and all(m.path.startswith("src/pkg2/") for m in only)
    with pytest.raises(PatternInvalid) as err:
        view.search_code("(unclosed", regex=True)
    assert err.value.code == "pattern.invalid"
    with pytest.raises(PatternInvalid):
        view.search_code("x", max_results=0)


def test_search_sees_unsealed_draft_writes(store: Store) -> None:
    pid, _ = _project(store)
    turn = store.start_turn(pid, "add needle")
    store.write_file(turn.id, "src/pkg0/needle.py", b"NEEDLE = 'here'\n")
    res = store.view(pid).search_code("NEEDLE")
    assert [(m.path, m.line_number) for m in res] == [("src/pkg0/needle.py", 1)]


def test_a_pinned_view_does_not_change_under_a_concurrent_writer(store: Store) -> None:
    pid, _ = _project(store)
    turn = store.start_turn(pid, "write a lot")
    store.write_file(turn.id, "src/pkg0/mod0.py", b"version 0\n")
    pinned = store.view(pid)
    files_before = pinned.list_files()
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(1, 31):
                store.apply_changes(turn.id, {"src/pkg0/mod0.py": f"version {i}\n".encode(),
                                              f"src/extra/f{i}.py": b"x"})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            stop.set()

    t = threading.Thread(target=writer)
    t.start()
    seen = set()
    while not stop.is_set():
        seen.add(pinned.read_file("src/pkg0/mod0.py"))
        assert pinned.list_files() == files_before
    t.join()
    assert not errors
    assert seen == {b"version 0\n"}
    fresh = store.view(pid)
    assert fresh.read_file("src/pkg0/mod0.py") == b"version 30\n"
    assert len(fresh.find_files("src/extra/*")) == 30


def test_view_at_a_version_and_at_turn_boundaries(store: Store) -> None:
    pid, v1 = _project(store)
    turn = store.start_turn(pid, "change hero")
    store.write_file(turn.id, "README.md", b"# changed\n")
    store.patch_characters(turn.id, [{"op": "replace", "path": "/hero/hp", "value": 7}])
    with pytest.raises(TurnAlreadyRunning):
        store.view_at_turn(turn.id, "end")
    store.complete_turn(turn.id, "done")
    start, end = store.view_at_turn(turn.id, "start"), store.view_at_turn(turn.id, "end")
    assert start.read_file("README.md") == b"# demo\nsee src/\n" and start.characters["hero"]["hp"] == 1
    assert end.read_file("README.md") == b"# changed\n" and end.characters["hero"]["hp"] == 7
    v2 = store.publish(pid, "changed")
    assert store.view_at(pid, v1).read_file("README.md") == b"# demo\nsee src/\n"
    assert store.view_at(pid, v2.id).world_settings == {"era": "iron"}
    with pytest.raises(VersionNotFound):
        store.view_at(pid, "0" * 32)


def test_the_object_cache_is_bounded_in_bytes(stack: dict) -> None:
    from draftstore import Settings

    store = Store.open(**stack, settings=Settings(cache_bytes=64 * 1024), migrate=True)
    try:
        files = {f"f{i}.txt": bytes([i % 256]) * 4000 for i in range(100)}
        pid = store.create_project("cache", files=files).id
        view = store.view(pid)
        for path in files:
            assert view.read_file(path) == files[path]
        assert store.cache.size_bytes <= 64 * 1024
    finally:
        store.close()
