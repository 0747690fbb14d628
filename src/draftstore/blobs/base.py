"""The blob store contract, and the upload/verify flow written once.

A backend supplies five small raw hooks over opaque keys (``_put_raw``,
``_get_raw``, ``_has_raw``, ``_delete_raw``, ``_iter_raw``); ``BlobStoreBase``
turns them into a content-addressed store: keys derived from digests only,
idempotent writes, digest re-checked on every read, immutable objects cached
in process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..digest import Digest, digest_of
from ..errors import BlobNotFound, ChecksumMismatch
from .cache import ObjectCache

__all__ = ["BlobStore", "BlobStoreBase", "StoredObject", "object_key"]


@runtime_checkable
class BlobStore(Protocol):
    """Content-addressed, immutable objects keyed by SHA-256.

    Guarantees: ``put`` is idempotent and returns the digest of the data;
    ``get`` returns exactly the bytes whose digest was asked for, or raises
    ``blob.not_found`` / ``blob.checksum_mismatch``; no key ever contains user
    text.
    """

    url: str

    def put(self, data: bytes) -> Digest: ...

    def put_many(self, blobs: Iterable[bytes]) -> list[Digest]: ...

    def get(self, digest: Digest) -> bytes: ...

    def get_many(self, digests: Iterable[Digest]) -> dict[Digest, bytes]: ...

    def get_ranges(self, ranges: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], bytes]: ...

    def has(self, digest: Digest) -> bool: ...

    def delete(self, digest: Digest) -> None: ...

    def modified(self, digest: Digest) -> float | None: ...

    def iter_digests(self) -> Iterator[Digest]: ...

    def iter_objects(self) -> Iterator["StoredObject"]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class StoredObject:
    """An object as listed by its store: digest, size in bytes, last modified (epoch seconds)."""

    digest: Digest
    size: int
    modified: float


def object_key(digest: Digest) -> str:
    """The storage key of an object: derived from its digest alone."""
    return f"objects/{digest[:2]}/{digest[2:]}"


def digest_from_key(key: str) -> Digest | None:
    parts = key.rsplit("/", 2)
    if len(parts) < 2:
        return None
    try:
        return Digest(parts[-2] + parts[-1])
    except Exception:
        return None


class BlobStoreBase:
    """Shared flow of every backend: hashing, verification, caching."""

    url: str = ""

    def __init__(self, cache: ObjectCache | None = None) -> None:
        self.cache = cache if cache is not None else ObjectCache(0)

    # -- hooks a backend supplies -------------------------------------------------
    def _put_raw(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def _get_raw(self, key: str) -> bytes | None:
        """Bytes at key, or None if absent."""
        raise NotImplementedError

    def _has_raw(self, key: str) -> bool:
        raise NotImplementedError

    def _delete_raw(self, key: str) -> None:
        raise NotImplementedError

    def _iter_raw(self, prefix: str) -> Iterator[str]:
        raise NotImplementedError

    def _list_raw(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        """(key, size, modified epoch seconds) of every key under ``prefix``."""
        raise NotImplementedError

    def _modified_raw(self, key: str) -> float | None:
        """Modified time (epoch seconds) of ``key``, or None if absent."""
        raise NotImplementedError

    def _get_range_raw(self, key: str, start: int, length: int) -> bytes | None:
        """Up to ``length`` bytes of ``key`` from ``start``, or None if absent.
        Backends that can read a range without the whole object override this."""
        data = self._get_raw(key)
        return None if data is None else data[start:start + length]

    # -- the contract -----------------------------------------------------------------
    def put(self, data: bytes) -> Digest:
        """Store ``data``; idempotent; returns its digest. Storing an object that
        exists makes it young again, so garbage collection's grace protects a
        write that refers to it anew. Every put reaches the backend: the read
        cache knowing the bytes does not mean they are still stored (another
        process's garbage collection may have swept them since)."""
        data = bytes(data)
        digest = digest_of(data)
        self._put_raw(object_key(digest), data)
        self.cache.add(digest, data)
        return digest

    def put_many(self, blobs: Iterable[bytes]) -> list[Digest]:
        """Store several objects; backends may run the uploads in parallel."""
        return [self.put(b) for b in blobs]

    def get(self, digest: Digest) -> bytes:
        """Bytes of ``digest``, verified. Raises ``blob.not_found``, ``blob.checksum_mismatch``."""
        digest = Digest(digest)
        cached = self.cache.get(digest)
        if cached is not None:
            return cached
        data = self._get_raw(object_key(digest))
        if data is None:
            raise BlobNotFound(f"object {digest.short} not in the blob store", digest=str(digest))
        actual = digest_of(data)
        if actual != digest:
            raise ChecksumMismatch(
                f"object {digest.short} is corrupt (content hashes to {actual.short})",
                digest=str(digest),
                actual=str(actual),
            )
        self.cache.add(digest, data)
        return data

    def get_many(self, digests: Iterable[Digest]) -> dict[Digest, bytes]:
        """Several objects, verified, as {digest: bytes}; backends may fetch in
        parallel. Raises like ``get`` for the first object that fails."""
        return {Digest(d): self.get(d) for d in digests}

    def get_ranges(self, ranges: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], bytes]:
        """Byte ranges ``(digest, start, length)`` of stored objects, *not verified*
        (a range cannot be checked against the whole object's digest: the caller
        checks what it reads, e.g. a pack frame against its hash). A range past
        the end is cut short. Raises ``blob.not_found`` for an absent object."""
        out: dict[tuple[str, int, int], bytes] = {}
        for r in ranges:
            out[r] = self._get_range(r)
        return out

    def _get_range(self, r: tuple[str, int, int]) -> bytes:
        digest, start, length = r
        data = self._get_range_raw(object_key(Digest(digest)), start, length)
        if data is None:
            raise BlobNotFound(f"object {Digest(digest).short} not in the blob store", digest=str(digest))
        return data

    def has(self, digest: Digest) -> bool:
        digest = Digest(digest)
        return digest in self.cache or self._has_raw(object_key(digest))

    def delete(self, digest: Digest) -> None:
        """Remove an object (garbage collection only); absent is not an error."""
        digest = Digest(digest)
        self.cache.discard(digest)
        self._delete_raw(object_key(digest))

    def modified(self, digest: Digest) -> float | None:
        """When ``digest`` was last stored (epoch seconds), or None if absent."""
        return self._modified_raw(object_key(Digest(digest)))

    def iter_digests(self) -> Iterator[Digest]:
        for key in self._iter_raw("objects/"):
            d = digest_from_key(key)
            if d is not None:
                yield d

    def iter_objects(self) -> Iterator[StoredObject]:
        """Every stored object with its size and age (garbage collection, fsck)."""
        for key, size, modified in self._list_raw("objects/"):
            d = digest_from_key(key)
            if d is not None:
                yield StoredObject(d, size, modified)

    def close(self) -> None:
        pass
