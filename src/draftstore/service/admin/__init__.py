"""The admin web page: plain HTML, CSS and ES modules served at ``/admin``.

No build step: the files in ``static/`` are shipped as package data and
served as they are. The page itself needs no token (it holds no data); every
call it makes goes to the ``/v1`` API with the token the user typed in (kept
in the tab's ``sessionStorage``), or with none in open loopback mode, so the
API's roles apply unchanged. The routes stay out of the OpenAPI document:
they are not part of the API.

A Content-Security-Policy allows only this origin's scripts, styles and
connections, so even text that slipped into markup could not run.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from starlette.responses import FileResponse, Response

from ..errors import error_response

__all__ = ["router", "STATIC_DIR"]

STATIC_DIR = Path(__file__).resolve().parent / "static"

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                "img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: an upgraded install serves its own page at once
}

router = APIRouter(include_in_schema=False)


def _asset(name: str) -> Response:
    # flat folder: a name is one known file, never a path
    path = STATIC_DIR / name
    media_type = MEDIA_TYPES.get(path.suffix)
    if "/" in name or "\\" in name or name.startswith(".") or media_type is None or not path.is_file():
        return error_response(404, "route.not_found", f"no admin asset {name[:100]!r}")
    return FileResponse(path, media_type=media_type, headers=HEADERS)


@router.get("/admin")
@router.get("/admin/")
async def index() -> Response:
    return _asset("index.html")  # asset URLs in it are absolute, so both paths work


@router.get("/admin/static/{name}")
async def asset(name: str) -> Response:
    return _asset(name)
