"""A trigram index of the files of one subtree (as in codesearch and Zoekt); no I/O.

The index lists the subtree's files and, for every trigram (three bytes)
of their lowercased content, which files contain it. A search asks for the
trigrams every match must contain (``required``) and gets the files that
hold them all: a superset of the files that match, which the exact matcher
then confirms. Lowercasing (ASCII) makes one index serve case-sensitive and
case-insensitive searches; it can only add candidates, never lose one.
Using only *some* of the required trigrams also only adds candidates: a
query may leave out trigrams whose posting lists it would have to fetch.

Format 2 (written now; ``build_index_objects``): a small *directory* object
plus *shard* objects, each content-addressed on its own, so a first query
fetches only the directory and at most ``MAX_SHARDS_PER_QUERY`` shards::

    directory: b"DSIDX2\\n" + zstd(8-byte header length + header JSON
                                    + inline keys + inline offsets + inline postings
                                    + per file: frame (int32, -1: stored alone), offset, length (uint32))
    header: {"files": [relative path, ...], "width": 2 or 4, "n": inline trigram count,
             "frames": [[start, stored, hash, raw], ...],     frames of the index's pack
             "loose": {ordinal: digest},                      files stored alone
             "shards": [[first trigram, digest, postings], ...],
             "lines": digest}                                 the line table (``linetables``), if written
    shard:     b"DSIXS2\\n" + zstd(8-byte trigram count + keys + offsets + postings)

The rarest trigrams (at most ``INLINE_MAX`` files each, ``INLINE_BUDGET``
postings in all) are *inline* in the directory; every other trigram is in
exactly one shard, the shards covering consecutive trigram ranges of about
``SHARD_POSTINGS`` postings (a trigram with more is a shard alone). Each file
is located by the frame of the pack that holds it (``packs.FrameLocation``),
so a candidate's content is one ranged read of a frame checked against its
hash, not the whole pack.

Format 1 (no longer written; read by ``SearchIndex`` because packs written before
format 2 still hold such objects)::

    b"DSIDX1\\n" + zstd(8-byte header length + header JSON + trigrams + offsets + postings)
    header: {"files": [[relative path, digest], ...], "n": trigram count, "width": 2 or 4}
    trigrams: n x uint32 (sorted) | offsets: (n + 1) x uint32 | postings: file ordinals
    (uint16 while there are fewer than 65,536 files, else uint32)
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import zstandard

from ..digest import digest_of
from ..errors import IntegrityError
from .linetables import SUMMARY_MAGIC, LineTable, build_unit_lines, trigram_keys
from ..packs import FrameLocation

try:  # the parser behind ``re`` (Python 3.11+ names; ``sre_parse`` is its deprecated alias)
    from re import _constants as sre_constants  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

__all__ = ["build_index_objects", "IndexObjects", "decode_index", "index_shards", "SearchIndex", "IndexDirectory", "IndexShard",
           "required_trigrams", "Query", "INLINE_MAX", "INLINE_BUDGET", "SHARD_POSTINGS", "MAX_SHARDS_PER_QUERY"]

_MAGIC = b"DSIDX1\n"
_MAGIC2 = b"DSIDX2\n"
_SHARD_MAGIC = b"DSIXS2\n"
INLINE_MAX = 64  # a trigram in at most this many files may be inline in the directory
INLINE_BUDGET = 4096  # inline postings per directory, rarest trigrams first (keeps the directory small)
SHARD_POSTINGS = 131072  # postings per shard (a trigram with more is a shard alone)
MAX_SHARDS_PER_QUERY = 2  # shards one query alternative fetches at most (the smallest)
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


def _by_trigram(tri: np.ndarray) -> np.ndarray:
    """The permutation that orders 24-bit trigrams ascending, equal ones kept in their
    order (stable): a radix sort in two stable passes, by the low byte (uint8) and then
    the high 16 bits (uint16). numpy sorts keys of 16 bits or fewer by radix (one pass
    per byte) in linear time, wider ones by comparison: for the 2.7 million trigrams of
    2,500 files of 1 KiB, a sort of 64-bit (file, trigram) keys took 161 ms here, two
    passes of 12 bits with their gathers 107 ms (four byte passes); the table then needs
    no second sort. For a pack's 800,000 trigrams: two 12-bit passes 20.7 ms, these 19.1."""
    low = np.argsort((tri & 0xFF).astype(np.uint8), kind="stable")
    return low[np.argsort((tri[low] >> 8).astype(np.uint16), kind="stable")]


