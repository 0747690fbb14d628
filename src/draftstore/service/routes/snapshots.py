"""Sandbox snapshots of a project's states (materialising is local: ``draftstore materialize``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import Field
from ..threads import run_sync

from ... import errors as E
from ...records import Page, Snapshot
from ..auth import AGENT, Allow, Principal, StoreDep, project_scope
from ..responses import JSON
from ..schemas import Body, Cursor, Limit

router = APIRouter(prefix="/v1/projects/{project_id}/snapshots", tags=["snapshots"])


class CreateSnapshot(Body):
    source: str = Field("head", description="head | draft | a version id")
    external_ref: str | None = Field(None, description="record a snapshot kept elsewhere (e.g. a sandbox "
                                                       "provider's id) instead of building a bundle")


@router.get("", response_model=Page[Snapshot], response_class=JSON)
def list_snapshots(project_id: str, store: StoreDep, cursor: Cursor = None, limit: Limit = None,
                   principal: Principal = Allow(*AGENT)) -> JSON:
    """The project's snapshots, oldest first, paged."""
    project_scope(principal, project_id)
    return JSON(store.page_snapshots(project_id, cursor, limit))


@router.get("/best", response_model=Snapshot, response_class=JSON)
def best_snapshot(project_id: str, store: StoreDep,
                  state: Annotated[str, Query(description="draft (the draft, else head) | head | a version id")],
                  principal: Principal = Allow(*AGENT)) -> JSON:
    """The ready snapshot that restores ``state`` exactly (same tree root): an external one
    first, else a bundle; 404 ``snapshot.not_found`` when none fits (rebuild from the blobs)."""
    project_scope(principal, project_id)
    snap = store.best_snapshot(project_id, state)
    if snap is None:
        raise E.SnapshotNotFound(f"no ready snapshot restores {state[:80]!r} of project {project_id}",
                                 project_id=project_id, state=state[:80])
    return JSON(snap)


@router.post("", status_code=201, response_model=Snapshot, response_class=JSON)
async def create_snapshot(project_id: str, body: CreateSnapshot, store: StoreDep,
                          principal: Principal = Allow(*AGENT)) -> JSON:
    """Build a tar + zstd bundle of the state now (or record an external one)."""
    project_scope(principal, project_id)
    if body.external_ref is not None:
        snap = await run_sync(store.record_snapshot, project_id, body.source, body.external_ref)
    else:
        snap = await run_sync(store.create_snapshot, project_id, body.source)
    return JSON(snap, status_code=201)
