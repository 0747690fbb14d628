"""Merkle trees: encoding is canonical, sealing rewrites only changed paths."""

from __future__ import annotations

import pytest

from draftstore.blobs import DirectoryBlobStore, ObjectCache
from draftstore.digest import EMPTY_TREE, digest_of
from draftstore.errors import IntegrityError
from draftstore.trees import Entry, FileEntry, TreeReader, decode_tree, encode_tree


@pytest.fixture
def trees(tmp_path) -> TreeReader:
    cache = ObjectCache(1 << 20)
    return TreeReader(DirectoryBlobStore(tmp_path, cache=cache), cache)


def _file(trees: TreeReader, data: bytes, executable: bool = False) -> FileEntry:
    return FileEntry(trees.blobs.put(data), len(data), executable)


def test_encoding_is_canonical_and_round_trips() -> None:
    d = digest_of(b"x")
    a = {"b": Entry("b", "f", d, 1), "a": Entry("a", "d", d, 3), "name with space": Entry("name with space", "f", d, 1)}
    data = encode_tree(a)
    assert data == encode_tree(dict(reversed(list(a.items()))))
    assert decode_tree(data) == a
    assert encode_tree({}) == b"tree 1\n" and digest_of(encode_tree({})) == EMPTY_TREE


def test_a_malformed_tree_object_is_an_integrity_error() -> None:
    with pytest.raises(IntegrityError):
        decode_tree(b"not a tree")
    with pytest.raises(IntegrityError):
        decode_tree(b"tree 1\nf abc\n")


def test_sealing_builds_nested_directories_and_counts_files(trees: TreeReader) -> None:
    root, count = trees.seal(EMPTY_TREE, {"a/b/c.txt": _file(trees, b"1"), "a/d.txt": _file(trees, b"2"),
                                          "e.txt": _file(trees, b"3")})
    assert count == 3
    assert [p for p, _ in trees.walk(root)] == ["a/b/c.txt", "a/d.txt", "e.txt"]
    assert trees.lookup(root, "a").is_dir and trees.lookup(root, "a").size == 2
    assert trees.blobs.get(trees.lookup(root, "a/b/c.txt").digest) == b"1"
    assert trees.lookup(root, "a/b/c.txt/x") is None and trees.lookup(root, "zzz") is None


def test_files_lists_what_walk_lists_with_the_same_entries(trees: TreeReader) -> None:
    changes = {f"d{i % 3}/s{i % 5}/f-{i}.py": _file(trees, str(i).encode(), executable=i % 7 == 0)
               for i in range(60)}
    changes.update({"top.txt": _file(trees, b"t"), "a-b": _file(trees, b"ab"), "a/b": _file(trees, b"a/b")})
    root, count = trees.seal(EMPTY_TREE, changes)
    files = trees.files(root)
    assert files == dict(trees.walk(root)) and len(files) == count == len(changes)
    assert {p: (e.digest, e.size, e.executable) for p, e in files.items()} == {
        p: (f.digest, f.size, f.executable) for p, f in changes.items()}
    assert trees.files(EMPTY_TREE) == {}


def test_same_content_gives_the_same_root_whatever_the_order_of_writes(trees: TreeReader) -> None:
    f1, f2 = _file(trees, b"1"), _file(trees, b"2")
    r1, _ = trees.seal(EMPTY_TREE, {"x/1": f1, "y/2": f2})
    r2, _ = trees.seal(EMPTY_TREE, {"y/2": f2})
    r2, _ = trees.seal(r2, {"x/1": f1})
    assert r1 == r2


def test_sealing_one_change_rewrites_only_the_directories_on_its_path(trees: TreeReader) -> None:
    files = {f"d{i}/s{j}/f{k}.txt": _file(trees, f"{i}{j}{k}".encode()) for i in range(5) for j in range(5)
             for k in range(5)}
    root, count = trees.seal(EMPTY_TREE, files)
    assert count == 125
    before = set(trees.blobs.iter_digests())
    new_root, count = trees.seal(root, {"d2/s3/f4.txt": _file(trees, b"changed")})
    created = set(trees.blobs.iter_digests()) - before
    # the changed file's blob + 3 tree nodes (root, d2, d2/s3): O(depth), not O(files)
    assert len(created) == 4
    assert count == 125
    untouched = trees.lookup(root, "d1")
    assert trees.lookup(new_root, "d1") == untouched


def test_deleting_the_last_file_removes_empty_directories(trees: TreeReader) -> None:
    root, _ = trees.seal(EMPTY_TREE, {"a/b/c": _file(trees, b"1"), "z": _file(trees, b"2")})
    root, count = trees.seal(root, {"a/b/c": None, "missing/file": None})
    assert count == 1 and trees.lookup(root, "a") is None
    root, count = trees.seal(root, {"z": None})
    assert root == EMPTY_TREE and count == 0


def test_an_executable_file_is_its_own_kind_of_entry_and_changes_the_tree_digest(trees):
    plain, _ = trees.seal(EMPTY_TREE, {"run.sh": _file(trees, b"echo hi\n")})
    runnable, _ = trees.seal(EMPTY_TREE, {"run.sh": _file(trees, b"echo hi\n", executable=True)})
    assert plain != runnable
    entry = trees.lookup(runnable, "run.sh")
    assert entry.kind == "x" and entry.executable and entry.file().executable
    assert not trees.lookup(plain, "run.sh").executable
    assert b"x " in trees.blobs.get(runnable)


def test_a_tree_object_with_an_unknown_entry_kind_is_malformed():
    with pytest.raises(IntegrityError):
        decode_tree(b"tree 1\nq " + b"0" * 64 + b" 1 name\n")
