"""Files in and out: ``import``, ``export``, ``cat``, ``ls``, ``diff``, ``snapshot``, ``materialize``.

``export`` writes a state's exact files plus ``.draftstore-state.json`` (its
characters and world settings); ``import`` reads that file back into the new
project's characters and world settings, never as an ordinary file, so the two
round-trip. ``import`` honours ``.draftstoreignore`` (gitignore syntax) and
always skips ``.git``, ``__pycache__`` and ``.draftstore``.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import pathspec
from rich.progress import Progress

from .. import errors as E
from .output import echo, emit_json, progress_bar, table, warn
from .root import Ids, json_option, main, open_store, view_of

STATE_FILE = ".draftstore-state.json"
IGNORE_FILE = ".draftstoreignore"
ALWAYS_SKIPPED = (".git", "__pycache__", ".draftstore")


def _bar(description: str) -> tuple[Progress, Callable[[int, int], None]]:
    progress = progress_bar()
    task = progress.add_task(description, total=None)

    def update(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    return progress, update


# --------------------------------------------------------------------------- import
@dataclass
class Collected:
    """What ``collect`` found below a directory."""

    files: dict[str, bytes] = field(default_factory=dict)
    executable: list[str] = field(default_factory=list)
    ignored: int = 0
    links: list[str] = field(default_factory=list)
    special: list[str] = field(default_factory=list)
    state: dict[str, Any] | None = None


def _ignore_spec(directory: Path) -> pathspec.PathSpec | None:
    """The rules of ``.draftstoreignore``, a regular file; a link there is not followed (the
    walk reports it among the skipped links, and skipped it is)."""
    f = directory / IGNORE_FILE
    try:
        if not stat.S_ISREG(f.lstat().st_mode):
            return None
    except FileNotFoundError:
        return None
    return pathspec.GitIgnoreSpec.from_lines(f.read_text(encoding="utf-8", errors="replace").splitlines())


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # Recursion: nested past the parser's depth
        reason = "nested too deep" if isinstance(exc, RecursionError) else str(exc)
        raise E.InvalidInput(f"{path} is not a draftstore state file: {reason}", path=str(path)) from exc
    if not isinstance(state, dict) or not {"characters", "world_settings"} & state.keys():
        raise E.InvalidInput(f"{path} is not a draftstore state file (no characters or world_settings)",
                             path=str(path))
    return state


def _unreadable(exc: OSError) -> None:
    raise exc  # os.walk would skip the directory and go on


def collect(directory: Path, tick: Callable[[], None] = lambda: None) -> Collected:
    """Every regular file below ``directory`` that is not ignored, read into memory.

    Symlinks (to files or directories) are never followed; they and special
    files are listed in ``links``/``special`` for the caller to report. A
    directory that cannot be read raises its ``OSError``: nothing below it is
    dropped silently.
    """
    out = Collected()
    spec = _ignore_spec(directory)
    for root, dirs, names in os.walk(directory, onerror=_unreadable):
        base = Path(root)
        rel_root = base.relative_to(directory).as_posix()
        prefix = "" if rel_root == "." else rel_root + "/"
        keep = []
        for d in sorted(dirs):
            rel = prefix + d
            if (base / d).is_symlink():
                out.links.append(rel)
            elif d in ALWAYS_SKIPPED or (spec is not None and spec.match_file(rel + "/")):
                out.ignored += 1
            else:
                keep.append(d)
        dirs[:] = keep
        for n in sorted(names):
            rel, p = prefix + n, base / n
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                out.links.append(rel)
            elif not stat.S_ISREG(st.st_mode):
                out.special.append(rel)
            elif rel == STATE_FILE:
                out.state = _read_state(p)
            elif n in ALWAYS_SKIPPED or (spec is not None and spec.match_file(rel)):
                out.ignored += 1
            else:
                out.files[rel] = p.read_bytes()
                if st.st_mode & 0o111:
                    out.executable.append(rel)
                tick()
    return out


def _listed(paths: list[str], limit: int = 5) -> str:
    return ", ".join(paths[:limit]) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


@main.command("import")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--name", help="project name (default: the directory name)")
def import_dir(directory: Path, name: str | None) -> None:
    """Create a project whose version 1 is the content of DIRECTORY.

    Honours DIRECTORY/.draftstoreignore (gitignore syntax); skips .git,
    __pycache__ and .draftstore; symlinks are skipped and reported. A
    .draftstore-state.json written by `export` sets characters and world settings.
    A directory or file that cannot be read fails the import (io.error, exit 5):
    nothing is created.
    """
    with progress_bar() as progress:
        task = progress.add_task("reading files", total=None)
        found = collect(directory, lambda: progress.advance(task))
    if found.links:
        warn(f"skipped {len(found.links)} symlinks: {_listed(sorted(found.links))}")
    if found.special:
        warn(f"skipped {len(found.special)} special files: {_listed(sorted(found.special))}")
    state = found.state or {}
    with open_store() as store:
        project = store.create_project(name or directory.resolve().name, files=found.files,
                                       executable=found.executable, characters=state.get("characters"),
                                       world_settings=state.get("world_settings"))
    extra = f", {found.ignored} ignored" if found.ignored else ""
    echo(f"project {project.id} version {project.current_version_id} ({len(found.files)} files{extra}"
         f"{', characters and world settings from ' + STATE_FILE if found.state else ''})")


# ---------------------------------------------------------------- export, materialize
def _state_into(command: Callable[..., None]) -> Callable[..., None]:
    """PROJECT DIRECTORY [--version V | --head] [--replace], as export and materialize take them."""
    for option in reversed((
            click.argument("project"),
            click.argument("directory", type=click.Path(path_type=Path)),
            click.option("--version", "version", help="a version id (default: the draft, else head)"),
            click.option("--head", is_flag=True, help="the head version, not the draft"),
            click.option("--replace", is_flag=True, help="clear DIRECTORY first if it is not empty"))):
        command = option(command)
    return command


def _materialize(project: str, directory: Path, version: str | None, head: bool, replace: bool) -> tuple[Any, Any]:
    """Write the chosen state's files into ``directory``: (the project, what ``materialize`` did)."""
    with open_store() as store:
        ids = Ids(store)
        project_id = ids.project(project)
        p = store.get_project(project_id)
        progress, update = _bar("writing files")
        with progress:
            done = store.materialize(project_id, directory, ids.state(project_id, version, head),
                                     replace=replace, progress=update)
    return p, done


