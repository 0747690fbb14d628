"""the design's names: columns and tool-call entries as the design spells them

SQL written against the design reads the tables as they are:
- project_version, project_draft: characters_json -> characters_state_json,
  world_settings_json -> worldsettings_state_json (renamed; values kept);
- project_draft.updated_at: when the row last changed (existing drafts: when
  they closed, else their last status change);
- sandbox_snapshot: external_ref -> e2b_snapshot_ref;
- project_turn.tool_calls_json entries: ``ended_at`` becomes ``finished_at``, a
  call's error moves to ``result.error``, and ``args``/``result`` are always
  present (null when offloaded, or, for ``result``, not finished). Other keys
  (digests, previews, approval) are kept as they are.

Reversible: the downgrade renames back and rewrites the entries to the 0007 keys.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_RENAMES = {
    "project_version": [("characters_json", "characters_state_json"),
                        ("world_settings_json", "worldsettings_state_json")],
    "project_draft": [("characters_json", "characters_state_json"),
                      ("world_settings_json", "worldsettings_state_json")],
    "sandbox_snapshot": [("external_ref", "e2b_snapshot_ref")],
}
_BATCH = 500  # turns rewritten per statement round: bounded memory whatever the history's size


def _json() -> Any:
    return sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


def _rename(pairs_of: dict[str, list[tuple[str, str]]]) -> None:
    for table, pairs in pairs_of.items():
        with op.batch_alter_table(table) as b:
            for old, new in pairs:
                b.alter_column(old, new_column_name=new)


def upgrade() -> None:
    _rename(_RENAMES)
    with op.batch_alter_table("project_draft") as b:
        b.add_column(sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE project_draft SET updated_at = COALESCE(closed_at, status_changed_at)")
    with op.batch_alter_table("project_draft") as b:
        b.alter_column("updated_at", existing_type=sa.DateTime(timezone=True), nullable=False)
    _ensure_open_draft_index()
    _rewrite_entries(_to_design)


def downgrade() -> None:
    _rewrite_entries(_to_0007)
    with op.batch_alter_table("project_draft") as b:
        b.drop_column("updated_at")
    _rename({table: [(new, old) for old, new in pairs] for table, pairs in _RENAMES.items()})
    _ensure_open_draft_index()


def _ensure_open_draft_index() -> None:
    """SQLite rebuilds a table in batch mode: make sure the invariant's partial
    unique index (one open draft per project) is still there."""
    if any(ix["name"] == "uq_draft_open" for ix in sa.inspect(op.get_bind()).get_indexes("project_draft")):
        return
    op.create_index("uq_draft_open", "project_draft", ["project_id"], unique=True,
                    sqlite_where=sa.text("closed_at IS NULL"), postgresql_where=sa.text("closed_at IS NULL"))


# -- tool-call entries (the format of ``draftstore.toolcalls`` at each revision, frozen here) --------
def _to_design(c: dict[str, Any]) -> dict[str, Any]:
    """A 0007 entry with the design's keys (an entry already converted is returned as it is)."""
    if "finished_at" in c and "ended_at" not in c:
        return c
    out = {k: v for k, v in c.items() if k not in ("error", "ended_at")}
    out.setdefault("args", None)
    error = c.get("error")
    if "result" not in c:
        out["result"] = None if error is None else {"error": error}
    out["finished_at"] = c.get("ended_at")
    return out


def _to_0007(c: dict[str, Any]) -> dict[str, Any]:
    """An entry with the design's keys as 0007 wrote it."""
    if "ended_at" in c and "finished_at" not in c:
        return c
    out = {k: v for k, v in c.items() if k not in ("result", "finished_at")}
    result: Any = c.get("result")
    error: Any = None
    if c.get("status") != "completed" and isinstance(result, dict) and "error" in result:
        result, error = None, result["error"]
    if out.get("args") is None and out.get("args_digest") is not None:
        del out["args"]  # offloaded: 0007 left the key out
    if result is not None or (c.get("status") == "completed" and c.get("result_digest") is None):
        out["result"] = result
    out["error"], out["ended_at"] = error, c.get("finished_at")
    return out


def _rewrite_entries(convert: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Every ended turn's compacted history, entry by entry, in batches of turns."""
    bind = op.get_bind()
    turn = sa.table("project_turn", sa.column("id", sa.String), sa.column("tool_calls_json", _json()))
    update = turn.update().where(turn.c.id == sa.bindparam("p_id")).values(
        tool_calls_json=sa.bindparam("p_calls", type_=_json()))
    after = ""
    while True:
        rows = bind.execute(sa.select(turn.c.id, turn.c.tool_calls_json).where(
            turn.c.tool_calls_json.is_not(None), turn.c.id > after).order_by(turn.c.id).limit(_BATCH)).all()
        if not rows:
            return
        changed = []
        for turn_id, calls in rows:
            new = [convert(c) for c in calls]
            if new != calls:
                changed.append({"p_id": turn_id, "p_calls": new})
        if changed:
            bind.execute(update, changed)
        after = rows[-1][0]
