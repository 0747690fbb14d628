"""The MCP server: draftstore's agent tools for any framework that speaks MCP.

- ``serve_stdio(project_id, turn_id)`` — ``draftstore mcp --project P [--turn T]``:
  opens the store the ``DRAFTSTORE_*`` environment describes and serves the
  tools over stdio (stdout is the protocol channel: nothing else is written there).
- ``mcp_http_app()`` — the streamable-HTTP endpoint the service mounts at
  ``/mcp`` (``/mcp/projects/{project_id}[/turns/{turn_id}]``, agent or admin token).

Tools, bounds, recording and errors: docs/mcp.md.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .tools import READ_TOOLS, TOOL_NAMES, WRITE_TOOLS, AgentTools, Bounds

if TYPE_CHECKING:
    from ..settings import Settings
    from .http import McpHttpApp

__all__ = ["serve_stdio", "require_store", "mcp_http_app", "AgentTools", "Bounds", "READ_TOOLS", "WRITE_TOOLS", "TOOL_NAMES"]


def serve_stdio(project_id: str, turn_id: str | None = None) -> None:
    """Serve the tools of ``project_id`` over stdio until the client closes the connection.

    With ``turn_id`` every call goes through that turn; without it, through the
    project's running turn at the time of the call (writes need one). Raises
    ``project.not_found`` / ``turn.not_found`` (a turn of another project is not
    found either) before serving anything.
    """
    from .. import errors as E
    from ..heap import tune_collector
    from ..store import Store
    from .server import build_server

    require_store()
    with contextlib.redirect_stdout(sys.stderr):  # nothing but the protocol may reach stdout
        store = Store.from_env()
    tune_collector()  # start-up heap frozen, fewer young collections (heap.py)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            store.get_project(project_id)
            if turn_id is not None and store.get_turn(turn_id, tool_calls=False).project_id != project_id:
                raise E.turn_not_found(turn_id, project_id)
        agent = AgentTools(store, project_id, turn_id)
        build_server(lambda _context: agent).run("stdio")
    finally:
        store.close()


def require_store(settings: "Settings | None" = None) -> None:
    """Raise ``config.invalid`` if the settings name an embedded database that does not exist.

    The tools serve a project of an existing store: opening the embedded default in
    the wrong directory would create an empty ``.draftstore/`` there (and then not
    find the project). Checked before anything is opened, so nothing is left behind.
    """
    from .. import errors as E
    from ..settings import Settings

    from sqlalchemy.engine import make_url

    settings = settings or Settings.load()
    url = make_url(settings.resolved_database_url())
    if url.get_backend_name() == "sqlite" and url.database:
        path = Path(url.database)
        if not path.is_file():
            raise E.ConfigInvalid(f"no draftstore database at {path.absolute()}: run where the store's "
                                  ".draftstore/ is, or set DRAFTSTORE_HOME or DRAFTSTORE_DATABASE_URL",
                                  database=str(path.absolute()))


def mcp_http_app(**kwargs: Any) -> "McpHttpApp":
    """The ASGI app the HTTP service mounts at ``/mcp`` (run its ``lifespan()`` inside the service's)."""
    from .http import McpHttpApp

    return McpHttpApp(**kwargs)
