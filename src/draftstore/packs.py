"""Packs: the objects of one subtree in one content-addressed object.

A cold reader of a tree would otherwise pay one GET per file. A pack bundles
the tree nodes and file blobs of one *pack root* — a directory with at most
``MAX_PACK_FILES`` files below it — so versions share packs the way they
share subtrees: a subtree whose digest did not change keeps its pack. Above
the pack roots, a small *spine* pack holds the directory nodes of a large
tree, and a large directory's own files get a *files* pack. A pack over
``MAX_PACK_BYTES`` is split into parts; files over ``MAX_PACKED_FILE`` stay
single objects.

Format (the whole object is content-addressed and verified on read like any
blob). Packs are written in format 2; format 1 packs are still read::

    2: b"DSPACK2\\n" + len(zheader) as 8 bytes big-endian + zheader + frame + frame + ...
       zheader = zstd(header JSON)
       header: {"objects": [[digest, offset, length], ...], "frames": [[offset, length, stored, hash], ...]}
    1: b"DSPACK1\\n" + zstd(len(header) as 8 bytes big-endian + header JSON + objects)
       header: {"objects": [[digest, offset, length], ...]}

Offsets and lengths are into the *objects part* (every object's bytes, in
order). In format 2 the objects part is cut, at object boundaries, into
frames of about ``FRAME_BYTES``, each its own zstd frame stored back to back
after the header: frame ``[offset, length]`` of the objects part, ``stored``
bytes in the object, ``hash`` the digest of those stored bytes. A reader that
knows where a frame is (a search index records it for each file) can fetch
that one frame with a range read and check it against its hash, instead of
fetching and decompressing the whole pack (``frame_locations``,
``PackedObjects.read_frames``).

Every object taken from a pack is re-hashed against its digest. The database
records each pack (``pack``: the subtree it covers) and where every object
lives (``pack_object``), so an object stays addressable by its digest alone:
``PackedObjects`` answers ``get(digest)`` from the object cache, a pack
already in memory, a pack found through ``pack_object``, or finally the
object stored on its own.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import zstandard

from .blobs import BlobStore, ObjectCache
from .digest import Digest, digest_of
from .errors import ChecksumMismatch, IntegrityError

__all__ = ["MAX_PACK_FILES", "MAX_PACK_BYTES", "MAX_PACKED_FILE", "FRAME_BYTES", "encode_pack", "Pack",
           "PackedObjects", "FrameLocation", "frame_locations", "open_frame"]

MAX_PACK_FILES = 4000
MAX_PACK_BYTES = 8 * 1024 * 1024
MAX_PACKED_FILE = 1024 * 1024
_MAGIC = b"DSPACK1\n"
_MAGIC2 = b"DSPACK2\n"
MERGE_GAP = 1024 * 1024  # frames of one pack closer than this are read in one ranged read
FRAME_BYTES = 64 * 1024  # objects part per frame (cut at object boundaries): ~10% larger than one stream
_LEVEL = 3  # zstd: fast to write, ~3-4x smaller for source code

Location = tuple[str, int, int]  # (pack digest, offset, length)


def encode_pack(objects: Iterable[tuple[Digest, bytes]]) -> tuple[bytes, list[tuple[Digest, int, int]]]:
    """The bytes of a pack (format 2) of ``objects`` (duplicates kept once) and each
    object's (digest, offset, length) in the objects part."""
    index: list[tuple[Digest, int, int]] = []
    parts: list[bytes] = []
    seen: set[str] = set()
    offset = 0
    for digest, data in objects:
        if digest in seen:
            continue
        seen.add(digest)
        index.append((digest, offset, len(data)))
        parts.append(data)
        offset += len(data)
    cctx = zstandard.ZstdCompressor(level=_LEVEL)
    frames: list[list[Any]] = []
    stored: list[bytes] = []
    start = i = 0
    while i < len(parts):
        j, size = i, 0
        while j < len(parts) and (size < FRAME_BYTES or j == i):
            size += len(parts[j])
            j += 1
        z = cctx.compress(b"".join(parts[i:j]))
        frames.append([start, size, len(z), digest_of(z)])
        stored.append(z)
        start += size
        i = j
    zheader = cctx.compress(json.dumps({"objects": index, "frames": frames}, separators=(",", ":")).encode())
    return b"".join([_MAGIC2, len(zheader).to_bytes(8, "big"), zheader, *stored]), index


@dataclass(frozen=True)
class FrameLocation:
    """Where one object of a format-2 pack is: the frame holding it (``start``,
    ``stored`` bytes into the pack object, ``hash`` of those bytes, ``raw`` bytes
    once decompressed) and the object's ``offset`` and ``length`` inside it."""

    start: int
    stored: int
    hash: str
    raw: int
    offset: int
    length: int


