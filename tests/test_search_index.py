"""The trigram search index is only ever a filter: a search through it equals a full scan.

- a property test on both stacks: random small corpora (random paths in a few
  directories, text from a small alphabet so patterns hit, some binary files),
  packed by ``create_project`` (with the pack limits drawn small too, so that
  spines, ``files`` packs, multi-part packs and loose files all occur), searched
  with random literals and regexes, with and without a glob, with small and
  large caps; the same view with its index turned off (a ``Planner`` without indexes)
  is the oracle. Then again on a draft whose overlay writes, modifies and
  deletes files, once more after the turn ends (sealed, partly packed), and
  after publishing it (the new version packed by ``run_background``); the index
  shape is drawn too: the production format 2, format 2 with tiny limits (every
  trigram in a shard, many frames, one ranged read per frame, one shard per
  query), and old stores (format-1 packs and indexes, still read);
- gc keeps every shard a live index names; fsck reports a missing one;
- unit tests of ``required_trigrams`` on tricky patterns: whatever the pattern,
  a file that matches is never excluded by the index.
"""

from __future__ import annotations

import json
import re
from array import array
from contextlib import ExitStack
from typing import Any
from unittest import mock

import pytest
import sqlalchemy as sa
import zstandard
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from draftstore import PatternInvalid, Settings, Store
from draftstore import packing as packing_module
from draftstore import packs as packs_module
from draftstore.search import linetables as linetables_module
from draftstore.search import trigrams as trigrams_module
from draftstore.search import planner as planner_module
from draftstore.db.tables import PACKS
from draftstore.digest import Digest, digest_of
from draftstore.search import Planner, Searcher
from draftstore.search.packed import index_key
from draftstore.search.trigrams import IndexDirectory, IndexObjects, SearchIndex, required_trigrams

KELVIN = "\u212a"  # KELVIN SIGN: RE2 folds it with k and K
LONG_S = "\u017f"  # LATIN SMALL LETTER LONG S: RE2 folds it with s and S


# =====================================================================================
# fixtures and helpers
# =====================================================================================
def lines(result: Any) -> list[tuple[str, int, str]]:
    return [(m.path, m.line_number, m.line) for m in result.matches]


def scan_view(store: Store, project_id: str) -> Any:
    """The newest state with its index turned off: every file is read (the oracle)."""
    view = store.view(project_id)
    view._search = Planner()  # noqa: SLF001 - no indexes: every file is read
    return view


def outcome(view: Any, pattern: str, **kw: Any) -> tuple[str, Any]:
    try:
        res = view.search_code(pattern, **kw)
    except PatternInvalid:
        return ("pattern.invalid", None)
    return ("ok", (lines(res), res.truncated))


def index_admits(pattern: str, regex: bool, ignore_case: bool, text: bytes) -> bool:
    """Would a one-file index holding ``text`` list that file as a candidate?"""
    idx = SearchIndex.decode(encode_index_v1([("f", digest_of(text), text)]))
    return "f" in idx.candidates(required_trigrams(pattern, regex, ignore_case))


def matches(pattern: str, regex: bool, ignore_case: bool, text: bytes) -> bool:
    res = Searcher(pattern, regex=regex, ignore_case=ignore_case).run([("f", lambda: text)])
    return len(res.matches) > 0


# =====================================================================================
# the property: indexed search == full scan
# =====================================================================================
# File names and directory names are disjoint (no file/directory clash), and chosen
# so that a directory "a" sorts next to files "a.b" and "a-c" (path order matters).
DIRS = ["", "a/", "a/c/", "a-b/", "b/", "b/a/"]
NAMES = ["a.b", "a-c", "x.txt", "k", "\u00c4.md", "f1", "z"]
NEW_NAMES = ["n1", "n.txt", "a.b", "z"]
# a small alphabet, mostly a and b, so that random patterns hit random files
ALPHABET = "abk12 \u00e4\u00c4" + KELVIN + "."
CHARS = st.sampled_from(list("aaaabbbbkk1 .") + ["\u00e4", "\u00c4", KELVIN])
LITERAL_CHARS = st.sampled_from(list("aaabbbkkK1 ") + ["\u00e4", "\u00c4", KELVIN])

texts = st.lists(st.text(alphabet=CHARS, max_size=20), min_size=0, max_size=8).map("\n".join)


@st.composite
def contents(draw: Any) -> bytes:
    text = draw(texts)
    kind = draw(st.sampled_from(["text", "text", "text", "crlf", "binary"]))
    if kind == "crlf":
        return text.replace("\n", "\r\n").encode() + b"\r\n"
    if kind == "binary":
        return b"\x00\x01" + text.encode()
    return text.encode()


corpora = st.dictionaries(
    st.tuples(st.sampled_from(DIRS), st.sampled_from(NAMES)).map("".join), contents(), min_size=4, max_size=24)


def fragments(pool: list[str]) -> st.SearchStrategy[str]:
    """Short texts: random ones, or (when the corpus has text) pieces of its lines, so that
    patterns hit often and caps and ordering matter."""
    random_text = st.text(alphabet=LITERAL_CHARS, min_size=1, max_size=4)
    if not pool:
        return random_text

    @st.composite
    def piece(draw: Any) -> str:
        line = draw(st.sampled_from(pool))
        i = draw(st.integers(0, len(line) - 1))
        return line[i:draw(st.integers(i + 1, min(len(line), i + 5)))]

    return st.one_of(random_text, piece(), piece())


