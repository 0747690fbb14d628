"""Line tables: the lines that hold a tree's rarest trigrams, so a selective search reads no file.

A first search of a large tree spends most of its time reading the packs
that hold its candidates (docs/packs.md). Yet a selective literal -- an
identifier an agent looks for -- holds a trigram found on a handful of lines
of the whole tree. If the index keeps those lines, such a search is
answered from one object.

- A **unit table** (``DSLIN1``) is written with each ``tree``/``files``
  pack's search index and named by its directory (``"lines"``). It holds,
  for every *inline* trigram of that index (the rarest, the trigram index's
  ``INLINE_MAX``/``INLINE_BUDGET``), every line of every file that holds it,
  with its line number; a trigram with a line over ``MAX_LINE`` bytes, a
  line with a NUL byte, or more than ``MAX_LINES_PER_TRIGRAM`` lines is left
  out, and so is one that spans a line end. It also holds every trigram the unit holds at all (``present``).
- A **tree summary** (``DSSUM1``) is written when a tree's spine pack is
  (``packing``), and named by the spine row's ``search_index``. It merges
  the unit tables of every pack covering the tree: a trigram is in it when
  every unit that holds the trigram lists its lines (a unit that does not
  hold it has nothing to list), rarest first while ``SUMMARY_BUDGET`` bytes
  of lines last.

Trigrams are the index's: three bytes of ASCII-lowercased content (a binary
file holds none). **Guarantee:** for a trigram in a table, the table lists
every line, of every file it covers, whose lowercased bytes contain that
trigram -- so every line a literal matches, for any literal that requires
that trigram (``trigrams.required_trigrams``). Lines are stored as they
are (a ``\\r`` before the ``\\n`` kept) with their 1-based numbers.

Format (either kind)::

    magic + zstd(8-byte header length + header JSON {"n": trigrams, "lines": line records,
                 "refs": references, "present": trigram count, "paths": count}
                 + trigrams (n x uint32, ascending) + offsets ((n + 1) x uint32 into the references)
                 + references (uint32 line records) + per line record: path, line number (uint32 each)
                 + text starts ((lines + 1) x uint32)
                 + present trigrams (uint32, ascending) + path starts ((paths + 1) x uint32)
                 + the paths (UTF-8) + the lines' text)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import orjson
import zstandard

from ..errors import IntegrityError

__all__ = ["LineTable", "build_unit_lines", "build_summary", "trigram_keys", "MAX_LINE", "MAX_LINES_PER_TRIGRAM",
           "SUMMARY_BUDGET", "UNIT_MAGIC", "SUMMARY_MAGIC"]

UNIT_MAGIC = b"DSLIN1\n"
SUMMARY_MAGIC = b"DSSUM1\n"
MAX_LINE = 1024  # bytes: a trigram with a longer line is not kept (a minified file's lines)
MAX_LINES_PER_TRIGRAM = 256
SUMMARY_BUDGET = 128 * 1024  # bytes of lines a tree summary keeps at most (rarest trigrams first)


def trigram_keys(lowered: np.ndarray) -> np.ndarray:
    """The trigram starting at each position of ``lowered`` (ASCII-lowercased bytes, uint8)
    but the last two, as a 24-bit key (uint32): the one encoding of the search index
    (``trigrams``) and of these tables, whose keys must match it."""
    wide = lowered.astype(np.uint32)  # 32-bit arithmetic: half the memory traffic of 64 bits
    return (wide[:-2] << 16) | (wide[1:-1] << 8) | wide[2:]


def _starts(lengths: list[int]) -> np.ndarray:
    """Where each of consecutive items of ``lengths`` starts, and one more: the end (uint32)."""
    return np.append(0, np.cumsum(lengths, dtype=np.int64)).astype(np.uint32)


class _Writer:
    """Collects line records (each line once) and the trigrams that reference them."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self._path_no: dict[str, int] = {}
        self.records: list[tuple[int, int, bytes]] = []  # (path number, line number, text)
        self._record_no: dict[tuple[int, int], int] = {}
        self.trigrams: list[tuple[int, list[int]]] = []

    def line(self, path: str, line_no: int, text: bytes) -> int:
        p = self._path_no.get(path)
        if p is None:
            p = self._path_no[path] = len(self.paths)
            self.paths.append(path)
        key = (p, line_no)
        r = self._record_no.get(key)
        if r is None:
            r = self._record_no[key] = len(self.records)
            self.records.append((p, line_no, text))
        return r

    def encode(self, magic: bytes, present: np.ndarray) -> bytes:
        self.trigrams.sort()
        return _encode(magic, np.array([t for t, _ in self.trigrams], dtype=np.uint32),
                       _starts([len(refs) for _, refs in self.trigrams]),
                       np.array([r for _, rs in self.trigrams for r in rs], dtype=np.uint32),
                       np.array([(p, n) for p, n, _ in self.records], dtype=np.uint32),
                       [t for _, _, t in self.records], self.paths, present)