def frame_locations(raw: bytes) -> dict[str, FrameLocation]:
    """digest -> FrameLocation for every object of a format-2 pack (empty for format 1).
    Raises ``IntegrityError`` if the pack is malformed."""
    if not raw.startswith(_MAGIC2):
        return {}
    header, frames = _frame_table("", raw)
    out: dict[str, FrameLocation] = {}
    k = 0
    for digest, off, length in header["objects"]:
        while k + 1 < len(frames) and off >= frames[k][0] + frames[k][1]:  # (an empty object: the frame it ends)
            k += 1
        offset, size, pos, stored, hash_ = frames[k]
        out[digest] = FrameLocation(pos, stored, hash_, size, off - offset, length)
    return out


def open_frame(stored: bytes, loc: FrameLocation) -> bytes:
    """The decompressed bytes of the frame ``loc`` is in, from its stored bytes, after
    checking them against the frame's hash. Raises ``ChecksumMismatch`` or ``IntegrityError``."""
    if digest_of(stored) != loc.hash:
        raise ChecksumMismatch(f"pack frame {loc.hash[:12]} is corrupt", digest=loc.hash)
    try:
        data = zstandard.ZstdDecompressor().decompress(stored, max_output_size=loc.raw)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"pack frame {loc.hash[:12]} is malformed: {exc}", digest=loc.hash) from exc
    if len(data) != loc.raw:
        raise IntegrityError(f"pack frame {loc.hash[:12]} is not as long as recorded", digest=loc.hash)
    return data


def _header2(digest: str, raw: bytes) -> tuple[dict[str, Any], int]:
    """A format-2 pack's header and where its first frame starts."""
    try:
        n = int.from_bytes(raw[len(_MAGIC2):len(_MAGIC2) + 8], "big")
        base = len(_MAGIC2) + 8 + n
        header = orjson.loads(zstandard.ZstdDecompressor().decompress(raw[len(_MAGIC2) + 8:base],
                                                                       max_output_size=1 << 30))
        if not isinstance(header, dict) or not isinstance(header.get("frames"), list):
            raise ValueError("no frame table")
        return header, base
    except (zstandard.ZstdError, ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"pack {digest[:12]} is malformed: {exc}", digest=digest) from exc


Frame = tuple[int, int, int, int, str]  # offset in the objects part, length, start in the pack, stored bytes, hash


def _frame_table(digest: str, raw: bytes) -> tuple[dict[str, Any], list[Frame]]:
    """A format-2 pack's header and its frames, checked to follow one another and to
    fill the pack exactly (``IntegrityError`` otherwise)."""
    header, pos = _header2(digest, raw)
    try:
        frames: list[Frame] = []
        expect = 0
        for offset, length, stored, hash_ in header["frames"]:
            if offset != expect or length < 0 or stored < 0:
                raise ValueError("frames do not follow one another")
            frames.append((int(offset), int(length), pos, int(stored), str(hash_)))
            expect, pos = offset + length, pos + stored
        if pos != len(raw):
            raise ValueError("frames do not fill the pack")
    except (ValueError, TypeError) as exc:
        raise IntegrityError(f"pack {digest[:12]} is malformed: {exc}", digest=digest) from exc
    return header, frames


