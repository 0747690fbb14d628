"""API tokens (admin tokens of no project scope only), and who the caller is (any role)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import APIRouter, Query
from starlette.responses import Response

from ... import errors as E
from ...records import Page, Token
from ..auth import ADMIN, ANY, Allow, Principal, StoreDep
from ..responses import JSON
from ..schemas import CreateToken, NewToken, Whoami

router = APIRouter(prefix="/v1", tags=["tokens"])


@router.get("/whoami", response_model=Whoami, response_class=JSON)
async def whoami(principal: Principal = Allow(*ANY)) -> JSON:
    """The caller's role and project scope, so a client can offer only what the role may do."""
    return JSON({"role": principal.role, "project_id": principal.project_id, "token_id": principal.token_id,
                 "open_mode": principal.token_id is None})


def _global_admin(principal: Principal) -> None:
    if principal.project_id is not None:
        raise E.Forbidden("only an admin token of every project manages tokens")


@router.post("/tokens", status_code=201, response_model=NewToken, response_class=JSON)
def create_token(body: CreateToken, store: StoreDep, principal: Principal = Allow(*ADMIN)) -> JSON:
    """A new token; ``token`` is its secret, shown only in this answer."""
    _global_admin(principal)
    token, secret = store.tokens.create(body.role, project_id=body.project_id, name=body.name,
                                        actor=principal.token_id)
    # no-store: the one answer that carries a secret must not stay in any cache (RFC 9111 5.2.2.5)
    return JSON({**dataclasses.asdict(token), "token": secret}, status_code=201, headers={"Cache-Control": "no-store"})


@router.get("/tokens", response_model=Page[Token], response_class=JSON)
def list_tokens(store: StoreDep, cursor: str | None = None, limit: Annotated[int | None, Query(ge=1, le=200)] = None,
                principal: Principal = Allow(*ADMIN)) -> JSON:
    _global_admin(principal)
    return JSON(store.tokens.page(cursor, limit))


@router.delete("/tokens/{token_id}", status_code=204)
def revoke_token(token_id: str, store: StoreDep, principal: Principal = Allow(*ADMIN)) -> Response:
    _global_admin(principal)
    store.tokens.revoke(token_id)
    return Response(status_code=204)