def regexes(pool: list[str] = []) -> st.SearchStrategy[str]:  # noqa: B006 - never mutated
    frag = fragments(pool).map(lambda t: t.replace(".", r"\."))

    @st.composite
    def build(draw: Any) -> str:
        atoms = draw(st.lists(st.one_of(
            frag, frag,
            st.just("."), st.just(r"\d"), st.just("[ab]"),
            st.sampled_from("abk12").map(lambda c: c + "+"),
            st.tuples(frag, frag).map(lambda t: f"({t[0]}|{t[1]})"),
            frag.map(lambda t: f"({t})?"),
            st.sampled_from("ab").map(lambda c: c + "{0,2}"),
        ), min_size=1, max_size=4))
        body = "".join(atoms)
        if draw(st.booleans()):
            body = "^" + body
        if draw(st.booleans()):
            body = body + "$"
        if draw(st.integers(0, 4)) == 0:
            body = "(?i)" + body
        return body

    return build()


def queries(pool: list[str] = []) -> st.SearchStrategy[dict[str, Any]]:  # noqa: B006 - never mutated
    @st.composite
    def build(draw: Any) -> dict[str, Any]:
        regex = draw(st.booleans())
        pattern = draw(regexes(pool) if regex else fragments(pool))
        return {
            "pattern": pattern,
            "regex": regex,
            "ignore_case": draw(st.booleans()),
            "max_results": draw(st.sampled_from([1, 2, 3, 1000])),
            "glob": draw(st.sampled_from([None, None, "a/**", "**/*.txt", "b/**", "*", "a/c/**"])),
        }

    return build()


def text_lines(*corpora: dict[str, bytes | None]) -> list[str]:
    return sorted({line for c in corpora for data in c.values() if data and not data.startswith(b"\x00")
                   for line in data.decode().splitlines() if line})


# (MAX_PACK_FILES, MAX_PACK_BYTES, MAX_PACKED_FILE): the production limits, and small
# ones under which even a tiny corpus gets a spine, files packs, parts and loose files.
# (Small pack roots are never combined with loose files here: a files pack whose files
# are all loose crashes the import, a bug pinned by test_packs.py on its own.)
LIMITS = [(packing_module.MAX_PACK_FILES, packing_module.MAX_PACK_BYTES, packing_module.MAX_PACKED_FILE),
          (2, 60, 1 << 20), (1, 1 << 25, 1 << 20), (3, 40, 1 << 20), (10_000, 1 << 25, 24), (10_000, 50, 1 << 20)]


def pack_limits(limits: tuple[int, int, int]) -> ExitStack:
    files, size, loose = limits
    stack = ExitStack()
    stack.enter_context(mock.patch.object(packing_module, "MAX_PACK_FILES", files))
    stack.enter_context(mock.patch.object(packing_module, "MAX_PACK_BYTES", size))
    stack.enter_context(mock.patch.object(packing_module, "MAX_PACKED_FILE", loose))
    return stack


def encode_pack_v1(objects: Any) -> tuple[bytes, list[tuple[str, int, int]]]:
    """A pack as format 1 wrote it (one zstd stream): what an old store holds."""
    index, parts, seen, offset = [], [], set(), 0
    for digest, data in objects:
        if digest not in seen:
            seen.add(digest)
            index.append((digest, offset, len(data)))
            parts.append(data)
            offset += len(data)
    header = json.dumps({"objects": index}, separators=(",", ":")).encode()
    body = len(header).to_bytes(8, "big") + header + b"".join(parts)
    return b"DSPACK1\n" + zstandard.ZstdCompressor(level=3).compress(body), index


def encode_index_v1(files: list[tuple[str, str, bytes]]) -> bytes:
    """A search index as format 1 wrote it (one object): what an old store's packs
    hold, and the reader (``SearchIndex``) must still serve. Trigrams of the
    ASCII-lowercased content, 24-bit keys; a file with a NUL in its first 8 KiB
    (binary) has none."""
    postings: dict[int, list[int]] = {}
    for n, (_, _, data) in enumerate(files):
        low = b"" if b"\x00" in data[:8192] else data.lower()
        for key in sorted({(low[i] << 16) | (low[i + 1] << 8) | low[i + 2] for i in range(len(low) - 2)}):
            postings.setdefault(key, []).append(n)
    keys = sorted(postings)
    offsets = [0]
    for key in keys:
        offsets.append(offsets[-1] + len(postings[key]))
    width = 2 if len(files) < 65536 else 4
    header = json.dumps({"files": [[path, digest] for path, digest, _ in files], "n": len(keys), "width": width},
                        separators=(",", ":")).encode()
    flat = [n for key in keys for n in postings[key]]
    body = b"".join([len(header).to_bytes(8, "big"), header, array("I", keys).tobytes(),
                     array("I", offsets).tobytes(), array("H" if width == 2 else "I", flat).tobytes()])
    return b"DSIDX1\n" + zstandard.ZstdCompressor(level=3).compress(body)


# how indexes are written: the production format 2; format 2 with tiny limits (no
# inline posting list, a shard per trigram or two, a frame per object, a ranged read
# per frame, one shard per query: every code path of a sharded index); line tables and
# tree summaries that leave out most lines and trigrams; format 1 (no line tables)
SHAPES = ["v2", "v2-tiny", "lines-tiny", "v1"]


def index_shape(shape: str) -> ExitStack:
    stack = ExitStack()
    if shape == "v2-tiny":
        for name, value in (("INLINE_BUDGET", 1), ("INLINE_MAX", 1), ("SHARD_POSTINGS", 2),
                            ("MAX_SHARDS_PER_QUERY", 1)):
            stack.enter_context(mock.patch.object(trigrams_module, name, value))
        stack.enter_context(mock.patch.object(packs_module, "FRAME_BYTES", 1))
        stack.enter_context(mock.patch.object(packs_module, "MERGE_GAP", 0))
    elif shape == "lines-tiny":  # line tables and tree summaries that leave out most trigrams
        for name, value in (("MAX_LINE", 12), ("MAX_LINES_PER_TRIGRAM", 2), ("SUMMARY_BUDGET", 120)):
            stack.enter_context(mock.patch.object(linetables_module, name, value))
    elif shape == "v1":
        stack.enter_context(mock.patch.object(packing_module, "encode_pack", encode_pack_v1))
        stack.enter_context(mock.patch.object(
            packing_module, "build_index_objects", lambda files, locations: IndexObjects(encode_index_v1(files), [], None)))
    return stack


