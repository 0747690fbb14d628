"""``draftstore`` command line: demo, db upgrade, import/export, log, show, diff, publish, rollback, sweep.

Every command reads the store location from ``DRAFTSTORE_*`` variables (embedded
defaults under ./.draftstore/ when unset). Errors print their stable code and
exit with status 2 (bad input / not found / conflict) or 3 (a backend failed).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import errors as E
from .settings import Settings
from .store import Store

console = Console()
err_console = Console(stderr=True)


def _handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except E.BackendError as exc:
            err_console.print(f"[red]error[/red] {escape(str(exc))}")
            sys.exit(3)
        except E.DraftstoreError as exc:
            err_console.print(f"[red]error[/red] {escape(str(exc))}")
            sys.exit(2)

    return wrapper


def _message_text(value: Any) -> str:
    """A JSON message as one line of text: a string as it is, else its text parts, else JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), list):
        texts = [part.get("text") for part in value["content"] if isinstance(part, dict)]
        if texts and all(isinstance(t, str) for t in texts):
            return " ".join(texts)
    return json.dumps(value, ensure_ascii=False)


def _open(migrate: bool | None = None) -> Store:
    return Store.open(migrate=migrate)


@click.group()
@click.version_option(package_name="draftstore")
def main() -> None:
    """draftstore: versioned drafts, turns and tool-call history for AI agents."""


# ---------------------------------------------------------------------------- db
@main.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
@_handle_errors
def db_upgrade(revision: str) -> None:
    """Migrate the configured database to the newest schema (idempotent)."""
    from .db.engine import create_db_engine
    from .db.migrate import current_revision, upgrade

    url = Settings().resolved_database_url()
    engine = create_db_engine(url)
    try:
        before = current_revision(engine)
        upgrade(engine, revision)
        after = current_revision(engine)
    finally:
        engine.dispose()
    console.print(f"schema {before or 'empty'} -> {after}")


@db.command("current")
@_handle_errors
def db_current() -> None:
    """Print the schema revision of the database and the one this code needs."""
    from .db.engine import create_db_engine
    from .db.migrate import current_revision, head_revision

    engine = create_db_engine(Settings().resolved_database_url())
    try:
        console.print(f"database: {current_revision(engine) or 'empty'}  code needs: {head_revision()}")
    finally:
        engine.dispose()


# ---------------------------------------------------------------------- projects
@main.command("projects")
@_handle_errors
def projects() -> None:
    """List projects with their head and draft."""
    with _open() as store:
        table = Table("id", "name", "head", "draft")
        for p in store.list_projects():
            table.add_row(p.id, p.name, p.current_version_id or "-", p.active_draft_id or "-")
        console.print(table)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=False)


@main.command("import")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--name", help="project name (default: the directory name)")
@_handle_errors
def import_dir(directory: Path, name: str | None) -> None:
    """Create a project whose version 1 is the content of DIRECTORY."""
    paths = [p for p in sorted(directory.rglob("*")) if p.is_file() and not p.is_symlink() and ".git" not in p.parts]
    files: dict[str, bytes] = {}
    executable: list[str] = []
    with _progress() as progress:
        task = progress.add_task("reading files", total=len(paths))
        for p in paths:
            rel = p.relative_to(directory).as_posix()
            files[rel] = p.read_bytes()
            if os.access(p, os.X_OK):
                executable.append(rel)
            progress.advance(task)
    with _open() as store:
        with console.status(f"storing {len(files)} files in packs"):
            project = store.create_project(name or directory.resolve().name, files=files, executable=executable)
    console.print(f"project {project.id} version {project.current_version_id} ({len(files)} files)")


@main.command("export")
@click.argument("project_id")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--version", "version_id", help="a version id (default: the draft, else head)")
@_handle_errors
def export_dir(project_id: str, directory: Path, version_id: str | None) -> None:
    """Write a project state (draft, head, or --version) into DIRECTORY."""
    with _open() as store:
        view = store.view_at(project_id, version_id) if version_id else store.view(project_id)
        files = view.list_files()
        with _progress() as progress:
            task = progress.add_task(f"exporting {view.kind}", total=len(files))
            for path in files:
                target = directory / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(view.read_file(path))
                progress.advance(task)
        (directory / ".draftstore-state.json").write_text(
            json.dumps({"characters": view.characters, "world_settings": view.world_settings}, indent=2)
        )
    console.print(f"wrote {len(files)} files of {view.kind} {view.draft_id or view.version_id} to {directory}")


