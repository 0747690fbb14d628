r"""Globs and code search over a state: pure functions, no I/O of their own.

Every pattern runs on RE2 (google-re2): time linear in the text, so no
agent-supplied pattern can hang a worker by backtracking. A case-sensitive literal
(the default) needs no regex engine: StringZilla's SIMD substring search finds it,
also in linear time.

Search (``Searcher``, ``View.search_code``): a literal (the default) matches its
exact text; ``regex=True`` takes RE2 syntax, https://github.com/google/re2/wiki/Syntax
-- ``\d \w \s \b``, ``[[:alpha:]]``, ``\pL``, lazy quantifiers, named groups,
flags ``(?i) (?s) (?U)``, ``\A``, ``\z`` (not ``\Z``). RE2 refuses what needs
backtracking -- backreferences (``\1``, ``(?P=name)``), lookaround (``(?=``
``(?!`` ``(?<=`` ``(?<!``), atomic groups ``(?>``, possessive ``a++``, recursion
-- and such a pattern, or a malformed one, raises ``pattern.invalid`` saying
what is wrong. ``ignore_case=True`` (literal or regex) folds case Unicode-wide.

Lines are grep's: split on ``\n`` only; a ``\r`` before it (or ending the file)
is part of the terminator, so ``$`` matches at a CRLF line end and no returned
line ends in that ``\r``. A line matches when the pattern matches within it
(``^``/``$`` anchor at line ends; no match spans lines), so the pattern always
matches the returned line. ``.`` and classes match whole UTF-8 characters, never
an invalid byte. Files with a NUL in their first 8 KiB are binary, skipped.

Globs (``compile_glob``, against the whole '/'-separated path, case-sensitive):
``*`` any run of characters within one segment, ``?`` one character within a
segment, ``[abc]`` ``[a-z]`` ``[!abc]`` (or ``[^abc]``) a class that never
matches '/' (a ``]`` first in it is a member: ``[]]``), a whole segment ``**``
any number of directories, none included. So ``*.py`` matches top-level files
only and ``**/*.py`` any depth. An unclosed ``[`` raises ``pattern.invalid``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import re2
import stringzilla

from ..errors import PatternInvalid

__all__ = ["compile_glob", "glob_base", "Glob", "SearchMatch", "SearchResult", "Searcher", "MAX_RESULTS_CAP",
           "RE2_SYNTAX_URL", "PAGE_BYTES", "PAGE_LINE_BYTES", "paged"]

RE2_SYNTAX_URL = "https://github.com/google/re2/wiki/Syntax"
MAX_RESULTS_CAP = 10_000
_BINARY_SNIFF = 8192
PAGE_BYTES = 1 << 20  # one page of search results over HTTP, as JSON, at most
PAGE_LINE_BYTES = 2048  # one line (or context line) of a page, as JSON; longer ones are clipped
# what a page holds besides its matches (counts, flags, a cursor naming a path of up to 1 KiB)
_PAGE_OVERHEAD = 4096
_GLOB_CHARS = set("*?[")
_GLOB_WILDCARDS = {"*": "[^/]*", "?": "[^/]"}

# What PCRE/Python users reach for and RE2 refuses, by the start of the fragment
# RE2 names in an "invalid perl operator" or "invalid escape sequence" error.
_UNSUPPORTED = (
    ("(?<=", "lookbehind (?<=...)"), ("(?<!", "negative lookbehind (?<!...)"),
    ("(?=", "lookahead (?=...)"), ("(?!", "negative lookahead (?!...)"),
    ("(?>", "atomic group (?>...)"), ("(?P", "named backreference (?P=name) or recursion (?P>name)"),
    ("(?#", "inline comment (?#...)"), ("(?|", "branch reset (?|...)"), ("(?(", "conditional (?(...)...)"),
    ("(?R", "recursion (?R)"), ("(?x", "verbose flag (?x)"), ("\\k", "named backreference \\k<name>"),
    ("\\g", "backreference \\g"), ("\\Z", "\\Z (use \\z for the end of the text)"),
)


def _options(*, ignore_case: bool = False, literal: bool = False) -> re2.Options:
    opts = re2.Options()
    opts.log_errors = False  # RE2 would print every rejected pattern to stderr
    opts.case_sensitive, opts.literal = not ignore_case, literal
    return opts


def _compile(pattern: str, opts: re2.Options) -> re2._Regexp:
    """``pattern`` compiled by RE2, or ``pattern.invalid`` naming what RE2 refused."""
    try:
        return re2.compile(pattern, opts)
    except (re2.error, UnicodeEncodeError) as exc:  # the latter: a lone surrogate
        raw = exc.args[0] if isinstance(exc, re2.error) and exc.args else exc  # RE2 gives bytes
        reason = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        kind, _, frag = reason.partition(": ")
        what = None
        if kind == "bad repetition operator" and frag.endswith("+"):
            what = f"possessive quantifier {frag}"
        elif kind == "invalid escape sequence" and frag[1:2].isdigit():
            what = f"backreference {frag}"
        elif kind in ("invalid perl operator", "invalid escape sequence"):
            what = next((name for key, name in _UNSUPPORTED if frag.startswith(key)), None)
        message = (f"RE2 syntax does not support {what}; see {RE2_SYNTAX_URL}" if what else
                   f"invalid regular expression: {reason} (patterns use RE2 syntax, see {RE2_SYNTAX_URL})")
        raise PatternInvalid(message, pattern=pattern[:200], reason=reason) from exc


# -- globs ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Glob:
    """A compiled glob: ``match(path)`` is True exactly when the whole path matches."""

    pattern: str
    _rx: re2._Regexp = field(repr=False)
    _head: str = field(repr=False)  # literal start and end of every match: a cheap first test
    _tail: str = field(repr=False)
    _shape: str = field(repr=False)  # "**" or "**/*": what lies between head and tail, tested without RE2

    def match(self, path: str) -> bool:
        if not (path.startswith(self._head) and path.endswith(self._tail)):
            return False
        if self._shape:  # "**": anything; "**/*": no empty directory name
            return self._shape == "**" or "//" not in "/" + path[len(self._head):]
        # bytes: google-re2 maps str offsets back from UTF-8, which costs more than the match
        return self._rx.fullmatch(path.encode("utf-8", "surrogatepass")) is not None


def _class_regex(glob: str, seg: str, i: int) -> tuple[str, int]:
    """The RE2 class for the glob class opening at ``seg[i]``, and the index of its ']'."""
    j = i + 2 if seg[i + 1:i + 2] in ("!", "^") else i + 1
    close = seg.find("]", j + 1)  # a ']' first in the class is a member, as in fnmatch
    if close < 0:
        raise PatternInvalid(f"unclosed '[' in glob {glob!r} (a ']' right after '[' or '[!' is a member)", pattern=glob)
    body, items, k = seg[j:close], [], 0
    while k < len(body):
        lo = hi = ord(body[k])
        if k + 2 < len(body) and body[k + 1] == "-":
            hi, k = ord(body[k + 2]), k + 3
        else:
            k += 1
        if lo > hi:
            raise PatternInvalid(f"reversed range {chr(lo)}-{chr(hi)} in glob {glob!r}", pattern=glob)
        # a class never matches '/' (0x2F): a range across it is split (a segment holds no '/' itself)
        for a, b in ((lo, min(hi, 0x2E)), (max(lo, 0x30), hi)):
            if a <= b:
                items.append(f"\\x{{{a:x}}}" if a == b else f"\\x{{{a:x}}}-\\x{{{b:x}}}")
    return ("[^/" if j > i + 1 else "[") + "".join(items) + "]", close


def _segment_regex(glob: str, seg: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(seg):
        if seg[i] == "[":
            cls, i = _class_regex(glob, seg, i)
            out.append(cls)
        else:
            out.append(_GLOB_WILDCARDS.get(seg[i]) or re2.escape(seg[i]))
        i += 1
    return "".join(out)


def _unicode(pattern: str, what: str) -> None:
    try:
        pattern.encode("utf-8")
    except UnicodeEncodeError:
        raise PatternInvalid(f"{what} is not valid Unicode (it holds a lone surrogate)",
                             pattern=pattern[:200].encode("utf-8", "replace").decode()) from None


def compile_glob(pattern: str) -> Glob:
    """Compile a glob (rules in the module docstring); matching is linear-time whatever the glob.
    Raises ``pattern.invalid``: not a non-empty string of <= 1024 characters, NUL, a lone
    surrogate, unclosed ``[``, reversed range."""
    if not isinstance(pattern, str) or not pattern or len(pattern) > 1024 or "\x00" in pattern:
        raise PatternInvalid("a glob is a non-empty string of at most 1024 characters", pattern=str(pattern)[:100])
    _unicode(pattern, "a glob")
    segments = (pattern[2:] if pattern.startswith("./") else pattern).split("/")
    parts: list[str] = []
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg == "**":
            parts.append(".*" if last else "(?:[^/]+/)*")
        else:
            parts.append(_segment_regex(pattern, seg) + ("" if last else "/"))
    glob, end = "/".join(segments), segments[-1]
    head = glob[:min([i for i in map(glob.find, "*?[") if i >= 0], default=len(glob))]
    tail = "" if end == "**" else end[max(map(end.rfind, "*?]")) + 1:]  # (no unclosed '[' got here)
    rest = glob[len(head):] if head == "" or head.endswith("/") else None  # the common shapes:
    shape = "**" if rest == "**" else "**/*" if rest == "**/*" + tail else ""  # src/**, **/*.py
    return Glob(pattern, _compile("(?s)" + "".join(parts), _options()), head, tail, shape)


def glob_base(pattern: str) -> str:
    """The literal directory prefix of a glob ('' if none): where a walk can start."""
    if pattern.startswith("./"):
        pattern = pattern[2:]
    segments = pattern.lstrip("/").split("/")[:-1]
    base: list[str] = []
    for seg in segments:
        if _GLOB_CHARS & set(seg):
            break
        base.append(seg)
    return "/".join(base)


# -- search --------------------------------------------------------------------------
# Not frozen: a search builds up to MAX_RESULTS_CAP of these, and a frozen dataclass's __init__
# (an object.__setattr__ call per field) was measured at over a tenth of a search for a common
# literal. Like the SearchResult that holds them, matches are the caller's to keep or change.
@dataclass(slots=True)
class SearchMatch:
    """One matching line: a record compared by value (not hashable)."""

    path: str
    line_number: int  # 1-based
    line: str  # without its terminator; invalid UTF-8 shown as U+FFFD
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


@dataclass
class SearchResult:
    matches: list[SearchMatch] = field(default_factory=list)
    truncated: bool = False  # True: more matches exist than max_results (or than the byte budget holds)
    files_searched: int = 0
    binary_files_skipped: int = 0  # binary files the pattern occurs in (so not reported)
    lines_clipped: bool = False  # True: a line (or context line) was cut short to fit a page (``paged``)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.matches)

    def __len__(self) -> int:
        return len(self.matches)


# StringZilla's SIMD substring search and count: several times faster than bytes.find and
# bytes.count on source text (a needle such as "import " defeats CPython's skip heuristics),
# and cheaper per call even for a newline; each takes Python's (haystack, needle, start, end)
# and gives Python's answer.
_sz_find = stringzilla.find
_sz_rfind = stringzilla.rfind
_sz_count = stringzilla.count


_NUMPY_COUNT_FROM = 16384  # bytes: past this numpy's count outruns StringZilla's (per-call cost aside)


def _numpy_count_newlines(data: bytes, start: int, end: int) -> int:
    """How many "\\n" lie in ``data[start:end]``, counted by numpy (long spans)."""
    return int(np.count_nonzero(np.frombuffer(data, np.uint8, end - start, start) == 0x0A))


def _line(data: bytes, pos: int) -> tuple[int, int]:
    """Start and end (its "\\n", or the end of ``data``) of the line holding ``data[pos]``."""
    end = data.find(b"\n", pos)
    return data.rfind(b"\n", 0, pos) + 1, (len(data) if end < 0 else end)


def _context(data: bytes, ls: int, le: int, c: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Up to ``c`` lines before the line ``data[ls:le]`` and up to ``c`` after it, within ``data``."""
    before: list[str] = []
    s = ls
    while len(before) < c and s > 0:
        s, e = _line(data, s - 1)
        before.append(data[s:e].decode("utf-8", "replace"))
    after: list[str] = []
    e, n = le, len(data)
    while len(after) < c and e + 1 < n:
        s, e = _line(data, e + 1)
        after.append(data[s:e].decode("utf-8", "replace"))
    return tuple(reversed(before)), tuple(after)


def _lf_lines(data: bytes) -> bytes:
    """Each CRLF (and a CR ending ``data``) made "\\n": neither patterns nor returned lines see that CR."""
    if b"\r" not in data:  # one memchr; a two-byte needle would scan several times slower
        return data
    data = data.replace(b"\r\n", b"\n")
    return data[:-1] if data.endswith(b"\r") else data


class Searcher:
    """One search: a literal or RE2 pattern, context lines and a result cap. ``run`` reports every
    line the pattern matches within (module docstring), in file then line order, at most
    ``max_results``; with ``after=(path, line)``, only the lines after that one in that order
    (the next page of an earlier search). With ``max_bytes``, it also stops (``truncated``)
    before the match that would take its lines and context past that many characters (the
    first match is always kept), so what a search holds is bounded however wide its
    context. Raises ``pattern.invalid`` for a bad pattern or argument, before any search."""

    def __init__(self, pattern: str, *, regex: bool = False, context: int = 0, max_results: int = 100,
                 ignore_case: bool = False, after: tuple[str, int] | None = None,
                 max_bytes: int | None = None) -> None:
        if not isinstance(pattern, str) or pattern == "":
            raise PatternInvalid("a search pattern is a non-empty string")
        if len(pattern) > 4096:
            raise PatternInvalid("a search pattern is at most 4096 characters")
        _unicode(pattern, "a search pattern")
        if not isinstance(context, int) or not 0 <= context <= 100:
            raise PatternInvalid("context is an integer from 0 to 100", context=context)
        if not isinstance(max_results, int) or not 1 <= max_results <= MAX_RESULTS_CAP:
            raise PatternInvalid(f"max_results is an integer from 1 to {MAX_RESULTS_CAP}", max_results=max_results)
        self.context, self.max_results = context, max_results
        self._bytes_left = max_bytes  # None: no byte budget
        if after is not None and not (isinstance(after, tuple) and len(after) == 2 and isinstance(after[0], str)
                                      and isinstance(after[1], int) and not isinstance(after[1], bool)
                                      and after[1] >= 0):
            raise PatternInvalid("after is a (path, line) pair of the last match reported")
        self._after = after
        self._needle: bytes | None = None
        if regex or ignore_case:
            opts = _options(ignore_case=ignore_case, literal=not regex)
            rx = _compile(pattern, opts)  # bare first: errors quote the agent's pattern as given
            if regex:
                rx = _compile("(?m)" + pattern, opts)  # ^ and $ anchor at line ends

            def find(data: bytes, pos: int = 0, end: int | None = None) -> tuple[int, int] | None:
                # RE2 sees all of data (^ $ \b look past pos/end); no pos/end: a third faster per call
                m = rx.search(data) if end is None else rx.search(data, pos, end)
                return None if m is None else m.span()
        else:
            needle = self._needle = pattern.encode("utf-8", "surrogatepass")

            def find(data: bytes, pos: int = 0, end: int | None = None) -> tuple[int, int] | None:
                i = _sz_find(data, needle, pos, len(data) if end is None else end)
                return None if i < 0 else (i, i + len(needle))
        self._find = find  # (start, end) of the first match inside data[pos:end], or None

    def run(self, files: Iterable[tuple[str, Callable[[], bytes]]]) -> SearchResult:
        """Search ``(path, read)`` pairs in order; stops once the cap is exceeded."""
        needle = self._needle
        if needle is not None and b"\n" not in needle:
            return self._run_literal(files, needle)  # the common case: a literal within one line
        result = SearchResult()
        for path, read in self.from_cursor(files):
            data = read()
            result.files_searched += 1
            if needle is not None and _sz_find(data, needle) < 0:
                continue  # one SIMD scan, nothing decoded
            if _sz_find(data, b"\x00", 0, _BINARY_SNIFF) >= 0:  # binary: the pattern is looked for as stored
                if needle is not None or self._find(data) is not None:
                    result.binary_files_skipped += 1
                continue
            data = _lf_lines(data)  # before a regex runs: '$' sees CRLF line ends
            hit = self._find(data)
            if hit is not None and self._add_lines(path, data, hit, result, self._skip(path)):
                break
        return result

    def from_cursor(self, files: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The ``(path, ...)`` items from the cursor's file on (all of them without a cursor):
        a caller that reads files lazily filters before reading."""
        if self._after is None:
            return files
        first = self._after[0]
        return (f for f in files if f[0] >= first)

    def _skip(self, path: str) -> int:
        """Lines of ``path`` up to this number were reported on an earlier page."""
        return self._after[1] if self._after is not None and path == self._after[0] else 0

    def _over_budget(self, line: int, before: tuple[str, ...], after: tuple[str, ...],
                     matches: list[SearchMatch]) -> bool:
        """True if a match of these sizes does not fit what is left of ``max_bytes`` (and one
        is already kept); else it is taken out of the budget."""
        size = line + sum(map(len, before)) + sum(map(len, after))
        assert self._bytes_left is not None
        if size > self._bytes_left and matches:
            return True
        self._bytes_left -= size
        return False

    def _run_literal(self, files: Iterable[tuple[str, Callable[[], bytes]]], needle: bytes) -> SearchResult:
        """``run`` for a literal without "\\n": every match lies inside one line, so a matching line
        costs a few C calls -- SIMD searches for the next match past the previous line's end and
        for the line's ends, a SIMD count of the newlines since the previous matching line -- and
        one decode; everything else is set up once per search, not per file or per match."""
        result = SearchResult()
        c, matches = self.context, result.matches
        # A needle without "\r" matches the same lines whether or not CRLFs are made LFs first,
        # so without context only a reported line needs its CR dropped, not every file.
        strip_cr = b"\r" not in needle and not c
        find, rfind, count, append = _sz_find, _sz_rfind, _sz_count, matches.append
        left = self.max_results
        before: tuple[str, ...] = ()
        after: tuple[str, ...] = ()
        searched = 0
        for path, read in self.from_cursor(files):
            data = read()
            searched += 1
            at = find(data, needle)
            if at < 0:
                continue  # the common case: one SIMD scan, nothing decoded
            if find(data, b"\x00", 0, _BINARY_SNIFF) >= 0:
                result.binary_files_skipped += 1  # binary: skipped, counted as it holds the needle
                continue
            if not strip_cr and b"\r" in data:
                data = _lf_lines(data)
                at = find(data, needle)
                if at < 0:
                    continue
            n = len(data)
            line_number, counted = 1, 0
            skip = self._skip(path)
            while at >= 0:  # inlined: a Python call per match costs as much as a SIMD search
                ls = rfind(data, b"\n", 0, at) + 1
                le = find(data, b"\n", at)
                if le < 0:
                    le = n
                line_number += (count(data, b"\n", counted, ls) if ls - counted < _NUMPY_COUNT_FROM
                                else _numpy_count_newlines(data, counted, ls))
                counted = ls
                if line_number <= skip:  # reported on an earlier page
                    at = find(data, needle, le + 1) if le < n else -1
                    continue
                if not left:
                    result.truncated = True
                    result.files_searched = searched
                    return result
                if c:
                    before, after = _context(data, ls, le, c)
                if self._bytes_left is not None and self._over_budget(le - ls, before, after, matches):
                    result.truncated = True
                    result.files_searched = searched
                    return result
                left -= 1
                text = data[ls:le - 1 if strip_cr and le > ls and data[le - 1] == 0x0D else le]
                append(SearchMatch(path, line_number, text.decode("utf-8", "replace"), before, after))
                at = find(data, needle, le + 1) if le < n else -1
        result.files_searched = searched
        return result

    def _add_lines(self, path: str, data: bytes, hit: tuple[int, int] | None, result: SearchResult,
                   skip: int = 0) -> bool:
        """Add one file's matching lines from its first match ``hit``; True once the cap is exceeded.
        Python work is per candidate line only: one search over the rest of the file finds the next
        match; if it runs past its line's end, a search inside that line alone decides."""
        find, c, matches = self._find, self.context, result.matches
        n = len(data)
        last = n - 1 if n == 0 or data[-1] == 0x0A else n  # a match starting later (past a final "\n") is in no line
        line_number, counted = 1, 0
        while hit is not None and hit[0] <= last:
            ls, le = _line(data, hit[0])
            if hit[1] <= le or find(data, ls, le) is not None:
                line_number += data.count(b"\n", counted, ls)
                counted = ls
                if line_number <= skip:  # reported on an earlier page
                    hit = find(data, le + 1, n) if le < n else None
                    continue
                if len(matches) == self.max_results:
                    result.truncated = True
                    return True
                before, after = _context(data, ls, le, c)
                if self._bytes_left is not None and self._over_budget(le - ls, before, after, matches):
                    result.truncated = True
                    return True
                text = data[ls:le].decode("utf-8", "replace")
                matches.append(SearchMatch(path, line_number, text, before, after))
            hit = find(data, le + 1, n) if le < n else None
        return False


def _json_len(text: str) -> int:
    """Bytes of ``text`` as a JSON string's content (UTF-8, escapes included)."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8")) - 2


def _clip_line(line: str, limit: int) -> tuple[str, bool]:
    """``line`` cut so that it takes at most ``limit`` bytes in JSON (never inside a character)."""
    if len(line) * 6 <= limit or _json_len(line) <= limit:  # no character takes more than 6 (a \u00XX escape)
        return line, False
    cut = line.encode("utf-8")[:limit].decode("utf-8", "ignore")
    if _json_len(cut) > limit:  # escapes (quotes, backslashes, control characters) made it longer
        cut = line[:limit // 6]
    return cut, True


def paged(result: SearchResult, page_bytes: int = PAGE_BYTES, line_bytes: int = PAGE_LINE_BYTES) -> SearchResult:
    """The leading matches of ``result`` that fit one page: each line and context line
    clipped to ``line_bytes`` as JSON (``lines_clipped``), and the matches together at
    most ``page_bytes`` of JSON with the rest of the page; past it the page is
    ``truncated``, to go on after its last match. With the defaults, one match (100
    context lines either side) always fits, so every page holds at least one."""
    room = page_bytes - _PAGE_OVERHEAD
    kept: list[SearchMatch] = []
    clipped = False
    for m in result.matches:
        line, c = _clip_line(m.line, line_bytes)
        before = [_clip_line(x, line_bytes) for x in m.before]
        after = [_clip_line(x, line_bytes) for x in m.after]
        # the match's members, their keys and separators, and each line's quotes and comma
        size = (80 + _json_len(m.path) + len(str(m.line_number)) + _json_len(line)
                + sum(_json_len(x) + 3 for x, _ in before + after))
        if size > room and kept:
            return SearchResult(kept, True, result.files_searched, result.binary_files_skipped, clipped)
        room -= size
        clipped = clipped or c or any(x[1] for x in before + after)
        kept.append(SearchMatch(m.path, m.line_number, line, tuple(x for x, _ in before),
                                tuple(x for x, _ in after)))
    return SearchResult(kept, result.truncated, result.files_searched, result.binary_files_skipped, clipped)
