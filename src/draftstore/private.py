"""Files and directories of the embedded store, readable by their owner only.

The embedded database, its coordinator file and the blob directory hold every
draft, message and token hash of the store: created under the usual umask 022
they would be world-readable (0644, 0755). What draftstore creates, it creates
0600 (files) and 0700 (directories), whatever the umask. What already exists
is left as it is: its owner chose its mode.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["private_dir", "private_file"]


def private_dir(path: str | os.PathLike[str]) -> None:
    """Make ``path`` and any missing parents; each directory created here is 0700 (an existing one
    is not changed). Raises ``OSError`` as ``os.makedirs`` does."""
    path = Path(path)
    if path.is_dir():
        return
    if not path.parent.is_dir():
        private_dir(path.parent)
    try:
        path.mkdir(mode=0o700)  # the umask can only clear bits, never widen 0700
    except FileExistsError:
        if not path.is_dir():
            raise


def private_file(path: str | os.PathLike[str]) -> None:
    """Create ``path`` empty and 0600 if it does not exist (its directory: ``private_dir``), so a
    database opened on it afterwards (and the ``-wal``/``-shm`` files SQLite gives the same mode)
    is the owner's only. An existing file is left as it is."""
    private_dir(Path(path).parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return
    os.close(fd)
