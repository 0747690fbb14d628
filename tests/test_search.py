"""Search and globs as an agent meets them: pure tests of the matcher, draftstore.search.matcher (no store)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import re2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftstore.errors import PatternInvalid
from draftstore.search import MAX_RESULTS_CAP, RE2_SYNTAX_URL, Searcher, SearchMatch, SearchResult, compile_glob

HANG_TIMEOUT_S = 20.0  # a hang check, not a speed goal: RE2 takes milliseconds here


def search(pattern: str, files: dict[str, bytes], **options: Any) -> SearchResult:
    return Searcher(pattern, **options).run([(path, lambda data=data: data) for path, data in files.items()])


def finishes(work: Callable[[], Any]) -> Any:
    """``work()``'s result, failing the test if it has not returned within HANG_TIMEOUT_S."""
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(work()), daemon=True)
    worker.start()
    worker.join(HANG_TIMEOUT_S)
    assert not worker.is_alive(), f"still running after {HANG_TIMEOUT_S} s"
    assert out, "the work raised (see the thread's traceback above)"
    return out[0]


def lines(result: SearchResult) -> list[tuple[str, int, str]]:
    return [(m.path, m.line_number, m.line) for m in result]


SOURCE = b"import os\n\ndef load_handler(x):\n    return x\n\ndef save_handler(y):\n    return y\n"


# -- an agent's pattern can never hang the worker --------------------------------------
def test_a_catastrophic_regex_over_a_long_line_returns_promptly() -> None:
    line = b"a" * 100_000 + b"!"  # (a+)+$ backtracks exponentially on this in a backtracking engine
    result = finishes(lambda: search(r"(a+)+$", {"big.txt": line, "ok.txt": b"aaa\n"}, regex=True))
    assert lines(result) == [("ok.txt", 1, "aaa")]


def test_many_double_star_segments_against_a_long_deep_path_return_promptly() -> None:
    glob = compile_glob("**/" * 12 + "*.py")
    deep = "/".join(f"dir{i}" for i in range(40))
    assert finishes(lambda: glob.match(deep + "/x.pyc")) is False
    assert finishes(lambda: glob.match(deep + "/x.py")) is True


# -- what RE2 refuses is named, never silently mis-matched ------------------------------
@pytest.mark.parametrize(("pattern", "construct"), [
    (r"(a)\1", r"backreference \1"),
    (r"(?P<q>')x(?P=q)", "named backreference"),
    (r"foo(?=bar)", "lookahead"),
    (r"foo(?!bar)", "negative lookahead"),
    (r"(?<=def )load", "lookbehind"),
    (r"(?<!def )load", "negative lookbehind"),
    (r"(?>a|ab)c", "atomic group"),
    (r"a++", "possessive quantifier"),
    (r"end\Z", r"\Z (use \z"),
])
def test_constructs_re2_does_not_support_are_refused_by_name(pattern: str, construct: str) -> None:
    with pytest.raises(PatternInvalid) as err:
        Searcher(pattern, regex=True)
    assert err.value.code == "pattern.invalid"
    assert "RE2 syntax does not support" in err.value.message and construct in err.value.message
    assert RE2_SYNTAX_URL in err.value.message


@pytest.mark.parametrize("pattern", ["(unclosed", "[a-", "a{2,1}", "x**", r"\p{NoSuchScript}"])
def test_a_malformed_regex_is_pattern_invalid(pattern: str) -> None:
    with pytest.raises(PatternInvalid) as err:
        Searcher(pattern, regex=True)
    assert err.value.code == "pattern.invalid"
    assert err.value.message.startswith("invalid regular expression") and RE2_SYNTAX_URL in err.value.message


def test_rejected_patterns_print_nothing_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PatternInvalid):
        Searcher(r"(a)\1", regex=True)
    assert capfd.readouterr().err == ""


def test_arguments_out_of_range_are_pattern_invalid() -> None:
    for bad in ({"max_results": 0}, {"max_results": MAX_RESULTS_CAP + 1}, {"context": 101}):
        with pytest.raises(PatternInvalid):
            Searcher("x", **bad)
    with pytest.raises(PatternInvalid):
        Searcher("")