@main.command("export")
@_state_into
def export_dir(project: str, directory: Path, version: str | None, head: bool, replace: bool) -> None:
    """Write a project state's files, characters and world settings into DIRECTORY.

    `import DIRECTORY` reads it back as the same state.
    """
    p, done = _materialize(project, directory, version, head, replace)
    state = {"draftstore_export": 1, "project_id": p.id, "project_name": p.name,
             "source": {"kind": done.source_kind, "id": done.source_id},
             "characters": done.characters, "world_settings": done.world_settings}
    (directory / STATE_FILE).write_text(json.dumps(state, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    echo(f"wrote {done.files} files of {done.source_kind} {done.source_id} to {directory} "
         f"(+ {STATE_FILE})")


# ----------------------------------------------------------------------------- reads
@main.command("cat")
@click.argument("project")
@click.argument("path")
@click.option("--version", "version", help="a version id (default: the draft, else head)")
@click.option("--head", is_flag=True, help="the head version, not the draft")
def cat(project: str, path: str, version: str | None, head: bool) -> None:
    """Print one file's bytes as stored."""
    with open_store() as store:
        view = view_of(store, Ids(store).project(project), version, head)
        data = view.read_file(path)
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


@main.command("ls")
@click.argument("project")
@click.argument("directory", default="")
@click.option("--version", "version", help="a version id (default: the draft, else head)")
@click.option("--head", is_flag=True, help="the head version, not the draft")
@click.option("--recursive", "-r", is_flag=True, help="every file below DIRECTORY")
@json_option
def ls(project: str, directory: str, version: str | None, head: bool, recursive: bool, as_json: bool) -> None:
    """List a directory of a project state (the draft, else head)."""
    with open_store() as store:
        view = view_of(store, Ids(store).project(project), version, head)
        under = directory.strip("/")
        if recursive:
            rows: list[Any] = [s for _, s in view.iter_files(under)]
        else:
            if under and not view.is_dir(under):
                raise E.PathNotFound(f"no directory {under!r} in this state", path=under)
            rows = view.list_dir(under)
    if as_json:
        emit_json(rows)
    elif recursive:
        table(("size", "x", "path"), [(s.size, "x" if s.executable else "", s.path) for s in rows])
    else:
        table(("kind", "size", "name"), [(e.kind, e.size, e.name + ("/" if e.kind == "dir" else "")) for e in rows])


@main.command("diff")
@click.argument("a")
@click.argument("b")
@click.option("--stat", is_flag=True, help="only the list of changed files")
@json_option
def diff(a: str, b: str, stat: bool, as_json: bool) -> None:
    """What changed from state A to state B.

    A state is a VERSION id, draft:PROJECT, head:PROJECT or turn:TURN[:start|end].
    """
    with open_store() as store:
        ids = Ids(store)
        d = store.diff(ids.ref(a), ids.ref(b), text=not stat)
    if as_json:
        emit_json(d)
        return
    for f in d.files:
        moved = f" (from {f.old_path})" if f.old_path else ""
        echo(f"{f.status:<9} {f.path}{moved}")
        if f.unified and not stat:
            click.echo(f.unified, nl=not f.unified.endswith("\n"))
    for name, ops in (("characters", d.characters), ("world_settings", d.world_settings)):
        if ops:
            echo(f"{name}: {json.dumps(ops, ensure_ascii=False)}")
    if d.empty:
        echo("no changes")


# ------------------------------------------------------------------ snapshots, materialize
@main.command("snapshot")
@click.argument("project", required=False)
@click.option("--version", "version", help="a version id (default: head)")
@click.option("--draft", is_flag=True, help="the open draft (it must have no turn writing; head if none is open)")
@click.option("--pending", is_flag=True, help="build the snapshots publish scheduled, pack new versions and drafts' trees")
@json_option
def snapshot(project: str | None, version: str | None, draft: bool, pending: bool, as_json: bool) -> None:
    """Build a sandbox snapshot (tar + zstd bundle) of a project's head, a version or its draft."""
    with open_store() as store:
        if pending:
            done = store.run_background(limit=1000)
            if as_json:
                emit_json(done)
            else:
                echo(f"{done['snapshots_built']} snapshots built, {done['versions_packed']} versions packed, "
                     f"{done['drafts_packed']} draft trees packed")
            return
        if project is None:
            raise click.UsageError("give a PROJECT (or --pending)")
        ids = Ids(store)
        project_id = ids.project(project)
        source = "draft" if draft else ids.version(version, project_id) if version else "head"
        progress, update = _bar("bundling files")
        with progress:
            snap = store.create_snapshot(project_id, source, progress=update)
    if draft and snap.source_kind != "draft":  # "the draft" reads through to head when none is open
        warn(f"no open draft: the snapshot is of head ({snap.source_kind} {snap.source_id})")
    if as_json:
        emit_json(snap)
    else:
        echo(f"snapshot {snap.id} {snap.status}: {snap.files} files, {snap.size_bytes:,} bytes "
             f"of {snap.source_kind} {snap.source_id}")


@main.command("materialize")
@_state_into
def materialize(project: str, directory: Path, version: str | None, head: bool, replace: bool) -> None:
    """Write a project state's exact files into DIRECTORY (from a snapshot when one matches)."""
    _, done = _materialize(project, directory, version, head, replace)
    how = f"from snapshot {done.snapshot_id}" if done.path == "snapshot" else "rebuilt from blobs"
    echo(f"{done.files} files, {done.bytes:,} bytes of {done.source_kind} {done.source_id} written to "
         f"{directory} ({how})")


__all__ = ["collect", "Collected", "STATE_FILE", "IGNORE_FILE", "ALWAYS_SKIPPED"]