@main.command("log")
@click.argument("project_id")
@_handle_errors
def log_cmd(project_id: str) -> None:
    """Versions, head moves and turns of a project."""
    with _open() as store:
        head = store.get_project(project_id).current_version_id
        versions = Table("#", "version", "summary", "files", "created", title="versions")
        for v in store.list_versions(project_id):
            mark = "*" if v.id == head else ""
            versions.add_row(f"{v.number}{mark}", v.id, v.summary, str(v.file_count), v.created_at.isoformat())
        console.print(versions)
        moves = Table("at", "reason", "from", "to", "by", title="head moves")
        for m in store.head_moves(project_id):
            moves.add_row(m.at.isoformat(), m.reason, m.from_version_id or "-", m.to_version_id or "-", m.actor or "-")
        console.print(moves)
        turns = Table("#", "turn", "status", "user message", title="turns")
        for t in store.list_turns(project_id):
            turns.add_row(str(t.number), t.id, t.status, escape(_message_text(t.user_message)[:60]))
        console.print(turns)


@main.command("show")
@click.argument("turn_id")
@_handle_errors
def show(turn_id: str) -> None:
    """A turn with its tool-call history."""
    with _open() as store:
        t = store.get_turn(turn_id)
        console.print(f"turn {t.id} #{t.number} [bold]{t.status}[/bold]  draft {t.draft_id}")
        console.print(f"  user: {escape(_message_text(t.user_message))}")
        if t.assistant_message is not None:
            console.print(f"  assistant: {escape(_message_text(t.assistant_message))}")
        if t.error is not None:
            console.print(f"  error: {escape(_message_text(t.error))}")
        for c in t.tool_calls:
            args = c.args_preview if c.args_offloaded else json.dumps(c.args)
            console.print(f"  {c.seq:>4} {c.tool_name} {c.status} {args[:80]}")


@main.command("diff")
@click.argument("a")
@click.argument("b")
@click.option("--stat", is_flag=True, help="only the list of changed files")
@_handle_errors
def diff(a: str, b: str, stat: bool) -> None:
    """What changed from state A to state B.

    A state is a version id, draft:<project>, head:<project> or turn:<turn>:start|end.
    """
    with _open() as store:
        d = store.diff(a, b, text=not stat)
        for f in d.files:
            moved = f" (from {f.old_path})" if f.old_path else ""
            console.print(f"{f.status:<9} {f.path}{moved}", soft_wrap=True, highlight=False, markup=False)
            if f.unified and not stat:
                console.print(f.unified, soft_wrap=True, highlight=False, markup=False, end="")
        for name, ops in (("characters", d.characters), ("world_settings", d.world_settings)):
            if ops:
                console.print(f"{name}: {json.dumps(ops)}", soft_wrap=True, highlight=False, markup=False)
        if d.empty:
            console.print("no changes")


@main.command("publish")
@click.argument("project_id")
@click.option("--summary", "-m", default="", help="what this version changes")
@click.option("--force", is_flag=True, help="publish even if the draft's base is no longer head")
@_handle_errors
def publish(project_id: str, summary: str, force: bool) -> None:
    """Publish the project's draft as a new version."""
    with _open() as store:
        v = store.publish(project_id, summary, force=force, actor=os.environ.get("USER"))
    console.print(f"published version {v.number} ({v.id})")


@main.command("rollback")
@click.argument("project_id")
@click.argument("version_id")
@_handle_errors
def rollback(project_id: str, version_id: str) -> None:
    """Move the project's head to VERSION_ID (nothing is deleted)."""
    with _open() as store:
        store.rollback_to(project_id, version_id, actor=os.environ.get("USER"))
    console.print(f"head of {project_id} is now {version_id}")


@main.command("sweep")
@_handle_errors
def sweep() -> None:
    """Recovery sweep: reap turns whose worker died, release stuck publishes."""
    with _open() as store:
        done = store.sweep()
    console.print(f"{done['turns_reaped']} turns interrupted (heartbeat lapsed), {done['turns_failed']} could not be "
                  f"ended now, {done['publishing_released']} stuck publishes released", highlight=False)


# --------------------------------------------------------------------- maintenance
def _phases() -> tuple[Progress, Callable[[str, int, int | None], None]]:
    progress = _progress()
    tasks: dict[str, Any] = {}

    def update(phase: str, done: int, total: int | None) -> None:
        if phase not in tasks:
            tasks[phase] = progress.add_task(phase, total=total)
        progress.update(tasks[phase], completed=done, total=total)

    return progress, update


