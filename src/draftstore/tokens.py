"""API tokens: bearer secrets with a role and an optional project scope.

A token is ``dst_<id>_<secret>``. Only the SHA-256 of the whole token is
stored, so a token can never be read back: it is shown once, when created.
Authentication looks the row up by the id part and compares digests in
constant time. Revoking is immediate in the database (the service caches an
authenticated token for a few seconds at most).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Any

import sqlalchemy as sa

from . import errors as E
from . import paging
from . import validation as check
from .database import Database
from .db.tables import PROJECTS, TOKENS, utcnow
from .ids import new_id
from .records import Page, Role, Token, aware

__all__ = ["Tokens", "token_record"]

_TOKEN = re.compile(r"dst_([0-9a-f]{32})_[A-Za-z0-9_-]{43}")


def token_record(r: Any) -> Token:
    return Token(r.id, Role(r.role), r.project_id, r.name, aware(r.created_at), r.created_by,  # type: ignore[arg-type]
                 aware(r.revoked_at))


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class Tokens:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, role: Any, *, project_id: str | None = None, name: str = "",
               actor: str | None = None) -> tuple[Token, str]:
        """A new token; returns its record and the secret (shown this once).
        Raises ``input.invalid`` (unknown role), ``project.not_found``."""
        try:
            role = Role(role)
        except ValueError:
            raise E.InvalidInput(f"role is one of {', '.join(r.value for r in Role)}", field="role") from None
        if project_id is not None:
            check.project_id(project_id)
        name = check.text("name", name, max_chars=check.MAX_NAME_CHARS)
        actor = check.actor(actor)
        tid = new_id()
        secret = f"dst_{tid}_{secrets.token_urlsafe(32)}"
        with self.db.tx() as conn:
            if project_id is not None and conn.execute(sa.select(PROJECTS.c.id)
                                                       .where(PROJECTS.c.id == project_id)).first() is None:
                raise E.ProjectNotFound(f"no project {project_id!r}", project_id=project_id)
            conn.execute(TOKENS.insert().values(id=tid, secret_hash=_digest(secret), role=role, project_id=project_id,
                                                name=name, created_at=utcnow(), created_by=actor))
            row = conn.execute(sa.select(TOKENS).where(TOKENS.c.id == tid)).one()
        return token_record(row), secret

    def page(self, cursor: str | None = None, limit: int | None = None) -> Page[Token]:
        """Tokens, oldest first (revoked ones included, marked)."""
        n = paging.limit(limit)
        with self.db.tx(read_only=True) as conn:
            rows = conn.execute(paging.by_creation(TOKENS, "tokens", cursor, n)).all()
        return paging.page("tokens", rows, n, lambda r: (aware(r.created_at), r.id), token_record)

    def revoke(self, token_id: str) -> Token:
        """Revoke a token (idempotent). Raises ``token.not_found``."""
        if not isinstance(token_id, str) or not re.fullmatch(r"[0-9a-f]{32}", token_id):
            raise E.TokenNotFound(f"no token {str(token_id)[:80]!r}", token_id=str(token_id)[:80])
        with self.db.tx() as conn:
            conn.execute(TOKENS.update().where(TOKENS.c.id == token_id, TOKENS.c.revoked_at.is_(None))
                         .values(revoked_at=utcnow()))
            row = conn.execute(sa.select(TOKENS).where(TOKENS.c.id == token_id)).first()
        if row is None:
            raise E.TokenNotFound(f"no token {token_id!r}", token_id=token_id)
        return token_record(row)

    def authenticate(self, secret: Any) -> Token:
        """The token ``secret`` names. Raises ``auth.invalid`` (malformed, unknown or revoked)."""
        match = _TOKEN.fullmatch(secret) if isinstance(secret, str) else None
        if match is None:
            raise E.AuthInvalid("not a draftstore token")
        with self.db.statement(read_only=True) as conn:
            row = conn.execute(sa.select(TOKENS).where(TOKENS.c.id == match.group(1))).first()
        if row is None or not hmac.compare_digest(row.secret_hash, _digest(secret)):
            raise E.AuthInvalid("unknown token")
        if row.revoked_at is not None:
            raise E.AuthInvalid("this token was revoked")
        return token_record(row)

    def any_active(self) -> bool:
        """True once any token was ever created, revoked or not: from then on the
        service requires tokens (revoking every token never reopens it)."""
        with self.db.statement(read_only=True) as conn:
            return conn.execute(sa.select(sa.exists().select_from(TOKENS))).scalar() is True