class Pack:
    """A decoded pack: its objects, each verified when taken.

    A format-2 pack keeps its frames compressed and opens (decompresses) a frame
    the first time one of its objects is taken: a walk of the tree nodes, which a
    pack holds first, opens the first frame or two, not the whole pack. ``data``
    (every frame opened) is the whole objects part. ``size`` counts the pack as
    if every frame were open, for the pack cache's budget."""

    def __init__(self, digest: str, objects: dict[str, tuple[int, int]], data: bytes | None = None, *,
                 raw: bytes | memoryview = b"", frames: list[Frame] | None = None) -> None:
        self.digest = digest
        self.objects = objects
        self._data = data
        self._raw = memoryview(raw)
        self._frames = frames or []
        self._starts = [f[0] for f in self._frames]
        self._opened: dict[int, bytes] = {}
        whole = len(data) if data is not None else sum(f[1] for f in self._frames)
        self.size = whole + len(raw) + 100 * len(objects)

    @property
    def frames_open(self) -> int:
        """How many of a format-2 pack's frames were decompressed so far."""
        return len(self._opened)

    @property
    def data(self) -> bytes:
        """The objects part, every frame opened."""
        if self._data is None:
            self._data = b"".join(self._frame(k) for k in range(len(self._frames)))
        return self._data

    def _frame(self, k: int) -> bytes:
        opened = self._opened.get(k)
        if opened is None:  # two threads may open one frame at once: the same bytes, stored twice
            offset, length, pos, stored, _ = self._frames[k]
            try:
                opened = zstandard.ZstdDecompressor().decompress(self._raw[pos:pos + stored],
                                                                 max_output_size=length)
            except zstandard.ZstdError as exc:
                raise IntegrityError(f"pack {self.digest[:12]} is malformed: frame {k}: {exc}",
                                     digest=self.digest) from exc
            if len(opened) != length:
                raise IntegrityError(f"pack {self.digest[:12]} is malformed: frame {k} is not as long as recorded",
                                     digest=self.digest)
            self._opened[k] = opened
        return opened

    def _slice(self, offset: int, length: int) -> bytes:
        if self._data is not None or not self._frames:
            return (self._data or b"")[offset:offset + length]
        k = max(0, bisect.bisect_right(self._starts, offset) - 1)
        start = offset - self._frames[k][0]
        return self._frame(k)[start:start + length]  # an object never spans two frames (else: too short)

    @classmethod
    def decode(cls, digest: str, raw: bytes) -> "Pack":
        """A pack of either format (a format-2 pack's frames are opened when first
        needed). Raises ``IntegrityError`` if it is malformed; a frame found malformed
        later raises it from ``take``."""
        if raw.startswith(_MAGIC2):
            header, frames = _frame_table(digest, raw)
            try:
                objects = {d: (off, length) for d, off, length in header["objects"]}
            except (ValueError, KeyError, TypeError) as exc:
                raise IntegrityError(f"pack {digest[:12]} is malformed: {exc}", digest=digest) from exc
            return cls(digest, objects, raw=raw, frames=frames)
        if not raw.startswith(_MAGIC):
            raise IntegrityError(f"object {digest[:12]} is not a pack", digest=digest)
        try:
            body = zstandard.ZstdDecompressor().decompress(raw[len(_MAGIC):], max_output_size=1 << 34)
            n = int.from_bytes(body[:8], "big")
            header = orjson.loads(body[8:8 + n])
            objects = {d: (off, length) for d, off, length in header["objects"]}
        except (zstandard.ZstdError, ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"pack {digest[:12]} is malformed: {exc}", digest=digest) from exc
        return cls(digest, objects, body[8 + n:])

    def take(self, digest: str) -> bytes:
        off, length = self.objects[digest]
        data = self._slice(off, length)
        if digest_of(data) != digest:
            raise ChecksumMismatch(f"object {digest[:12]} in pack {self.digest[:12]} is corrupt",
                                   digest=digest, pack=self.digest)
        return data