def _encode(magic: bytes, keys: np.ndarray, offsets: np.ndarray, refs: np.ndarray, records: np.ndarray,
            texts: list[bytes], paths: list[str], present: np.ndarray) -> bytes:
    """A table in the module docstring's format. ``records``: (path number, line number) per
    line record, ``texts`` the records' lines; ``refs`` index records, ``offsets`` into ``refs``."""
    names = [p.encode("utf-8", "surrogatepass") for p in paths]
    header = orjson.dumps({"paths": len(names), "n": len(keys), "lines": len(texts),
                           "refs": len(refs), "present": len(present)})
    body = b"".join([len(header).to_bytes(8, "big"), header, keys.astype(np.uint32).tobytes(),
                     offsets.astype(np.uint32).tobytes(), refs.astype(np.uint32).tobytes(),
                     records.astype(np.uint32).reshape(len(texts), 2).tobytes(),
                     _starts([len(t) for t in texts]).tobytes(), present.astype(np.uint32).tobytes(),
                     _starts([len(n) for n in names]).tobytes(), *names, *texts])
    return magic + zstandard.ZstdCompressor(level=3).compress(body)


def build_unit_lines(files: list[tuple[str, str, bytes]], keys: np.ndarray, offsets: np.ndarray,
                     postings: np.ndarray, lined: np.ndarray) -> bytes:
    """The unit table of an index's ``files`` (relative path, digest, content): the lines of
    the trigrams ``lined`` (indexes into ``keys``, the index's inline trigrams) and every
    trigram of ``keys`` as present. ``keys``/``offsets``/``postings``: the index's whole
    trigram table (``trigrams._table``).

    Vectorised: one pass over the files that hold a lined trigram finds every
    occurrence of one, then numpy groups them into lines and drops the trigrams
    that break a limit -- no Python step per trigram or file (an import builds a
    table per pack, beside the uploads)."""
    keys = np.asarray(keys, dtype=np.uint32)
    lined = np.asarray(lined, dtype=np.int64)
    want = keys[lined]
    # a trigram spanning a line end: no literal within a line requires it
    spans = ((want >> 16) & 0xFF == 10) | ((want >> 8) & 0xFF == 10) | (want & 0xFF == 10)
    lined, want = lined[~spans], want[~spans]
    # the files that hold a lined trigram (text: a binary file holds none), concatenated
    counts = np.diff(np.asarray(offsets, dtype=np.int64))
    holders = np.zeros(len(counts), dtype=bool)
    holders[lined] = True
    chosen = np.unique(np.asarray(postings)[np.repeat(holders, counts)]).astype(np.int64)
    datas = [files[int(f)][2] for f in chosen]
    fstart = _starts([len(d) for d in datas]).astype(np.int64)
    data = b"".join(datas)
    lowered = np.frombuffer(data.lower(), dtype=np.uint8)
    tid, owner, begin, end, line_no = _lines_of(lowered, fstart, want)
    # a trigram with a line too long, a line with a NUL byte, or too many lines is left out
    nul = np.flatnonzero(lowered == 0)
    bad = (end - begin > MAX_LINE) | (np.searchsorted(nul, end) > np.searchsorted(nul, begin))
    n_lines = np.bincount(tid, minlength=len(want))
    keep = (n_lines <= MAX_LINES_PER_TRIGRAM) & (np.bincount(tid, weights=bad, minlength=len(want)) == 0)
    kept = keep[tid]
    owner, begin, end, line_no = owner[kept], begin[kept], end[kept], line_no[kept]
    # line records: each (file, line) once, ascending; paths: the files with a record
    line_key = owner << 32 | line_no
    by_line = np.argsort(line_key, kind="stable")
    new = np.ones(len(by_line), dtype=bool)
    new[1:] = line_key[by_line][1:] != line_key[by_line][:-1]
    refs = np.empty(len(by_line), dtype=np.int64)
    refs[by_line] = np.cumsum(new) - 1
    rec = by_line[new]  # an occurrence of each record
    used, path_no = np.unique(owner[rec], return_inverse=True)
    listed = np.flatnonzero(keep & (n_lines > 0))
    return _encode(UNIT_MAGIC, want[listed], _starts(n_lines[listed].tolist()), refs,
                   np.stack([path_no.ravel(), line_no[rec]], axis=1),
                   [data[s:e] for s, e in zip(begin[rec].tolist(), end[rec].tolist())],
                   [files[int(chosen[f])][0] for f in used], keys)