def assert_same_as_scan(store: Store, project_id: str, qs: list[dict[str, Any]], where: str) -> None:
    indexed_view = store.view(project_id)
    oracle = scan_view(store, project_id)
    assert indexed_view.root == oracle.root and dict(indexed_view.overlay) == dict(oracle.overlay)
    for q in qs:
        kw = {k: v for k, v in q.items() if k != "pattern"}
        got = outcome(indexed_view, q["pattern"], **kw)
        want = outcome(oracle, q["pattern"], **kw)
        assert got == want, f"{where}: indexed search differs from a full scan for {q!r}"
        if got[0] == "ok" and got[1][1]:  # cut short: the pages that follow, through the cursor
            whole = outcome(oracle, q["pattern"], **{**kw, "max_results": 1000})
            if len(whole[1][0]) <= 40:
                assert paged(indexed_view, q["pattern"], **kw) == whole[1][0], \
                    f"{where}: the pages of {q!r} differ from one uncut search"


def paged(view: Any, pattern: str, **kw: Any) -> list[tuple[str, int, str]]:
    """Every match, ``max_results`` at a time, each page going on after the last match of the one before."""
    out: list[tuple[str, int, str]] = []
    after = None
    for _ in range(200):
        res = view.search_code(pattern, after=after, **kw)
        out += lines(res)
        if not res.truncated:
            return out
        assert res.matches, "a page cut short holds a match to go on from"
        after = (res.matches[-1].path, res.matches[-1].line_number)
    raise AssertionError("paging did not end")


# bounded: no shrinking (a failure is reported as found, its corpus and query in the notes)
@settings(max_examples=120, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(
    corpus=corpora,
    limits=st.sampled_from(LIMITS),
    shape=st.sampled_from(SHAPES),
    edits=st.dictionaries(
        st.tuples(st.sampled_from(DIRS), st.sampled_from(NEW_NAMES)).map("".join),
        st.one_of(st.none(), contents()), max_size=6),
    deletions=st.sets(st.integers(0, 30), max_size=4),
    data=st.data(),
)
def test_indexed_search_equals_a_full_scan(store: Store, corpus: dict[str, bytes], limits: tuple[int, int, int],
                                           shape: str, edits: dict[str, bytes | None], deletions: set[int],
                                           data: Any) -> None:
    with index_shape(shape):
        _indexed_search_equals_a_full_scan(store, corpus, limits, edits, deletions, data)


def _indexed_search_equals_a_full_scan(store: Store, corpus: dict[str, bytes], limits: tuple[int, int, int],
                                       edits: dict[str, bytes | None], deletions: set[int], data: Any) -> None:
    qs = data.draw(st.lists(queries(text_lines(corpus, edits)), min_size=6, max_size=10), label="queries")
    note(f"corpus={corpus!r}")
    note(f"limits={limits!r}")
    with pack_limits(limits):
        p = store.create_project("prop", files=corpus)
    # the version: every subtree packed and indexed
    assert_same_as_scan(store, p.id, qs, "version")
    store.clear_caches()
    assert_same_as_scan(store, p.id, qs, "version, read cold")  # indexes, shards and frames fetched anew

    # a draft whose overlay adds, modifies and deletes files (turn still running)
    existing = sorted(corpus)
    changes: dict[str, bytes | None] = {path: data for path, data in edits.items()
                                        if data is not None or path in corpus}
    for i in deletions:
        if i < len(existing):
            changes[existing[i]] = None
    note(f"overlay={changes!r}")
    t = store.start_turn(p.id, "edit")
    if changes:
        store.apply_changes(t.id, changes)
    assert_same_as_scan(store, p.id, qs, "draft with overlay")
    view = store.view(p.id)
    deleted = {path for path, v in changes.items() if v is None}
    for q in qs:
        try:
            res = view.search_code(q["pattern"], regex=q["regex"], ignore_case=q["ignore_case"], max_results=1000)
        except PatternInvalid:
            continue
        assert not deleted & {m.path for m in res.matches}, "a deleted file was reported"

    # sealed: the draft's new subtrees have no packs, the unchanged ones keep theirs
    store.complete_turn(t.id, "done")
    assert_same_as_scan(store, p.id, qs, "sealed draft")

    # published, and packed in the background: the new version's own packs and indexes
    store.publish(p.id, "published")
    with pack_limits(limits):
        store.run_background()
    store.cache.clear()  # (a covering answered before the packs existed is cached)
    assert_same_as_scan(store, p.id, qs, "published version, packed")


# =====================================================================================
# deterministic cases the property covers, pinned so each failure names one cause
# =====================================================================================
def test_the_index_is_used_and_narrows_the_files_read(store: Store) -> None:
    files = {f"d{i}/f{j}.txt": f"line {i}-{j}\n".encode() for i in range(5) for j in range(20)}
    files["d3/f7.txt"] = b"line needle here\n"
    p = store.create_project("narrow", files=files)
    res = store.view(p.id).search_code("needle")
    assert lines(res) == [("d3/f7.txt", 1, "line needle here")]
    assert res.files_searched < 10  # the index named one candidate; a scan reads 100 files
    assert scan_view(store, p.id).search_code("needle").files_searched == 100


def sharded_project(store: Store) -> tuple[Any, list[Any]]:
    """A project written with tiny index limits: every trigram in a shard, a frame per file."""
    files = {f"d{i}/f{j}.txt": f"line {i}-{j} common\n".encode() for i in range(3) for j in range(30)}
    files["d1/f7.txt"] = b"line needle here\n"
    with index_shape("v2-tiny"):
        p = store.create_project("sharded", files=files)
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(PACKS).where(PACKS.c.search_index.is_not(None))).all()
    return p, rows


