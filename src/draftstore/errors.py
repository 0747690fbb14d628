"""The one exception family of draftstore.

Every error raised on purpose by draftstore is a ``DraftstoreError`` with a
stable, dotted ``code``. Callers (and the HTTP layer) branch on ``code``, never
on the message. Errors from SQLAlchemy, psycopg, obstore, botocore and redis-py are
mapped at the backend boundary and chained with ``from``.

Tree (code in brackets)::

    DraftstoreError
    ├── InvalidInput                     bad input; nothing was changed
    │   ├── PathDenied         [path.denied]
    │   ├── PayloadTooLarge    [payload.too_large]
    │   ├── HeadersTooLarge    [headers.too_large]
    │   ├── PatchInvalid       [patch.invalid]
    │   ├── PatternInvalid     [pattern.invalid]
    │   ├── LimitExceeded      [limit.exceeded]
    │   └── ConfigInvalid      [config.invalid]
    │       └── PooledMigration [config.pooled_migration]  a migration through a transaction-mode pooler
    ├── NotFound
    │   ├── ProjectNotFound    [project.not_found]
    │   ├── VersionNotFound    [version.not_found]
    │   ├── TurnNotFound       [turn.not_found]
    │   ├── ToolCallNotFound   [toolcall.not_found]
    │   ├── PathNotFound       [path.not_found]
    │   ├── DraftNone          [draft.none]
    │   ├── TokenNotFound      [token.not_found]
    │   ├── StateNotFound      [state.not_found]
    │   ├── SnapshotNotFound   [snapshot.not_found]
    │   ├── SandboxNotFound    [sandbox.not_found]
    │   └── BlobNotFound       [blob.not_found]
    ├── StateConflict                    the state moved; retry or decide
    │   ├── TurnNotRunning     [turn.not_running]
    │   ├── TurnAlreadyRunning [turn.already_running]
    │   ├── TurnConflict       [turn.conflict]   not a boundary of the current draft (revert, continue)
    │   ├── ToolCallNotStarted [toolcall.not_started]
    │   │   ├── ToolCallAlreadyFinished [toolcall.already_finished]
    │   │   └── ToolCallAwaitingApproval [toolcall.awaiting_approval]
    │   ├── ToolCallNotAwaitingApproval [toolcall.not_awaiting_approval]
    │   ├── IdempotencyConflict [idempotency.conflict] a key reused for another request
    │   ├── DraftConflict      [draft.conflict]
    │   ├── DraftBusy          [draft.busy]
    │   ├── PathConflict       [path.conflict]
    │   ├── VersionProtected   [version.protected]
    │   ├── SandboxConflict    [sandbox.conflict]
    │   └── LockTimeout        [lock.timeout]
    ├── AuthError                        who is asking may not
    │   ├── AuthRequired       [auth.required]   no token given
    │   ├── AuthInvalid        [auth.invalid]    unknown or revoked token
    │   └── Forbidden          [auth.forbidden]  the token's role may not do this
    ├── IntegrityError
    │   └── ChecksumMismatch   [blob.checksum_mismatch]
    └── BackendError                     a store could not be reached or used
        ├── BackendUnavailable [backend.unavailable]
        ├── PoolerUndeclared   [backend.pooler]   a transaction-mode pooler the database URL does not declare
        └── SchemaOutdated     [schema.outdated]
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DraftstoreError",
    "InvalidInput",
    "PathDenied",
    "PayloadTooLarge",
    "HeadersTooLarge",
    "PatchInvalid",
    "PatternInvalid",
    "LimitExceeded",
    "ConfigInvalid",
    "PooledMigration",
    "NotFound",
    "ProjectNotFound",
    "VersionNotFound",
    "TurnNotFound",
    "ToolCallNotFound",
    "PathNotFound",
    "DraftNone",
    "StateNotFound",
    "SnapshotNotFound",
    "SandboxNotFound",
    "BlobNotFound",
    "StateConflict",
    "TurnNotRunning",
    "TurnAlreadyRunning",
    "TurnConflict",
    "ToolCallNotStarted",
    "ToolCallAlreadyFinished",
    "ToolCallAwaitingApproval",
    "ToolCallNotAwaitingApproval",
    "IdempotencyConflict",
    "TokenNotFound",
    "AuthError",
    "AuthRequired",
    "AuthInvalid",
    "Forbidden",
    "DraftConflict",
    "DraftBusy",
    "PathConflict",
    "VersionProtected",
    "SandboxConflict",
    "LockTimeout",
    "IntegrityError",
    "ChecksumMismatch",
    "BackendError",
    "BackendUnavailable",
    "PoolerUndeclared",
    "SchemaOutdated",
    "turn_not_found",
    "turn_refused",
]


class DraftstoreError(Exception):
    """Base of every draftstore error; ``code`` is stable across releases."""

    code: str = "draftstore.error"
    #: the same call may succeed later unchanged (a backend came back, a lock was freed)
    retryable: bool = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "retryable": self.retryable, **self.details}


class InvalidInput(DraftstoreError):
    code = "input.invalid"


class PathDenied(InvalidInput):
    code = "path.denied"


class PayloadTooLarge(InvalidInput):
    code = "payload.too_large"


class HeadersTooLarge(InvalidInput):
    code = "headers.too_large"


class PatchInvalid(InvalidInput):
    code = "patch.invalid"


class PatternInvalid(InvalidInput):
    code = "pattern.invalid"


class LimitExceeded(InvalidInput):
    code = "limit.exceeded"


class ConfigInvalid(InvalidInput):
    code = "config.invalid"


class PooledMigration(ConfigInvalid):
    """A migration asked of a database URL that declares a transaction-mode pooler:
    migrations go to PostgreSQL directly. Nothing was changed."""

    code = "config.pooled_migration"


class NotFound(DraftstoreError):
    code = "not_found"


class ProjectNotFound(NotFound):
    code = "project.not_found"


class VersionNotFound(NotFound):
    code = "version.not_found"


class TurnNotFound(NotFound):
    code = "turn.not_found"


class ToolCallNotFound(NotFound):
    code = "toolcall.not_found"


class PathNotFound(NotFound):
    code = "path.not_found"


class DraftNone(NotFound):
    code = "draft.none"


class StateNotFound(NotFound):
    """A state reference that names nothing recorded (e.g. the end of a turn
    that an older release rolled back without recording it)."""

    code = "state.not_found"


class TokenNotFound(NotFound):
    code = "token.not_found"


class SnapshotNotFound(NotFound):
    code = "snapshot.not_found"


class SandboxNotFound(NotFound):
    """A sandbox session id that names no session (of that project)."""

    code = "sandbox.not_found"


class BlobNotFound(NotFound):
    code = "blob.not_found"


class StateConflict(DraftstoreError):
    code = "state.conflict"


class TurnNotRunning(StateConflict):
    code = "turn.not_running"


class TurnAlreadyRunning(StateConflict):
    code = "turn.already_running"


class TurnConflict(StateConflict):
    """The turn is not a boundary of the project's current draft: it ran on an earlier
    draft (published or discarded), or it was reverted already; or it is the turn a
    continue names (``from_turn_id``) and is not an ended turn of the current draft."""

    code = "turn.conflict"


class ToolCallNotStarted(StateConflict):
    code = "toolcall.not_started"


class IdempotencyConflict(StateConflict):
    """An ``Idempotency-Key`` already recorded a request that differs from this one
    (another tool, other args): a retry repeats its request exactly. Nothing was recorded."""

    code = "idempotency.conflict"


class ToolCallAlreadyFinished(ToolCallNotStarted):
    """Completing or failing a call that already completed or failed."""

    code = "toolcall.already_finished"


class ToolCallAwaitingApproval(ToolCallNotStarted):
    """Completing or failing a call that still waits for its approval decision."""

    code = "toolcall.awaiting_approval"


class ToolCallNotAwaitingApproval(StateConflict):
    """Deciding on a call that does not wait for approval (never needed it, or decided)."""

    code = "toolcall.not_awaiting_approval"


class DraftConflict(StateConflict):
    code = "draft.conflict"


class DraftBusy(StateConflict):
    code = "draft.busy"
    retryable = True


class PathConflict(StateConflict):
    code = "path.conflict"


class VersionProtected(StateConflict):
    """Pruning a version a head move names, without force."""

    code = "version.protected"


class SandboxConflict(StateConflict):
    """A sandbox session status change its status does not allow (``closed`` and
    ``lost`` are final)."""

    code = "sandbox.conflict"


class LockTimeout(StateConflict):
    code = "lock.timeout"
    retryable = True


class AuthError(DraftstoreError):
    code = "auth.error"


class AuthRequired(AuthError):
    code = "auth.required"


class AuthInvalid(AuthError):
    code = "auth.invalid"


class Forbidden(AuthError):
    code = "auth.forbidden"


class IntegrityError(DraftstoreError):
    code = "integrity.error"


class ChecksumMismatch(IntegrityError):
    code = "blob.checksum_mismatch"


class BackendError(DraftstoreError):
    code = "backend.error"


class BackendUnavailable(BackendError):
    code = "backend.unavailable"
    retryable = True


class PoolerUndeclared(BackendError):
    """The database answered as only a transaction-mode pooler in between explains
    (the driver's prepared statements lost or duplicated): add ``?pooler=transaction``."""

    code = "backend.pooler"


class SchemaOutdated(BackendError):
    code = "schema.outdated"


def turn_not_found(turn_id: str, project_id: str | None = None) -> TurnNotFound:
    """The one way a ``turn.not_found`` reads: no turn ``turn_id`` (in ``project_id``,
    when the caller looked only there)."""
    where = "" if project_id is None else f" in project {project_id}"
    return TurnNotFound(f"no turn {turn_id!r}{where}", turn_id=turn_id)


def turn_refused(turn_id: str, status: str | None,
                 why: str = "only a running turn may change its draft") -> TurnNotFound | TurnNotRunning:
    """Why a turn refused a call only a running turn takes: ``turn.not_found``
    (``status`` None: there is no such turn) or ``turn.not_running`` (it is
    ``status``, named in the details); ``why`` ends the message."""
    if status is None:
        return turn_not_found(turn_id)
    return TurnNotRunning(f"turn {turn_id} is {status}; {why}", turn_id=turn_id, status=status)