# -- line semantics -----------------------------------------------------------------------
def test_literal_and_regex_search_agree_on_lines_and_context() -> None:
    files = {"a.py": SOURCE, "b.py": b"nothing here\n", "c.py": b"def x_handler(): pass"}
    literal = search("_handler(", files, context=1)
    regex = search(r"def \w+_handler", files, regex=True, context=1)
    assert [(m.path, m.line_number, m.line, m.before, m.after) for m in literal] == \
           [(m.path, m.line_number, m.line, m.before, m.after) for m in regex] == [
        ("a.py", 3, "def load_handler(x):", ("",), ("    return x",)),
        ("a.py", 6, "def save_handler(y):", ("",), ("    return y",)),
        ("c.py", 1, "def x_handler(): pass", (), ()),
    ]
    assert literal.files_searched == regex.files_searched == 3


def test_context_stops_at_the_file_edges() -> None:
    result = search("b", {"f": b"a\nb\nc"}, context=5)
    assert [(m.before, m.after) for m in result] == [(("a",), ("c",))]


def test_a_match_spanning_a_newline_is_not_a_line_match() -> None:
    files = {"f": b"foo\nbar\nfoo bar\n"}
    assert lines(search(r"foo\sbar", files, regex=True)) == [("f", 3, "foo bar")]
    assert lines(search(r"o[^x]b", files, regex=True)) == [("f", 3, "foo bar")]
    assert lines(search("foo\nbar", files)) == []
    assert lines(search(r"foo\nbar", files, regex=True)) == []


def test_anchors_match_at_line_boundaries_and_no_line_follows_the_last_newline() -> None:
    files = {"f": b"alpha\n\nbeta\n"}
    assert lines(search(r"^beta$", files, regex=True)) == [("f", 3, "beta")]
    assert lines(search(r"^$", files, regex=True)) == [("f", 2, "")]
    assert [m.line_number for m in search(r"^", files, regex=True)] == [1, 2, 3]
    assert lines(search(r"x*", {"empty": b""}, regex=True)) == []


def test_crlf_files_report_lines_without_the_carriage_return() -> None:
    files = {"win.txt": b"first\r\nsecond foo\r\nthird\r\n", "old.txt": b"last foo\r"}
    literal = search("foo", files, context=1)
    assert [(m.line_number, m.line, m.before, m.after) for m in literal] == [
        (2, "second foo", ("first",), ("third",)), (1, "last foo", (), ())]
    assert lines(search(r"foo$", files, regex=True)) == lines(literal)


def test_ignore_case_for_literal_and_regex() -> None:
    files = {"f": b"NEEDLE\nneedle\nNeedle in a haystack\nnoodle\nA.B\naxb\n\xc3\x89t\xc3\xa9\n"}
    assert [m.line_number for m in search("needle", files, ignore_case=True)] == [1, 2, 3]
    assert [m.line_number for m in search(r"^ne+dle$", files, regex=True, ignore_case=True)] == [1, 2]
    assert [m.line_number for m in search("a.b", files, ignore_case=True)] == [5]  # still a literal
    assert [m.line_number for m in search("ÉTÉ", files, ignore_case=True)] == [7]
    assert [m.line_number for m in search("needle", files)] == [2]


def test_invalid_utf8_is_shown_replaced() -> None:
    result = search("bad", {"f": b"ok\nbad \xff byte\n"}, context=1)
    assert [(m.line, m.before) for m in result] == [("bad \ufffd byte", ("ok",))]


def test_binary_files_are_skipped_and_counted() -> None:
    files = {
        "logo.png": b"\x89PNG\x00\x00needle",
        "late-nul.txt": b"needle\n" + b"x" * 9000 + b"\x00",  # NUL past the first 8 KiB: text
        "src.py": b"needle = 1\n",
    }
    for options in ({}, {"regex": True}):
        result = search("needle", files, **options)
        assert [m.path for m in result] == ["late-nul.txt", "src.py"]
        assert result.binary_files_skipped == 1 and result.files_searched == 3


def test_max_results_caps_and_says_truncated() -> None:
    files = {"a": b"hit\nhit\nhit\n", "b": b"hit\nhit\n"}
    for options in ({}, {"regex": True}):
        capped = search("hit", files, max_results=3, **options)
        assert [(m.path, m.line_number) for m in capped] == [("a", 1), ("a", 2), ("a", 3)] and capped.truncated
        exact = search("hit", files, max_results=5, **options)
        assert len(exact) == 5 and not exact.truncated