def _lines_of(lowered: np.ndarray, fstart: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every (trigram, line) where a trigram of ``want`` (ascending) occurs in the files
    concatenated in ``lowered`` (file ``i`` at ``fstart[i]:fstart[i + 1]``), each once,
    ordered by trigram and then position: (index into ``want``, file, line start, line end,
    1-based line number), int64 arrays."""
    if len(lowered) < 3 or not len(want):
        return tuple(np.empty(0, dtype=np.int64) for _ in range(5))
    # where a wanted trigram starts, and which: a table over all 2**24 trigrams
    # (allocated lazily: only the pages of wanted trigrams are ever written)
    tri = trigram_keys(lowered)
    which = np.zeros(1 << 24, dtype=np.uint16 if len(want) < 0xFFFF else np.uint32)
    which[want] = np.arange(1, len(want) + 1)
    found = which[tri]
    del which, tri
    pos = np.flatnonzero(found)
    tid = found[pos].astype(np.int64) - 1
    owner = np.searchsorted(fstart, pos, side="right") - 1
    inside = pos + 2 < fstart[owner + 1]  # never across two files
    pos, tid, owner = pos[inside], tid[inside], owner[inside]
    # the line of each: bounded by newlines and by its file
    nl = np.flatnonzero(lowered == 10)
    k = np.searchsorted(nl, pos)
    end = np.minimum(np.append(nl, len(lowered))[k], fstart[owner + 1])
    begin = np.maximum(np.append(-1, nl)[k] + 1, fstart[owner])
    line_no = k - np.searchsorted(nl, fstart[owner]) + 1
    # positions come ascending: a stable sort by trigram keeps each trigram's in order
    order = np.argsort(tid, kind="stable")
    tid, owner, begin, end, line_no = tid[order], owner[order], begin[order], end[order], line_no[order]
    first = np.ones(len(tid), dtype=bool)
    first[1:] = (tid[1:] != tid[:-1]) | (begin[1:] != begin[:-1])
    return tid[first], owner[first], begin[first], end[first], line_no[first]


@dataclass
class LineTable:
    """A decoded unit table or tree summary (module docstring): ``lines(trigram)``."""

    name_starts: np.ndarray  # where each path starts in ``names`` (one more: the end)
    names: memoryview  # the paths, UTF-8, one after another (decoded when a line of theirs is asked for)
    keys: np.ndarray
    offsets: np.ndarray
    refs: np.ndarray
    records: np.ndarray  # (path number, line number) per line record
    starts: np.ndarray
    present: np.ndarray
    text: memoryview
    summary: bool

    @classmethod
    def decode(cls, raw: bytes) -> "LineTable":
        """Raises ``IntegrityError`` for anything but a well-formed table."""
        if raw.startswith(UNIT_MAGIC):
            summary = False
        elif raw.startswith(SUMMARY_MAGIC):
            summary = True
        else:
            raise IntegrityError("object is not a line table")
        try:
            body = zstandard.ZstdDecompressor().decompress(raw[len(UNIT_MAGIC):], max_output_size=1 << 32)
            hl = int.from_bytes(body[:8], "big")
            h = orjson.loads(body[8:8 + hl])
            n, m, r, p = int(h["n"]), int(h["lines"]), int(h["refs"]), int(h["present"])
            pos = 8 + hl
            keys = np.frombuffer(body, np.uint32, n, pos)
            pos += 4 * n
            offsets = np.frombuffer(body, np.uint32, n + 1, pos)
            pos += 4 * (n + 1)
            refs = np.frombuffer(body, np.uint32, r, pos)
            pos += 4 * r
            records = np.frombuffer(body, np.uint32, 2 * m, pos).reshape(m, 2)
            pos += 8 * m
            starts = np.frombuffer(body, np.uint32, m + 1, pos)
            pos += 4 * (m + 1)
            present = np.frombuffer(body, np.uint32, p, pos)
            pos += 4 * p
            k = int(h["paths"])
            name_starts = np.frombuffer(body, np.uint32, k + 1, pos)
            pos += 4 * (k + 1)
            names = memoryview(body)[pos:pos + int(name_starts[-1])]
            text = memoryview(body)[pos + int(name_starts[-1]):]
            if (int(offsets[-1]) != r or (r and int(refs.max()) >= m) or int(starts[-1]) != len(text)
                    or len(names) != int(name_starts[-1]) or (m and int(records[:, 0].max()) >= k)
                    or np.any(np.diff(starts.astype(np.int64)) < 0) or np.any(np.diff(name_starts.astype(np.int64)) < 0)):
                raise ValueError("inconsistent tables")
        except (zstandard.ZstdError, ValueError, KeyError, TypeError, orjson.JSONDecodeError) as exc:
            raise IntegrityError(f"malformed line table: {exc}") from exc
        return cls(name_starts, names, keys, offsets, refs, records, starts, present, text, summary)

    @property
    def size(self) -> int:
        return (len(self.text) + self.keys.nbytes + self.offsets.nbytes + self.refs.nbytes + self.records.nbytes
                + self.starts.nbytes + self.present.nbytes + self.name_starts.nbytes + len(self.names) + 200)

    def path(self, i: int) -> str:
        return str(self.names[int(self.name_starts[i]):int(self.name_starts[i + 1])], "utf-8", "surrogatepass")

    def _find(self, trigram: int) -> int:
        i = int(np.searchsorted(self.keys, trigram))
        return i if i < len(self.keys) and int(self.keys[i]) == trigram else -1

    def count(self, trigram: int) -> int | None:
        """How many lines the table lists for ``trigram``; None when it does not list it."""
        i = self._find(trigram)
        return None if i < 0 else int(self.offsets[i + 1] - self.offsets[i])

    def holds(self, trigram: int) -> bool:
        """A unit table: whether any file of the unit holds ``trigram`` at all."""
        i = int(np.searchsorted(self.present, trigram))
        return i < len(self.present) and int(self.present[i]) == trigram

    def lines(self, trigram: int) -> dict[str, list[tuple[int, bytes]]] | None:
        """path -> [(line number, line bytes), ...] ascending, of every line holding
        ``trigram`` (module docstring); None when the table does not list the trigram."""
        i = self._find(trigram)
        if i < 0:
            return None
        out: dict[str, list[tuple[int, bytes]]] = {}
        text, ends = self.text, self.starts
        for r in self.refs[self.offsets[i]:self.offsets[i + 1]]:
            r = int(r)
            p, n = self.records[r]
            out.setdefault(self.path(int(p)), []).append((int(n), bytes(text[int(ends[r]):int(ends[r + 1])])))
        for v in out.values():
            v.sort()
        return out


def _costs(t: LineTable) -> np.ndarray:
    """Per trigram of ``t``: the bytes of its lines, plus 16 per line (numbers, references)."""
    per_record = np.diff(t.starts.astype(np.int64)) + 16
    per_ref = np.append(0, np.cumsum(per_record[t.refs.astype(np.int64)]))
    return per_ref[t.offsets[1:].astype(np.int64)] - per_ref[t.offsets[:-1].astype(np.int64)]


def build_summary(units: list[tuple[str, LineTable]]) -> bytes | None:
    """The tree summary of the units covering a tree: (path prefix, unit table) each, every
    file of the tree in exactly one unit. None when no trigram qualifies. Vectorised over
    trigrams: a tree of many packs costs numpy passes, not a Python step per trigram and pack."""
    if not units:
        return None
    candidates = np.unique(np.concatenate([t.keys for _, t in units]))
    ok = np.ones(len(candidates), dtype=bool)
    cost = np.zeros(len(candidates), dtype=np.int64)
    where: list[tuple[np.ndarray, np.ndarray]] = []  # per unit: which candidates it lists, at which index
    for _, t in units:
        at = np.minimum(np.searchsorted(t.keys, candidates), max(len(t.keys) - 1, 0))
        listed = (t.keys[at] == candidates) if len(t.keys) else np.zeros(len(candidates), dtype=bool)
        held = np.isin(candidates, t.present, assume_unique=True)
        ok &= listed | ~held
        if len(t.keys):
            cost += np.where(listed, _costs(t)[at], 0)
        where.append((listed, at))
    chosen = np.flatnonzero(ok)
    chosen = chosen[np.lexsort((candidates[chosen], cost[chosen]))]  # cheapest first, then by trigram
    taken = chosen[np.cumsum(cost[chosen]) <= SUMMARY_BUDGET]
    w = _Writer()
    for c in np.sort(taken):
        refs: list[int] = []
        for (prefix, t), (listed, at) in zip(units, where):
            if listed[c]:
                for path, lines in (t.lines(int(t.keys[at[c]])) or {}).items():
                    refs += [w.line(prefix + path, n, text) for n, text in lines]
        w.trigrams.append((int(candidates[c]), refs))
    if not w.trigrams:
        return None
    return w.encode(SUMMARY_MAGIC, np.empty(0, dtype=np.uint32))
