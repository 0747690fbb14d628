"""Projects, their versions and head moves, and the admin operations on them."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from fastapi import APIRouter, Query

from ... import errors as E
from ... import paging
from ...diff import Diff
from ...records import Draft, HeadMove, HeadMoveReason, Page, Project, Role, Version
from ..auth import ADMIN, AGENT, ANY, Allow, Principal, StoreDep, project_scope
from ..responses import JSON
from ..schemas import (Actor, CreateProject, Cursor, Fork, Limit, ProjectDetail, Publish, Revert, Rollback,
                       decode_files)
from .states import observer_ref

router = APIRouter(prefix="/v1", tags=["projects"])

Order = Annotated[Literal["oldest", "newest"], Query(description="oldest first (the default) or newest first; "
                                                                 "a cursor belongs to the order it came from")]


def _unscoped(principal: Principal, doing: str) -> None:
    # a new project would be out of a project-scoped token's own reach
    if principal.project_id is not None:
        raise E.Forbidden(f"a token scoped to one project cannot {doing}")


def _shown(p: Project, principal: Principal) -> Project:
    # an observer (or an approver) never learns of a draft
    return dataclasses.replace(p, active_draft_id=None) if principal.published_only else p


@router.post("/projects", status_code=201, response_model=Project, response_class=JSON)
def create_project(body: CreateProject, store: StoreDep, principal: Principal = Allow(*ADMIN)) -> JSON:
    _unscoped(principal, "create projects")
    files = decode_files(body.files, "files") if body.files is not None else None
    project = store.create_project(body.name, files, body.characters, body.world_settings,  # type: ignore[arg-type]
                                   actor=body.actor or principal.actor)
    return JSON(project, status_code=201)


@router.get("/projects", response_model=Page[Project], response_class=JSON)
def list_projects(store: StoreDep, cursor: Cursor = None, limit: Limit = None,
                  principal: Principal = Allow(*ANY)) -> JSON:
    if principal.project_id is not None:  # a scoped token sees its one project
        return JSON(Page([_shown(store.get_project(principal.project_id), principal)], None))
    page = store.page_projects(cursor, limit)
    return JSON(Page([_shown(p, principal) for p in page.items], page.next_cursor))


@router.get("/projects/{project_id}", response_model=ProjectDetail, response_class=JSON)
def get_project(project_id: str, store: StoreDep, principal: Principal = Allow(*ANY)) -> JSON:
    """The project with its head version (``head``) and its active draft (``draft``; never
    shown to an observer)."""
    project_scope(principal, project_id)
    project = _shown(store.get_project(project_id), principal)
    head = store.get_version(project.current_version_id) if project.current_version_id else None
    draft = None
    if project.active_draft_id is not None:
        try:
            draft = store.get_draft(project_id)
        except E.DraftNone:  # closed since (published or discarded): as the project row said a moment ago
            pass
    fields = {f.name: getattr(project, f.name) for f in dataclasses.fields(project)}
    return JSON(ProjectDetail(**fields, head=head, draft=draft))


@router.get("/projects/{project_id}/draft", response_model=Draft, response_class=JSON)
def get_draft(project_id: str, store: StoreDep, principal: Principal = Allow(*AGENT)) -> JSON:
    project_scope(principal, project_id)
    return JSON(store.get_draft(project_id))


@router.get("/projects/{project_id}/versions", response_model=Page[Version], response_class=JSON)
def list_versions(project_id: str, store: StoreDep, cursor: Cursor = None, limit: Limit = None,
                  order: Order = "oldest", principal: Principal = Allow(*ANY)) -> JSON:
    project_scope(principal, project_id)
    return JSON(store.page_versions(project_id, cursor, limit, newest_first=order == "newest"))


@router.get("/projects/{project_id}/versions/{version_id}", response_model=Version, response_class=JSON)
def get_version(project_id: str, version_id: str, store: StoreDep, principal: Principal = Allow(*ANY)) -> JSON:
    project_scope(principal, project_id)
    return JSON(store.get_version(version_id, project_id=project_id))


@router.get("/projects/{project_id}/head-moves", response_model=Page[HeadMove], response_class=JSON)
def list_head_moves(project_id: str, store: StoreDep, cursor: Cursor = None, limit: Limit = None,
                    order: Order = "oldest", principal: Principal = Allow(*ANY)) -> JSON:
    project_scope(principal, project_id)
    page = store.page_head_moves(project_id, cursor, limit, newest_first=order == "newest")
    if principal.role == Role.OBSERVER:  # a revert is of the draft (and names a draft turn): never shown to one
        page = Page([m for m in page.items if m.reason != HeadMoveReason.REVERT], page.next_cursor)
    return JSON(page)


@router.get("/projects/{project_id}/diff", response_model=Diff, response_class=JSON)
def diff(project_id: str, a: str, b: str, store: StoreDep, text: bool = True, cursor: Cursor = None,
         limit: Limit = None, principal: Principal = Allow(*ANY)) -> JSON:
    """Diff between two states: version ids, ``draft``, ``head``, ``version:<id>``,
    ``turn:<id>:start|end`` (observers: published versions only). Paged: the changed
    files in path order (a page also ends once its text diffs reach 4 MiB), the JSON
    Patch operations of characters and world settings with the first page."""
    project_scope(principal, project_id)
    refs = [observer_ref(store, principal, project_id, ref) for ref in (a, b)]
    return JSON(store.diff(refs[0], refs[1], text=text, cursor=cursor, limit=limit or paging.DEFAULT_LIMIT))


@router.post("/projects/{project_id}/publish", status_code=201, response_model=Version, response_class=JSON)
def publish(project_id: str, body: Publish, store: StoreDep, principal: Principal = Allow(*ADMIN)) -> JSON:
    project_scope(principal, project_id)
    return JSON(store.publish(project_id, body.summary, force=body.force, actor=body.actor or principal.actor), status_code=201)


@router.post("/projects/{project_id}/discard", response_model=Draft, response_class=JSON)
def discard(project_id: str, store: StoreDep, body: Actor | None = None,
            principal: Principal = Allow(*ADMIN)) -> JSON:
    project_scope(principal, project_id)
    return JSON(store.discard_draft(project_id, actor=(body.actor if body else None) or principal.actor))


@router.post("/projects/{project_id}/draft/revert", response_model=Draft, response_class=JSON)
def revert(project_id: str, body: Revert, store: StoreDep, principal: Principal = Allow(*ADMIN)) -> JSON:
    """Undo the draft's turns from ``to_turn_id`` on: files, characters and world settings
    become that turn's start state; the undone turns stay, marked reverted."""
    project_scope(principal, project_id)
    return JSON(store.revert_draft(project_id, body.to_turn_id, actor=body.actor or principal.actor))


@router.post("/projects/{project_id}/rollback", response_model=Project, response_class=JSON)
def rollback(project_id: str, body: Rollback, store: StoreDep, principal: Principal = Allow(*ADMIN)) -> JSON:
    project_scope(principal, project_id)
    return JSON(store.rollback_to(project_id, body.version_id, actor=body.actor or principal.actor))


@router.post("/projects/{project_id}/fork", status_code=201, response_model=Project, response_class=JSON)
def fork(project_id: str, body: Fork, store: StoreDep, principal: Principal = Allow(*ADMIN)) -> JSON:
    project_scope(principal, project_id)
    _unscoped(principal, "fork into a new project")
    version_id = body.version_id or store.resolve(f"head:{project_id}").version_id or ""
    store.get_version(version_id, project_id=project_id)  # this project's version, or version.not_found
    return JSON(store.fork_project(version_id, body.name, actor=body.actor or principal.actor), status_code=201)
