"""The parallel directory writer ``materialize`` writes with (``draftstore.dirwriter``).

What it must never do: lose a writer thread's error, leave threads running
after it is left (the caller clears the directory next), follow a link, or
let the umask change a mode.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from draftstore import IntegrityError, PathConflict, dirwriter
from draftstore.dirwriter import _BATCH_BYTES, _BATCH_FILES, _QUEUED, DirectoryWriter


def _writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("draftstore-writer-")]


def test_every_file_is_on_disk_with_its_mode_once_closed(tmp_path: Path) -> None:
    files = {f"d{i % 7}/sub/f{i}.txt": bytes([i % 256]) * (i % 300) for i in range(1000)}
    files["big/blob.bin"] = os.urandom(_BATCH_BYTES + 5)  # written on the calling thread, from a view
    old = os.umask(0o077)  # a umask that would clear group and other bits
    try:
        with DirectoryWriter(tmp_path, files, threads=3) as w:
            for i, (path, data) in enumerate(files.items()):
                w.write(path, memoryview(bytearray(data)), executable=i % 5 == 0)
    finally:
        os.umask(old)
    assert w.count == len(files) and not _writers()
    for i, (path, data) in enumerate(files.items()):
        p = tmp_path / path
        assert p.read_bytes() == data
        assert stat.S_IMODE(p.stat().st_mode) == (0o755 if i % 5 == 0 else 0o644)


def test_a_path_written_twice_is_refused_on_the_calling_thread(tmp_path: Path) -> None:
    with pytest.raises(IntegrityError, match="written twice"):
        with DirectoryWriter(tmp_path, ["a.txt"]) as w:
            w.write("a.txt", b"1", False)
            w.write("a.txt", b"2", False)
    assert not _writers()


def test_a_writer_threads_error_reaches_the_caller_and_no_link_is_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep")
    dest = tmp_path / "dest"
    dest.mkdir()
    files = {f"f{i}.txt": b"x" for i in range(500)}
    with pytest.raises(PathConflict) as caught:
        with DirectoryWriter(dest, files, threads=2) as w:
            os.symlink(outside, dest / "f250.txt")  # O_NOFOLLOW: creating through it fails
            for path, data in files.items():
                w.write(path, data, False)
    assert caught.value.code == "path.conflict" and caught.value.details["path"] == "f250.txt"
    assert outside.read_bytes() == b"keep"
    assert not _writers()


def test_leaving_on_an_exception_skips_what_is_still_queued(tmp_path: Path, monkeypatch: Any) -> None:
    real = dirwriter.write_file

    def slow(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.003)
        real(*args, **kwargs)

    monkeypatch.setattr(dirwriter, "write_file", slow)
    handed = (1 + _QUEUED) * _BATCH_FILES + 10  # one batch being written, a full queue, a batch being filled
    files = {f"f{i}.txt": b"x" for i in range(handed + 1)}
    with pytest.raises(RuntimeError, match="caller gave up"):
        with DirectoryWriter(tmp_path, files, threads=1) as w:
            for i, (path, data) in enumerate(files.items()):
                if i == handed:
                    raise RuntimeError("caller gave up")
                w.write(path, data, False)
    assert not _writers()
    # the batch in the writer's hands is finished; the queued ones are not written
    assert len(list(tmp_path.iterdir())) <= 2 * _BATCH_FILES


def test_a_writer_that_failed_stops_the_caller_early_and_never_leaves_it_blocked(tmp_path: Path,
                                                                                monkeypatch: Any) -> None:
    real = dirwriter.write_file

    def slow(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.001)
        real(*args, **kwargs)

    monkeypatch.setattr(dirwriter, "write_file", slow)
    dest = tmp_path / "dest"
    dest.mkdir()
    files = {f"f{i:05d}.txt": b"x" for i in range(20_000)}
    os.symlink(tmp_path / "elsewhere", dest / "f00000.txt")  # the very first file fails
    outcome: list[Any] = []

    def produce() -> None:
        try:
            with DirectoryWriter(dest, files, threads=1) as w:
                for path, data in files.items():
                    w.write(path, data, False)
        except PathConflict as exc:
            outcome.append((exc, w.count))

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the caller is blocked on a writer that stopped"
    [(exc, handed)] = outcome
    assert handed < len(files)  # told by write(), not only once everything was queued
    assert not (tmp_path / "elsewhere").exists() and not _writers()


# -- links planted while the tree is written ----------------------------------------------------
def _planted_tree(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    dest, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    dest.mkdir()
    elsewhere.mkdir()
    return dest, elsewhere, {f"sub/deeper/f{i}.txt": b"x" for i in range(200)} | {"top.txt": b"t"}


def test_a_link_where_the_tree_needs_a_directory_is_refused_and_nothing_lands_outside(tmp_path: Path) -> None:
    dest, elsewhere, files = _planted_tree(tmp_path)
    os.symlink(elsewhere, dest / "sub")  # there before the writer makes its directories
    with pytest.raises(PathConflict) as exc:
        DirectoryWriter(dest, files)
    assert exc.value.details["path"] == "sub"
    assert list(elsewhere.iterdir()) == [] and not _writers()


def test_a_directory_swapped_for_a_link_mid_write_is_never_written_through(tmp_path: Path) -> None:
    """Once made, a directory is written through the descriptor opened on it, never by
    name: a link planted at its name afterwards leads nowhere (the files land in the
    directory that was made, or the write is refused), never outside."""
    dest, elsewhere, files = _planted_tree(tmp_path)
    refused = None
    try:
        with DirectoryWriter(dest, files, threads=2) as w:
            os.rename(dest / "sub", tmp_path / "moved-away")  # within the test's own tree
            os.symlink(elsewhere, dest / "sub")
            for path, data in files.items():
                w.write(path, data, False)
    except PathConflict as exc:
        refused = exc
    assert refused is not None and refused.details["path"].startswith("sub")
    assert list(elsewhere.iterdir()) == [] and not _writers()
