"""Synthetic projects: realistic small source-like files in nested directories.

Layout (three levels, like a source tree)::

    pkg_NN/mod_NN/file_NNN.py      50 files per leaf directory,
                                   <= 50 leaf directories per package

so a 100,000-file project has 40 packages x 50 modules x 50 files, a
10,000-file one 4 x 50 x 50, a 100-file one 1 x 2 x 50. Every file is unique
(its path is in its header), so building a project really uploads one blob
per file. Content is deterministic for a given seed.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from pathlib import Path

from draftstore import Store

from .env import progress

FILES_PER_DIR = 50
DIRS_PER_PKG = 50
NEEDLE = "NEEDLE_LITERAL"

_WORDS = (
    "agent turn draft version sandbox snapshot character world setting tool call result args "
    "path digest tree blob overlay seal publish rollback head project store view cache buffer event "
    "stream lock heartbeat record payload preview limit error status running paused interrupted "
    "config value index entry count size offset length token message user assistant context"
).split()
_TYPES = ("int", "str", "bytes", "float", "bool", "dict[str, Any]", "list[str]", "None")


def layout(n_files: int) -> list[str]:
    """The ``n_files`` paths of a project, in a stable order."""
    leaves = max(1, -(-n_files // FILES_PER_DIR))
    pkgs = max(1, -(-leaves // DIRS_PER_PKG))
    per_pkg = -(-leaves // pkgs)
    paths: list[str] = []
    for leaf in range(leaves):
        pkg, mod = divmod(leaf, per_pkg)
        for f in range(FILES_PER_DIR):
            if len(paths) == n_files:
                return paths
            paths.append(f"pkg_{pkg:02d}/mod_{mod:02d}/file_{f:03d}.py")
    return paths


def source_text(rng: random.Random, path: str, size: int) -> bytes:
    """About ``size`` bytes of Python-looking text, unique to ``path``."""
    out = [f"# {path}\n", '"""', " ".join(rng.choice(_WORDS) for _ in range(8)), '."""\n\n',
           "from __future__ import annotations\n\n"]
    n = sum(len(s) for s in out)
    while n < size:
        name = "_".join(rng.choice(_WORDS) for _ in range(2))
        a, b = rng.choice(_WORDS), rng.choice(_WORDS)
        chunk = (
            f"\ndef {name}({a}: {rng.choice(_TYPES)}, {b}: {rng.choice(_TYPES)} = None) -> {rng.choice(_TYPES)}:\n"
            f"    # {' '.join(rng.choice(_WORDS) for _ in range(6))}\n"
            f"    if {a} is None:\n"
            f"        return {rng.randint(0, 9999)}\n"
            f"    return {a} + {b}\n"
        )
        out.append(chunk)
        n += len(chunk)
    data = "".join(out).encode()
    return data[:size] if len(data) > size + 200 else data


def random_source(size: int = 1024) -> bytes:
    """Fresh content (never seen before) of about ``size`` bytes."""
    return source_text(random.Random(os.urandom(8)), f"fresh/{os.urandom(6).hex()}.py", size)


def make_files(n_files: int, size: int, seed: int = 1, needles: int = 0) -> dict[str, bytes]:
    """The files of a synthetic project; ``needles`` files (spread out) contain ``NEEDLE``."""
    rng = random.Random(seed)
    paths = layout(n_files)
    files = {p: source_text(rng, p, size) for p in paths}
    if needles:
        step = max(1, len(paths) // needles)
        for p in paths[::step][:needles]:
            files[p] = files[p] + f"\n{NEEDLE} = {rng.randint(0, 99)}  # marker\n".encode()
    return files


class _Ticker:
    """Prints elapsed time (and S3 PUTs done, when the blob store counts them) to stderr while a long call runs."""

    def __init__(self, label: str, store: Store, total: int, every_s: float = 5.0) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self._calls = getattr(store.blobs, "calls", None)  # the S3 backend counts its requests by kind
        self._start = self._calls["put"] if self._calls is not None else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._stop.wait(self.every_s):
            done = ""
            if self._calls is not None:
                done = f", {self._calls['put'] - self._start:,}/{self.total:,} blobs uploaded"
            progress(f"  {self.label}: {time.perf_counter() - t0:.0f}s{done}")

    def __enter__(self) -> "_Ticker":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def build_project(store: Store, name: str, files: dict[str, bytes], preupload: bool = False) -> str:
    """``store.create_project(name, files=files)``, with progress on stderr; returns the id.

    With ``preupload`` the file blobs are first stored one PUT each
    (``store.blobs.put_many``) and seeded into ``store.cache`` (give the
    building store a cache big enough for every file), so ``create_project``
    uploads only the tree nodes: the old way, slower than packs.
    """
    t0 = time.perf_counter()
    mb = sum(len(v) for v in files.values()) / 1e6
    how = "pre-upload one PUT each + create_project" if preupload else "create_project"
    progress(f"building {name}: {len(files):,} files, {mb:.1f} MB ({how})")
    if preupload:
        blobs = list(files.values())
        for at in range(0, len(blobs), 2000):
            batch = blobs[at:at + 2000]
            for d, b in zip(store.blobs.put_many(batch), batch):
                store.cache.add(d, b)
            progress(f"  {name}: {at + len(batch):,}/{len(blobs):,} blobs uploaded")
        progress(f"  {name}: blobs uploaded in {time.perf_counter() - t0:.1f}s; sealing the tree")
    with _Ticker(name, store, len(files)):
        project = store.create_project(name, files=files)
    os.sync()  # let the services' write-back happen now, not during a measurement
    progress(f"built {name} in {time.perf_counter() - t0:.1f}s")
    return project.id


def materialise(files: dict[str, bytes], root: Path) -> Path:
    """Write ``files`` under ``root`` (for grep and git baselines)."""
    made: set[str] = set()
    for path, data in files.items():
        parent = os.path.dirname(path)
        if parent not in made:
            (root / parent).mkdir(parents=True, exist_ok=True)
            made.add(parent)
        (root / path).write_bytes(data)
    return root


if __name__ == "__main__":  # python -m bench.projects N: print the layout summary
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    ps = layout(n)
    print(len(ps), ps[0], ps[-1], len({os.path.dirname(p) for p in ps}), "leaf dirs")