def test_after_goes_on_from_the_last_match_of_a_page() -> None:
    files = {"a": b"hit\nmiss\nhit hit\n", "b/c": b"hit\n", "d": b"miss\nhit\nhit"}
    for options in ({}, {"regex": True}, {"ignore_case": True}):
        whole = lines(search("hit", files, **options))
        assert [(p, n) for p, n, _ in whole] == [("a", 1), ("a", 3), ("b/c", 1), ("d", 2), ("d", 3)]
        for size in (1, 2, 4):
            got, after = [], None
            for _ in range(10):
                page = search("hit", files, max_results=size, after=after, **options)
                got += lines(page)
                if not page.truncated:
                    break
                after = (page.matches[-1].path, page.matches[-1].line_number)
            assert got == whole, (options, size)
        # a cursor between files (its file gone meanwhile) goes on with the next path
        assert [(p, n) for p, n, _ in lines(search("hit", files, after=("b", 7), **options))] == \
            [("b/c", 1), ("d", 2), ("d", 3)]
        assert lines(search("hit", files, after=("d", 3), **options)) == []


@pytest.mark.parametrize("after", [("a",), ("a", -1), ("a", "1"), (1, 1), ["a", 1], ("a", True)])
def test_a_malformed_after_is_pattern_invalid(after: Any) -> None:
    with pytest.raises(PatternInvalid):
        Searcher("x", after=after)


# -- a literal's line-by-line search (the common case) gives grep's lines ------------------
def grep_lines(needle: str, files: dict[str, bytes], context: int, max_results: int) -> tuple[list[Any], bool]:
    """What ``grep -nF`` reports, written the slow obvious way: the oracle for literal search."""
    found: list[Any] = []
    raw = needle.encode("utf-8", "surrogatepass")
    for path, data in files.items():
        if b"\x00" in data[:8192]:
            continue
        data = data.replace(b"\r\n", b"\n")
        data = data[:-1] if data.endswith(b"\r") else data
        rows = data.split(b"\n")
        if data.endswith(b"\n"):
            rows.pop()  # no line follows the last newline
        text = [r.decode("utf-8", "replace") for r in rows]
        for i, row in enumerate(rows):
            if raw in row:
                if len(found) == max_results:
                    return found, True
                found.append((path, i + 1, text[i], tuple(text[max(0, i - context):i]),
                              tuple(text[i + 1:i + 1 + context])))
    return found, False


def full(result: SearchResult) -> tuple[list[Any], bool]:
    return [(m.path, m.line_number, m.line, m.before, m.after) for m in result], result.truncated


PIECES = [b"a", b"b", b"ab", b"ba", b"\n", b"\r", b"\r\n", b"\xff", b"\xc3\xa9", b"\xc3", b" ", b"\x00"]


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    files=st.dictionaries(st.sampled_from(["a", "b/c", "d"]),
                          st.lists(st.sampled_from(PIECES), max_size=40).map(b"".join), max_size=3),
    needle=st.sampled_from(["a", "ab", "aa", "b a", "é", "a\r", "\rb", "a\nb", "\ufffd", "ba b"]),
    context=st.integers(0, 2),
    max_results=st.integers(1, 12),
)
def test_a_literal_finds_what_grep_finds(files: dict[str, bytes], needle: str, context: int,
                                         max_results: int) -> None:
    files = dict(sorted(files.items()))
    literal = search(needle, files, context=context, max_results=max_results)
    assert full(literal) == grep_lines(needle, files, context, max_results)
    if literal.truncated:  # the next page, from the last match of this one, is grep's next lines
        everything, _ = grep_lines(needle, files, context, 10_000)
        last = literal.matches[-1]
        rest = search(needle, files, context=context, max_results=max_results, after=(last.path, last.line_number))
        assert full(rest)[0] == everything[max_results:2 * max_results]
    regex = search(re2.escape(needle), files, regex=True, context=context, max_results=max_results)
    assert full(literal) == full(regex)
    assert (literal.files_searched, literal.binary_files_skipped) == (regex.files_searched,
                                                                       regex.binary_files_skipped)