@main.command("gc")
@click.option("--apply", is_flag=True, help="delete (without it: a dry run that only reports)")
@_handle_errors
def gc(apply: bool) -> None:
    """Garbage collection: delete objects nothing retained reaches (older than the grace period)."""
    with _open() as store:
        progress, update = _phases()
        with progress:
            st = store.gc(dry_run=not apply, progress=update)
    verb = "deleted" if apply else "would delete"
    console.print(f"{verb} {st.objects_swept} objects ({st.bytes_swept:,} bytes) of {st.objects_listed} stored; "
                  f"{st.objects_reachable} reachable, {st.objects_young} unreachable but younger than the grace "
                  f"period; {st.packs_dropped} pack rows dropped, {st.turns_pruned} turns past retention "
                  f"({st.seconds:.1f}s){'' if apply else ' — dry run: add --apply to delete'}", highlight=False)


@main.command("fsck")
@click.option("--quick", is_flag=True, help="check references only; do not re-read and re-hash every object")
@_handle_errors
def fsck(quick: bool) -> None:
    """Check that every reference resolves and every object is what its key says. Exit 1 on any problem."""
    with _open() as store:
        progress, update = _phases()
        with progress:
            report = store.fsck(verify_objects=not quick, progress=update)
    for problem in report.problems:
        console.print(str(problem), highlight=False, markup=False, soft_wrap=True)
    console.print(f"{len(report.problems)} problems; {report.trees_checked} trees, {report.references_checked} "
                  f"references, {report.objects_verified} objects, {report.packs_verified} packs checked "
                  f"({report.seconds:.1f}s)", highlight=False)
    if report.problems:
        sys.exit(1)


@main.command("retention")
@click.argument("project_id")
@click.option("--turns-days", type=float, default=None, help="keep ended turns' states and payloads this long")
@click.option("--discarded-days", type=float, default=None, help="keep discarded drafts' trees this long")
@click.option("--default", "reset", multiple=True, type=click.Choice(["turns", "discarded"]),
              help="go back to the store's default for this setting")
@_handle_errors
def retention(project_id: str, turns_days: float | None, discarded_days: float | None, reset: tuple[str, ...]) -> None:
    """Show or set a project's retention (what garbage collection may delete, and when)."""
    with _open() as store:
        changes: dict[str, Any] = {f"{name}_days": None for name in reset}
        if turns_days is not None:
            changes["turns_days"] = turns_days
        if discarded_days is not None:
            changes["discarded_days"] = discarded_days
        r = store.set_retention(project_id, **changes) if changes else store.retention(project_id)
    show = (lambda d: "for ever" if d is None else f"{d:g} days")
    console.print(f"turns: {show(r.turns_days)}; discarded drafts: {show(r.discarded_days)}", highlight=False)


@main.command("prune-versions")
@click.argument("project_id")
@click.argument("version_ids", nargs=-1, required=True)
@click.option("--force", is_flag=True, help="also versions that were head once (never the current head)")
@_handle_errors
def prune_versions(project_id: str, version_ids: tuple[str, ...], force: bool) -> None:
    """Delete versions (their objects go at the next gc --apply). Versions that were head once need --force."""
    with _open() as store:
        n = store.prune_versions(project_id, list(version_ids), force=force)
    console.print(f"{n} versions pruned; run `draftstore gc --apply` to free their objects", highlight=False)