def test_a_cold_search_reads_the_directory_a_few_shards_and_the_candidates_frames_not_the_packs(
        store: Store) -> None:
    p, rows = sharded_project(store)
    directory = IndexDirectory.decode(store.blobs.get(Digest(rows[0].search_index)))
    query = required_trigrams("needle", False)
    assert len(directory.shard_digest) > 10
    assert 1 <= len(directory.shards_for(query)) <= trigrams_module.MAX_SHARDS_PER_QUERY < len(query[0])
    store.clear_caches()
    with mock.patch.object(trigrams_module, "MAX_SHARDS_PER_QUERY", 1):
        res = store.view(p.id).search_code("needle")
    assert lines(res) == [("d1/f7.txt", 1, "line needle here")]
    assert not store.cached_packs() & {r.digest for r in rows}  # no pack fetched whole
    assert res.files_searched < 90


def test_a_warm_search_reuses_what_it_found_in_the_frames_and_refetches_what_was_evicted(store: Store) -> None:
    p, rows = sharded_project(store)
    store.cache.clear()
    first = lines(store.view(p.id).search_code("common", max_results=1000))
    directory = store.cache.get(index_key(rows[0].search_index))  # the decoded directory, as the search keeps it
    assert isinstance(directory, IndexDirectory) and directory.found  # the frames' objects were remembered
    assert lines(store.view(p.id).search_code("common", max_results=1000)) == first
    for digest in set(directory.found.values()):
        store.cache.discard(digest)  # evicted: the remembered digest alone must not be trusted
    assert not store.cached_packs()  # no pack held whole: what was evicted comes from its frames again
    assert lines(store.view(p.id).search_code("common", max_results=1000)) == first
    assert len(first) == 89


def test_gc_keeps_the_shards_of_live_indexes_and_fsck_reports_a_missing_one(store_factory: Any) -> None:
    store = store_factory(settings=Settings(gc_grace_s=0))
    p, rows = sharded_project(store)
    shards = {sh for r in rows for sh in IndexDirectory.decode(store.blobs.get(Digest(r.search_index))).shard_digest}
    assert shards
    stats = store.gc(dry_run=False)
    assert not shards & set(stats.swept)
    listed = {o.digest for o in store.blobs.iter_objects()}
    assert shards <= listed
    assert store.fsck().ok
    cold = store_factory()
    assert lines(cold.view(p.id).search_code("needle")) == [("d1/f7.txt", 1, "line needle here")]
    gone = sorted(shards)[0]
    store.blobs.delete(Digest(gone))
    report = store_factory().fsck(verify_objects=False)
    assert [(pr.kind, pr.key) for pr in report.problems] == [("missing", gone)]
    assert "a shard of search index" in report.problems[0].detail


def test_results_come_in_the_same_path_order_with_and_without_the_index(store: Store) -> None:
    # a directory "a" and files "a-c", "a.b" beside it: '-' and '.' sort before '/'
    files = {"a/x.txt": b"hit\n", "a.b": b"hit\n", "a-c": b"hit\n", "b/a/y": b"hit\n", "b/a.z": b"hit\n"}
    p = store.create_project("order", files=files)
    indexed = store.view(p.id).search_code("hit")
    scanned = scan_view(store, p.id).search_code("hit")
    assert lines(indexed) == lines(scanned)
    first = store.view(p.id).search_code("hit", max_results=1)
    assert lines(first) == lines(scan_view(store, p.id).search_code("hit", max_results=1))


def test_an_overlay_write_does_not_move_a_file_in_path_order(store: Store) -> None:
    files = {"a/x.txt": b"hit\n", "a.b": b"hit\n", "a-c": b"hit\n", "b/a/y": b"hit\n", "b/a.z": b"hit\n"}
    p = store.create_project("order-overlay", files=files)
    version_order = store.view(p.id).list_files()
    t = store.start_turn(p.id, "rewrite a.b and b/a.z in place")
    store.apply_changes(t.id, {"a.b": b"hit again\n", "b/a.z": b"hit again\n"})
    draft = store.view(p.id)
    assert draft.list_files() == version_order  # same paths, contents changed: same order
    assert [m.path for m in scan_view(store, p.id).search_code("hit")] == version_order
    assert [m.path for m in draft.search_code("hit")] == version_order


@pytest.mark.parametrize("pattern,regex,text", [
    ("kelvin", False, KELVIN.encode() + b"elvin"),
    ("KELVIN", False, KELVIN.encode() + b"ELVIN"),
    ("(?i)kelvin", True, KELVIN.encode() + b"elvin"),
    ("mass", False, b"ma" + LONG_S.encode() + b"s"),
])
def test_ignore_case_never_loses_a_file_whose_letters_fold_outside_ascii(store: Store, pattern: str, regex: bool,
                                                                         text: bytes) -> None:
    """RE2 folds case Unicode-wide: k ~ K ~ U+212A, s ~ S ~ U+017F."""
    p = store.create_project("fold", files={"f.txt": text + b"\n", "other.txt": b"nothing\n"})
    scanned = scan_view(store, p.id).search_code(pattern, regex=regex, ignore_case=True)
    assert [m.path for m in scanned] == ["f.txt"]  # RE2 matches it ...
    indexed = store.view(p.id).search_code(pattern, regex=regex, ignore_case=True)
    assert lines(indexed) == lines(scanned)  # ... so the index must not drop it


def test_posix_classes_never_lose_a_file(store: Store) -> None:
    p = store.create_project("posix", files={"f.txt": b"7ab\n", "g.txt": b"]ab\n"})
    for pattern in ("[[:digit:]]ab", "[[:alnum:]]ab", "x?[[:digit:]]abc?"):
        scanned = scan_view(store, p.id).search_code(pattern, regex=True)
        assert [m.path for m in scanned] == ["f.txt"], pattern
        assert lines(store.view(p.id).search_code(pattern, regex=True)) == lines(scanned), pattern