def test_a_match_on_a_last_line_without_a_newline_is_reported() -> None:
    result = search("end", {"f": b"start\nthe end"}, context=1)
    assert full(result) == ([("f", 2, "the end", ("start",), ())], False)


def test_line_numbers_hold_far_into_a_large_file() -> None:
    body = b"".join(b"line %d\n" % i for i in range(20_000))  # ~200 KB between matches
    files = {"big": b"hit 1\n" + body + b"hit 2\n" + body + b"tail hit", "small": b"hit\n"}
    assert full(search("hit", files, context=1)) == grep_lines("hit", files, 1, 100)
    assert [m.line_number for m in search("hit", files)] == [1, 20_002, 40_003, 1]


def test_overlapping_and_repeated_matches_report_their_line_once() -> None:
    result = search("aa", {"f": b"aaaa aa\nb\naaa"})
    assert [(m.line_number, m.line) for m in result] == [(1, "aaaa aa"), (3, "aaa")]


def test_crlf_and_a_lone_carriage_return_in_a_literal() -> None:
    files = {"f": b"one\r\ntwo\rx\r\nthree\r"}
    assert [(m.line_number, m.line) for m in search("two", files)] == [(2, "two\rx")]
    assert [(m.line_number, m.line) for m in search("\rx", files)] == [(2, "two\rx")]
    assert lines(search("one\r", files)) == [] and lines(search("three\r", files)) == []
    doubled = {"f": b"a\r\r\nb a\r\r"}  # one CR goes with the line end, the other stays in the line
    for options in ({}, {"context": 1}, {"regex": True}):
        assert [m.line for m in search("a", doubled, **options)] == ["a\r", "b a\r"]


def test_matches_past_max_results_stop_the_search_in_that_file() -> None:
    files = {"a": b"x\n" * 3, "b": b"y\nx\n", "c": b"x\n"}
    capped = search("x", files, max_results=4)
    assert [(m.path, m.line_number) for m in capped] == [("a", 1), ("a", 2), ("a", 3), ("b", 2)]
    assert capped.truncated and capped.files_searched == 3  # "c" holds the fifth match
    exact = search("x", {"a": files["a"], "b": files["b"]}, max_results=4)
    assert not exact.truncated and exact.files_searched == 2


def test_non_utf8_bytes_in_matched_and_context_lines_are_replaced() -> None:
    files = {"f": b"\xfe\xff\nname = b'\xc3' + x\n\xe2\x82\n"}
    result = search("name", files, context=1)
    assert full(result) == ([("f", 2, "name = b'\ufffd' + x", ("\ufffd\ufffd",), ("\ufffd",))], False)


def test_a_match_compares_by_value_and_has_no_other_fields() -> None:
    (m,) = search("x", {"f": b"x\n"})
    assert m == SearchMatch("f", 1, "x") and m != SearchMatch("f", 1, "x", ("w",))
    with pytest.raises(AttributeError):
        m.column = 1  # type: ignore[attr-defined]


# -- globs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("glob", ["[", "a[", "**/[", "[!]", "[]", "src/[abc", "[z-a]", ""])
def test_a_malformed_glob_is_pattern_invalid(glob: str) -> None:
    with pytest.raises(PatternInvalid) as err:
        compile_glob(glob)
    assert err.value.code == "pattern.invalid"


def test_a_bracket_right_after_the_opening_one_is_a_member() -> None:
    assert compile_glob("[]]").match("]") is True
    assert compile_glob("[]a]x").match("ax") is True
    assert compile_glob("[!]]").match("]") is False and compile_glob("[!]]").match("x") is True


def test_single_star_stays_in_its_directory_and_double_star_spans_any_depth() -> None:
    top, deep = compile_glob("*.py"), compile_glob("**/*.py")
    assert top.match("main.py") and not top.match("src/main.py")
    assert deep.match("main.py") and deep.match("src/a/b/main.py") and not deep.match("src/main.pyc")
    middle = compile_glob("a/**/b.py")
    assert middle.match("a/b.py") and middle.match("a/x/y/b.py")
    assert not middle.match("ab.py") and not middle.match("a/xb.py") and not middle.match("c/a/b.py")
    assert compile_glob("src/**").match("src/x/y.txt") and not compile_glob("src/**").match("srcx/y")
    assert compile_glob("./src/?.py").match("src/a.py") and not compile_glob("src/?.py").match("src/ab.py")
    # '**' spans whole directory names only, so no path with an empty one matches
    assert not deep.match("a//b.py") and not deep.match("/b.py") and not middle.match("a//b.py")


