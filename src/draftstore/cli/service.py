"""The service side: ``serve``, ``token``, ``mcp`` (agent tools over stdio), ``demo``."""

from __future__ import annotations

from pathlib import Path

import click

from ..records import Role
from ..settings import Settings
from ..store import Store
from .failures import EXIT, fail
from .output import clip, echo, emit_json, table, warn, when
from .root import Ids, actor, json_option, main, open_store


@main.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8765, show_default=True, type=int)
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1, 64))
def serve(host: str, port: int, workers: int) -> None:
    """Run the HTTP service (REST + SSE, MCP at /mcp, admin page at /admin; OpenAPI at /docs)."""
    import uvicorn

    from ..service.auth import loopback_host
    from ..service.protocol import BoundedHead

    with open_store() as store:  # migrates an embedded database; checks a PostgreSQL one
        tokens = store.tokens.any_active()
    if not tokens:
        if not loopback_host(host):
            fail("auth.required", f"no token exists: refusing to serve {host} open", EXIT["input"],
                 hint="create one first: draftstore token create --role admin")
        warn("warning: no token exists: serving loopback clients only, each as an admin "
             "(create one with: draftstore token create --role admin)")
    here = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host)  # every address: name one
    shown = here or (f"[{host}]" if ":" in host else host)
    warn(f"serving on {'every address, port ' + str(port) if here else f'http://{shown}:{port}'} "
         f"(admin page: http://{shown}:{port}/admin)")
    # BoundedHead: uvicorn's httptools protocol, with a bound on a request's headers (protocol.py)
    uvicorn.run("draftstore.service.app:create_app", factory=True, host=host, port=port, workers=workers,
                access_log=False, log_level="warning", http=BoundedHead)


@main.group()
def token() -> None:
    """API tokens of the HTTP service."""


@token.command("create")
@click.option("--role", type=click.Choice([r.value for r in Role]), required=True,
              help="admin: everything; agent: turns and draft writes; observer: published versions; "
                   "approver: decides tool calls awaiting approval, reads turns, never writes a draft")
@click.option("--project", "project", default=None, help="scope it to one project (default: every project)")
@click.option("--name", default="", help="a label, to recognise it in lists")
def token_create(role: str, project: str | None, name: str) -> None:
    """Create a token and print it (this is the only time it is shown)."""
    with open_store() as store:
        project_id = Ids(store).project(project) if project else None
        record, secret = store.tokens.create(role, project_id=project_id, name=name, actor=actor())
    warn(f"token {record.id} ({record.role}, {record.project_id or 'every project'}):")
    click.echo(secret)


@token.command("list")
@json_option
def token_list(as_json: bool) -> None:
    """Tokens (never their secrets)."""
    items = []
    with open_store() as store:
        cursor: str | None = None
        while True:
            page = store.tokens.page(cursor, 200)
            items.extend(page.items)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    if as_json:
        emit_json(items)
        return
    table(("id", "role", "project", "created", "revoked", "name"),
          [(t.id, t.role, t.project_id or "*", when(t.created_at), when(t.revoked_at) if t.revoked_at else "-",
            clip(t.name, 40)) for t in items])


@token.command("revoke")
@click.argument("token_id")
def token_revoke(token_id: str) -> None:
    """Revoke a token (running services stop accepting it within 5 seconds)."""
    with open_store() as store:
        full = Ids(store).token(token_id)
        store.tokens.revoke(full)
    echo(f"revoked {full}")
    warn("running services stop accepting it within 5 seconds")


@main.command("mcp")
@click.option("--project", "project", required=True, help="the project the tools read and write")
@click.option("--turn", "turn", default=None, help="the turn writes go through (default: the project's running turn)")
def mcp(project: str, turn: str | None) -> None:
    """Serve the agent tools over MCP on stdin/stdout (view_file, search_code, write_file, ...).

    Every tool call is recorded in the turn's tool-call history.
    """
    from ..mcpserver import require_store, serve_stdio

    require_store()  # an embedded store that does not exist is not created here (config.invalid)
    with open_store() as store:
        ids = Ids(store)
        project_id = ids.project(project)
        turn_id = ids.turn(turn, project_id) if turn else None
    serve_stdio(project_id, turn_id)


@main.command("demo")
@click.option("--home", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="where the embedded store lives (default ./.draftstore, or DRAFTSTORE_* URLs)")
def demo(home: Path | None) -> None:
    """Walk a project through the whole lifecycle and print what happened."""
    from ..demo import run_demo

    settings = Settings.load(home=home) if home else Settings.load()
    with Store.open(settings=settings) as store:
        run_demo(store, echo)