def _pairs(texts: list[bytes], first: int) -> tuple[np.ndarray, np.ndarray]:
    """(trigram, file ordinal) pairs, each once, ordered by trigram and then file, for
    files ``first``, ``first + 1``, ...: one vectorised pass over their concatenation
    instead of one numpy call per file."""
    lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    a = np.frombuffer(b"".join(texts).lower(), dtype=np.uint8)
    if len(a) < 3:
        return np.empty(0, dtype=np.uint32), np.empty(0, dtype=np.uint32)
    owner = np.repeat(np.arange(first, first + len(texts), dtype=np.uint32), lengths)
    keep = owner[:-2] == owner[2:]  # a trigram never spans two files
    tri = trigram_keys(a)[keep]
    owner = owner[:-2][keep]
    # positions come in file order, so a stable sort by trigram leaves each trigram's
    # files ascending, and a trigram's repeats within one file side by side
    order = _by_trigram(tri)
    tri, owner = tri[order], owner[order]
    first_seen = np.empty(len(tri), dtype=bool)
    if len(tri):
        first_seen[0] = True
        np.logical_or(tri[1:] != tri[:-1], owner[1:] != owner[:-1], out=first_seen[1:])
    return tri[first_seen], owner[first_seen]


def _table(files: list[tuple[str, str, bytes]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted distinct trigrams, offsets into the postings, postings: file ordinals
    ascending within each trigram). A binary file contributes no trigram."""
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
    if len(grams) > 1:
        # batches hold disjoint, ascending runs of files: a stable sort by trigram of
        # their concatenation keeps each trigram's files ascending
        g, o = np.concatenate(grams), np.concatenate(owners)
        order = _by_trigram(g)
        g, o = g[order], o[order]
    elif grams:
        g, o = grams[0], owners[0]
    else:
        g = o = np.empty(0, dtype=np.uint32)
    starts = np.flatnonzero(_distinct(g))
    return g[starts].astype(np.uint32), np.append(starts, len(o)).astype(np.uint32), o.astype(np.uint32)


@dataclass
class IndexObjects:
    """The objects of one format-2 index: store ``shards`` and ``lines`` before the
    ``directory`` that names them."""

    directory: bytes
    shards: list[bytes]
    lines: bytes | None  # the unit's line table (``linetables``), named by the directory


def build_index_objects(files: list[tuple[str, str, bytes]], locations: dict[str, FrameLocation], *,
                        inline_max: int | None = None, inline_budget: int | None = None,
                        shard_postings: int | None = None, lines: bool = True) -> IndexObjects:
    """The format-2 index of ``files`` (relative path, digest, content): directory,
    shards and (``lines``) the line table of its inline trigrams. ``locations``: where
    each packed file's object is in the index's pack (``packs.frame_locations``); a
    file not there is recorded by digest (stored alone)."""
    inline_max = INLINE_MAX if inline_max is None else inline_max
    inline_budget = INLINE_BUDGET if inline_budget is None else inline_budget
    shard_postings = SHARD_POSTINGS if shard_postings is None else shard_postings
    keys, offsets, o = _table(files)
    width = 2 if len(files) < 65536 else 4
    ptype = np.uint16 if width == 2 else np.uint32
    counts = np.diff(offsets.astype(np.int64))
    # inline: the rarest trigrams first, while the budget lasts
    inline = np.zeros(len(keys), dtype=bool)
    order = np.argsort(counts, kind="stable")
    order = order[counts[order] <= inline_max]
    taken = order[np.cumsum(counts[order]) <= inline_budget]
    inline[taken] = True

    def part(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The table of the trigrams ``idx`` (indexes into ``keys``, ascending)."""
        lens = counts[idx]
        if len(idx):
            post = np.concatenate([o[offsets[i]:offsets[i + 1]] for i in idx])
        else:
            post = np.empty(0, dtype=np.uint32)
        return keys[idx], np.append(0, np.cumsum(lens)).astype(np.uint32), post.astype(ptype)

    cctx = zstandard.ZstdCompressor(level=3)
    rest = np.flatnonzero(~inline)
    shards: list[bytes] = []
    table: list[list[Any]] = []
    i = 0
    while i < len(rest):
        j, n = i, 0
        while j < len(rest) and (n < shard_postings or j == i):
            n += int(counts[rest[j]])
            j += 1
        k, off, post = part(rest[i:j])
        raw = _SHARD_MAGIC + cctx.compress(b"".join([len(k).to_bytes(8, "big"), k.tobytes(), off.tobytes(),
                                                     post.tobytes()]))
        shards.append(raw)
        table.append([int(keys[rest[i]]), digest_of(raw), n])
        i = j
    frames: dict[tuple[int, int, str, int], int] = {}
    where = np.full(len(files), -1, dtype=np.int32)
    offs = np.zeros(len(files), dtype=np.uint32)
    lens = np.zeros(len(files), dtype=np.uint32)
    loose: dict[str, str] = {}
    for n_, (_, digest, _) in enumerate(files):
        loc = locations.get(digest)
        if loc is None:
            loose[str(n_)] = digest
            continue
        where[n_] = frames.setdefault((loc.start, loc.stored, loc.hash, loc.raw), len(frames))
        offs[n_], lens[n_] = loc.offset, loc.length
    k, off, post = part(np.flatnonzero(inline))
    meta: dict[str, Any] = {"files": [path for path, _, _ in files], "width": width, "n": int(len(k)),
                            "frames": [list(f) for f in frames], "loose": loose, "shards": table}
    line_table = build_unit_lines(files, keys, offsets, o, np.flatnonzero(inline)) if lines else None
    if line_table is not None:
        meta["lines"] = digest_of(line_table)
    header = json.dumps(meta, separators=(",", ":")).encode()
    body = b"".join([len(header).to_bytes(8, "big"), header, k.tobytes(), off.tobytes(), post.tobytes(),
                     where.tobytes(), offs.tobytes(), lens.tobytes()])
    return IndexObjects(_MAGIC2 + cctx.compress(body), shards, line_table)


def _unpack(raw: bytes, magic: bytes, what: str) -> bytes:
    """The decompressed body of an index object that starts with ``magic``
    (``IntegrityError`` naming ``what`` otherwise; a zstd error is the caller's to map)."""
    if not raw.startswith(magic):
        raise IntegrityError(f"object is not {what}")
    return zstandard.ZstdDecompressor().decompress(raw[len(magic):], max_output_size=1 << 32)


def _read_table(body: bytes, pos: int, k: int, width: int,
                count: int = -1) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], int]:
    """The (keys, offsets, postings) table of ``k`` trigrams written at ``pos`` (``count``
    postings, or all the bytes left), and where it ends."""
    keys = np.frombuffer(body, dtype=np.uint32, count=k, offset=pos)
    offsets = np.frombuffer(body, dtype=np.uint32, count=k + 1, offset=pos + 4 * k)
    postings = np.frombuffer(body, dtype=np.uint16 if width == 2 else np.uint32, count=count,
                             offset=pos + 8 * k + 4)
    return (keys, offsets, postings), pos + 8 * k + 4 + postings.nbytes


