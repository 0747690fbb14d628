"""Sandbox sessions of a project: which sandbox runs on which state, and whether it lives.

Agents and admins only (a sandbox runs unpublished work); a project-scoped token sees
only its project's sessions, and another project's session id is not found.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import Field

from ...records import Page, SandboxSession
from ..auth import AGENT, Allow, Principal, StoreDep, project_scope
from ..responses import JSON
from ..schemas import Body, Cursor, Limit

router = APIRouter(prefix="/v1/projects/{project_id}/sandbox-sessions", tags=["sandbox sessions"])

Status = Literal["starting", "ready", "paused", "closed", "lost"]


class OpenSandbox(Body):
    provider: str = Field(..., description="who runs the sandbox: e2b, docker, local, ...")
    external_id: str = Field(..., description="the provider's id of the sandbox")
    state: str = Field("draft", description="what it runs: draft (the draft, else head) | head | a version id")
    turn_id: str | None = Field(None, description="the turn it serves, if any (a turn of this project)")
    snapshot_id: str | None = Field(None, description="the snapshot it was restored from, if any")
    status: Literal["starting", "ready", "paused"] = "starting"


class SandboxHeartbeat(Body):
    status: Status | None = Field(None, description="its new status, if it changed (closed and lost are final)")


@router.post("", status_code=201, response_model=SandboxSession, response_class=JSON)
def open_sandbox_session(project_id: str, body: OpenSandbox, store: StoreDep,
                         principal: Principal = Allow(*AGENT)) -> JSON:
    """Record a sandbox opened on a state of the project; it counts as seen now."""
    project_scope(principal, project_id)
    return JSON(store.open_sandbox(project_id, body.provider, body.external_id, state=body.state,
                                   turn_id=body.turn_id, snapshot_id=body.snapshot_id, status=body.status),
                status_code=201)


@router.get("", response_model=Page[SandboxSession], response_class=JSON)
def list_sandbox_sessions(project_id: str, store: StoreDep, status: Annotated[Status | None, Query()] = None,
                          cursor: Cursor = None, limit: Limit = None,
                          principal: Principal = Allow(*AGENT)) -> JSON:
    """The project's sessions, oldest first, paged; only those of ``status`` if given."""
    project_scope(principal, project_id)
    return JSON(store.page_sandboxes(project_id, status, cursor, limit))


@router.get("/{session_id}", response_model=SandboxSession, response_class=JSON)
def get_sandbox_session(project_id: str, session_id: str, store: StoreDep,
                        principal: Principal = Allow(*AGENT)) -> JSON:
    project_scope(principal, project_id)
    return JSON(store.get_sandbox(session_id, project_id=project_id))


@router.post("/{session_id}/heartbeat", response_model=SandboxSession, response_class=JSON)
def sandbox_session_heartbeat(project_id: str, session_id: str, store: StoreDep,
                              body: SandboxHeartbeat | None = None,
                              principal: Principal = Allow(*AGENT)) -> JSON:
    """The sandbox is alive (and, with ``status``, in that status); 409 ``sandbox.conflict``
    once it is closed or lost: that is how its owner learns to stop."""
    project_scope(principal, project_id)
    status = body.status if body is not None else None
    return JSON(store.sandbox_heartbeat(session_id, status, project_id=project_id))


@router.post("/{session_id}/close", response_model=SandboxSession, response_class=JSON)
def close_sandbox_session(project_id: str, session_id: str, store: StoreDep,
                          principal: Principal = Allow(*AGENT)) -> JSON:
    """Close the session (final; closing a closed one answers it unchanged)."""
    project_scope(principal, project_id)
    return JSON(store.close_sandbox(session_id, project_id=project_id))
