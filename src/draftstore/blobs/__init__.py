"""Blob stores: content-addressed objects (file blobs, tree nodes, payloads).

``open_blob_store(url)`` picks the backend from the URL scheme:

- ``file:///abs/path`` (or a plain path): ``DirectoryBlobStore``, the embedded default;
- ``s3://bucket[/prefix]?endpoint_url=..&region=..``: ``S3BlobStore`` through obstore.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ..errors import ConfigInvalid
from .base import BlobStore, BlobStoreBase, object_key
from .cache import ObjectCache
from .directory import DirectoryBlobStore

__all__ = ["BlobStore", "BlobStoreBase", "ObjectCache", "DirectoryBlobStore", "open_blob_store", "object_key"]


def open_blob_store(url: str, cache: ObjectCache | None = None) -> BlobStore:
    """Open the blob store named by ``url``. Raises ``config.invalid`` on an unknown scheme."""
    parts = urlsplit(url)
    if parts.scheme in ("", "file"):
        path = parts.path if parts.scheme == "file" else url
        if parts.scheme == "file" and parts.netloc:
            path = parts.netloc + parts.path
        return DirectoryBlobStore(path, cache=cache)
    if parts.scheme == "s3":
        from .s3 import S3BlobStore

        return S3BlobStore.from_url(url, cache=cache)
    raise ConfigInvalid(f"unknown blob store URL scheme {parts.scheme!r}", url=url)