def test_an_overlay_is_searched_and_its_deletions_never_reported(store: Store) -> None:
    files = {f"src/m{i}.py": f"value = {i}\n".encode() for i in range(30)}
    p = store.create_project("overlay", files=files)
    t = store.start_turn(p.id, "edit")
    store.apply_changes(t.id, {"src/m3.py": None, "src/m4.py": b"value = forty\n", "src/new.py": b"value = new\n",
                               "top.py": b"value = top\n"})
    view = store.view(p.id)
    res = view.search_code("value = ", max_results=1000)
    paths = [m.path for m in res]
    assert "src/m3.py" not in paths and "src/new.py" in paths and "top.py" in paths
    assert ("src/m4.py", 1, "value = forty") in lines(res)
    assert lines(res) == lines(scan_view(store, p.id).search_code("value = ", max_results=1000))
    assert lines(view.search_code("value = 3")) == []  # only m3 held it, and it is deleted
    assert lines(view.search_code("value = 4")) == []  # m4 was rewritten
    assert lines(view.search_code("forty")) == [("src/m4.py", 1, "value = forty")]
    assert lines(view.search_code("value = 2", max_results=100)) == [
        (f"src/m{i}.py", 1, f"value = {i}") for i in [2] + list(range(20, 30))]


# =====================================================================================
# required_trigrams: conservative on every construct
# =====================================================================================
NEVER_EXCLUDED = [
    # (pattern, regex, ignore_case, a text the pattern matches)
    ("hello", False, False, b"say hello"),
    ("abc|xyz", True, False, b"--xyz--"),
    ("(abc|xyz)def", True, False, b"xyzdef"),
    ("(?:abc|abd)ef", True, False, b"abdef"),
    ("(abc)?def", True, False, b"def"),
    ("x(abc)?y", True, False, b"xy"),
    ("a{0,2}bcd", True, False, b"bcd"),
    ("(abc){0,1}", True, False, b"zzz"),
    ("(abc)*def", True, False, b"def"),
    ("(abc)+def", True, False, b"abcabcdef"),
    ("ab(cd)?ef", True, False, b"abef"),
    ("abc|", True, False, b"anything"),
    ("|abc", True, False, b"anything"),
    (r"abc\.def", True, False, b"abc.def"),
    (r"\x41BC", True, False, b"ABC"),
    (r"\101BC", True, False, b"ABC"),
    (r"a\tb\tc", True, False, b"a\tb\tc"),
    (r"a\-b\-c", True, False, b"a-b-c"),
    (r"\babc\b", True, False, b"x abc y"),
    ("abc$", True, False, b"xabc\r\n"),
    ("^abc", True, False, b"abcdef"),
    ("ab[c]de", True, False, b"abcde"),
    ("ab[cC]de", True, False, b"abCde"),
    (r"ab\d+cd", True, False, b"ab123cd"),
    ("((abc))", True, False, b"abc"),
    ("(?P<n>abc)d", True, False, b"abcd"),
    (r"\pLabc", True, False, b"xabc"),  # RE2-only syntax
    (r"\Qa.b\E", True, False, b"a.b"),  # RE2-only syntax
    (r"abc\z", True, False, b"abc"),  # RE2-only syntax
    ("a.c", True, False, b"a\xc3\xa4c"),
    ("(?s)a.c", True, False, b"abc"),
    ("(?i)ABC", True, False, b"abc"),
    ("(?i:ABC)d", True, False, b"abcd"),
    ("ABC", False, True, b"abc"),
    ("abc", False, True, b"ABC"),
    ("aBc", True, True, b"AbC"),
    # non-ASCII letters and case
    ("\u00c4rger", False, True, "\u00e4rger".encode()),
    ("\u00e4rger", False, True, "\u00c4RGER".encode()),
    ("\u00c4RGER", False, True, "\u00e4rger".encode()),
    ("(?i)\u00e4rger", True, False, "\u00c4rger".encode()),
    ("\u00c4rger", False, False, "\u00c4rger".encode()),
    ("\u00e9t\u00e9", False, True, "\u00c9T\u00c9".encode()),
    ("\u03a3\u03bf\u03c6", False, True, "\u03c3\u039f\u03a6".encode()),
    ("stra\u00dfe", False, True, "STRA\u00dfE".encode()),
    ("\U0001F600ab", False, False, "x\U0001F600ab".encode()),
    ("\U0001F600ab", True, True, "x\U0001F600AB".encode()),
    # letters RE2 folds across the ASCII boundary
    ("kab", False, True, KELVIN.encode() + b"ab"),
    ("(?i)kab", True, False, KELVIN.encode() + b"ab"),
    ("sab", False, True, LONG_S.encode() + b"ab"),
    ("[k]ab", True, True, KELVIN.encode() + b"ab"),
    # POSIX classes (RE2) that Python's parser reads as a set followed by a literal "]"
    ("[[:digit:]]ab", True, False, b"1ab"),
    ("[[:alpha:]]bcd", True, False, b"xbcd"),
    ("[[:^space:]]xy", True, False, b"qxy"),
]


@pytest.mark.parametrize("pattern,regex,ignore_case,text", NEVER_EXCLUDED,
                         ids=[repr(c[0]) + ("/i" if c[2] else "") for c in NEVER_EXCLUDED])
def test_required_trigrams_never_exclude_a_matching_file(pattern: str, regex: bool, ignore_case: bool,
                                                         text: bytes) -> None:
    assert matches(pattern, regex, ignore_case, text), "the case is wrong: RE2 does not match it"
    assert index_admits(pattern, regex, ignore_case, text), required_trigrams(pattern, regex, ignore_case)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(st.one_of(st.binary(max_size=60), st.text("abAB\u00e9\n ", max_size=60).map(str.encode)),
                      max_size=30),
       batch=st.sampled_from([1 << 22, 64, 7]))
