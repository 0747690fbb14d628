"""The statements on the hot paths, built once per dialect (no I/O here).

Building a SQLAlchemy statement costs more than executing a cached one, and
the hot paths (a write, a tool call, opening a view) run thousands of times
per turn; so they are built here once, with bind parameters, and reused.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from .tables import DraftChangeRow, DraftRow, ProjectRow, ToolCallRow, TurnRow, VersionRow

__all__ = ["Queries"]

P = ProjectRow.__table__
V = VersionRow.__table__
D = DraftRow.__table__
C = DraftChangeRow.__table__
T = TurnRow.__table__
TC = ToolCallRow.__table__

RUNNING = "running"


def overlay_condition(n_paths: int) -> Any:
    """Overlay rows deciding the merged state of n paths: the paths and their
    parents (bind ``names``, expanding) and everything below each path
    (binds ``lo0``/``hi0``, ...: '/' is 0x2F and '0' 0x30, so the range
    [p + '/', p + '0') is exactly the paths below p)."""
    conds = [C.c.path.in_(sa.bindparam("names", expanding=True))]
    conds += [sa.and_(C.c.path > sa.bindparam(f"lo{i}"), C.c.path < sa.bindparam(f"hi{i}")) for i in range(n_paths)]
    return sa.or_(*conds)


class Queries:
    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        sqlite = dialect == "sqlite"

        # a write's first statement: lock the draft of the turn, bump its revision
        self.lock_draft = (
            D.update()
            .where(D.c.id == sa.select(T.c.draft_id).where(T.c.id == sa.bindparam("turn_id")).scalar_subquery())
            .values(revision=D.c.revision + 1)
            .returning(D.c.id, D.c.revision, D.c.code_manifest_key, D.c.file_count, D.c.project_id,
                       D.c.characters_json, D.c.world_settings_json)
        )
        self.turn_status = sa.select(T.c.status).where(T.c.id == sa.bindparam("turn_id"))
        self._status_and_overlay: dict[int | None, Any] = {}

        if sqlite:
            from sqlalchemy.dialects.sqlite import insert
        else:
            from sqlalchemy.dialects.postgresql import insert
        ins = insert(C)
        self.upsert_overlay = ins.on_conflict_do_update(
            index_elements=[C.c.draft_id, C.c.path],
            set_={"digest": ins.excluded.digest, "size": ins.excluded.size, "revision": ins.excluded.revision},
        )
        self.add_file_count = (
            D.update().where(D.c.id == sa.bindparam("draft_id")).values(file_count=D.c.file_count + sa.bindparam("delta"))
        )

        # tool calls: one statement each, O(1) in the length of the history
        # (binds are prefixed p_: SQLAlchemy reserves column names in INSERT/UPDATE)
        next_seq = (
            sa.select(sa.func.coalesce(sa.func.max(TC.c.seq), 0) + 1)
            .where(TC.c.turn_id == sa.bindparam("p_turn_id"))
            .scalar_subquery()
        )
        source = sa.select(
            T.c.id,
            next_seq,
            sa.bindparam("p_tool_name", type_=sa.String),
            sa.literal("started"),
            sa.bindparam("p_args_json", type_=sa.Text),
            sa.bindparam("p_args_digest", type_=sa.String),
            sa.bindparam("p_args_preview", type_=sa.Text),
            sa.bindparam("p_now", type_=sa.DateTime(timezone=True)),
        ).where(T.c.id == sa.bindparam("p_turn_id"), T.c.status == RUNNING)
        if not sqlite:
            # wait for, then re-check, a concurrent status change of the turn
            source = source.with_for_update(read=True, of=T)
        self.tool_started = (
            TC.insert()
            .from_select(
                ["turn_id", "seq", "tool_name", "status", "args_json", "args_digest", "args_preview", "started_at"],
                source,
            )
            .returning(TC.c.seq)
        )
        running = sa.exists().where(T.c.id == sa.bindparam("p_turn_id"), T.c.status == RUNNING)
        finish = TC.update().where(
            TC.c.turn_id == sa.bindparam("p_turn_id"), TC.c.seq == sa.bindparam("p_seq"), TC.c.status == "started", running
        )
        self.tool_completed = finish.values(
            status="completed", ended_at=sa.bindparam("p_now"), result_json=sa.bindparam("p_result_json"),
            result_digest=sa.bindparam("p_result_digest"), result_preview=sa.bindparam("p_result_preview"),
        )
        self.tool_failed = finish.values(status="failed", ended_at=sa.bindparam("p_now"), error=sa.bindparam("p_error"))

        # a view: project, its draft (or head) and the draft's overlay in ONE
        # statement, so the sealed root and the overlay come from one snapshot
        null_s, null_i = sa.cast(sa.null(), sa.String), sa.cast(sa.null(), sa.Integer)
        head = sa.select(
            sa.literal(0).label("part"),
            P.c.active_draft_id.label("draft_id"),
            P.c.current_version_id.label("version_id"),
            D.c.code_manifest_key.label("d_root"),
            D.c.characters_json.label("d_chars"),
            D.c.world_settings_json.label("d_world"),
            D.c.base_version_id.label("d_base"),
            D.c.revision.label("d_rev"),
            V.c.code_manifest_key.label("v_root"),
            V.c.characters_json.label("v_chars"),
            V.c.world_settings_json.label("v_world"),
            null_s.label("path"),
            null_s.label("digest"),
            null_i.label("size"),
        ).select_from(
            P.outerjoin(D, D.c.id == P.c.active_draft_id).outerjoin(
                V, sa.and_(V.c.id == P.c.current_version_id, P.c.active_draft_id.is_(None))
            )
        ).where(P.c.id == sa.bindparam("project_id"))
        rows = sa.select(
            sa.literal(1), null_s, null_s, null_s, sa.cast(sa.null(), sa.Text), sa.cast(sa.null(), sa.Text), null_s,
            null_i, null_s, sa.cast(sa.null(), sa.Text), sa.cast(sa.null(), sa.Text), C.c.path, C.c.digest, C.c.size,
        ).select_from(P.join(C, C.c.draft_id == P.c.active_draft_id)).where(P.c.id == sa.bindparam("project_id"))
        self.view = sa.union_all(head, rows)

    def status_and_overlay(self, n_paths: int | None) -> Any:
        """The turn's status (re-read after the draft lock) with the overlay rows
        that matter for ``n_paths`` paths (None: the whole overlay), in one statement."""
        stmt = self._status_and_overlay.get(n_paths)
        if stmt is None:
            on = C.c.draft_id == sa.bindparam("draft_id")
            if n_paths is not None:
                on = sa.and_(on, overlay_condition(n_paths))
            stmt = (
                sa.select(T.c.status, C.c.path, C.c.digest, C.c.size)
                .select_from(T.outerjoin(C, on))
                .where(T.c.id == sa.bindparam("turn_id"))
            )
            self._status_and_overlay[n_paths] = stmt
        return stmt


class OneShot:
    """One statement, atomic on its own, run in autocommit.

    On PostgreSQL it is compiled once and executed on the pooled DBAPI
    connection directly: on the tool-call path SQLAlchemy's execution layer
    cost as much as the statement itself (measured: 1.75x two raw INSERTs
    through it, 1.34x without). Driver errors are re-raised as SQLAlchemy's
    (``IntegrityError``, ``OperationalError``, ...), so callers map one family.
    Elsewhere (SQLite) it is an ordinary SQLAlchemy execution.
    """

    def __init__(self, stmt: Any, engine: sa.Engine) -> None:
        self.stmt = stmt
        self.engine = engine
        self.raw = engine.dialect.name == "postgresql"
        if self.raw:
            compiled = stmt.compile(dialect=engine.dialect)
            self.sql = compiled.string
            # literals baked into the statement ('started', 0, 1, ...) are bind values too
            self.fixed = {name: bp.value for bp, name in compiled.bind_names.items() if bp.value is not None}

    def run(self, params: dict[str, Any]) -> tuple[Any | None, int]:
        """Execute; returns (first row or None, rowcount)."""
        if not self.raw:
            with self.engine.begin() as conn:
                res = conn.execute(self.stmt, params)
                row = res.first() if res.returns_rows else None
                return row, res.rowcount
        import psycopg

        conn = self.engine.raw_connection()
        try:
            with conn.cursor() as cur:
                cur.execute(self.sql, {**self.fixed, **params})
                row = cur.fetchone() if cur.description else None
                return row, cur.rowcount
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError):
                conn.invalidate()  # a broken connection must not go back to the pool
            wrapper: type[sa.exc.DBAPIError] = sa.exc.DBAPIError
            for base, mapped in ((psycopg.IntegrityError, sa.exc.IntegrityError),
                                 (psycopg.OperationalError, sa.exc.OperationalError),
                                 (psycopg.InterfaceError, sa.exc.InterfaceError)):
                if isinstance(exc, base):
                    wrapper = mapped
                    break
            raise wrapper(self.sql, params, exc) from exc
        finally:
            conn.close()
