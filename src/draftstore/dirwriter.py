"""Writing a tree of files into a directory: exact modes, never through a link, in parallel.

``DirectoryWriter`` is what ``materialize`` writes with, from a snapshot's
bundle or from the blobs. Creating a small file is kernel work (an inode, a
directory entry, a journal handle) that two threads do side by side, and
``os.open``/``os.write`` release the GIL: on this project's 2-core machines,
where creating a file costs ~100 µs, two writer threads create 10,000 files of
1 KiB in ~0.75x the time one thread takes; where it costs ~10 µs the writers
and the caller (which parses and checks what it hands over) mostly take turns
at the GIL, and it is a wash. So the calling thread checks and queues, and a
few writer threads create the files.

Guarantees:

- nothing is ever written outside ``dest``, even if links are planted in it
  while it is written: every directory and file is made and opened relative to
  its parent's open descriptor, with ``O_NOFOLLOW``, starting from ``dest``'s
  (no path below ``dest`` is resolved by name). A link where the tree needs a
  directory or a file raises ``path.conflict``;
- every file gets exactly mode 0o644 or 0o755, whatever the umask or a default
  ACL;
- a path written twice raises ``IntegrityError`` on the calling thread, before
  anything more is queued;
- ``close`` returns once every queued file is written, or raises the first
  error a writer thread met (the remaining queued files are then skipped);
  leaving the ``with`` block on an exception stops and joins the writers
  without masking it, so the caller may clear ``dest`` right after;
- memory stays bounded: at most ``_QUEUED`` batches of up to ``_BATCH_BYTES``
  wait, and a file that large or larger is written on the calling thread from
  the caller's buffer, never copied.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from types import TracebackType
from typing import Any

from . import errors as E

__all__ = ["DirectoryWriter", "creation_keeps_modes"]

_BATCH_FILES = 64
_BATCH_BYTES = 1 << 20
_THREADS = min(4, max(2, os.cpu_count() or 2))
_QUEUED = 2 * _THREADS

_Batch = list[tuple[str, "bytes | memoryview", bool]]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
_LINKED = (errno.ELOOP, errno.ENOTDIR)  # what O_NOFOLLOW (and O_DIRECTORY) answer on a link
_OPEN_DIRS = 256  # directory descriptors one walker keeps open (then closes them all and starts over)


def _planted(path: str, exc: OSError) -> E.PathConflict:
    return E.PathConflict(f"{path!r} in the target is a link or not a directory; nothing is written through it",
                          path=path)


class _Dirs:
    """Directories below a root descriptor, each opened relative to its parent's
    descriptor, never through a link; the descriptors of recent ones are kept."""

    def __init__(self, root: int, create: bool = False) -> None:
        self.root, self.create = root, create
        self.open: dict[str, int] = {}

    def fd(self, rel: str) -> int:
        """The descriptor of directory ``rel`` ('' is the root), made first if ``create``."""
        if rel == "":
            return self.root
        found = self.open.get(rel)
        if found is not None:
            return found
        parent_rel, _, name = rel.rpartition("/")
        parent = self.fd(parent_rel)
        if self.create:
            try:
                os.mkdir(name, dir_fd=parent)
            except FileExistsError:
                pass  # a directory (opened below) or anything else (refused below)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in _LINKED:
                raise _planted(rel, exc) from exc
            raise
        if len(self.open) >= _OPEN_DIRS:
            self.close()  # the new one stays open: its parent is no longer needed for it
        self.open[rel] = fd
        return fd

    def close(self) -> None:
        for fd in self.open.values():
            os.close(fd)
        self.open.clear()


class DirectoryWriter:
    """Writes files below ``dest`` (module docstring). Directories holding ``files``
    (paths relative to ``dest``) are made up front, on the calling thread."""

    def __init__(self, dest: str | os.PathLike[str], files: Any, threads: int = _THREADS) -> None:
        self.dest = os.fspath(dest)
        self.written: set[str] = set()
        # the one name resolved by path: every other is opened relative to this descriptor
        self._root = os.open(self.dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        made = _Dirs(self._root, create=True)
        try:
            for d in sorted({p.rpartition("/")[0] for p in files if "/" in p}):
                made.fd(d)
        except BaseException:
            os.close(self._root)
            raise
        finally:
            made.close()
        self._chmod = not creation_keeps_modes(self.dest)
        self._batch: _Batch = []
        self._batch_bytes = 0
        self._error: BaseException | None = None
        self._abandoned = False  # set when the caller gives up: the writers skip what is still queued
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=_QUEUED)
        self._threads = [threading.Thread(target=self._work, name=f"draftstore-writer-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def __enter__(self) -> "DirectoryWriter":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self._stop(skip=True)

    @property
    def count(self) -> int:
        """Files handed to the writer so far (all of them are on disk once ``close`` returns)."""
        return len(self.written)

    def write(self, path: str, data: bytes | memoryview, executable: bool) -> None:
        """Queue ``data`` as the file ``path`` (relative to ``dest``). A memoryview is
        copied if queued: the caller may reuse its buffer as soon as this returns."""
        if path in self.written:
            raise E.IntegrityError(f"{path!r} written twice")
        self.written.add(path)
        if self._error is not None:
            self._stop(skip=True)
            raise self._error
        size = len(data) if isinstance(data, bytes) else data.nbytes
        if size >= _BATCH_BYTES:
            dirs = _Dirs(self._root)
            try:
                write_file(dirs, path, data, executable, self._chmod)
            finally:
                dirs.close()
            return
        self._batch.append((path, data if isinstance(data, bytes) else data.tobytes(), executable))
        self._batch_bytes += size
        if len(self._batch) >= _BATCH_FILES or self._batch_bytes >= _BATCH_BYTES:
            self._flush()

    def close(self) -> None:
        """Write what is queued, stop the writer threads, and raise the first error one met."""
        self._flush()
        self._stop(skip=False)
        if self._error is not None:
            raise self._error

    def _flush(self) -> None:
        if self._batch:
            self._queue.put(self._batch)
            self._batch, self._batch_bytes = [], 0

    def _stop(self, skip: bool) -> None:
        if not self._threads:
            return
        self._abandoned = self._abandoned or skip
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self._threads = []
        os.close(self._root)

    def _work(self) -> None:
        while (batch := self._queue.get()) is not None:
            if self._error is not None or self._abandoned:
                continue  # drained, not written: the producer never blocks on a dead writer
            dirs = _Dirs(self._root)
            try:
                for path, data, executable in batch:
                    write_file(dirs, path, data, executable, self._chmod)
            except BaseException as exc:  # handed to the calling thread by close() or write()
                if self._error is None:
                    self._error = exc
            finally:
                dirs.close()


def write_file(dirs: _Dirs, path: str, data: bytes | memoryview, executable: bool, chmod: bool = True) -> None:
    """Create ``path`` below the root of ``dirs`` (never through a link: ``path.conflict``)
    holding ``data``, mode 0o755 or 0o644; ``chmod=False`` trusts the creation mode (see
    ``creation_keeps_modes``)."""
    mode = 0o755 if executable else 0o644
    parent, _, name = path.rpartition("/")
    try:
        fd = os.open(name, _FILE_FLAGS, mode, dir_fd=dirs.fd(parent))
    except OSError as exc:
        if exc.errno in _LINKED:
            raise _planted(path, exc) from exc
        raise
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if chmod:
            os.fchmod(fd, mode)  # the umask must not change a file's mode
    finally:
        os.close(fd)


def creation_keeps_modes(dest: str) -> bool:
    """True when a file created below ``dest`` (in a directory made there) gets exactly
    the mode 0o644 or 0o755 it is created with: the process umask clears none of those
    bits and ``dest`` has no default ACL (which would stand in for the umask). False
    whenever either cannot be told: every file is then chmod-ed (one journaled inode
    update a file saved otherwise)."""
    try:
        with open("/proc/self/status", "rb") as status:
            umask = next((int(line.split()[1], 8) for line in status if line.startswith(b"Umask:")), None)
    except (OSError, ValueError, IndexError):
        return False
    if umask is None or umask & 0o755 or not hasattr(os, "getxattr"):
        return False
    try:
        os.getxattr(dest, "system.posix_acl_default")
    except OSError as exc:
        return exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)
    return False
