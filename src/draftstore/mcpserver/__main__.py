"""``python -m draftstore.mcpserver --project P [--turn T]``: the stdio server (as ``draftstore mcp``)."""

from __future__ import annotations

import argparse
import sys

from ..errors import DraftstoreError
from . import serve_stdio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftstore.mcpserver",
                                     description="Serve draftstore's agent tools over MCP (stdio).")
    parser.add_argument("--project", required=True, help="the project the tools read and write")
    parser.add_argument("--turn", default=None, help="the turn writes go through (default: the running one)")
    args = parser.parse_args(argv)
    try:
        serve_stdio(args.project, args.turn)
    except DraftstoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
