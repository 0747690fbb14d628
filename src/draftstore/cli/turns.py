"""Turns: ``turns PROJECT`` lists them, ``turn TURN`` shows one with its tool-call timeline."""

from __future__ import annotations

import json
from typing import Any

import click

from ..records import ToolCall, Turn
from .output import clip, echo, emit_json, message_text, table, took, when
from .root import Ids, json_option, main, open_store


@main.command("turns")
@click.argument("project")
@json_option
def turns(project: str, as_json: bool) -> None:
    """The project's turns, oldest first."""
    with open_store() as store:
        items = store.list_turns(Ids(store).project(project))
    if as_json:
        emit_json(items)
        return
    table(("#", "turn", "status", "started", "took", "user message"),
          [(t.number, t.id, t.status, when(t.started_at), took(t.started_at, t.ended_at),
            clip(message_text(t.user_message))) for t in items])


def _block(label: str, value: Any) -> None:
    if value is None:
        return
    echo(f"{label}:")
    for line in message_text(value).splitlines() or [""]:
        echo(f"  {line}")


def _payload(value: Any, preview: str | None, offloaded: bool) -> str:
    if offloaded:
        return clip(preview, 100) + " (offloaded)"
    return clip(json.dumps(value, ensure_ascii=False), 100)


# calls the turn's end found unfinished have no result: say why, rather than show "null"
_UNFINISHED = {"interrupted": "(never finished: the turn ended first)",
               "expired": "(no decision came before the turn ended)"}


def _timeline(t: Turn) -> list[tuple[Any, ...]]:
    rows = []
    for c in t.tool_calls:
        at = f"+{(c.started_at - t.started_at).total_seconds():.2f}s"
        outcome = (f"error: {clip(message_text(c.error), 100)}" if c.error is not None else
                   _UNFINISHED[c.status] if c.status in _UNFINISHED else
                   _payload(c.result, c.result_preview, c.result_offloaded) if c.ended_at else "")
        rows.append((c.seq, at, took(c.started_at, c.ended_at), _status(c), c.tool_name,
                     _payload(c.args, c.args_preview, c.args_offloaded), outcome))
    return rows


def _status(c: ToolCall) -> str:
    if c.approval is None:
        return str(c.status)
    verdict = "approved" if c.approval.get("approved") else "denied"
    by = c.approval.get("by")
    return f"{c.status} ({verdict}{' by ' + str(by) if by else ''})"


@main.command("turn")
@click.argument("turn")
@json_option
def turn(turn: str, as_json: bool) -> None:
    """A turn: its messages, partial response, error and tool-call timeline."""
    with open_store() as store:
        t = store.get_turn(Ids(store).turn(turn))
    if as_json:
        emit_json(t)
        return
    reason = f" ({t.end_reason})" if t.end_reason and t.end_reason != t.status else ""
    echo(f"turn {t.id}  #{t.number}  {t.status}{reason}")
    echo(f"project {t.project_id}  draft {t.draft_id}  base version {t.base_version_id or '-'}")
    echo(f"started {when(t.started_at)}  ended {when(t.ended_at)}  took {took(t.started_at, t.ended_at)}"
         f"{'  by ' + t.actor if t.actor else ''}")
    if t.continues_turn_id:
        echo(f"continues turn {t.continues_turn_id}")
    _block("user", t.user_message)
    _block("assistant", t.assistant_message)
    _block("partial response", t.partial_response)
    _block("error", t.error)
    echo()
    if not t.tool_calls:
        echo("tool calls: none")
        return
    table(("#", "at", "took", "status", "tool", "args", "result / error"), _timeline(t),
          title="tool calls")


main.add_command(turn, "show")  # the earlier name, kept for scripts