def _json_header(body: bytes) -> tuple[Any, int]:
    """A body's length-prefixed JSON header, and where the arrays after it start."""
    n = int.from_bytes(body[:8], "big")
    return orjson.loads(body[8:8 + n]), 8 + n


@dataclass
class SearchIndex:
    files: list[tuple[str, str]]  # (relative path, digest), in ordinal order
    keys: np.ndarray
    offsets: np.ndarray
    postings: np.ndarray

    @classmethod
    def decode(cls, raw: bytes) -> "SearchIndex":
        try:
            body = _unpack(raw, _MAGIC, "a search index")
            header, pos = _json_header(body)
            (keys, offsets, postings), _ = _read_table(body, pos, header["n"], header.get("width", 4))
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


def _postings(table: tuple[np.ndarray, np.ndarray, np.ndarray], trigram: int) -> np.ndarray | None:
    """The posting list of ``trigram`` in a (keys, offsets, postings) table, None if absent."""
    keys, offsets, postings = table
    i = int(np.searchsorted(keys, trigram))
    if i == len(keys) or int(keys[i]) != trigram:
        return None
    return postings[offsets[i]:offsets[i + 1]]


@dataclass
class IndexShard:
    """One shard of a format-2 index: the posting lists of a range of trigrams."""

    table: tuple[np.ndarray, np.ndarray, np.ndarray]

    @classmethod
    def decode(cls, raw: bytes, width: int) -> "IndexShard":
        try:
            body = _unpack(raw, _SHARD_MAGIC, "a search index shard")
            k = int.from_bytes(body[:8], "big")
            table, _ = _read_table(body, 8, k, width)
            if k and int(table[1][-1]) != len(table[2]):
                raise ValueError("postings do not match the offsets")
        except (zstandard.ZstdError, ValueError, TypeError) as exc:
            raise IntegrityError(f"malformed search index shard: {exc}") from exc
        return cls(table)

    @property
    def size(self) -> int:
        return sum(a.nbytes for a in self.table) + 100


