"""record shapes: JSON messages, JSONB documents, compacted tool history, actors

- project_turn: user_message / assistant_message / error (text) become
  user_message_json / assistant_message_json / error_json (JSON values; an old
  text becomes a JSON string); new base_version_id (from its draft), actor,
  tool_calls_json (the history of ended turns, compacted from tool_call rows,
  which are then deleted).
- tool_call: error (text) becomes error_json (serialised JSON).
- project_draft: closed_by.
- characters, world settings and partial responses become JSONB on PostgreSQL
  (JSON on SQLite, where the stored text is unchanged).

Existing data is kept: every row reads back through the API as before, with
its messages as JSON strings. One exception, on PostgreSQL only: JSONB cannot
hold a NUL character, so one inside a JSON string (which 0001 accepted)
becomes U+FFFD.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
import sqlmodel
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _json() -> Any:
    return sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


# JSONB cannot hold a NUL character, which 0001 stored as the JSON escape \u0000
# in text: it becomes U+FFFD (an escaped backslash before "u0000" is no NUL)
_NUL_FREE = r"regexp_replace({0}, '(?<!\\)((?:\\\\)*)\\u0000', '\1\\ufffd', 'g')::jsonb"


def _without_nul(value: Any) -> Any:
    """The same value with every NUL character in its strings replaced by U+FFFD."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_without_nul(k): _without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_nul(v) for v in value]
    return value


_DOCUMENTS = {
    "project_version": [("characters_json", False), ("world_settings_json", False)],
    "project_draft": [("characters_json", False), ("world_settings_json", False), ("partial_response_json", True)],
    "project_turn": [("partial_response_json", True)],
}


def upgrade() -> None:
    bind = op.get_bind()
    pg = bind.dialect.name == "postgresql"

    with op.batch_alter_table("project_turn") as b:
        b.add_column(sa.Column("base_version_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True))
        b.add_column(sa.Column("actor", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True))
        b.add_column(sa.Column("user_message_json", _json(), nullable=True))
        b.add_column(sa.Column("assistant_message_json", _json(), nullable=True))
        b.add_column(sa.Column("error_json", _json(), nullable=True))
        b.add_column(sa.Column("tool_calls_json", _json(), nullable=True))
    with op.batch_alter_table("tool_call") as b:
        b.add_column(sa.Column("error_json", sa.Text(), nullable=True))
    with op.batch_alter_table("project_draft") as b:
        b.add_column(sa.Column("closed_by", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True))

    # texts become JSON strings (NULL stays NULL)
    quote = "to_jsonb({})" if pg else "CASE WHEN {0} IS NULL THEN NULL ELSE json_quote({0}) END"
    op.execute(
        "UPDATE project_turn SET "
        f"user_message_json = {quote.format('user_message')}, "
        f"assistant_message_json = {quote.format('assistant_message')}, "
        f"error_json = {quote.format('error')}, "
        "base_version_id = (SELECT project_draft.base_version_id FROM project_draft "
        "WHERE project_draft.id = project_turn.draft_id)"
    )
    op.execute(f"UPDATE tool_call SET error_json = {(quote + '::text') if pg else quote}".format("error"))

    _compact_ended_turns(bind, _without_nul if pg else (lambda value: value))

    with op.batch_alter_table("project_turn") as b:
        b.alter_column("user_message_json", existing_type=_json(), nullable=False)
        b.drop_column("user_message")
        b.drop_column("assistant_message")
        b.drop_column("error")
    with op.batch_alter_table("tool_call") as b:
        b.drop_column("error")

    for table, columns in _DOCUMENTS.items():
        with op.batch_alter_table(table) as b:
            for column, nullable in columns:
                b.alter_column(column, existing_type=sa.Text(), type_=_json(), existing_nullable=nullable,
                               postgresql_using=_NUL_FREE.format(column))
    _ensure_partial_indexes(bind)


def _ensure_partial_indexes(bind: Any) -> None:
    """SQLite rebuilds a table in batch mode; make sure the invariants' partial
    unique indexes are still there (created again if the rebuild lost them)."""
    names = {
        "project_draft": ("uq_draft_open", "closed_at IS NULL"),
        "project_turn": ("uq_turn_running", "status = 'running'"),
    }
    inspector = sa.inspect(bind)
    for table, (index, where) in names.items():
        if any(ix["name"] == index for ix in inspector.get_indexes(table)):
            continue
        op.create_index(index, table, ["project_id"], unique=True,
                        sqlite_where=sa.text(where), postgresql_where=sa.text(where))


def _iso(ts: Any) -> str | None:
    if ts is None:
        return None
    if isinstance(ts, str):  # SQLite without type information
        ts = datetime.fromisoformat(ts)
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=timezone.utc)
    return ts.isoformat()


def _compact_ended_turns(bind: Any, clean: Any) -> None:
    """The tool history of every ended turn moves onto its row (the format of
    ``draftstore.toolcalls`` at this revision); its tool_call rows go."""
    turns = bind.execute(sa.text("SELECT id FROM project_turn WHERE status <> 'running'")).scalars().all()
    update = sa.text("UPDATE project_turn SET tool_calls_json = :calls WHERE id = :id").bindparams(
        sa.bindparam("calls", type_=_json()))
    for turn_id in turns:
        rows = bind.execute(sa.text(
            "SELECT seq, tool_name, status, args_json, args_digest, args_preview, result_json, result_digest, "
            "result_preview, error_json, started_at, ended_at FROM tool_call WHERE turn_id = :t ORDER BY seq"
        ), {"t": turn_id}).all()
        calls = []
        for r in rows:
            call: dict[str, Any] = {"seq": r.seq, "tool_name": r.tool_name, "status": r.status}
            if r.args_json is not None:
                call["args"] = clean(json.loads(r.args_json))
            call.update(args_digest=r.args_digest, args_preview=r.args_preview)
            if r.result_json is not None:
                call["result"] = clean(json.loads(r.result_json))
            call.update(result_digest=r.result_digest, result_preview=r.result_preview,
                        error=None if r.error_json is None else clean(json.loads(r.error_json)),
                        started_at=_iso(r.started_at), ended_at=_iso(r.ended_at))
            calls.append(call)
        bind.execute(update, {"calls": calls, "id": turn_id})
        bind.execute(sa.text("DELETE FROM tool_call WHERE turn_id = :t"), {"t": turn_id})


def downgrade() -> None:
    raise NotImplementedError("0002 is not reversible: messages became JSON values")
