"""Operations: ``sweep``, ``gc``, ``fsck``, ``retention``, ``prune-versions``.

Each prints a readable summary (or ``--json``); long work shows its phases'
progress on stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click
from rich.progress import Progress

from .failures import EXIT
from .output import echo, emit_json, progress_bar
from .root import Ids, json_option, main, open_store


def _phases() -> tuple[Progress, Callable[[str, int, int | None], None]]:
    progress = progress_bar()
    tasks: dict[str, Any] = {}

    def update(phase: str, done: int, total: int | None) -> None:
        if phase not in tasks:
            tasks[phase] = progress.add_task(phase, total=total)
        progress.update(tasks[phase], completed=done, total=total)

    return progress, update


@main.command("sweep")
@json_option
def sweep(as_json: bool) -> None:
    """Recovery sweep: interrupt turns whose worker died, release stuck publishes."""
    with open_store() as store:
        done = store.sweep()
    if as_json:
        emit_json(done)
        return
    echo(f"{done['turns_reaped']} turns interrupted (heartbeat lapsed), {done['turns_failed']} could not be "
         f"ended now, {done['publishing_released']} stuck publishes released, {done['sandboxes_lost']} sandbox "
         "sessions lost (not seen)")


@main.command("gc")
@click.option("--apply", is_flag=True, help="delete (without it: a dry run that only reports)")
@json_option
def gc(apply: bool, as_json: bool) -> None:
    """Garbage collection: delete objects nothing retained reaches (older than the grace period)."""
    with open_store() as store:
        progress, update = _phases()
        with progress:
            st = store.gc(dry_run=not apply, progress=update)
    if as_json:
        emit_json(st)
        return
    verb = "deleted" if apply else "would delete"
    echo(f"{verb} {st.objects_swept} objects ({st.bytes_swept:,} bytes) of {st.objects_listed} stored; "
         f"{st.objects_young} unreachable but younger than the grace period (kept)")
    echo(f"  {st.objects_reachable} digests reachable (stored alone or inside packs)")
    echo(f"  {st.packs_dropped} pack rows dropped; {st.turns_pruned} turns past retention")
    echo(f"  took {st.seconds:.1f}s" + ("" if apply else "; dry run: add --apply to delete"))


@main.command("fsck")
@click.option("--quick", is_flag=True, help="check references only; do not re-read and re-hash every object")
@json_option
def fsck(quick: bool, as_json: bool) -> None:
    """Check that every reference resolves and every object is what its key says. Exit 1 on any problem."""
    with open_store() as store:
        progress, update = _phases()
        with progress:
            report = store.fsck(verify_objects=not quick, progress=update)
    if as_json:
        emit_json({"ok": report.ok, **report.__dict__})
    else:
        for problem in report.problems:
            echo(str(problem))
        echo(f"{len(report.problems)} problems; {report.trees_checked} trees, "
             f"{report.references_checked} references, {report.objects_verified} objects, "
             f"{report.packs_verified} packs checked ({report.seconds:.1f}s)")
    if report.problems:
        sys.exit(EXIT["problems"])


@main.command("retention")
@click.argument("project")
@click.option("--turns-days", type=float, default=None, help="keep ended turns' states and payloads this long")
@click.option("--discarded-days", type=float, default=None, help="keep discarded drafts' trees this long")
@click.option("--default", "reset", multiple=True, type=click.Choice(["turns", "discarded"]),
              help="go back to the store's default for this setting")
@json_option
def retention(project: str, turns_days: float | None, discarded_days: float | None, reset: tuple[str, ...],
              as_json: bool) -> None:
    """Show or set a project's retention (what garbage collection may delete, and when)."""
    with open_store() as store:
        project_id = Ids(store).project(project)
        changes: dict[str, Any] = {f"{name}_days": None for name in reset}
        if turns_days is not None:
            changes["turns_days"] = turns_days
        if discarded_days is not None:
            changes["discarded_days"] = discarded_days
        r = store.set_retention(project_id, **changes) if changes else store.retention(project_id)
    if as_json:
        emit_json(r)
        return
    days = (lambda d: "for ever" if d is None else f"{d:g} days")  # noqa: E731
    echo(f"turns: {days(r.turns_days)}; discarded drafts: {days(r.discarded_days)}")


@main.command("prune-versions")
@click.argument("project")
@click.argument("versions", nargs=-1, required=True)
@click.option("--force", is_flag=True, help="also versions that were head once (never the current head)")
def prune_versions(project: str, versions: tuple[str, ...], force: bool) -> None:
    """Delete versions (their objects go at the next gc --apply). Versions that were head once need --force."""
    with open_store() as store:
        ids = Ids(store)
        project_id = ids.project(project)
        n = store.prune_versions(project_id, [ids.version(v, project_id) for v in versions], force=force)
    echo(f"{n} versions pruned; run `draftstore gc --apply` to free their objects")