def test_the_trigram_table_is_every_files_distinct_trigrams_by_trigram_then_file(texts: list[bytes],
                                                                                batch: int) -> None:
    """The index's table, however its passes are batched, equals a plain set-based build:
    each lowercased trigram once, its files ascending; a binary file contributes none."""
    files = [(f"f{i}", "", t) for i, t in enumerate(texts)]
    expected: dict[int, set[int]] = {}
    for i, data in enumerate(texts):
        if b"\x00" in data[:8192]:
            continue
        low = data.lower()
        for j in range(len(low) - 2):
            expected.setdefault((low[j] << 16) | (low[j + 1] << 8) | low[j + 2], set()).add(i)
    with mock.patch.object(trigrams_module, "_BATCH", batch):
        keys, offsets, postings = trigrams_module._table(files)  # noqa: SLF001 - the structure under test
    assert keys.tolist() == sorted(expected)
    got = {int(k): postings[offsets[n]:offsets[n + 1]].tolist() for n, k in enumerate(keys)}
    assert got == {k: sorted(v) for k, v in expected.items()}
    assert int(offsets[-1]) == len(postings)


def test_required_trigrams_still_narrow() -> None:
    """Conservative, not useless: plain literals and alternations do filter."""
    def gram(s: str) -> int:
        b = s.encode()
        return (b[0] << 16) | (b[1] << 8) | b[2]

    assert required_trigrams("hello", False) == [frozenset({gram("hel"), gram("ell"), gram("llo")})]
    assert required_trigrams("HeLLo", False, ignore_case=True) == required_trigrams("hello", False)
    alts = required_trigrams("abc|xyz", True)
    assert alts is not None and sorted(map(sorted, alts)) == [[gram("abc")], [gram("xyz")]]
    assert required_trigrams("ab", False) is None  # too short to be certain of anything
    assert required_trigrams("a.c", True) is None
    assert required_trigrams("(abc)?", True) is None
    assert not index_admits("abc|xyz", True, False, b"nothing here")
    assert not index_admits("hello", False, True, b"HELP LO")
    # case-insensitive non-ASCII: the ASCII trigrams are still required
    q = required_trigrams("\u00c4rger", False, ignore_case=True)
    assert q is not None and gram("rge") in q[0] and gram("ger") in q[0]
    assert not index_admits("\u00c4rger", False, True, b"nothing")


