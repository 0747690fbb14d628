"""Projects and their refs: ``projects``, ``log``, ``publish``, ``discard``, ``revert``, ``rollback``, ``fork``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from ..paging import MAX_LIMIT
from ..records import HeadMoveReason, Page
from .output import clip, echo, emit_json, message_text, table, took, when
from .root import Ids, actor, json_option, main, open_store


@main.command("projects")
@json_option
def projects(as_json: bool) -> None:
    """List projects with their head and draft."""
    with open_store() as store:
        items = store.list_projects()
    if as_json:
        emit_json(items)
        return
    table(("id", "name", "head", "draft"),
          [(p.id, clip(p.name, 40), p.current_version_id, p.active_draft_id) for p in items])


def _newest(page: Callable[[str | None, int], Page[Any]], n: int) -> list[Any]:
    """The newest ``n`` items of a list paged newest first, oldest first: only the pages needed."""
    items: list[Any] = []
    cursor = None
    while len(items) < n:
        got = page(cursor, min(MAX_LIMIT, n - len(items)))
        items += got.items
        cursor = got.next_cursor
        if cursor is None:
            break
    return items[::-1]


@main.command("log")
@click.argument("project")
@click.option("--last", "-n", type=click.IntRange(min=1), default=None,
              help="only the newest N versions, head moves and turns (each read newest first, a page at a time)")
@json_option
def log_cmd(project: str, last: int | None, as_json: bool) -> None:
    """Versions, head moves and turns of a project, oldest first."""
    with open_store() as store:
        project_id = Ids(store).project(project)
        p = store.get_project(project_id)
        if last is None:
            versions, moves, turns = (store.list_versions(project_id), store.head_moves(project_id),
                                      store.list_turns(project_id))
        else:
            versions, moves, turns = (
                _newest(lambda c, n: store.page_versions(project_id, c, n, newest_first=True), last),
                _newest(lambda c, n: store.page_head_moves(project_id, c, n, newest_first=True), last),
                _newest(lambda c, n: store.page_turns(project_id, c, n, newest_first=True), last))
    if as_json:
        emit_json({"project": p, "versions": versions, "head_moves": moves, "turns": turns})
        return
    echo(f"project {p.id}  {clip(p.name, None)}")
    echo(f"head {p.current_version_id or '-'}  draft {p.active_draft_id or '-'}")
    echo()
    table(("#", "version", "files", "created", "summary"),
          [(f"{v.number}{'*' if v.id == p.current_version_id else ''}", v.id, v.file_count, when(v.created_at),
            clip(v.summary)) for v in versions], title="versions (* = head)")
    echo()
    table(("at", "reason", "from", "to", "by"),
          [(when(m.at), m.reason, *(("draft", f"start of turn {m.turn_id}") if m.reason == HeadMoveReason.REVERT
                                    else (m.from_version_id, m.to_version_id)), clip(m.actor, 30) or "-")
           for m in moves], title="head moves (a revert leaves head: the draft went back to the turn's start)")
    echo()
    table(("#", "turn", "status", "started", "took", "user message"),
          [(t.number, t.id, f"{t.status} (reverted)" if t.reverted_at else t.status, when(t.started_at),
            took(t.started_at, t.ended_at), clip(message_text(t.user_message))) for t in turns], title="turns")


@main.command("publish")
@click.argument("project")
@click.option("--summary", "-m", default="", help="what this version changes")
@click.option("--force", is_flag=True, help="publish even if the draft's base is no longer head (no rebase)")
def publish(project: str, summary: str, force: bool) -> None:
    """Publish the project's draft as a new version and make it head."""
    with open_store() as store:
        v = store.publish(Ids(store).project(project), summary, force=force, actor=actor())
    echo(f"published version {v.number} {v.id} ({v.file_count} files)")


@main.command("discard")
@click.argument("project")
@click.option("--yes", "-y", is_flag=True, help="do not ask for confirmation")
def discard(project: str, yes: bool) -> None:
    """Drop the project's draft (unpublished work); the project is back at its head."""
    with open_store() as store:
        project_id = Ids(store).project(project)
        if not yes:
            draft = store.get_draft(project_id)
            click.confirm(f"discard draft {draft.id} ({draft.status}, {draft.file_count} files) of {project_id}?",
                          abort=True, err=True)
        d = store.discard_draft(project_id, actor=actor())
    echo(f"discarded draft {d.id}; {project_id} is back at its head")


@main.command("revert")
@click.argument("project")
@click.option("--to-turn", "to_turn", required=True, metavar="TURN",
              help="the turn whose start the draft goes back to (that turn and the later ones are undone)")
@json_option
def revert(project: str, to_turn: str, as_json: bool) -> None:
    """Revert the project's draft to the start of TURN (the undone turns stay, marked reverted)."""
    with open_store() as store:
        ids = Ids(store)
        project_id = ids.project(project)
        turn_id = ids.turn(to_turn, project_id)
        draft = store.revert_draft(project_id, turn_id, actor=actor())
        number = store.get_turn(turn_id, tool_calls=False).number
    if as_json:
        emit_json(draft)
        return
    echo(f"draft {draft.id} of {project_id} is back at the start of turn {number} {turn_id} "
         f"({draft.file_count} files); turns from {number} on are marked reverted")


@main.command("rollback")
@click.argument("project")
@click.argument("version")
def rollback(project: str, version: str) -> None:
    """Move the project's head to VERSION (nothing is deleted)."""
    with open_store() as store:
        ids = Ids(store)
        project_id = ids.project(project)
        version_id = ids.version(version, project_id)
        store.rollback_to(project_id, version_id, actor=actor())
        number = store.get_version(version_id).number
    echo(f"head of {project_id} is now version {number} {version_id}")


@main.command("fork")
@click.argument("version")
@click.option("--name", default=None, help="the new project's name (default: '<name> (fork)')")
def fork(version: str, name: str | None) -> None:
    """A new project whose version 1 is VERSION of another project (objects are shared)."""
    with open_store() as store:
        v = store.get_version(Ids(store).version(version))
        source = store.get_project(v.project_id)
        p = store.fork_project(v.id, name or f"{source.name} (fork)", actor=actor())
    echo(f"project {p.id} forked from version {v.number} {v.id} of {source.id}")
