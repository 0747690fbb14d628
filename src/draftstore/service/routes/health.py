"""Liveness and readiness probes (no token needed)."""

from __future__ import annotations

from fastapi import APIRouter
from ..threads import run_sync

from ..auth import StoreDep
from ..responses import JSON
from ..schemas import Health, Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, response_class=JSON)
async def healthz() -> JSON:
    """The process is up."""
    return JSON({"status": "ok"})


@router.get("/readyz", response_model=Readiness, response_class=JSON,
            responses={503: {"model": Readiness, "description": "a backend is down"}})
async def readyz(store: StoreDep) -> JSON:
    """Each backend checked; 503 names the ones that are down."""
    checks = await run_sync(store.check_backends)
    down = {name: why for name, why in checks.items() if why is not None}
    body = {"status": "ready" if not down else "unavailable", "checks": {k: v or "ok" for k, v in checks.items()}}
    if down:
        body.update(code="backend.unavailable", message=f"down: {', '.join(sorted(down))}", details=down)
    return JSON(body, status_code=503 if down else 200)