def test_classes_never_match_a_slash() -> None:
    assert compile_glob("a[!x]b").match("a-b") and not compile_glob("a[!x]b").match("a/b")
    assert compile_glob("a[^x]b").match("a-b") and not compile_glob("a[^x]b").match("a/b")
    spans_slash = compile_glob("a[+-0]b")  # the range '+'..'0' includes '/'
    assert spans_slash.match("a.b") and spans_slash.match("a0b") and not spans_slash.match("a/b")
    assert compile_glob("v[0-9].py").match("v7.py") and not compile_glob("v[0-9].py").match("vx.py")


def test_glob_metacharacters_of_regexes_are_literal() -> None:
    glob = compile_glob("a+(b)|c.{x}$.py")
    assert glob.match("a+(b)|c.{x}$.py") and not glob.match("aa(b)|c.{x}$.py")


# -- a page of results is bounded in bytes ------------------------------------------------------
def test_a_searchers_byte_budget_stops_before_the_match_that_would_pass_it() -> None:
    files = {"a.txt": b"".join(b"hit %03d " % i + b"x" * 90 + b"\n" for i in range(50))}
    full = search("hit", files, context=3, max_results=1000)
    capped = search("hit", files, context=3, max_results=1000, max_bytes=5000)
    assert capped.truncated and 0 < len(capped) < len(full)
    assert capped.matches == full.matches[:len(capped)]
    assert sum(len(m.line) + sum(map(len, m.before + m.after)) for m in capped) <= 5000
    # the first match is kept whatever its size, so a page always moves on
    assert len(search("hit", files, context=3, max_bytes=1)) == 1


def test_a_page_clips_long_lines_and_stops_at_its_byte_budget() -> None:
    from draftstore.search import paged

    long_line = b"needle " + b"\x01\"" * 50_000  # escapes make its JSON six and two times its bytes
    files = {"a.txt": long_line + b"\n" + b"needle short\n" * 400}
    page = paged(search("needle", files, max_results=10_000, context=5), page_bytes=64 * 1024, line_bytes=512)
    assert page.lines_clipped and page.truncated
    import dataclasses
    import json
    body = json.dumps({"matches": [dataclasses.asdict(m) for m in page.matches]}, ensure_ascii=False).encode()
    assert len(body) <= 64 * 1024
    assert page.matches[0].line.startswith("needle ") and page.matches[1].line == "needle short"


def test_http_search_with_wide_context_is_paged_within_its_byte_budget(service: Any) -> None:
    """A 0.4 MB file, every 20th line a match, 100 lines of context each side: once 4 MB in one
    answer (40 MB with more matches). Now every page stays within the budget, says truncated,
    and following the cursors reports every match exactly once."""
    from draftstore.search import PAGE_BYTES

    lines = [(b"match %04d " % i if i % 20 == 0 else b"line %04d " % i) + b"." * 90 for i in range(4000)]
    c = service.client()
    pid = c.post("/v1/projects", json={"name": "big", "files": {}}).json()["id"]
    store = service.store
    turn = store.start_turn(pid, "big file")
    store.write_file(turn.id, "big.txt", b"\n".join(lines) + b"\n")
    store.write_file(turn.id, "small.txt", b"match here\n")
    expected = [("big.txt", i + 1) for i in range(0, 4000, 20)] + [("small.txt", 1)]
    seen: list[tuple[str, int]] = []
    params: dict[str, Any] = {"q": "match", "context": 100, "max_results": 10_000}
    pages = 0
    while True:
        r = c.get(f"/v1/projects/{pid}/view/search", params=params)
        assert r.status_code == 200, r.text
        assert len(r.content) <= PAGE_BYTES
        page = r.json()
        pages += 1
        seen += [(m["path"], m["line_number"]) for m in page["matches"]]
        assert all(len(m["before"]) <= 100 and len(m["after"]) <= 100 for m in page["matches"])
        if not page["truncated"]:
            assert page["next_cursor"] is None
            break
        params["cursor"] = page["next_cursor"]
    assert pages > 1
    assert seen == expected  # every match once, in order
