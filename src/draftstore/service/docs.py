"""The API's interactive documentation at ``/docs``, served from the installed package.

FastAPI's default ``/docs`` page loads Swagger UI from a public CDN and starts
it with an inline script: it needs the network, and the admin page's
Content-Security-Policy (``admin.HEADERS``: this origin's scripts only) would
block both. Here the Swagger UI files come from the ``swagger-ui-bundle-v2``
package (Swagger UI 5, Apache-2.0, which renders OpenAPI 3.1) and the page is
started by a same-origin script, under the same policy as the admin page:
the docs work offline and no third party's script runs on the service's origin.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from fastapi import APIRouter, Request
from starlette.responses import FileResponse, HTMLResponse, Response

from .admin import HEADERS
from .errors import error_response

__all__ = ["router"]

# the Swagger UI files the page loads: a fixed set, so a name is never a path
_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
}

# starts Swagger UI on the document the page names (a script file, not inline: the CSP allows no inline script)
_START = """const node = document.getElementById("swagger-ui");
window.ui = SwaggerUIBundle({url: node.dataset.openapi, dom_id: "#swagger-ui", deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis], layout: "BaseLayout"});
"""

router = APIRouter(include_in_schema=False)


def _swagger_dir() -> Path:
    import swagger_ui_bundle  # the package's only contents: Swagger UI's dist folder, and its path

    return Path(swagger_ui_bundle.swagger_ui_path)


@router.get("/docs")
async def page(request: Request) -> Response:
    root = escape(request.scope.get("root_path", ""), quote=True)
    html = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>draftstore API</title>
<link rel="icon" href="{root}/docs/static/favicon-32x32.png">
<link rel="stylesheet" href="{root}/docs/static/swagger-ui.css"></head>
<body><div id="swagger-ui" data-openapi="{root}/openapi.json"></div>
<script src="{root}/docs/static/swagger-ui-bundle.js"></script>
<script src="{root}/docs/static/start.js"></script></body></html>
"""
    return HTMLResponse(html, headers=HEADERS)


@router.get("/docs/static/{name}")
async def asset(name: str) -> Response:
    if name == "start.js":
        return Response(_START, media_type="text/javascript; charset=utf-8", headers=HEADERS)
    media_type = _ASSETS.get(name)
    if media_type is None:
        return error_response(404, "route.not_found", f"no docs asset {name[:100]!r}")
    return FileResponse(_swagger_dir() / name, media_type=media_type, headers=HEADERS)