@dataclass
class IndexDirectory:
    """A format-2 index's directory: the files, where each one is, the inline
    posting lists, and which shard holds every other trigram (module docstring).

    Guarantees: ``candidates(query, shards)`` is a superset of the listed files
    holding every trigram of some alternative of ``query``, given the shards
    ``shards_for(query)`` names (missing shards raise ``IntegrityError``)."""

    paths: list[str]
    width: int
    inline: tuple[np.ndarray, np.ndarray, np.ndarray]
    frames: list[tuple[int, int, str, int]]  # (start, stored, hash, raw) in the index's pack
    where: np.ndarray  # per file: frame number, -1 when the file is stored alone
    offsets: np.ndarray
    lengths: np.ndarray
    loose: dict[int, str]  # ordinal -> digest of a file stored alone
    shard_first: list[int]  # first trigram of each shard, ascending
    shard_digest: list[str]
    shard_postings: list[int]
    lines: str | None = None  # digest of the unit's line table (``linetables``), if written
    _listed: frozenset[str] | None = None
    # ordinal -> digest of the files already read out of the pack's frames: derived from
    # content-addressed objects, so never stale; lets a warm search skip locating them again
    found: dict[int, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def decode(cls, raw: bytes) -> "IndexDirectory":
        try:
            body = _unpack(raw, _MAGIC2, "a search index directory")
            h, pos = _json_header(body)
            paths, width, k = h["files"], h["width"], h["n"]
            offsets = np.frombuffer(body, dtype=np.uint32, count=k + 1, offset=pos + 4 * k)
            inline, pos = _read_table(body, pos, k, width, count=int(offsets[-1]))
            f = len(paths)
            where = np.frombuffer(body, dtype=np.int32, count=f, offset=pos)
            offs = np.frombuffer(body, dtype=np.uint32, count=f, offset=pos + 4 * f)
            lens = np.frombuffer(body, dtype=np.uint32, count=f, offset=pos + 8 * f)
            if pos + 12 * f != len(body):
                raise ValueError("trailing bytes")
            frames = [(int(a), int(b), str(c), int(d)) for a, b, c, d in h["frames"]]
            if f and int(where.max()) >= len(frames):
                raise ValueError("a file names a frame that is not there")
            shards = h["shards"]
            return cls(list(paths), width, inline, frames, where, offs, lens,
                       {int(i): str(d) for i, d in h["loose"].items()}, [int(s[0]) for s in shards],
                       [str(s[1]) for s in shards], [int(s[2]) for s in shards],
                       str(h["lines"]) if h.get("lines") is not None else None)
        except (zstandard.ZstdError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise IntegrityError(f"malformed search index directory: {exc}") from exc

    @property
    def size(self) -> int:
        return sum(a.nbytes for a in self.inline) + 12 * len(self.paths) + 80 * len(self.paths) + 100

    def listed(self) -> frozenset[str]:
        """Relative paths of every file the index knows (a file not listed is always searched)."""
        if self._listed is None:
            self._listed = frozenset(self.paths)
        return self._listed

    def _shard_of(self, trigram: int) -> int | None:
        i = bisect.bisect_right(self.shard_first, trigram) - 1
        return i if i >= 0 else None

    def _plan(self, query: Query) -> list[tuple[list[int], list[int]] | None]:
        """Per alternative: (inline trigrams, sharded trigrams to use) or None (no
        filter). Inline trigrams, when there are any, are enough (each is in at most
        ``INLINE_MAX`` files); otherwise the trigrams of the smallest shards."""
        plan: list[tuple[list[int], list[int]] | None] = []
        for alternative in query or ():
            if not alternative:
                plan.append(None)
                continue
            inline = [t for t in alternative if _postings(self.inline, t) is not None]
            if inline:
                plan.append((inline, []))
                continue
            by_shard: dict[int, list[int]] = {}
            for t in alternative:
                sh = self._shard_of(t)
                if sh is None:  # below every shard and not inline: no file holds it
                    by_shard = {-1: [t]}
                    break
                by_shard.setdefault(sh, []).append(t)
            if -1 in by_shard:
                plan.append(([], by_shard[-1]))
                continue
            chosen = sorted(by_shard, key=lambda sh: self.shard_postings[sh])[:MAX_SHARDS_PER_QUERY]
            plan.append(([], [t for sh in chosen for t in by_shard[sh]]))
        return plan

    def shards_for(self, query: Query) -> list[str]:
        """Digests of the shards ``candidates(query, ...)`` reads."""
        if query is None:
            return []
        out: list[str] = []
        for step in self._plan(query):
            for t in step[1] if step else ():
                sh = self._shard_of(t)
                if sh is not None:
                    out.append(self.shard_digest[sh])
        return list(dict.fromkeys(out))

    def candidates(self, query: Query, shards: dict[str, IndexShard]) -> list[int]:
        """Ordinals of the listed files that may match (every file if ``query`` is None)."""
        if query is None:
            return list(range(len(self.paths)))
        hits: set[int] = set()
        for step in self._plan(query):
            if step is None:  # an empty alternative filters nothing
                return list(range(len(self.paths)))
            lists: list[np.ndarray] = []
            for t in step[0]:
                lists.append(_postings(self.inline, t))  # type: ignore[arg-type]
            for t in step[1]:
                sh = self._shard_of(t)
                if sh is None:
                    lists.append(np.empty(0, dtype=np.uint32))
                    continue
                shard = shards.get(self.shard_digest[sh])
                if shard is None:
                    raise IntegrityError(f"search index shard {self.shard_digest[sh][:12]} was not loaded")
                found = _postings(shard.table, t)
                lists.append(np.empty(0, dtype=np.uint32) if found is None else found)
            lists.sort(key=len)
            acc: np.ndarray | None = None
            for h in lists:
                acc = h if acc is None else np.intersect1d(acc, h, assume_unique=True)
                if not len(acc):
                    break
            if acc is not None:
                hits.update(int(i) for i in acc)
        return sorted(hits)

    def location(self, ordinal: int) -> FrameLocation | str:
        """Where file ``ordinal`` is: its place in a frame of the pack, or its digest (stored alone)."""
        k = int(self.where[ordinal])
        if k < 0:
            return self.loose[ordinal]
        start, stored, hash_, raw = self.frames[k]
        return FrameLocation(start, stored, hash_, raw, int(self.offsets[ordinal]), int(self.lengths[ordinal]))


def index_shards(raw: bytes) -> list[str]:
    """Digests of the objects a search index object names: a directory's shards and
    line table (none for format 1 or a tree summary): what an index keeps reachable.
    Raises ``IntegrityError`` for a malformed directory."""
    if not raw.startswith(_MAGIC2):
        return []
    d = IndexDirectory.decode(raw)
    return d.shard_digest + ([d.lines] if d.lines else [])


def decode_index(raw: bytes) -> "SearchIndex | IndexDirectory | LineTable":
    """A search index object: either format of a pack's index, or a spine's tree
    summary (``linetables``). Raises ``IntegrityError``."""
    if raw.startswith(_MAGIC2):
        return IndexDirectory.decode(raw)
    if raw.startswith(SUMMARY_MAGIC):
        return LineTable.decode(raw)
    return SearchIndex.decode(raw)


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
