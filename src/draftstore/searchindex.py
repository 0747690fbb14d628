"""A trigram index of the files of one subtree (as in codesearch and Zoekt); no I/O.

The index lists the subtree's files and, for every trigram (three bytes)
of their lowercased content, which files contain it. A search asks for the
trigrams every match must contain (``required``) and gets the files that
hold them all: a superset of the files that match, which the exact matcher
then confirms. Lowercasing (ASCII) makes one index serve case-sensitive and
case-insensitive searches; it can only add candidates, never lose one.

Format (content-addressed like any object)::

    b"DSIDX1\\n" + zstd(8-byte header length + header JSON + trigrams + offsets + postings)
    header: {"files": [[relative path, digest], ...], "n": trigram count, "width": 2 or 4}
    trigrams: n x uint32 (sorted) | offsets: (n + 1) x uint32 | postings: file ordinals
    (uint16 while there are fewer than 65,536 files, else uint32)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from .errors import IntegrityError

try:  # the parser behind ``re`` (Python 3.11+ names; ``sre_parse`` is its deprecated alias)
    from re import _constants as sre_constants  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

__all__ = ["build_index", "SearchIndex", "required_trigrams", "Query"]

_MAGIC = b"DSIDX1\n"
_SNIFF = 8192  # a file with a NUL in its first 8 KiB is binary (the search skips it)

# A query: alternatives (OR) of trigram sets (AND). None: no filter (every file is a candidate).
Query = list[frozenset[int]] | None


def _distinct(sorted_values: np.ndarray) -> np.ndarray:
    """A mask of the first of each run of equal values in a sorted array (sort + mask
    is far faster than ``np.unique``'s hashing on large integer arrays)."""
    mask = np.empty(len(sorted_values), dtype=bool)
    if len(mask):
        mask[0] = True
        np.not_equal(sorted_values[1:], sorted_values[:-1], out=mask[1:])
    return mask


_BATCH = 1 << 22  # bytes of text per vectorised pass


def _pairs(texts: list[bytes], first: int) -> tuple[np.ndarray, np.ndarray]:
    """(trigram, file ordinal) pairs, each once, for files ``first``, ``first + 1``, ...:
    one vectorised pass over their concatenation instead of one numpy call per file."""
    lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    a = np.frombuffer(b"".join(texts).lower(), dtype=np.uint8).astype(np.uint64)
    if len(a) < 3:
        return np.empty(0, dtype=np.uint32), np.empty(0, dtype=np.uint32)
    owner = np.repeat(np.arange(len(texts), dtype=np.uint64), lengths)
    tri = (a[:-2] << 16) | (a[1:-1] << 8) | a[2:]
    keep = owner[:-2] == owner[2:]  # a trigram never spans two files
    keys = np.sort((owner[:-2][keep] << 24) | tri[keep])
    keys = keys[_distinct(keys)]
    return (keys & 0xFFFFFF).astype(np.uint32), ((keys >> 24) + first).astype(np.uint32)


def build_index(files: list[tuple[str, str, bytes]]) -> bytes:
    """The index of ``files`` (relative path, digest, content). A binary file is
    listed with no trigrams: the search skips it, so it is never a candidate."""
    listed = [[path, digest] for path, digest, _ in files]
    grams: list[np.ndarray] = []
    owners: list[np.ndarray] = []
    batch: list[bytes] = []
    start = size = 0
    for i, (_, _, data) in enumerate(files):
        if size + len(data) > _BATCH and batch:
            g, o = _pairs(batch, start)
            grams.append(g)
            owners.append(o)
            batch, start, size = [], i, 0
        batch.append(data if b"\x00" not in data[:_SNIFF] else b"")
        size += len(data)
    if batch:
        g, o = _pairs(batch, start)
        grams.append(g)
        owners.append(o)
    if grams:
        g = np.concatenate(grams)
        o = np.concatenate(owners)
        order = np.argsort(g, kind="stable")  # by trigram; owners stay ascending within one
        g, o = g[order], o[order]
        starts = np.flatnonzero(_distinct(g))
        keys = g[starts]
    else:
        keys = o = np.empty(0, dtype=np.uint32)
        starts = np.empty(0, dtype=np.int64)
    offsets = np.append(starts, len(o)).astype(np.uint32)
    width = 2 if len(listed) < 65536 else 4
    header = json.dumps({"files": listed, "n": int(len(keys)), "width": width}, separators=(",", ":")).encode()
    body = b"".join([len(header).to_bytes(8, "big"), header, keys.astype(np.uint32).tobytes(), offsets.tobytes(),
                     o.astype(np.uint16 if width == 2 else np.uint32).tobytes()])
    return _MAGIC + zstandard.ZstdCompressor(level=3).compress(body)


@dataclass
class SearchIndex:
    files: list[tuple[str, str]]  # (relative path, digest), in ordinal order
    keys: np.ndarray
    offsets: np.ndarray
    postings: np.ndarray

    @classmethod
    def decode(cls, raw: bytes) -> "SearchIndex":
        if not raw.startswith(_MAGIC):
            raise IntegrityError("object is not a search index")
        try:
            body = zstandard.ZstdDecompressor().decompress(raw[len(_MAGIC):], max_output_size=1 << 32)
            n = int.from_bytes(body[:8], "big")
            header = json.loads(body[8:8 + n])
            k = header["n"]
            pos = 8 + n
            keys = np.frombuffer(body, dtype=np.uint32, count=k, offset=pos)
            offsets = np.frombuffer(body, dtype=np.uint32, count=k + 1, offset=pos + 4 * k)
            width = header.get("width", 4)
            postings = np.frombuffer(body, dtype=np.uint16 if width == 2 else np.uint32, offset=pos + 8 * k + 4)
        except (zstandard.ZstdError, ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"malformed search index: {exc}") from exc
        return cls([(p, d) for p, d in header["files"]], keys, offsets, postings)

    @property
    def size(self) -> int:
        return self.keys.nbytes + self.offsets.nbytes + self.postings.nbytes + 120 * len(self.files)

    def _holding(self, trigram: int) -> np.ndarray:
        i = int(np.searchsorted(self.keys, trigram))
        if i == len(self.keys) or int(self.keys[i]) != trigram:
            return np.empty(0, dtype=np.uint32)
        return self.postings[self.offsets[i]:self.offsets[i + 1]]

    def listed(self) -> set[str]:
        """Relative paths of every file the index knows (a file not listed is always searched)."""
        return {p for p, _ in self.files}

    def candidates(self, query: Query) -> set[str]:
        """Relative paths of the listed files that may match (every file if ``query`` is None)."""
        if query is None:
            return self.listed()
        hits: set[int] = set()
        for alternative in query:
            found: np.ndarray | None = None
            for t in sorted(alternative, key=lambda t: len(self._holding(t))):
                h = self._holding(t)
                found = h if found is None else np.intersect1d(found, h, assume_unique=True)
                if not len(found):
                    break
            if found is None:  # an empty alternative filters nothing
                return self.listed()
            hits.update(int(i) for i in found)
        return {self.files[i][0] for i in hits}


# -- which trigrams every match contains -------------------------------------------------------
# letters a case-insensitive match may spell with bytes the lowercased index does
# not hold: any non-ASCII byte, and k and s (RE2 folds them with the Kelvin sign
# U+212A and the long s U+017F)
_FOLDS_BEYOND_ASCII = frozenset(b"ks")


def _grams(text: str, ignore_case: bool) -> frozenset[int] | None:
    # lowercased exactly as the index is (bytes.lower(): ASCII letters only)
    data = text.encode("utf-8").lower()
    grams = frozenset((data[i] << 16) | (data[i + 1] << 8) | data[i + 2] for i in range(len(data) - 2)
                      if not ignore_case or all(b < 0x80 and b not in _FOLDS_BEYOND_ASCII for b in data[i:i + 3]))
    return grams or None


def required_trigrams(pattern: str, regex: bool, ignore_case: bool = False) -> Query:
    """The trigrams any line matching ``pattern`` must contain, as alternatives of
    sets; None when nothing is certain (then every file is a candidate).
    Conservative by construction: a construct it does not understand requires nothing."""
    if not regex:
        g = _grams(pattern, ignore_case)
        return None if g is None else [g]
    if "[:" in pattern or "\\Q" in pattern:
        return None  # RE2 syntax Python's parser would misread as literals ([[:digit:]], \Q...\E)
    try:
        parsed = sre_parse.parse(pattern)
    except (sre_constants.error, re.error, RecursionError, OverflowError, ValueError, TypeError):
        return None  # RE2-only syntax: no filter, the matcher decides
    ignore_case = ignore_case or bool(parsed.state.flags & sre_constants.SRE_FLAG_IGNORECASE)
    return _dnf(list(parsed), ignore_case)


def _dnf(items: list[Any], ignore_case: bool) -> Query:
    """Required trigrams of a sequence: every maximal literal run contributes its
    trigrams; a top-level alternation contributes one alternative per branch."""
    required: set[int] = set()
    run: list[str] = []
    alternatives: Query = None

    def flush() -> None:
        g = _grams("".join(run), ignore_case)
        if g:
            required.update(g)
        run.clear()

    for op, arg in items:
        if op is sre_constants.LITERAL:
            run.append(chr(arg))
            continue
        flush()
        if op is sre_constants.SUBPATTERN and arg[1] == 0 and arg[2] == 0:  # a plain group, no flag changes
            sub = _dnf(list(arg[3]), ignore_case)
            if sub is not None and len(sub) == 1:
                required.update(sub[0])
        elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT) and arg[0] >= 1:
            sub = _dnf(list(arg[2]), ignore_case)
            if sub is not None and len(sub) == 1:
                required.update(sub[0])
        elif op is sre_constants.BRANCH and alternatives is None:
            branches = [_dnf(list(b), ignore_case) for b in arg[1]]
            if all(b is not None for b in branches):
                alternatives = [alt for b in branches for alt in b]  # type: ignore[union-attr]
    flush()
    if alternatives is None:
        return [frozenset(required)] if required else None
    return [frozenset(required | alt) for alt in alternatives]