# ----------------------------------------------------------------- snapshots, packs
def _bar(description: str) -> tuple[Progress, Callable[[int, int], None]]:
    progress = _progress()
    task = progress.add_task(description, total=None)

    def update(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    return progress, update


@main.command("snapshot")
@click.argument("project_id", required=False)
@click.option("--version", "version_id", help="a version id (default: head)")
@click.option("--draft", is_flag=True, help="the draft (it must have no turn writing)")
@click.option("--pending", is_flag=True, help="build the snapshots publish scheduled, and pack new versions")
@_handle_errors
def snapshot(project_id: str | None, version_id: str | None, draft: bool, pending: bool) -> None:
    """Build a sandbox snapshot (tar + zstd bundle) of a project's head, a version or its draft."""
    with _open() as store:
        if pending:
            done = store.run_background(limit=1000)
            console.print(f"{done['snapshots_built']} snapshots built, {done['versions_packed']} versions packed")
            return
        if project_id is None:
            raise click.UsageError("give a PROJECT_ID (or --pending)")
        progress, update = _bar("bundling files")
        with progress:
            snap = store.create_snapshot(project_id, "draft" if draft else version_id or "head", progress=update)
    console.print(f"snapshot {snap.id} {snap.status}: {snap.files} files, {snap.size_bytes} bytes "
                  f"(bundle {snap.bundle_key})", highlight=False)


@main.command("materialize")
@click.argument("project_id")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--version", "version_id", help="a version id (default: the draft, else head)")
@click.option("--head", is_flag=True, help="the head version, not the draft")
@click.option("--replace", is_flag=True, help="clear DIRECTORY first if it is not empty")
@_handle_errors
def materialize(project_id: str, directory: Path, version_id: str | None, head: bool, replace: bool) -> None:
    """Write a project state's exact files into DIRECTORY (from a snapshot when one matches)."""
    with _open() as store:
        progress, update = _bar("writing files")
        with progress:
            done = store.materialize(project_id, directory, version_id or ("head" if head else "draft"),
                                     replace=replace, progress=update)
    console.print(f"{done.files} files, {done.bytes} bytes written to {directory} "
                  f"({'from snapshot ' + str(done.snapshot_id) if done.path == 'snapshot' else 'rebuilt from blobs'})",
                  highlight=False)


# ------------------------------------------------------------------------- service
def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@main.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8765, show_default=True, type=int)
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1, 64))
@_handle_errors
def serve(host: str, port: int, workers: int) -> None:
    """Run the HTTP service (REST + SSE; OpenAPI at /docs)."""
    import uvicorn

    with _open() as store:  # migrates an embedded database; checks a PostgreSQL one
        tokens = store.tokens.any_active()
    if not tokens:
        if not _loopback(host):
            err_console.print(f"[red]error[/red] no token exists: refusing to serve {escape(host)} open. "
                              "Create one first: draftstore token create --role admin")
            sys.exit(2)
        err_console.print("[yellow]warning[/yellow] no token exists: serving loopback clients only, each as an "
                          "admin (create one with: draftstore token create --role admin)")
    uvicorn.run("draftstore.service.app:create_app", factory=True, host=host, port=port, workers=workers,
                access_log=False, log_level="warning")


@main.group()
def token() -> None:
    """API tokens of the HTTP service."""


@token.command("create")
@click.option("--role", type=click.Choice(["admin", "agent", "observer"]), required=True)
@click.option("--project", "project_id", default=None, help="scope it to one project (default: every project)")
@click.option("--name", default="", help="a label, to recognise it in lists")
@_handle_errors
def token_create(role: str, project_id: str | None, name: str) -> None:
    """Create a token and print it (this is the only time it is shown)."""
    with _open() as store:
        record, secret = store.tokens.create(role, project_id=project_id, name=name, actor=os.environ.get("USER"))
    err_console.print(f"token {record.id} ({record.role}, {record.project_id or 'every project'}):")
    click.echo(secret)


@token.command("list")
@_handle_errors
def token_list() -> None:
    """Tokens (never their secrets)."""
    with _open() as store:
        cursor: str | None = None
        table = Table("id", "role", "project", "name", "created", "revoked")
        while True:
            page = store.tokens.page(cursor, 200)
            for t in page.items:
                table.add_row(t.id, t.role, t.project_id or "*", escape(t.name), t.created_at.isoformat(),
                              t.revoked_at.isoformat() if t.revoked_at else "-")
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    console.print(table)


@token.command("revoke")
@click.argument("token_id")
@_handle_errors
def token_revoke(token_id: str) -> None:
    """Revoke a token (the service stops accepting it within seconds)."""
    with _open() as store:
        store.tokens.revoke(token_id)
    console.print(f"revoked {token_id}")


@main.command("demo")
@click.option("--home", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="where the embedded store lives (default ./.draftstore, or DRAFTSTORE_* URLs)")
@_handle_errors
def demo(home: Path | None) -> None:
    """Walk a project through the whole lifecycle and print what happened."""
    from .demo import run_demo

    settings = Settings(home=home) if home else Settings()
    with Store.open(settings=settings) as store:
        run_demo(store, lambda line: console.print(line, soft_wrap=True, highlight=False))


if __name__ == "__main__":  # pragma: no cover
    main()
