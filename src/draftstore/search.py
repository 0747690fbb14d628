"""Globs and code search over a state: pure functions, no I/O of their own.

Glob rules (matched against the whole '/'-separated path, case-sensitive):
``*`` any run of characters within one segment, ``?`` one character within a
segment, ``[abc]`` / ``[!abc]`` a character class, and a whole segment ``**``
any number of directories (including none). So ``*.py`` matches top-level
files only and ``**/*.py`` matches at any depth.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .errors import PatternInvalid

__all__ = ["compile_glob", "glob_base", "SearchMatch", "SearchResult", "Searcher", "MAX_RESULTS_CAP"]

MAX_RESULTS_CAP = 10_000
_BINARY_SNIFF = 8192
_GLOB_CHARS = set("*?[")


def _segment_regex(seg: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(seg):
        ch = seg[i]
        if ch == "*":
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "[":
            j = seg.find("]", i + 2 if i + 1 < len(seg) and seg[i + 1] in "!^" else i + 1)
            if j < 0:
                out.append(re.escape(ch))
            else:
                body = seg[i + 1 : j]
                neg = body[:1] in ("!", "^")
                if neg:
                    body = body[1:]
                body = body.replace("\\", "\\\\")
                # a negated class never matches the separator
                out.append(f"[^/{body}]" if neg else f"[{body}]")
                i = j
        else:
            out.append(re.escape(ch))
        i += 1
    return "".join(out)


def compile_glob(pattern: str) -> re.Pattern[str]:
    """Compile a glob to a regex matching whole paths. Raises ``pattern.invalid``."""
    if not isinstance(pattern, str) or not pattern or len(pattern) > 1024 or "\x00" in pattern:
        raise PatternInvalid("a glob is a non-empty string of at most 1024 characters", pattern=str(pattern)[:100])
    if pattern.startswith("./"):
        pattern = pattern[2:]
    segments = pattern.split("/")
    parts: list[str] = []
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg == "**":
            parts.append(".*" if last else "(?:[^/]+/)*")
            continue
        parts.append(_segment_regex(seg) + ("" if last else "/"))
    try:
        return re.compile("".join(parts) + r"\Z", re.DOTALL)
    except re.error as exc:
        raise PatternInvalid(f"invalid glob {pattern!r}: {exc}", pattern=pattern) from exc


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


@dataclass(frozen=True)
class SearchMatch:
    path: str
    line_number: int  # 1-based
    line: str
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


@dataclass
class SearchResult:
    matches: list[SearchMatch] = field(default_factory=list)
    truncated: bool = False  # True: more matches exist than max_results
    files_searched: int = 0
    binary_files_skipped: int = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.matches)

    def __len__(self) -> int:
        return len(self.matches)


class Searcher:
    """One search: a literal or regex pattern, context lines and a result cap."""

    def __init__(self, pattern: str, *, regex: bool = False, context: int = 0, max_results: int = 100,
                 ignore_case: bool = False) -> None:
        if not isinstance(pattern, str) or pattern == "":
            raise PatternInvalid("a search pattern is a non-empty string")
        if len(pattern) > 4096:
            raise PatternInvalid("a search pattern is at most 4096 characters")
        if not isinstance(context, int) or not 0 <= context <= 100:
            raise PatternInvalid("context is an integer from 0 to 100", context=context)
        if not isinstance(max_results, int) or not 1 <= max_results <= MAX_RESULTS_CAP:
            raise PatternInvalid(f"max_results is an integer from 1 to {MAX_RESULTS_CAP}", max_results=max_results)
        self.context = context
        self.max_results = max_results
        self._needle: bytes | None = None
        if regex or ignore_case:
            try:
                rx = re.compile(pattern if regex else re.escape(pattern), re.IGNORECASE if ignore_case else 0)
            except re.error as exc:
                raise PatternInvalid(f"invalid regular expression: {exc}", pattern=pattern[:200]) from exc
            self._line_match: Callable[[str], bool] = lambda line: rx.search(line) is not None
            self._file_rx = re.compile(rx.pattern, rx.flags | re.MULTILINE)
        else:
            self._needle = pattern.encode("utf-8")
            self._line_match = lambda line: pattern in line
            self._file_rx = None

    def run(self, files: Iterable[tuple[str, Callable[[], bytes]]]) -> SearchResult:
        """Search ``(path, read)`` pairs in order; stops once the cap is exceeded."""
        result = SearchResult()
        matches = result.matches
        needle = self._needle
        for path, read in files:
            data = read()
            result.files_searched += 1
            if needle is not None and needle not in data:
                continue  # the common case: one C-level scan, no decoding
            if b"\x00" in data[:_BINARY_SNIFF]:
                result.binary_files_skipped += 1
                continue
            text = data.decode("utf-8", errors="replace")
            if self._file_rx is not None and self._file_rx.search(text) is None:
                continue
            lines = text.splitlines()
            for i, line in enumerate(lines):
                if not self._line_match(line):
                    continue
                if len(matches) == self.max_results:
                    result.truncated = True
                    return result
                c = self.context
                matches.append(SearchMatch(path, i + 1, line, tuple(lines[max(0, i - c) : i]) if c else (),
                                           tuple(lines[i + 1 : i + 1 + c]) if c else ()))
        return result
