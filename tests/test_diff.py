"""Diffs between versions, drafts and turn boundaries; cost follows the change."""

from __future__ import annotations

from draftstore import Store


def _tree(n_dirs: int, per_dir: int) -> dict[str, bytes]:
    return {f"d{i:03}/s{j % 4}/f{j:03}.txt": f"line {i} {j}\n".encode() for i in range(n_dirs) for j in range(per_dir)}


def test_diff_reports_added_modified_deleted_renamed_with_unified_text(store: Store) -> None:
    p = store.create_project("diff", files={"a.txt": b"one\ntwo\n", "b.txt": b"bee\n", "c.bin": b"\x00\x01",
                                            "keep/x.txt": b"same\n"}, characters={"hero": "Ann"})
    v1 = p.current_version_id
    t = store.start_turn(p.id, "edit")
    store.apply_changes(t.id, {"a.txt": b"one\nTWO\n", "new.txt": b"fresh\n", "c.bin": b"\x00\x02"})
    store.move_file(t.id, "b.txt", "moved/b.txt")
    store.patch_characters(t.id, {"hero": "Bea", "villain": "Cy"})
    # draft (unsealed overlay) against the version
    d = store.diff(v1, f"draft:{p.id}")
    files = d.by_path()
    assert set(files) == {"a.txt", "new.txt", "c.bin", "moved/b.txt"}
    assert files["a.txt"].status == "modified" and "-two\n+TWO\n" in files["a.txt"].unified
    assert files["new.txt"].status == "added" and "+fresh" in files["new.txt"].unified
    assert files["c.bin"].status == "modified" and files["c.bin"].binary and files["c.bin"].unified is None
    assert files["moved/b.txt"].status == "renamed" and files["moved/b.txt"].old_path == "b.txt"
    assert {op["path"] for op in d.characters} == {"/hero", "/villain"}
    assert d.world_settings == []
    store.complete_turn(t.id, "ok")
    v2 = store.publish(p.id, "edited")
    sealed = store.diff(v1, v2.id)
    assert {f.path: f.status for f in sealed.files} == {f.path: f.status for f in d.files}
    back = store.diff(v2.id, v1, detect_renames=False).by_path()
    assert back["b.txt"].status == "added" and back["moved/b.txt"].status == "deleted"
    assert store.diff(v2.id, v2.id).empty


def test_diff_between_turn_boundaries(store: Store) -> None:
    p = store.create_project("turns", files={"x.py": b"x = 1\n"})
    t1 = store.start_turn(p.id, "first")
    store.write_file(t1.id, "y.py", b"y = 2\n")
    store.interrupt_turn(t1.id)
    t2 = store.continue_turn(p.id, "second")
    store.write_file(t2.id, "x.py", b"x = 3\n")
    store.complete_turn(t2.id, "ok")
    assert {f.path: f.status for f in store.diff(f"turn:{t1.id}:start", f"turn:{t1.id}:end").files} == {"y.py": "added"}
    assert {f.path: f.status for f in store.diff(f"turn:{t2.id}:start", f"turn:{t2.id}:end").files} == {"x.py": "modified"}
    assert store.diff(f"turn:{t1.id}:end", f"turn:{t2.id}:start").empty


def test_diff_work_is_proportional_to_the_change_not_to_project_size(store: Store) -> None:
    visited = {}
    for n_dirs in (2, 40):
        p = store.create_project(f"size-{n_dirs}", files=_tree(n_dirs, 25))
        v1 = p.current_version_id
        t = store.start_turn(p.id, "one change")
        store.write_file(t.id, "d001/s1/f005.txt", b"changed\n")
        store.complete_turn(t.id, "ok")
        v2 = store.publish(p.id, "one change").id
        d = store.diff(v1, v2)
        assert [(f.path, f.status) for f in d.files] == [("d001/s1/f005.txt", "modified")]
        visited[n_dirs] = d.nodes_visited
    # root, d001, d001/s1 on each side: the 20x bigger project costs the same
    assert visited[2] == visited[40] == 6
