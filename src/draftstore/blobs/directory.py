"""Blob store backend: a directory on the local file system (embedded default)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import BackendUnavailable
from ..private import private_dir
from .base import BlobStoreBase
from .cache import ObjectCache

__all__ = ["DirectoryBlobStore"]


class DirectoryBlobStore(BlobStoreBase):
    """Objects as files under ``root``; a write is temp file + fsync + rename,
    so a reader never sees a partial object and a crash leaves none behind.
    Storing an object again compares it with the stored file and rewrites a
    copy that differs, so a damaged object is repaired by the next put of it."""

    def __init__(self, root: str | os.PathLike[str], cache: ObjectCache | None = None) -> None:
        super().__init__(cache)
        self.root = Path(root)
        try:
            private_dir(self.root)  # 0700; each object is a mkstemp file, 0600 (private.py)
        except OSError as exc:
            raise BackendUnavailable(f"cannot create blob directory {self.root}: {exc}") from exc
        self.url = f"file://{self.root.absolute()}"

    def _path(self, key: str) -> Path:
        return self.root / key

    def _put_raw(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if _holds(path, data):  # else: not stored yet, swept meanwhile, or a damaged copy: written anew
            try:
                os.utime(path)  # stored again: young again (see BlobStoreBase.put)
                return
            except FileNotFoundError:
                pass  # swept meanwhile: write it
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def _get_raw(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def _get_range_raw(self, key: str, start: int, length: int) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(length)
        except FileNotFoundError:
            return None

    def _has_raw(self, key: str) -> bool:
        return self._path(key).exists()

    def _delete_raw(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass

    def _iter_raw(self, prefix: str) -> Iterator[str]:
        base = self.root / prefix
        if not base.exists():
            return
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                full = Path(dirpath) / name
                yield full.relative_to(self.root).as_posix()

    def _modified_raw(self, key: str) -> float | None:
        try:
            return self._path(key).stat().st_mtime
        except FileNotFoundError:
            return None

    def _list_raw(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        for key in self._iter_raw(prefix):
            try:
                st = self._path(key).stat()
            except FileNotFoundError:  # deleted while listing
                continue
            yield key, st.st_size, st.st_mtime


_COMPARE_CHUNK = 1 << 20


def _holds(path: Path, data: bytes) -> bool:
    """Whether the file at ``path`` holds exactly ``data`` (its size first, then its bytes a
    chunk at a time: a large bundle is not read whole a second time). Unreadable: no."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != len(data):
                return False
            view = memoryview(data)
            for start in range(0, len(data), _COMPARE_CHUNK):
                if f.read(_COMPARE_CHUNK) != view[start:start + _COMPARE_CHUNK]:
                    return False
            return True
    except OSError:
        return False
