"""The HTTP service (FastAPI): REST for every operation, SSE per turn and per project, tokens with roles."""

from .app import create_app

__all__ = ["create_app"]
