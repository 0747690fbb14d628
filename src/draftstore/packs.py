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
blob)::

    b"DSPACK1\\n" + zstd(len(header) as 8 bytes big-endian + header JSON + objects)
    header: {"objects": [[digest, offset, length], ...]}   offsets into the objects part

Every object taken from a pack is re-hashed against its digest. The database
records each pack (``pack``: the subtree it covers) and where every object
lives (``pack_object``), so an object stays addressable by its digest alone:
``PackedObjects`` answers ``get(digest)`` from the object cache, a pack
already in memory, a pack found through ``pack_object``, or finally the
object stored on its own.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zstandard

from .blobs import BlobStore, ObjectCache
from .digest import Digest, digest_of
from .errors import BlobNotFound, ChecksumMismatch, IntegrityError

__all__ = ["MAX_PACK_FILES", "MAX_PACK_BYTES", "MAX_PACKED_FILE", "encode_pack", "Pack", "PackedObjects"]

MAX_PACK_FILES = 4000
MAX_PACK_BYTES = 8 * 1024 * 1024
MAX_PACKED_FILE = 1024 * 1024
_MAGIC = b"DSPACK1\n"
_LEVEL = 3  # zstd: fast to write, ~3-4x smaller for source code

Location = tuple[str, int, int]  # (pack digest, offset, length)


def encode_pack(objects: Iterable[tuple[Digest, bytes]]) -> tuple[bytes, list[tuple[Digest, int, int]]]:
    """The bytes of a pack of ``objects`` (duplicates kept once) and each object's (digest, offset, length)."""
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
    header = json.dumps({"objects": index}, separators=(",", ":")).encode()
    body = len(header).to_bytes(8, "big") + header + b"".join(parts)
    return _MAGIC + zstandard.ZstdCompressor(level=_LEVEL).compress(body), index


@dataclass
class Pack:
    """A decoded pack: its objects, each verified when taken."""

    digest: str
    objects: dict[str, tuple[int, int]]
    data: bytes  # the objects part
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = len(self.data) + 100 * len(self.objects)

    @classmethod
    def decode(cls, digest: str, raw: bytes) -> "Pack":
        if not raw.startswith(_MAGIC):
            raise IntegrityError(f"object {digest[:12]} is not a pack", digest=digest)
        try:
            body = zstandard.ZstdDecompressor().decompress(raw[len(_MAGIC):], max_output_size=1 << 34)
            n = int.from_bytes(body[:8], "big")
            header = json.loads(body[8:8 + n])
            objects = {d: (off, length) for d, off, length in header["objects"]}
        except (zstandard.ZstdError, ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"pack {digest[:12]} is malformed: {exc}", digest=digest) from exc
        return cls(digest, objects, body[8 + n:])

    def take(self, digest: str) -> bytes:
        off, length = self.objects[digest]
        data = self.data[off:off + length]
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

    def has(self, digest: Digest) -> bool:
        digest = Digest(digest)
        return (digest in self.cache or self.packs.holder(digest) is not None or bool(self._locate([digest]))
                or self.raw.has(digest))

    # -- reads ------------------------------------------------------------------------------
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
            try:
                out.update(self.raw.get_many(missing))
            except BlobNotFound:
                raise
        return out
