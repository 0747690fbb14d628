"""The API's documentation page (``/docs``) in headless Chromium, offline: Swagger UI comes
from the package and runs under the admin page's Content-Security-Policy (same fixtures,
same skip rules as tests/test_admin_web.py)."""

from __future__ import annotations

from typing import Any

import pytest

from service_fixtures import Service
from test_admin_web import browser, page  # noqa: F401  (fixtures)

EMBEDDED = pytest.mark.parametrize("stack", ["embedded"], indirect=True)


@EMBEDDED
def test_the_api_docs_render_offline_under_the_pages_policy(service: Service, page: Any) -> None:  # noqa: F811
    from playwright.sync_api import expect

    outside: list[str] = []
    refused: list[str] = []
    page.route(lambda url: not url.startswith(service.url), lambda route: (outside.append(route.request.url),
                                                                           route.abort()))
    page.on("console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None)
    page.goto(f"{service.url}/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("draftstore")
    expect(page.locator(".opblock").first).to_be_visible()  # the operations, from /openapi.json
    assert outside == [] and refused == []