@settings(max_examples=300, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(pattern=regexes(), ignore_case=st.booleans(),
       text=st.text(alphabet=ALPHABET + "\n", max_size=40))
def test_required_trigrams_property(pattern: str, ignore_case: bool, text: str) -> None:
    """Pure and fast: on random regexes and texts, a text RE2 matches is always a candidate."""
    data = text.encode()
    try:
        hit = matches(pattern, True, ignore_case, data)
    except PatternInvalid:
        return
    if hit:
        assert index_admits(pattern, True, ignore_case, data), (pattern, ignore_case, text,
                                                                required_trigrams(pattern, True, ignore_case))


def test_literal_patterns_are_never_parsed_as_regexes() -> None:
    # a literal full of metacharacters: its own trigrams, nothing else
    pattern = "a(b|c)*d[e]"
    text = b"xx a(b|c)*d[e] yy"
    assert matches(pattern, False, False, text) and index_admits(pattern, False, False, text)
    assert re.escape(pattern) != pattern


# =====================================================================================
# line tables and tree summaries (search.linetables): a selective literal answered from one object
# =====================================================================================
def brute_lines(files: dict[str, bytes], gram: bytes) -> dict[str, list[tuple[int, bytes]]]:
    """Every line of every text file whose lowercased bytes hold ``gram``: what a table must list."""
    out: dict[str, list[tuple[int, bytes]]] = {}
    for path, data in files.items():
        if b"\x00" in data[:8192]:
            continue
        for n, line in enumerate(data.split(b"\n"), 1):
            if gram in line.lower():
                out.setdefault(path, []).append((n, line))
    return out


@settings(max_examples=200, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(units=st.lists(st.dictionaries(st.sampled_from(NAMES), contents(), min_size=1, max_size=5),
                      min_size=1, max_size=3))
def test_a_tree_summary_lists_every_line_of_each_trigram_it_holds(units: list[dict[str, bytes]]) -> None:
    """Pure: unit tables built from random files, merged; for every trigram of the summary,
    exactly the lines a scan finds, and no trigram a unit holds without listing it."""
    tables, every = [], {}
    for u, files in enumerate(units):
        listed = [(path, digest_of(data), data) for path, data in sorted(files.items())]
        built = trigrams_module.build_index_objects(listed, {}, inline_max=3, inline_budget=12)
        assert built.lines is not None
        tables.append((f"u{u}/", linetables_module.LineTable.decode(built.lines)))
        every.update({f"u{u}/{p}": d for p, d in files.items()})
    raw = linetables_module.build_summary(tables)
    if raw is None:
        return
    summary = linetables_module.LineTable.decode(raw)
    assert summary.summary and len(summary.keys)
    for key in summary.keys:
        gram = bytes(((int(key) >> 16) & 255, (int(key) >> 8) & 255, int(key) & 255))
        assert summary.lines(int(key)) == brute_lines(every, gram)
        for _, t in tables:  # a unit that holds it lists it
            assert t.count(int(key)) is not None or not t.holds(int(key))


def brute_unit_lines(files: dict[str, bytes], gram: bytes) -> dict[str, list[tuple[int, bytes]]] | None:
    """What a unit table must hold for ``gram``: its lines (``brute_lines``), or None when
    the module's limits leave the trigram out (a line too long or with a NUL, too many lines)."""
    found = brute_lines(files, gram)
    lines = [line for v in found.values() for _, line in v]
    if (b"\n" in gram or len(lines) > linetables_module.MAX_LINES_PER_TRIGRAM
            or any(len(line) > linetables_module.MAX_LINE or b"\x00" in line for line in lines)):
        return None
    return found


unit_texts = st.lists(st.text(alphabet=st.sampled_from(list("aabbk\n \r.") + ["\u00c4", "\x00"]), max_size=30),
                      min_size=1, max_size=4).map("\n".join).map(str.encode)


@st.composite
def unit_contents(draw: Any) -> bytes:
    """Text files, some with a NUL byte past the binary sniff (searched, but its line is
    never listed), some binary (NUL at the start), some shorter than a trigram."""
    text = draw(unit_texts)
    kind = draw(st.sampled_from(["text", "text", "late-nul", "binary", "tiny"]))
    if kind == "late-nul":
        return b"k" * 8200 + b"\n" + text
    if kind == "binary":
        return b"\x00" + text
    if kind == "tiny":
        return text[:2]
    return text.replace(b"\x00", b"")


@settings(max_examples=300, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(files=st.dictionaries(st.sampled_from(NAMES), unit_contents(), min_size=1, max_size=6),
       limits=st.sampled_from([(1024, 256), (6, 2), (3, 1)]),
       inline=st.sampled_from([(3, 12), (64, 4096), (1, 2)]))
def test_a_unit_table_lists_exactly_the_lines_of_its_trigrams(
        files: dict[str, bytes], limits: tuple[int, int], inline: tuple[int, int]) -> None:
    """Pure: for every inline trigram of a pack index, its unit table lists exactly the lines
    a scan finds, or leaves the trigram out exactly when a limit says so; it lists no other
    trigram, and ``present`` holds every trigram of the index."""
    listed = [(path, digest_of(data), data) for path, data in sorted(files.items())]
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(linetables_module, "MAX_LINE", limits[0]))
        stack.enter_context(mock.patch.object(linetables_module, "MAX_LINES_PER_TRIGRAM", limits[1]))
        built = trigrams_module.build_index_objects(listed, {}, inline_max=inline[0], inline_budget=inline[1])
        assert built.lines is not None
        table = linetables_module.LineTable.decode(built.lines)
        directory = trigrams_module.decode_index(built.directory)
        assert isinstance(directory, IndexDirectory)
        inline_keys = [int(k) for k in directory.inline[0]]
        keys, _, _ = trigrams_module._table(listed)
        assert [int(k) for k in table.present] == [int(k) for k in keys]
        assert set(int(k) for k in table.keys) <= set(inline_keys)
        for key in inline_keys:
            gram = bytes(((key >> 16) & 255, (key >> 8) & 255, key & 255))
            assert table.lines(key) == brute_unit_lines(files, gram), gram


@st.composite
def literal_queries(draw: Any, pool: list[str]) -> dict[str, Any]:
    line = draw(st.sampled_from(pool))
    i = draw(st.integers(0, max(0, len(line) - 3)))
    return {"pattern": line[i:draw(st.integers(min(i + 3, len(line)), min(len(line), i + 8)))],
            "regex": False, "ignore_case": draw(st.booleans()), "max_results": draw(st.sampled_from([1, 2, 1000])),
            "glob": draw(st.sampled_from([None, None, "**/*.txt", "*"]))}


class SummarySpy:
    """Counts the searches the tree summary answered."""

    def __init__(self) -> None:
        self.answered = 0
        self._real = planner_module.Planner._summarised

    def __call__(self, planner: Any, *a: Any) -> Any:
        out = self._real(planner, *a)
        self.answered += out is not None
        return out


@settings(max_examples=60, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(corpus=corpora, shape=st.sampled_from(["v2", "lines-tiny"]),
       edits=st.dictionaries(st.tuples(st.sampled_from(DIRS), st.sampled_from(NEW_NAMES)).map("".join),
                             st.one_of(st.none(), contents()), max_size=4),
       data=st.data())
def test_searches_answered_from_the_tree_summary_equal_a_full_scan(
        store: Store, corpus: dict[str, bytes], shape: str, edits: dict[str, bytes | None], data: Any) -> None:
    pool = [line for line in text_lines(corpus, edits) if len(line) >= 3]
    if not pool:
        return
    qs = data.draw(st.lists(literal_queries(pool), min_size=4, max_size=8), label="queries")
    with index_shape(shape), pack_limits((2, 60, 1 << 20)):  # a spine, so a summary, even for a few files
        p = store.create_project("summary", files=corpus)
    spy = SummarySpy()
    with mock.patch.object(planner_module.Planner, "_summarised", lambda planner, *a: spy(planner, *a)):
        assert_same_as_scan(store, p.id, qs, "version")
        store.cache.clear()
        assert_same_as_scan(store, p.id, qs, "version, read cold")
        plain = [q for q in qs if not q["ignore_case"] and any(q["pattern"] in line for line in text_lines(corpus))]
        if shape == "v2" and plain:
            assert spy.answered, "no search was answered from the tree summary"
        changes = {path: v for path, v in edits.items() if v is not None or path in corpus}
        if changes:
            t = store.start_turn(p.id, "edit")
            store.apply_changes(t.id, changes)
            assert_same_as_scan(store, p.id, qs, "draft with overlay")


def summarised_project(store: Store) -> tuple[Any, dict[str, bytes]]:
    """Four directories of 30 files: a spine, four tree packs, a tree summary."""
    files = {f"d{i}/f{j:02d}.txt": f"line {i}-{j} common words\nsecond line\n".encode()
             for i in range(4) for j in range(30)}
    files["d1/f07.txt"] = b"first\r\nthe Needle_X here\r\nand needle_x twice: needle_x\r\n"
    files["d3/f29.txt"] = b"needle_x at the end"
    with pack_limits((40, packing_module.MAX_PACK_BYTES, packing_module.MAX_PACKED_FILE)):
        p = store.create_project("summarised", files=files)
    return p, files


def test_a_first_search_reads_the_tree_summary_and_nothing_else(store_factory: Any) -> None:
    store = store_factory()
    p, _ = summarised_project(store)
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(PACKS)).all()
    spine = next(r for r in rows if r.kind == "spine")
    assert spine.search_index and linetables_module.LineTable.decode(store.blobs.get(Digest(spine.search_index))).summary
    cold = store_factory()
    res = cold.view(p.id).search_code("needle_x")
    assert lines(res) == [("d1/f07.txt", 3, "and needle_x twice: needle_x"), ("d3/f29.txt", 1, "needle_x at the end")]
    for r in rows:
        if r.kind != "spine":
            assert index_key(r.search_index) not in cold.cache  # no pack's index read
            assert r.digest not in cold.cached_packs()
    assert res.files_searched == 2
    oracle = scan_view(cold, p.id)
    for kw in ({"ignore_case": True}, {"glob": "**/*.txt"}, {"glob": "d1/*"}, {"context": 1}, {"max_results": 1},
               {"after": ("d1/f07.txt", 3)}):
        assert lines(cold.view(p.id).search_code("needle_x", **kw)) == lines(oracle.search_code("needle_x", **kw)), kw


def test_an_overlay_changes_what_the_summary_answers(store: Store) -> None:
    p, _ = summarised_project(store)
    t = store.start_turn(p.id, "edit")
    store.apply_changes(t.id, {"d1/f07.txt": b"no longer\n", "d2/new.txt": b"x\nneedle_x new\n", "d3/f29.txt": None})
    assert lines(store.view(p.id).search_code("needle_x")) == [("d2/new.txt", 2, "needle_x new")]


def test_a_missing_or_corrupt_summary_falls_back_and_fsck_reports_it(store_factory: Any,
                                                                     request: pytest.FixtureRequest) -> None:
    from test_snapshots import corrupt_object

    store = store_factory(settings=Settings(gc_grace_s=0))
    p, _ = summarised_project(store)
    want = [("d1/f07.txt", 3, "and needle_x twice: needle_x"), ("d3/f29.txt", 1, "needle_x at the end")]
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(PACKS)).all()
    spine = next(r for r in rows if r.kind == "spine")
    tables = [IndexDirectory.decode(store.blobs.get(Digest(r.search_index))).lines for r in rows if r.kind != "spine"]
    assert all(tables)
    swept = set(store.gc(dry_run=False).swept)
    assert not swept & {spine.search_index, *tables}  # gc keeps the summary and every line table
    assert store.fsck().ok
    corrupt_object(store, request, spine.search_index, b"DSSUM1\nnot zstd")
    assert lines(store_factory().view(p.id).search_code("needle_x")) == want
    store.blobs.delete(Digest(spine.search_index))
    assert lines(store_factory().view(p.id).search_code("needle_x")) == want
    report = store_factory().fsck(verify_objects=False)
    assert [(pr.kind, pr.key) for pr in report.problems] == [("missing", spine.search_index)]


def test_packs_without_line_tables_get_no_summary_and_search_the_old_way(store_factory: Any) -> None:
    store = store_factory()
    old = lambda files, locations: trigrams_module.build_index_objects(files, locations, lines=False)  # noqa: E731
    with mock.patch.object(packing_module, "build_index_objects", old):
        p, _ = summarised_project(store)
    with store.engine.connect() as conn:
        spine = conn.execute(sa.select(PACKS).where(PACKS.c.kind == "spine")).one()
    assert spine.search_index is None
    spy = SummarySpy()
    with mock.patch.object(planner_module.Planner, "_summarised", lambda planner, *a: spy(planner, *a)):
        res = store_factory().view(p.id).search_code("needle_x")
    assert len(res.matches) == 2 and spy.answered == 0


def test_every_state_the_store_hands_out_searches_through_its_indexes(store_factory: Any) -> None:
    """The head, a version, a turn's boundaries and the draft (with its writes) all plan
    their searches with the store's indexes: each is answered from the tree summary, and
    each answer equals a full scan of that same state."""
    store = store_factory()
    p, _ = summarised_project(store)
    t = store.start_turn(p.id, "edit")
    store.write_file(t.id, "d0/new.txt", b"needle_x written\n")
    store.complete_turn(t.id, "done")
    with pack_limits((40, packing_module.MAX_PACK_BYTES, packing_module.MAX_PACKED_FILE)):
        assert store.run_background()["drafts_packed"] == 1  # the draft's new tree, and its summary
    t2 = store.start_turn(p.id, "again")
    cold = store_factory()
    states = {"draft": cold.view(p.id), "head": cold.resolve(f"head:{p.id}"),
              "version": cold.view_at(p.id, p.current_version_id),
              "turn start": cold.view_at_turn(t.id, "start"), "turn end": cold.view_at_turn(t.id, "end")}
    assert states["draft"].draft_id and states["draft"].overlay == {}  # t2 runs; t's write is sealed
    spy = SummarySpy()
    with mock.patch.object(planner_module.Planner, "_summarised", lambda planner, *a: spy(planner, *a)):
        for name, view in states.items():
            before = spy.answered
            got = lines(view.search_code("needle_x"))
            view._search = Planner()  # noqa: SLF001 - no indexes: every file is read
            assert got == lines(view.search_code("needle_x")), name
            assert spy.answered == before + 1, f"{name}: not answered from the tree summary"
    assert ("d0/new.txt", 1, "needle_x written") in lines(states["draft"].search_code("needle_x"))
    assert ("d0/new.txt", 1, "needle_x written") not in lines(states["turn start"].search_code("needle_x"))
    store.interrupt_turn(t2.id)
