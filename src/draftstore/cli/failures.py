"""How a failed command ends: one line on stderr with the error's code and a
hint, and an exit status a script can branch on. ``--debug`` (or
``DRAFTSTORE_DEBUG=1``) prints the traceback as well.

Exit statuses:

====  ==========================================================================
0     done
1     ``fsck`` found problems
2     bad input, not found, a state conflict, a usage error
3     a backend (database, blob store, coordinator) failed or stored data is bad
4     a ``DRAFTSTORE_*`` setting or URL is invalid
5     a local file or directory could not be read or written
70    a bug in draftstore (please report it with the ``--debug`` output)
130   interrupted
141   stdout was closed early (``draftstore log P | head``); nothing is printed

====  ==========================================================================
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, NoReturn

import click

from .. import errors as E
from .output import clip

__all__ = ["EXIT", "DraftstoreGroup", "fail"]

EXIT = {"ok": 0, "problems": 1, "input": 2, "backend": 3, "config": 4, "file": 5, "bug": 70, "interrupted": 130,
        "pipe": 141}

#: what to do next, by error code
HINTS = {
    "config.invalid": "check the DRAFTSTORE_* variables (`draftstore config` lists them)",
    "backend.unavailable": "is it running, and is its DRAFTSTORE_*_URL right? (`draftstore config`)",
    "backend.error": "run again with --debug for details",
    "schema.outdated": "run `draftstore db upgrade`",
    "project.not_found": "`draftstore projects` lists projects",
    "version.not_found": "`draftstore log PROJECT` lists a project's versions",
    "turn.not_found": "`draftstore turns PROJECT` lists a project's turns",
    "token.not_found": "`draftstore token list` lists tokens",
    "draft.none": "the project has no open draft; a turn opens one",
    "draft.conflict": "publish with --force to replace head with the draft (there is no rebase)",
    "draft.busy": "wait for the turn to end, or interrupt it",
    "path.conflict": "add --replace to clear the directory first",
    "version.protected": "add --force to prune versions that were head once",
    "blob.checksum_mismatch": "run `draftstore fsck` to list every damaged object",
}


def _exit_for(exc: E.DraftstoreError) -> int:
    if isinstance(exc, E.ConfigInvalid):
        return EXIT["config"]
    if isinstance(exc, (E.BackendError, E.IntegrityError)):
        return EXIT["backend"]
    return EXIT["input"]


def fail(code: str, message: str, status: int, hint: str | None = None) -> NoReturn:
    """Print ``error [code] message (hint)`` as one line on stderr and exit with ``status``."""
    hint = hint if hint is not None else HINTS.get(code)
    line = f"error [{code}] {clip(message, None)}"
    if hint and hint not in message:  # a message that already says what to do is not repeated
        line += f" (hint: {hint})"
    click.echo(line, err=True)
    sys.exit(status)


class DraftstoreGroup(click.Group):
    """The root command group: turns every exception into ``fail``."""

    def invoke(self, ctx: click.Context) -> Any:
        debug = bool(ctx.params.get("debug")) or os.environ.get("DRAFTSTORE_DEBUG") == "1"
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(EXIT["interrupted"])
        except BrokenPipeError:
            # the reader went away (`| head`): stop quietly, and keep the interpreter's
            # final flush from failing on the closed pipe too
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT["pipe"])
        except E.DraftstoreError as exc:
            _trace(debug)
            fail(exc.code, exc.message, _exit_for(exc))
        except OSError as exc:
            _trace(debug)
            where = f" {exc.filename}" if exc.filename else ""
            fail("io.error", f"{exc.strerror or exc}:{where}", EXIT["file"])
        except Exception as exc:  # a bug: say so in one line, keep the traceback for --debug
            _trace(debug)
            fail("internal", f"{type(exc).__name__}: {exc}", EXIT["bug"],
                 hint=None if debug else "run again with --debug for the traceback")


def _trace(debug: bool) -> None:
    if debug:
        traceback.print_exc(file=sys.stderr)
