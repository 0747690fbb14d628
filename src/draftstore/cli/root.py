"""The root ``draftstore`` group, opening the store, and reading ids as people type them."""

from __future__ import annotations

import os
from typing import Any

import click

from ..heap import tune_collector
from ..settings import Settings
from ..store import Store
from .failures import DraftstoreGroup

__all__ = ["main", "open_store", "actor", "json_option", "Ids"]


@click.group(cls=DraftstoreGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="print the traceback of a failure")
@click.version_option(package_name="draftstore")
def main(debug: bool) -> None:
    """draftstore: versioned drafts, turns and tool-call history for AI agents.

    Ids may be given as any unique prefix of at least 6 characters. Exit
    status: 0 done, 1 fsck found problems, 2 bad input / not found / conflict,
    3 a backend failed, 4 invalid configuration, 5 a local file error.
    """


def open_store(migrate: bool | None = None) -> Store:
    """The store the ``DRAFTSTORE_*`` environment names (embedded defaults when unset)."""
    store = Store.open(settings=Settings.load(), migrate=migrate)
    tune_collector(collect=False)  # start-up heap frozen, fewer young collections (heap.py)
    return store


def actor() -> str | None:
    """Who is acting, for head moves and discards: the login name."""
    return os.environ.get("USER") or os.environ.get("LOGNAME")


json_option = click.option("--json", "as_json", is_flag=True, help="print JSON (for scripts)")


class Ids:
    """Full ids from what was typed (a full id or a unique prefix of ≥ 6 characters)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def project(self, text: str) -> str:
        return self.store.resolve_id("project", text)

    def version(self, text: str, project_id: str | None = None) -> str:
        return self.store.resolve_id("version", text, project_id=project_id)

    def turn(self, text: str, project_id: str | None = None) -> str:
        return self.store.resolve_id("turn", text, project_id=project_id)

    def token(self, text: str) -> str:
        return self.store.resolve_id("token", text)

    def state(self, project_id: str, version: str | None, head: bool = False) -> str:
        """A materialize/export state: a version id, ``head`` or ``draft`` (the draft, else head)."""
        if version:
            return self.version(version, project_id)
        return "head" if head else "draft"

    def ref(self, text: str) -> str:
        """A state reference for diffs: VERSION, draft:PROJECT, head:PROJECT, turn:TURN[:start|end]."""
        kind, sep, rest = text.partition(":")
        if not sep:
            return self.version(text)
        if kind in ("draft", "head"):
            return f"{kind}:{self.project(rest)}"
        if kind == "turn":
            turn, sep2, boundary = rest.partition(":")
            return f"turn:{self.turn(turn)}" + (f":{boundary}" if sep2 else "")
        return text  # let the store say what is wrong with it


def view_of(store: Store, project_id: str, version: str | None, head: bool) -> Any:
    """The View a read command looks at: --version, --head, else the draft (else head)."""
    ids = Ids(store)
    if version:
        return store.view_at(project_id, ids.version(version, project_id))
    if head:
        return store.resolve(f"head:{project_id}")
    return store.view(project_id)