class _PackCache:
    """Decoded packs, least recently used first out, bounded in bytes; and which
    cached pack holds each object."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._packs: OrderedDict[str, Pack] = OrderedDict()
        self._where: dict[str, str] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def holder(self, digest: str) -> Pack | None:
        with self._lock:
            name = self._where.get(digest)
            pack = self._packs.get(name) if name else None
            if pack is not None:
                self._packs.move_to_end(name)  # type: ignore[arg-type]
            return pack

    def has_pack(self, digest: str) -> bool:
        with self._lock:
            return digest in self._packs

    def digests(self) -> frozenset[str]:
        """The packs held now."""
        with self._lock:
            return frozenset(self._packs)

    def clear(self) -> None:
        """Let every pack go (the next read of one fetches it again)."""
        with self._lock:
            self._packs.clear()
            self._where.clear()
            self._bytes = 0

    def add(self, pack: Pack) -> None:
        with self._lock:
            if pack.digest in self._packs or pack.size > self.max_bytes:
                return
            self._packs[pack.digest] = pack
            self._bytes += pack.size
            for d in pack.objects:
                self._where.setdefault(d, pack.digest)
            while self._bytes > self.max_bytes and self._packs:
                name, old = self._packs.popitem(last=False)
                self._bytes -= old.size
                for d in old.objects:
                    if self._where.get(d) == name:
                        del self._where[d]


class PackedObjects:
    """A ``BlobStore`` whose reads also find objects inside packs (see the module docstring).

    ``locate(digests)`` answers where packed objects live (the database's
    ``pack_object``). Writes go to the underlying store unchanged.
    """

    def __init__(self, raw: BlobStore, cache: ObjectCache, locate: Callable[[list[str]], dict[str, Location]],
                 pack_cache_bytes: int) -> None:
        self.raw = raw
        self.cache = cache
        self.url = raw.url
        self._locate = locate
        self.packs = _PackCache(pack_cache_bytes)

    # -- writes and the rest: the underlying store --------------------------------------
    def put(self, data: bytes) -> Digest:
        return self.raw.put(data)

    def put_many(self, blobs: Iterable[bytes]) -> list[Digest]:
        return self.raw.put_many(blobs)

    def delete(self, digest: Digest) -> None:
        self.raw.delete(digest)

    def modified(self, digest: Digest) -> float | None:
        return self.raw.modified(digest)

    def iter_digests(self) -> Iterator[Digest]:
        return self.raw.iter_digests()

    def iter_objects(self) -> Iterator[Any]:
        return self.raw.iter_objects()

    def close(self) -> None:
        self.raw.close()

    def get_ranges(self, ranges: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], bytes]:
        return self.raw.get_ranges(ranges)

    def has(self, digest: Digest) -> bool:
        digest = Digest(digest)
        return (digest in self.cache or self.packs.holder(digest) is not None or bool(self._locate([digest]))
                or self.raw.has(digest))

    # -- reads ------------------------------------------------------------------------------
    def read_frames(self, wanted: Iterable[tuple[str, FrameLocation]]) -> dict[tuple[str, FrameLocation], Digest]:
        """Objects of format-2 packs read frame by frame: for ``(pack digest, location)``
        pairs, the digest of the object there. One ranged read per run of nearby
        frames of a pack (``MERGE_GAP``; the reads in parallel), each frame checked
        against its hash; the objects go to the object cache. (A caller that read
        a location before remembers its digest: ``IndexDirectory.found``.) Raises
        ``blob.not_found``, ``blob.checksum_mismatch``, ``IntegrityError``."""
        out: dict[tuple[str, FrameLocation], Digest] = {}
        by_frame: dict[tuple[str, int, int], list[FrameLocation]] = {}
        for pack, loc in dict.fromkeys(wanted):
            by_frame.setdefault((pack, loc.start, loc.stored), []).append(loc)
        if not by_frame:
            return out
        # one ranged read per run of frames less than MERGE_GAP apart: on a store where
        # a request costs far more than a few hundred KB of bytes, fewer reads win
        spans: list[tuple[str, int, int]] = []
        members: list[list[tuple[str, int, int]]] = []  # the frames each span holds
        for frame in sorted(by_frame):
            pack, start, size = frame
            if spans and spans[-1][0] == pack and start - (spans[-1][1] + spans[-1][2]) <= MERGE_GAP:
                _, s0, n = spans[-1]
                spans[-1] = (pack, s0, max(start + size, s0 + n) - s0)
                members[-1].append(frame)
            else:
                spans.append(frame)
                members.append([frame])
        got = self.raw.get_ranges(spans)
        span_of = {frame: span for span, held in zip(spans, members) for frame in held}
        for (pack, start, size), locs in by_frame.items():
            span = span_of[(pack, start, size)]
            s0 = span[1]
            body = open_frame(got[span][start - s0:start - s0 + size], locs[0])
            for loc in locs:
                data = body[loc.offset:loc.offset + loc.length]
                if len(data) != loc.length:
                    raise IntegrityError(f"pack frame {loc.hash[:12]} does not hold the object it should",
                                         digest=loc.hash)
                d = digest_of(data)
                self.cache.add(d, data)
                out[(pack, loc)] = d
        return out

    def load_packs(self, digests: Iterable[str]) -> None:
        """Fetch and decode these packs (in parallel) unless already in memory."""
        todo = [d for d in dict.fromkeys(digests) if not self.packs.has_pack(d)]
        if todo:
            for d, raw in self.raw.get_many([Digest(d) for d in todo]).items():
                self.packs.add(Pack.decode(d, raw))

    def _from_packs(self, digest: Digest) -> bytes | None:
        pack = self.packs.holder(digest)
        if pack is None:
            return None
        data = pack.take(digest)
        self.cache.add(digest, data)
        return data

    def get(self, digest: Digest) -> bytes:
        return self.get_many([digest])[Digest(digest)]

    def get_many(self, digests: Iterable[Digest]) -> dict[Digest, bytes]:
        out: dict[Digest, bytes] = {}
        missing: list[Digest] = []
        for d in dict.fromkeys(Digest(d) for d in digests):
            data = self.cache.get(d)
            if data is None:
                data = self._from_packs(d)
            if data is None:
                missing.append(d)
            else:
                out[d] = data
        if not missing:
            return out
        located = self._locate(missing)
        if located:
            self.load_packs(pack for pack, _, _ in located.values())
            for d in list(missing):
                data = self._from_packs(d) if d in located else None
                if data is None and d in located:  # the pack did not fit the pack cache: take it directly
                    pack = Pack.decode(located[d][0], self.raw.get(Digest(located[d][0])))
                    data = pack.take(d)
                if data is not None:
                    out[d] = data
                    missing.remove(d)
        if missing:
            out.update(self.raw.get_many(missing))
        return out
