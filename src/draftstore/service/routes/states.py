"""Agent reads through the view (draft, else head), or a pinned state with ``?at=``.

``at``: ``draft`` (default: the draft, else head), ``head``, ``version:<id>``
(or a bare version id), ``turn:<id>:start`` / ``turn:<id>:end``. Observers
read published versions only: ``at=head`` or ``at=version:<id>``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from starlette.responses import Response

from ... import errors as E
from ... import paging
from ...records import Page
from ...search import PAGE_BYTES, paged
from ...store import Store
from ...view import DirEntry, FileStat, PathList, View
from ..auth import ANY, Allow, Principal, StoreDep, project_scope
from ..responses import JSON
from ..schemas import Cursor, Limit, PathPage, SearchPage, ViewState

router = APIRouter(prefix="/v1/projects/{project_id}/view", tags=["view"])

At = Annotated[str, Query(description="draft | head | version:<id> | turn:<id>:start|end")]


def observer_ref(store: Store, principal: Principal, project_id: str, ref: str) -> str:
    """An HTTP state reference as a library one, checked against the project
    (another project's version or turn is not found) and the role."""
    if not isinstance(ref, str) or not ref or len(ref) > 200:
        raise E.InvalidInput("a state is draft, head, version:<id> or turn:<id>:start|end", field="at")
    kind, _, rest = ref.partition(":")
    if kind in ("draft", "head") and not rest:
        if kind == "draft" and principal.published_only:
            raise E.Forbidden(f"an {principal.role} reads published versions only (at=head or at=version:<id>)")
        return f"{kind}:{project_id}"
    if kind == "turn":
        if principal.published_only:
            raise E.Forbidden(f"an {principal.role} reads published versions only")
        turn_id, _, boundary = rest.partition(":")
        if store.get_turn(turn_id, tool_calls=False).project_id != project_id:
            raise E.turn_not_found(turn_id, project_id)
        return f"turn:{turn_id}:{boundary or 'end'}"
    version_id = rest if kind == "version" else ref
    store.get_version(version_id, project_id=project_id)
    return version_id


def _view(store: Store, principal: Principal, project_id: str, at: str) -> View:
    project_scope(principal, project_id)
    return store.resolve(observer_ref(store, principal, project_id, at))


def _state(view: View) -> dict[str, Any]:
    return {"project_id": view.project_id, "kind": view.kind, "root": view.root, "version_id": view.version_id,
            "draft_id": view.draft_id, "revision": view.revision, "characters": view.characters,
            "world_settings": view.world_settings}


@router.get("", response_model=ViewState, response_class=JSON)
def state(project_id: str, store: StoreDep, at: At = "draft", principal: Principal = Allow(*ANY)) -> JSON:
    """Which state this is (kind, root, ids) with its characters and world settings."""
    return JSON(_state(_view(store, principal, project_id, at)))


@router.get("/files/{path:path}", response_class=Response,
            responses={200: {"content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary"}}}}})
def read_file(project_id: str, path: str, store: StoreDep, at: At = "draft",
              principal: Principal = Allow(*ANY)) -> Response:
    view = _view(store, principal, project_id, at)
    st = view.stat(path)
    return Response(view.read_file(path), media_type="application/octet-stream",
                    headers={"ETag": f'"{st.digest}"', "X-Draftstore-Digest": st.digest})


@router.get("/stat/{path:path}", response_model=FileStat, response_class=JSON)
def stat(project_id: str, path: str, store: StoreDep, at: At = "draft", principal: Principal = Allow(*ANY)) -> JSON:
    return JSON(_view(store, principal, project_id, at).stat(path))


@router.get("/list", response_model=Page[DirEntry], response_class=JSON)
def list_dir(project_id: str, store: StoreDep, dir: str = "", at: At = "draft", cursor: Cursor = None,
             limit: Limit = None, principal: Principal = Allow(*ANY)) -> JSON:
    """A directory's entries by name, paged."""
    return JSON(_view(store, principal, project_id, at).page_dir(dir, cursor, limit))


@router.get("/find", response_model=PathPage, response_class=JSON)
def find_files(project_id: str, store: StoreDep, glob: str = "**",
               limit: Annotated[int, Query(ge=1, le=10_000)] = 1000, at: At = "draft", cursor: Cursor = None,
               principal: Principal = Allow(*ANY)) -> JSON:
    """Paths matching ``glob``, sorted, ``limit`` at a time: ``truncated`` when more match,
    and ``next_cursor`` to read them."""
    key = paging.decode("find", cursor, (str,))
    paths: PathList = _view(store, principal, project_id, at).find_files(glob, limit=limit,
                                                                        after=key[0] if key else None)
    return JSON({"paths": list(paths), "truncated": paths.truncated,
                 "next_cursor": paging.encode("find", [paths[-1]]) if paths.truncated and paths else None})


@router.get("/search", response_model=SearchPage, response_class=JSON)
def search_code(project_id: str, q: str, store: StoreDep, regex: bool = False, glob: str | None = None,
                context: Annotated[int, Query(ge=0, le=100)] = 0,
                max_results: Annotated[int, Query(ge=1, le=10_000)] = 100, ignore_case: bool = False,
                at: At = "draft", cursor: Cursor = None, principal: Principal = Allow(*ANY)) -> JSON:
    """Matching lines in file then line order, ``max_results`` at a time and at most
    ``search.PAGE_BYTES`` of JSON (lines clipped at ``search.PAGE_LINE_BYTES``:
    ``lines_clipped``): ``truncated`` when more match, and ``next_cursor`` to read them
    (the same ``q``, ``regex``, ``glob`` and ``ignore_case``; a state that changed
    meanwhile is searched as it is now)."""
    key = paging.decode("search", cursor, (str, int))
    if key is not None and key[1] < 1:
        raise E.InvalidInput("cursor is not one this list handed out", field="cursor")
    view = _view(store, principal, project_id, at)
    found = paged(view.search_code(q, regex=regex, glob=glob, context=context, max_results=max_results,
                                   ignore_case=ignore_case, after=(key[0], key[1]) if key else None,
                                   max_bytes=PAGE_BYTES))
    last = found.matches[-1] if found.truncated and found.matches else None
    return JSON(SearchPage.of(found, paging.encode("search", [last.path, last.line_number]) if last else None))
