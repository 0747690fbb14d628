"""The ``Store``: every domain operation over the three backends.

Correctness comes from the relational database alone: each operation is one
transaction (or a short, restartable sequence of them) guarded by row locks
and compare-and-swap on rows; the blob store only ever receives immutable,
content-addressed objects *before* the transaction that refers to them; the
coordinator carries events and heartbeats and may be flushed at any time.

Lock order, the same in every operation, so transactions never deadlock:
project row -> draft row -> turn row(s) -> overlay / tool-call rows.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import jsonpatch
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from . import errors as E
from .blobs import BlobStore, ObjectCache, open_blob_store
from .coord import Coordinator, open_coordinator
from .db.engine import create_db_engine, is_sqlite
from .db.migrate import check_schema, upgrade
from .db.queries import C, D, P, T, TC, V, OneShot, Queries
from .db.tables import HeadMoveRow, utcnow
from .digest import EMPTY_TREE, Digest, digest_of
from .events import EventPublisher
from .paths import normalize_path, parent_dirs
from .records import (
    Draft,
    DraftStatus,
    HeadMove,
    Project,
    ToolCall,
    Turn,
    TurnStatus,
    Version,
    aware,
    loads,
)
from .settings import Limits, Settings
from .trees import FileChange, TreeReader
from .view import OverlayEntry, View, merged_file, merged_is_dir, overlay_entry

__all__ = ["Store"]

log = logging.getLogger("draftstore")

H = HeadMoveRow.__table__

# above this many paths, a batch reads the whole overlay instead of targeted rows
_TARGETED_OVERLAY_MAX = 16


def _new_id() -> str:
    return uuid.uuid4().hex


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise E.InvalidInput(f"value is not JSON-serialisable: {exc}") from exc


def _check_text(name: str, value: Any, max_bytes: int) -> str:
    if not isinstance(value, str):
        raise E.InvalidInput(f"{name} must be a string", field=name)
    if len(value.encode("utf-8", "surrogatepass")) > max_bytes:
        raise E.PayloadTooLarge(f"{name} is larger than {max_bytes} bytes", field=name, limit=max_bytes)
    return value


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON Merge Patch."""
    if not isinstance(patch, dict):
        return copy_json(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def copy_json(value: Any) -> Any:
    return json.loads(json.dumps(value))


class Store:
    """One facade over the relational DB, the blob store and the coordinator.

    Thread-safe: share one ``Store`` across threads. Several processes (or
    service replicas) may open stores on the same backends at once.
    """

    def __init__(
        self,
        engine: Engine,
        blobs: BlobStore,
        coord: Coordinator,
        settings: Settings | None = None,
        cache: ObjectCache | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.limits: Limits = self.settings.limits
        self.engine = engine
        self.blobs = blobs
        self.coord = coord
        self.cache = cache if cache is not None else getattr(blobs, "cache", ObjectCache(self.settings.cache_bytes))
        self.trees = TreeReader(blobs, self.cache)
        self._sqlite = is_sqlite(engine)
        self.q = Queries(engine.dialect.name)
        # single-statement operations run on a pool of autocommit connections: one
        # round trip each, no BEGIN/COMMIT, no per-checkout isolation switching
        self._autocommit = engine if self._sqlite else create_db_engine(
            engine.url.render_as_string(hide_password=False), isolation_level="AUTOCOMMIT",
            pool_reset_on_return=None)
        self._events = EventPublisher(coord)
        # uploads that overlap a transaction (which commits only once they are done)
        self._uploads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="draftstore-upload")
        self._tool_started = OneShot(self.q.tool_started, self._autocommit)
        self._tool_completed = OneShot(self.q.tool_completed, self._autocommit)
        self._tool_failed = OneShot(self.q.tool_failed, self._autocommit)

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(
        cls,
        database_url: str | None = None,
        blob_url: str | None = None,
        coord_url: str | None = None,
        *,
        settings: Settings | None = None,
        migrate: bool | None = None,
    ) -> "Store":
        """Open a store on the given URLs (unset ones fall back to ``settings``/embedded).

        On SQLite the schema is migrated on open (zero set-up). Elsewhere the
        schema must already be current (``draftstore db upgrade``), else
        ``schema.outdated`` is raised; ``migrate=True`` forces an upgrade.
        """
        s = settings or Settings()
        updates = {
            k: v
            for k, v in (("database_url", database_url), ("blob_url", blob_url), ("coord_url", coord_url))
            if v is not None
        }
        if updates:
            s = s.model_copy(update=updates)
        engine = create_db_engine(s.resolved_database_url())
        try:
            if migrate or (migrate is None and is_sqlite(engine)):
                upgrade(engine)
            else:
                check_schema(engine)
        except E.DraftstoreError:
            engine.dispose()
            raise
        except sa_exc.OperationalError as exc:
            engine.dispose()
            raise E.BackendUnavailable(f"database unreachable: {exc.orig}") from exc
        cache = ObjectCache(s.cache_bytes)
        blobs = open_blob_store(s.resolved_blob_url(), cache=cache)
        coord = open_coordinator(s.resolved_coord_url())
        return cls(engine, blobs, coord, settings=s, cache=cache)

    @classmethod
    def from_env(cls) -> "Store":
        """Open the store the ``DRAFTSTORE_*`` environment describes (embedded if none)."""
        return cls.open()

    def close(self) -> None:
        self._uploads.shutdown(wait=True)
        self._events.close()
        if self._autocommit is not self.engine:
            self._autocommit.dispose()
        self.engine.dispose()
        self.blobs.close()
        self.coord.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --------------------------------------------------------------- plumbing
    @contextmanager
    def _db_errors(self) -> Iterator[None]:
        """The database boundary: driver failures become ``backend.unavailable``
        (integrity errors are left to callers, who know what they mean)."""
        try:
            yield
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
            raise E.BackendUnavailable(f"database error: {exc.orig}") from exc

    @contextmanager
    def _tx(self, *, read_only: bool = False) -> Iterator[Connection]:
        """One database transaction; driver errors become typed errors.

        ``read_only`` lets SQLite readers run beside a writer (deferred BEGIN).
        """
        with self._db_errors(), self.engine.connect() as conn:
            if read_only:
                conn.execution_options(draftstore_read_only=True)
            with conn.begin():
                yield conn

    @contextmanager
    def _statement(self, *, read_only: bool = False) -> Iterator[Connection]:
        """A connection for ONE statement, atomic on its own (autocommit where it helps)."""
        with self._db_errors(), self._autocommit.connect() as conn:
            if not self._sqlite:
                yield conn
                return
            if read_only:
                conn.execution_options(draftstore_read_only=True)
            with conn.begin():
                yield conn

    def _one(self, stmt: OneShot, params: dict[str, Any]) -> tuple[Any | None, int]:
        """Run a prebuilt single statement; driver errors become typed errors."""
        with self._db_errors():
            return stmt.run(params)

    def _for_update(self, stmt: sa.Select, of: Any = None) -> sa.Select:
        return stmt if self._sqlite else stmt.with_for_update(of=of)

    def _emit(self, stream: str, type: str, data: dict[str, Any]) -> None:
        # events are a convenience (rebuildable from rows): queued, never waited for
        self._events.emit(stream, type, data)

    def _load_project(self, conn: Connection, project_id: str, lock: bool = False) -> Any:
        stmt = sa.select(P).where(P.c.id == project_id)
        row = conn.execute(self._for_update(stmt) if lock else stmt).first()
        if row is None:
            raise E.ProjectNotFound(f"no project {project_id!r}", project_id=project_id)
        return row

    def _load_version(self, conn: Connection, version_id: str, project_id: str | None = None) -> Any:
        row = conn.execute(sa.select(V).where(V.c.id == version_id)).first()
        if row is None or (project_id is not None and row.project_id != project_id):
            raise E.VersionNotFound(f"no version {version_id!r}" + (f" in project {project_id!r}" if project_id else ""),
                                    version_id=version_id)
        return row

    def _load_turn(self, conn: Connection, turn_id: str) -> Any:
        row = conn.execute(sa.select(T).where(T.c.id == turn_id)).first()
        if row is None:
            raise E.TurnNotFound(f"no turn {turn_id!r}", turn_id=turn_id)
        return row

    def _active_draft(self, conn: Connection, project: Any, lock: bool = False) -> Any | None:
        if project.active_draft_id is None:
            return None
        stmt = sa.select(D).where(D.c.id == project.active_draft_id)
        return conn.execute(self._for_update(stmt) if lock else stmt).first()

    def _not_running(self, conn: Connection, turn_id: str) -> E.DraftstoreError:
        row = conn.execute(sa.select(T.c.status).where(T.c.id == turn_id)).first()
        if row is None:
            return E.TurnNotFound(f"no turn {turn_id!r}", turn_id=turn_id)
        return E.TurnNotRunning(
            f"turn {turn_id} is {row.status}; only a running turn may change its draft",
            turn_id=turn_id,
            status=row.status,
        )

    def _lock_draft_of_running_turn(self, conn: Connection, turn_id: str) -> Any:
        """Lock the draft a running turn writes to; bump its revision.

        The draft row is taken first (everything that ends a turn locks it
        first too), then the turn's status is read by a new statement, so on
        PostgreSQL's read-committed a turn ended by a transaction that held
        the lock is seen as ended: a late write is always refused.
        """
        draft = conn.execute(self.q.lock_draft, {"turn_id": turn_id}).first()
        status = conn.execute(self.q.turn_status, {"turn_id": turn_id}).scalar()
        if draft is None or status != TurnStatus.RUNNING:
            raise self._not_running(conn, turn_id)
        return draft

    def _lock_draft_with_overlay(self, conn: Connection, turn_id: str,
                                 paths: list[str]) -> tuple[Any, dict[str, OverlayEntry]]:
        """``_lock_draft_of_running_turn`` plus the overlay rows that decide the
        merged state of ``paths``, read with the turn's status in one statement."""
        draft = conn.execute(self.q.lock_draft, {"turn_id": turn_id}).first()
        if draft is None:
            raise self._not_running(conn, turn_id)
        targeted = len(paths) <= _TARGETED_OVERLAY_MAX
        params: dict[str, Any] = {"turn_id": turn_id, "draft_id": draft.id}
        if targeted:
            names = set(paths)
            for i, p in enumerate(paths):
                names.update(parent_dirs(p))
                params[f"lo{i}"], params[f"hi{i}"] = p + "/", p + "0"
            params["names"] = sorted(names)
        rows = conn.execute(self.q.status_and_overlay(len(paths) if targeted else None), params).all()
        if not rows or rows[0].status != TurnStatus.RUNNING:
            raise self._not_running(conn, turn_id)
        overlay = {r.path: overlay_entry(r.digest, r.size) for r in rows if r.path is not None}
        return draft, overlay

    def _check_json_state(self, name: str, value: Any) -> str:
        text = _dumps(value)
        if len(text.encode()) > self.limits.max_json_state_bytes:
            raise E.PayloadTooLarge(
                f"{name} is larger than {self.limits.max_json_state_bytes} bytes",
                field=name,
                limit=self.limits.max_json_state_bytes,
            )
        return text

    def _check_file_data(self, path: str, data: Any) -> bytes:
        if isinstance(data, str):
            data = data.encode("utf-8")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise E.InvalidInput(f"content of {path!r} must be bytes or str", path=path)
        data = bytes(data)
        if len(data) > self.limits.max_file_bytes:
            raise E.PayloadTooLarge(
                f"{path!r} is {len(data)} bytes, larger than {self.limits.max_file_bytes}",
                path=path,
                limit=self.limits.max_file_bytes,
            )
        return data

    # ---------------------------------------------------------------- projects
    def create_project(
        self,
        name: str,
        files: Mapping[str, bytes | str] | None = None,
        characters: Any = None,
        world_settings: Any = None,
        *,
        actor: str | None = None,
    ) -> Project:
        """Create a project. Given any initial content, it becomes version 1 (the head).

        Atomic: on any error (``path.denied``, ``payload.too_large``, ...) no
        project exists.
        """
        name = _check_text("name", name, 200).strip()
        if not name:
            raise E.InvalidInput("project name must not be empty", field="name")
        has_content = files is not None or characters is not None or world_settings is not None
        root, count = EMPTY_TREE, 0
        if files:
            root, count = self._seal_new_files(files)
        chars = self._check_json_state("characters", {} if characters is None else characters)
        world = self._check_json_state("world_settings", {} if world_settings is None else world_settings)
        now = utcnow()
        pid = _new_id()
        with self._tx() as conn:
            conn.execute(P.insert().values(id=pid, name=name, created_at=now))
            if has_content:
                self._insert_version(conn, pid, None, 1, root, count, chars, world, "initial content",
                                     None, actor, now, reason="create")
            return self._project(conn, pid)

    def fork_project(self, version_id: str, name: str, *, actor: str | None = None) -> Project:
        """A new project whose version 1 is ``version_id`` of another project.

        Restores an old state without touching the original project; objects
        are shared (content addressing), nothing is copied.
        """
        name = _check_text("name", name, 200).strip()
        if not name:
            raise E.InvalidInput("project name must not be empty", field="name")
        now = utcnow()
        pid = _new_id()
        with self._tx() as conn:
            src = self._load_version(conn, version_id)
            conn.execute(P.insert().values(id=pid, name=name, created_at=now, forked_from_version_id=src.id))
            self._insert_version(conn, pid, None, 1, src.code_manifest_key, src.file_count, src.characters_json,
                                 src.world_settings_json, f"forked from version {src.id}", None, actor, now,
                                 reason="create")
            return self._project(conn, pid)

    def _seal_new_files(self, files: Mapping[str, bytes | str]) -> tuple[Digest, int]:
        cleaned = self._clean_batch(files, self.limits.max_files_per_draft, "files")
        if any(v is None for v in cleaned.values()):
            raise E.InvalidInput("initial files cannot be deletions (None)")
        self._check_batch_shape(cleaned)
        digests = self.blobs.put_many(list(cleaned.values()))
        changes = {p: (d, len(b)) for (p, b), d in zip(cleaned.items(), digests)}
        return self.trees.seal(EMPTY_TREE, changes)

    @staticmethod
    def _check_batch_shape(writes: Mapping[str, Any]) -> None:
        """No written path may also be a directory of another written path."""
        for path, value in writes.items():
            if value is None:  # a deletion never makes a directory
                continue
            for parent in parent_dirs(path):
                if parent in writes and writes[parent] is not None:
                    raise E.PathConflict(f"{parent!r} cannot be a file and a directory", path=parent)

    def _insert_version(
        self,
        conn: Connection,
        project_id: str,
        parent_id: str | None,
        number: int,
        root: str,
        file_count: int,
        chars: str,
        world: str,
        summary: str,
        turn_id: str | None,
        actor: str | None,
        now: Any,
        reason: str,
        clear_draft: bool = False,
    ) -> str:
        vid = _new_id()
        conn.execute(
            V.insert().values(
                id=vid, project_id=project_id, number=number, parent_version_id=parent_id,
                code_manifest_key=root, file_count=file_count, characters_json=chars,
                world_settings_json=world, summary=summary, created_by_turn_id=turn_id,
                created_by=actor, created_at=now,
            )
        )
        head: dict[str, Any] = {"current_version_id": vid}
        if clear_draft:
            head["active_draft_id"] = None
        conn.execute(P.update().where(P.c.id == project_id).values(**head))
        conn.execute(
            H.insert().values(project_id=project_id, from_version_id=parent_id, to_version_id=vid,
                              reason=reason, actor=actor, turn_id=turn_id, at=now)
        )
        return vid

    def _project(self, conn: Connection, project_id: str) -> Project:
        r = self._load_project(conn, project_id)
        return Project(r.id, r.name, r.current_version_id, r.active_draft_id, r.forked_from_version_id,
                       aware(r.created_at))

    def get_project(self, project_id: str) -> Project:
        """The project's row: head (``current_version_id``) and ``active_draft_id``."""
        with self._tx(read_only=True) as conn:
            return self._project(conn, project_id)

    def list_projects(self) -> list[Project]:
        with self._tx(read_only=True) as conn:
            rows = conn.execute(sa.select(P).order_by(P.c.created_at, P.c.id)).all()
        return [Project(r.id, r.name, r.current_version_id, r.active_draft_id, r.forked_from_version_id,
                        aware(r.created_at)) for r in rows]

    # ---------------------------------------------------------------- versions
    @staticmethod
    def _version(r: Any) -> Version:
        return Version(r.id, r.project_id, r.number, r.parent_version_id, r.code_manifest_key, r.file_count,
                       loads(r.characters_json), loads(r.world_settings_json), r.summary,
                       r.created_by_turn_id, r.created_by, aware(r.created_at))

    def get_version(self, version_id: str) -> Version:
        with self._tx(read_only=True) as conn:
            return self._version(self._load_version(conn, version_id))

    def list_versions(self, project_id: str) -> list[Version]:
        """Every version of the project, oldest first (rollback deletes none)."""
        with self._tx(read_only=True) as conn:
            self._load_project(conn, project_id)
            rows = conn.execute(sa.select(V).where(V.c.project_id == project_id).order_by(V.c.number)).all()
        return [self._version(r) for r in rows]

    def head_moves(self, project_id: str) -> list[HeadMove]:
        """Every head move of the project, oldest first: who, when, from, to, why."""
        with self._tx(read_only=True) as conn:
            self._load_project(conn, project_id)
            rows = conn.execute(sa.select(H).where(H.c.project_id == project_id).order_by(H.c.id)).all()
        return [HeadMove(r.id, r.project_id, r.from_version_id, r.to_version_id, r.reason, r.actor, r.turn_id,
                         aware(r.at)) for r in rows]

    # ------------------------------------------------------------------ drafts
    @staticmethod
    def _draft(r: Any) -> Draft:
        return Draft(r.id, r.project_id, r.base_version_id, r.status, r.code_manifest_key, r.file_count,
                     r.revision, r.last_turn_id, loads(r.partial_response_json), aware(r.created_at),
                     aware(r.closed_at), r.closed_reason)

    def get_draft(self, project_id: str) -> Draft:
        """The project's active draft. Raises ``draft.none``."""
        with self._tx(read_only=True) as conn:
            project = self._load_project(conn, project_id)
            row = self._active_draft(conn, project)
        if row is None:
            raise E.DraftNone(f"project {project_id} has no active draft", project_id=project_id)
        return self._draft(row)

    def _create_draft(self, conn: Connection, project: Any, now: Any) -> Any:
        if project.current_version_id is not None:
            head = self._load_version(conn, project.current_version_id)
            root, count, chars, world = (head.code_manifest_key, head.file_count, head.characters_json,
                                         head.world_settings_json)
        else:
            root, count, chars, world = EMPTY_TREE, 0, "{}", "{}"
        did = _new_id()
        conn.execute(
            D.insert().values(
                id=did, project_id=project.id, base_version_id=project.current_version_id,
                status=DraftStatus.PAUSED, code_manifest_key=root, file_count=count, characters_json=chars,
                world_settings_json=world, revision=0, status_changed_at=now, created_at=now,
            )
        )
        conn.execute(P.update().where(P.c.id == project.id).values(active_draft_id=did))
        return conn.execute(sa.select(D).where(D.c.id == did)).first()

    # ------------------------------------------------------------------- turns
    def start_turn(self, project_id: str, user_message: str, *, actor: str | None = None) -> Turn:
        """Start a QA turn; derive a draft from head if the project has none.

        Raises ``turn.already_running`` while another turn of the project
        runs (the database enforces one running turn per project) and
        ``draft.busy`` while the draft is being published.
        """
        return self._begin_turn(project_id, user_message, require_draft=False)

    def continue_turn(self, project_id: str, user_message: str) -> Turn:
        """A new turn on the same draft; earlier turns stay readable.

        Continuing never resumes an old process: whatever the previous turn
        left in the draft (sealed when it ended) is where the new one starts.
        Raises ``draft.none`` if the project has no draft to continue.
        """
        return self._begin_turn(project_id, user_message, require_draft=True)

    def _begin_turn(self, project_id: str, user_message: str, require_draft: bool) -> Turn:
        _check_text("user_message", user_message, self.limits.max_message_bytes)
        with self._tx(read_only=True) as conn:
            project = self._load_project(conn, project_id)
            draft_id = project.active_draft_id
            running = conn.execute(
                sa.select(T.c.id).where(T.c.project_id == project_id, T.c.status == TurnStatus.RUNNING)
            ).scalar()
        if running is not None:  # refuse before doing any work (re-checked under the lock below)
            raise E.TurnAlreadyRunning(f"turn {running} of project {project_id} is still running", turn_id=running)
        if draft_id is None and require_draft:
            raise E.DraftNone(f"project {project_id} has no draft to continue", project_id=project_id)
        if draft_id is not None:
            # fold leftovers of a turn whose worker died before sealing
            self._seal_draft(draft_id)
        now = utcnow()
        tid = _new_id()
        try:
            with self._tx() as conn:
                project = self._load_project(conn, project_id, lock=True)
                draft = self._active_draft(conn, project, lock=True)
                if draft is None:
                    if require_draft:
                        raise E.DraftNone(f"project {project_id} has no draft to continue", project_id=project_id)
                    draft = self._create_draft(conn, project, now)
                if draft.status == DraftStatus.PUBLISHING:
                    raise E.DraftBusy(f"draft {draft.id} is being published", draft_id=draft.id)
                running = conn.execute(
                    sa.select(T.c.id).where(T.c.project_id == project_id, T.c.status == TurnStatus.RUNNING)
                ).scalar()
                if running is not None:
                    raise E.TurnAlreadyRunning(
                        f"turn {running} of project {project_id} is still running", turn_id=running
                    )
                number = (conn.execute(sa.select(sa.func.max(T.c.number)).where(T.c.project_id == project_id))
                          .scalar() or 0) + 1
                conn.execute(
                    T.insert().values(
                        id=tid, project_id=project_id, draft_id=draft.id, number=number,
                        continues_turn_id=draft.last_turn_id, status=TurnStatus.RUNNING,
                        user_message=user_message, start_root=draft.code_manifest_key, started_at=now,
                        start_state_digest=self._put_state(draft.characters_json, draft.world_settings_json),
                    )
                )
                conn.execute(
                    D.update().where(D.c.id == draft.id).values(
                        status=DraftStatus.RUNNING, last_turn_id=tid, status_changed_at=now,
                        revision=D.c.revision + 1,
                    )
                )
        except sa_exc.IntegrityError as exc:
            # the partial unique indexes caught a race the checks above could not see
            raise E.TurnAlreadyRunning(f"another turn of project {project_id} started first") from exc
        self._beat(tid)
        self._emit(f"turn:{tid}", "turn.started", {"turn_id": tid, "project_id": project_id})
        self._emit(f"project:{project_id}", "turn.started", {"turn_id": tid})
        return self.get_turn(tid)

    def _put_state(self, characters_json: str, world_settings_json: str) -> str:
        """Store characters + world settings as one immutable blob (turn boundaries)."""
        data = ('{"characters":' + characters_json + ',"world_settings":' + world_settings_json + "}").encode()
        return self.blobs.put(data)

    def heartbeat(self, turn_id: str) -> None:
        """Mark a running turn's worker alive; the recovery sweep reaps turns whose beat lapsed."""
        self._beat(turn_id)

    def _beat(self, turn_id: str) -> None:
        try:
            self.coord.beat(f"turn:{turn_id}", self.settings.heartbeat_ttl_s)
        except E.DraftstoreError as exc:
            log.warning("heartbeat for turn %s not recorded: %s", turn_id, exc)

    def complete_turn(self, turn_id: str, assistant_message: str) -> Turn:
        """End a running turn successfully; seal its writes; the draft waits (``paused``)."""
        _check_text("assistant_message", assistant_message, self.limits.max_message_bytes)
        return self._end_turn(turn_id, TurnStatus.COMPLETED, DraftStatus.PAUSED,
                              assistant_message=assistant_message)

    def interrupt_turn(self, turn_id: str, partial_response: Any = None) -> Turn:
        """Stop a running turn; its writes so far stay in the draft (sealed).

        ``partial_response`` is a UI cache kept on the turn and the draft;
        never model context. After this, any write through the turn is
        refused with ``turn.not_running``.
        """
        partial = None if partial_response is None else self._check_json_state("partial_response", partial_response)
        return self._end_turn(turn_id, TurnStatus.INTERRUPTED, DraftStatus.INTERRUPTED, partial=partial)

    def fail_turn(self, turn_id: str, error: str) -> Turn:
        """End a running turn as failed; its writes stay in the draft (sealed)."""
        _check_text("error", error, self.limits.max_message_bytes)
        return self._end_turn(turn_id, TurnStatus.FAILED, DraftStatus.INTERRUPTED, error=error)

    def _end_turn(
        self,
        turn_id: str,
        status: str,
        draft_status: str,
        *,
        assistant_message: str | None = None,
        error: str | None = None,
        partial: str | None = None,
    ) -> Turn:
        now = utcnow()
        dvals: dict[str, Any] = {"status": draft_status, "status_changed_at": now, "revision": D.c.revision + 1}
        if partial is not None:
            dvals["partial_response_json"] = partial
        tvals: dict[str, Any] = {"status": status, "ended_at": now}
        if assistant_message is not None:
            tvals["assistant_message"] = assistant_message
        if error is not None:
            tvals["error"] = error
        if partial is not None:
            tvals["partial_response_json"] = partial
        with self._tx() as conn:
            # draft row first (the lock order of every writer), then the turn row,
            # whose status is re-checked under its lock: exactly one ender wins
            draft = conn.execute(
                D.update()
                .where(D.c.id == sa.select(T.c.draft_id).where(T.c.id == turn_id).scalar_subquery())
                .values(**dvals)
                .returning(D.c.id, D.c.revision, D.c.project_id, D.c.characters_json, D.c.world_settings_json)
            ).first()
            ended = conn.execute(T.update().where(T.c.id == turn_id, T.c.status == TurnStatus.RUNNING)
                                 .values(**tvals)).rowcount if draft is not None else 0
            if ended != 1:
                raise self._not_running(conn, turn_id)  # rolls the draft update back
            project_id = draft.project_id
            # the JSON state as the turn left it (no write can follow: the turn has ended)
            state = self._put_state(draft.characters_json, draft.world_settings_json)

            def record_end(conn: Connection, root: Digest) -> Turn:
                row = conn.execute(T.update().where(T.c.id == turn_id).values(end_root=root, end_state_digest=state)
                                   .returning(*T.c)).first()
                calls = conn.execute(sa.select(TC).where(TC.c.turn_id == turn_id).order_by(TC.c.seq)).all()
                return self._turn(row, tuple(self._tool_call(c) for c in calls))

            # fold only this turn's writes (revisions up to the one taken at its end),
            # so a turn that starts meanwhile never leaks into this turn's end root
            overlay = conn.execute(self._sealed_root_and_overlay(draft.id, draft.revision)).all()
            if all(r.path is None for r in overlay):  # nothing written: the end is the sealed root
                root = Digest(overlay[0].code_manifest_key)
                turn = record_end(conn, root)
        if any(r.path is not None for r in overlay):
            root, turn = self._seal_draft(draft.id, upto_revision=draft.revision, then=record_end,
                                          preloaded=overlay)
        try:
            self.coord.forget(f"turn:{turn_id}")
        except E.DraftstoreError:
            pass
        self._emit(f"turn:{turn_id}", f"turn.{status}", {"turn_id": turn_id, "end_root": root})
        self._emit(f"project:{project_id}", f"turn.{status}", {"turn_id": turn_id})
        return turn

    def _turn(self, r: Any, calls: tuple[ToolCall, ...] = ()) -> Turn:
        return Turn(r.id, r.project_id, r.draft_id, r.number, r.continues_turn_id, r.status, r.user_message,
                    r.assistant_message, r.error, loads(r.partial_response_json), r.start_root, r.end_root,
                    aware(r.started_at), aware(r.ended_at), calls)

    @staticmethod
    def _tool_call(r: Any) -> ToolCall:
        return ToolCall(r.turn_id, r.seq, r.tool_name, r.status, loads(r.args_json), r.args_digest,
                        r.args_preview, loads(r.result_json), r.result_digest, r.result_preview, r.error,
                        aware(r.started_at), aware(r.ended_at))

    def get_turn(self, turn_id: str) -> Turn:
        """A turn with its whole tool-call history, in ``seq`` order."""
        with self._tx(read_only=True) as conn:
            return self._read_turn(conn, turn_id)

    def _read_turn(self, conn: Connection, turn_id: str) -> Turn:
        r = self._load_turn(conn, turn_id)
        calls = conn.execute(sa.select(TC).where(TC.c.turn_id == turn_id).order_by(TC.c.seq)).all()
        return self._turn(r, tuple(self._tool_call(c) for c in calls))

    def list_turns(self, project_id: str) -> list[Turn]:
        """Every turn of the project, oldest first (tool calls not loaded: see ``get_turn``)."""
        with self._tx(read_only=True) as conn:
            self._load_project(conn, project_id)
            rows = conn.execute(sa.select(T).where(T.c.project_id == project_id).order_by(T.c.number)).all()
        return [self._turn(r) for r in rows]

    # -------------------------------------------------------------- tool calls
    def _payload(self, name: str, value: Any) -> tuple[str | None, str | None, str | None]:
        """(inline JSON, blob digest, preview): big payloads go to the blob store."""
        text = _dumps(value)
        size = len(text.encode("utf-8"))
        if size > self.limits.max_payload_bytes:
            raise E.PayloadTooLarge(f"tool {name} is {size} bytes, larger than {self.limits.max_payload_bytes}",
                                    field=name, limit=self.limits.max_payload_bytes)
        if size <= self.limits.inline_payload_bytes:
            return text, None, None
        digest = self.blobs.put(text.encode("utf-8"))
        return None, digest, text[: self.limits.payload_preview_chars]

    def tool_started(self, turn_id: str, tool_name: str, args: Any = None) -> ToolCall:
        """Record that a tool call began; returns it with its ``seq`` (1, 2, 3, ... per turn).

        One row insert whatever the length of the history (O(1)). Raises
        ``turn.not_running`` once the turn has ended.
        """
        _check_text("tool_name", tool_name, 200)
        if not tool_name:
            raise E.InvalidInput("tool_name must not be empty", field="tool_name")
        args_json, args_digest, args_preview = self._payload("args", args)
        now = utcnow()
        params = {"p_turn_id": turn_id, "p_tool_name": tool_name, "p_args_json": args_json,
                  "p_args_digest": args_digest, "p_args_preview": args_preview, "p_now": now}
        for attempt in range(20):
            try:
                row, _ = self._one(self._tool_started, params)
                seq = row[0] if row is not None else None
                if seq is None:
                    with self._tx(read_only=True) as conn:
                        raise self._not_running(conn, turn_id)
                break
            except sa_exc.IntegrityError:
                # two recorders raced for the same seq: take the next one
                if attempt == 19:
                    raise
                time.sleep(0.001 * (attempt + 1))
        self._emit(f"turn:{turn_id}", "tool.started", {"turn_id": turn_id, "seq": seq, "tool_name": tool_name})
        return ToolCall(turn_id, seq, tool_name, "started", (None if args_digest else args), args_digest, args_preview,
                        None, None, None, None, now, None)

    def tool_completed(self, turn_id: str, seq: int, result: Any = None) -> None:
        """Record a started call's result. Raises ``toolcall.not_started``, ``turn.not_running``."""
        result_json, result_digest, result_preview = self._payload("result", result)
        self._finish_call(turn_id, seq, "completed", self._tool_completed, {
            "result_json": result_json, "result_digest": result_digest, "result_preview": result_preview,
        })

    def tool_failed(self, turn_id: str, seq: int, error: str) -> None:
        """Record that a started call failed with ``error``."""
        _check_text("error", error, self.limits.max_message_bytes)
        self._finish_call(turn_id, seq, "failed", self._tool_failed, {"error": error})

    def _finish_call(self, turn_id: str, seq: int, status: str, stmt: OneShot, values: dict[str, Any]) -> None:
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise E.InvalidInput("seq must be an integer", field="seq")
        params = {"p_turn_id": turn_id, "p_seq": seq, "p_now": utcnow(), **{f"p_{k}": v for k, v in values.items()}}
        _, updated = self._one(stmt, params)
        if updated != 1:
            with self._tx(read_only=True) as conn:
                turn = conn.execute(sa.select(T.c.status).where(T.c.id == turn_id)).first()
                if turn is None or turn.status != TurnStatus.RUNNING:
                    raise self._not_running(conn, turn_id)
                call = conn.execute(sa.select(TC.c.status).where(TC.c.turn_id == turn_id, TC.c.seq == seq)).first()
                if call is None:
                    raise E.ToolCallNotFound(f"turn {turn_id} has no tool call {seq}", turn_id=turn_id, seq=seq)
                raise E.ToolCallNotStarted(f"tool call {seq} of turn {turn_id} already {call.status}",
                                           turn_id=turn_id, seq=seq, status=call.status)
        self._emit(f"turn:{turn_id}", f"tool.{status}", {"turn_id": turn_id, "seq": seq})

    def read_payload(self, digest: str) -> Any:
        """An offloaded tool-call payload (``args_digest`` / ``result_digest``), decoded."""
        return json.loads(self.blobs.get(Digest(digest)).decode("utf-8"))

    # ------------------------------------------------------------------ writes
    def write_file(self, turn_id: str, path: str, data: bytes | str) -> None:
        """Write one file into the draft of a running turn.

        The blob is stored first, then one transaction upserts the overlay
        row and bumps the draft revision; no tree object is written until the
        turn ends. Raises ``path.denied``, ``payload.too_large``,
        ``path.conflict`` (a file where a directory is, or under a file),
        ``limit.exceeded``, ``turn.not_running``; on error nothing changes.
        """
        self.apply_changes(turn_id, {path: data})

    def delete_file(self, turn_id: str, path: str) -> None:
        """Delete one file from the draft. Raises ``path.not_found`` if absent."""
        self.apply_changes(turn_id, {path: None})

    def move_file(self, turn_id: str, src: str, dst: str) -> None:
        """Rename a file, atomically (no content is copied). Raises ``path.not_found``, ``path.conflict``."""
        s = normalize_path(src, self.limits)
        d = normalize_path(dst, self.limits)
        if s == d:
            raise E.PathConflict("move source and destination are the same path", path=s)
        self._apply(turn_id, {s: None, d: ("move", s)})

    def apply_changes(self, turn_id: str, changes: Mapping[str, bytes | str | None]) -> None:
        """Apply a batch ``{path: content | None}`` (None deletes) atomically: all or nothing."""
        self._apply(turn_id, self._clean_batch(changes, self.limits.max_batch_files, "changes"))

    def _clean_batch(self, changes: Any, max_paths: int, name: str) -> dict[str, bytes | None]:
        """Validate ``{path: content | None}``: every path canonical, no path named
        twice, contents within limits. Raises before anything is stored."""
        if not isinstance(changes, Mapping):
            raise E.InvalidInput(f"{name} must be a mapping of path to bytes (or None to delete)")
        if len(changes) > max_paths:
            raise E.LimitExceeded(f"more than {max_paths} paths in one call", limit=max_paths)
        cleaned: dict[str, bytes | None] = {}
        for raw, data in changes.items():
            path = normalize_path(raw, self.limits)
            if path in cleaned:
                raise E.PathConflict(f"path {path!r} given twice", path=path)
            cleaned[path] = None if data is None else self._check_file_data(path, data)
        return cleaned

    def _apply(self, turn_id: str, changes: dict[str, Any]) -> None:
        if not changes:
            return
        self._check_batch_shape(changes)
        writes = [(p, v) for p, v in changes.items() if isinstance(v, bytes)]
        stored = {p: (digest_of(v), len(v)) for p, v in writes}
        # the upload runs while the transaction does its checks; the transaction
        # commits only after every blob is stored (a row never names a missing blob)
        upload = self._uploads.submit(self.blobs.put_many, [v for _, v in writes]) if writes else None
        try:
            self._apply_rows(turn_id, changes, stored, upload)
        finally:
            if upload is not None and not upload.done():
                upload.cancel() or upload.exception()  # never leave an upload running past the call
        self._emit(f"turn:{turn_id}", "draft.changed",
                   {"turn_id": turn_id, "paths": sorted(changes)[:100]})

    def _apply_rows(self, turn_id: str, changes: dict[str, Any], stored: dict[str, tuple[Digest, int]],
                    upload: Any) -> None:
        with self._tx() as conn:
            draft, overlay = self._lock_draft_with_overlay(conn, turn_id, list(changes))
            state = _MergedState(self.trees, Digest(draft.code_manifest_key), overlay)
            moved = {}
            for value in changes.values():
                if isinstance(value, tuple):  # ("move", src): resolved before the source is deleted
                    src_file = state.file(value[1])
                    if src_file is None:
                        raise E.PathNotFound(f"no file {value[1]!r} to move", path=value[1])
                    moved[value[1]] = src_file
            rows: list[dict[str, Any]] = []
            delta = 0
            # deletions (and move sources) first, so a batch may replace a directory by a file
            ordered = sorted(changes.items(), key=lambda kv: kv[1] is not None)
            for path, value in ordered:
                if isinstance(value, tuple):
                    value = moved[value[1]]
                elif value is not None:
                    value = stored[path]
                existed = state.file(path) is not None
                if value is None:
                    if not existed:
                        raise E.PathNotFound(f"no file {path!r} in the draft", path=path)
                else:
                    for parent in parent_dirs(path):
                        if state.file(parent) is not None:
                            raise E.PathConflict(f"{parent!r} is a file, cannot hold {path!r}", path=path)
                    if state.is_dir(path):
                        raise E.PathConflict(f"{path!r} is a directory", path=path)
                state.set(path, value)
                delta += (value is not None) - existed
                rows.append({"draft_id": draft.id, "path": path, "digest": None if value is None else value[0],
                             "size": 0 if value is None else value[1], "revision": draft.revision})
            if draft.file_count + delta > self.limits.max_files_per_draft:
                raise E.LimitExceeded(f"the draft would hold more than {self.limits.max_files_per_draft} files",
                                      limit=self.limits.max_files_per_draft)
            conn.execute(self.q.upsert_overlay, rows)
            if delta:
                conn.execute(self.q.add_file_count, {"draft_id": draft.id, "delta": delta})
            if upload is not None:
                upload.result()  # raises the upload's error, which rolls the transaction back

    # ------------------------------------------------------- characters, world
    def patch_characters(self, turn_id: str, patch: Any) -> Any:
        """Patch the draft's characters JSON; returns the new value.

        A list is a JSON Patch (RFC 6902), a dict a JSON Merge Patch (RFC 7386).
        Atomic; raises ``patch.invalid``, ``payload.too_large``, ``turn.not_running``.
        """
        return self._patch_json(turn_id, "characters_json", "characters", patch)

    def patch_world_settings(self, turn_id: str, patch: Any) -> Any:
        """Patch the draft's world-settings JSON (as ``patch_characters``)."""
        return self._patch_json(turn_id, "world_settings_json", "world_settings", patch)

    def _patch_json(self, turn_id: str, column: str, name: str, patch: Any) -> Any:
        if not isinstance(patch, (list, dict)):
            raise E.PatchInvalid("a patch is a JSON Patch list or a JSON Merge Patch object")
        with self._tx() as conn:
            draft = self._lock_draft_of_running_turn(conn, turn_id)
            current = json.loads(getattr(draft, column))
            if isinstance(patch, list):
                try:
                    new = jsonpatch.JsonPatch(patch).apply(current)
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError, KeyError,
                        ValueError, AttributeError) as exc:
                    raise E.PatchInvalid(f"JSON Patch not applicable to {name}: {exc}") from exc
            else:
                new = _merge_patch(current, patch)
            text = self._check_json_state(name, new)
            conn.execute(D.update().where(D.c.id == draft.id).values(**{column: text}))
        self._emit(f"turn:{turn_id}", f"{name}.changed", {"turn_id": turn_id})
        return new

    # ------------------------------------------------------------------ sealing
    def _seal_draft(
        self,
        draft_id: str,
        *,
        upto_revision: int | None = None,
        then: Callable[[Connection, Digest], Any] | None = None,
        preloaded: list[Any] | None = None,
    ) -> Any:
        """Fold the draft's overlay into tree objects; returns the new sealed root.

        Restartable and safe to race: tree objects are put before the
        compare-and-swap of ``code_manifest_key``, and only the overlay rows
        that were folded (same path and revision) are removed, so a write
        that lands meanwhile stays in the overlay. ``upto_revision`` folds
        only rows written at or below that draft revision. ``then(conn, root)``
        runs inside the transaction that commits the root (or in its own when
        there is nothing to fold); with it, returns ``(root, then's result)``.
        ``preloaded``: the rows of ``_sealed_root_and_overlay``, already read.
        """
        stmt = self._sealed_root_and_overlay(draft_id, upto_revision)
        for _ in range(50):
            if preloaded is not None:
                found, preloaded = preloaded, None
            else:
                with self._statement(read_only=True) as conn:  # root and overlay from one snapshot
                    found = conn.execute(stmt).all()
            if not found:
                raise E.DraftNone(f"no draft {draft_id!r}")
            old = Digest(found[0].code_manifest_key)
            rows = [r for r in found if r.path is not None]
            if not rows:
                if then is None:
                    return old
                with self._tx() as conn:
                    return old, then(conn, old)
            changes: dict[str, FileChange] = {
                r.path: overlay_entry(r.digest, r.size) for r in rows
            }
            plan = self.trees.plan(old, changes)
            new = plan.root
            # tree objects upload while the transaction does its work; it commits
            # only once they are stored, so a committed root is always complete
            upload = self._uploads.submit(self.trees.store, plan)
            with self._tx() as conn:
                res = conn.execute(
                    D.update().where(D.c.id == draft_id, D.c.code_manifest_key == old).values(code_manifest_key=new)
                )
                if res.rowcount != 1:
                    upload.exception()  # let it settle; stray objects are harmless
                    continue  # another sealer moved the root first: redo on top of it
                conn.execute(
                    C.delete().where(
                        C.c.draft_id == draft_id,
                        C.c.path == sa.bindparam("p"),
                        C.c.revision == sa.bindparam("r"),
                    ),
                    [{"p": r.path, "r": r.revision} for r in rows],
                )
                result = then(conn, new) if then is not None else None
                upload.result()  # raises the upload's error, which rolls the transaction back
            return new if then is None else (new, result)
        raise E.DraftBusy(f"draft {draft_id} kept changing while sealing", draft_id=draft_id)

    @staticmethod
    def _sealed_root_and_overlay(draft_id: str, upto_revision: int | None = None) -> Any:
        """The draft's sealed root with its overlay rows (one row with path NULL if none)."""
        return (
            sa.select(D.c.code_manifest_key, C.c.path, C.c.digest, C.c.size, C.c.revision)
            .select_from(D.outerjoin(C, sa.and_(
                C.c.draft_id == D.c.id,
                sa.true() if upto_revision is None else C.c.revision <= upto_revision,
            )))
            .where(D.c.id == draft_id)
        )

    # ------------------------------------------------------------------ publish
    def publish(self, project_id: str, summary: str = "", *, force: bool = False, actor: str | None = None) -> Version:
        """Turn the active draft into a new version and make it head; clears the draft.

        Atomic: the version row, the head move and the draft's closing commit
        together or not at all. Raises ``draft.none``; ``draft.busy`` while a
        turn runs or another publish is under way; ``draft.conflict`` when the
        draft's base is no longer head (``force=True`` publishes anyway, on top
        of the current head). Two racing publishes produce exactly one version.
        """
        _check_text("summary", summary, self.limits.max_message_bytes)
        now = utcnow()
        with self._tx() as conn:
            project = self._load_project(conn, project_id, lock=True)
            draft = None
            if project.active_draft_id is not None:
                stmt = sa.select(D, sa.exists().where(C.c.draft_id == D.c.id).label("unsealed")).where(
                    D.c.id == project.active_draft_id)
                draft = conn.execute(self._for_update(stmt, of=D)).first()
            if draft is None:
                raise E.DraftNone(f"project {project_id} has no draft to publish", project_id=project_id)
            if draft.status in (DraftStatus.RUNNING, DraftStatus.PUBLISHING):
                raise E.DraftBusy(
                    f"draft {draft.id} is {draft.status}; finish or interrupt the turn first"
                    if draft.status == DraftStatus.RUNNING else f"draft {draft.id} is already being published",
                    draft_id=draft.id, status=draft.status,
                )
            if draft.base_version_id != project.current_version_id and not force:
                raise E.DraftConflict(
                    f"draft {draft.id} is based on {draft.base_version_id}, head is now "
                    f"{project.current_version_id}: rebase, or publish with force=True",
                    draft_id=draft.id, base_version_id=draft.base_version_id,
                    head_version_id=project.current_version_id,
                )
            unsealed = draft.unsealed
            if not unsealed:
                # the common case (turn ends seal the draft): everything in this one transaction
                version = self._finish_publish(conn, project, draft, summary, actor, now)
            else:
                conn.execute(D.update().where(D.c.id == draft.id).values(status=DraftStatus.PUBLISHING,
                                                                          status_changed_at=now))
        if unsealed:
            # unsealed writes (a worker died before its turn's end sealed them): seal
            # outside any transaction, the 'publishing' status keeping turns out meanwhile
            try:
                self._seal_draft(draft.id)
                with self._tx() as conn:
                    project = self._load_project(conn, project_id, lock=True)
                    if project.current_version_id != draft.base_version_id and not force:
                        raise E.DraftConflict(f"head of project {project_id} moved during publish",
                                              draft_id=draft.id, head_version_id=project.current_version_id)
                    d = conn.execute(self._for_update(sa.select(D).where(D.c.id == draft.id))).first()
                    if d is None or d.closed_at is not None or d.status != DraftStatus.PUBLISHING:
                        raise E.DraftBusy(f"draft {draft.id} was released while publishing", draft_id=draft.id)
                    if conn.execute(sa.select(sa.exists().where(C.c.draft_id == draft.id))).scalar():
                        raise E.DraftBusy(f"draft {draft.id} changed while publishing", draft_id=draft.id)
                    version = self._finish_publish(conn, project, d, summary, actor, now)
            except BaseException:
                self._release_publishing(draft.id, draft.status)
                raise
        self._emit(f"project:{project_id}", "version.published", {"version_id": version.id, "number": version.number})
        return version

    def _finish_publish(self, conn: Connection, project: Any, d: Any, summary: str, actor: str | None,
                        now: Any) -> Version:
        """Within the caller's transaction (project and draft rows locked, overlay
        empty): insert the version, move head, close the draft, record the move."""
        number = (conn.execute(sa.select(sa.func.max(V.c.number)).where(V.c.project_id == project.id))
                  .scalar() or 0) + 1
        vid = self._insert_version(
            conn, project.id, project.current_version_id, number, d.code_manifest_key, d.file_count,
            d.characters_json, d.world_settings_json, summary, d.last_turn_id, actor, now, reason="publish",
            clear_draft=True,
        )
        conn.execute(D.update().where(D.c.id == d.id).values(
            closed_at=now, closed_reason="published", published_version_id=vid, status_changed_at=now))
        return Version(vid, project.id, number, project.current_version_id, d.code_manifest_key, d.file_count,
                       loads(d.characters_json), loads(d.world_settings_json), summary, d.last_turn_id, actor, now)

    def _release_publishing(self, draft_id: str, status: str) -> None:
        try:
            with self._tx() as conn:
                conn.execute(D.update().where(D.c.id == draft_id, D.c.status == DraftStatus.PUBLISHING,
                                              D.c.closed_at.is_(None))
                             .values(status=status, status_changed_at=utcnow()))
        except E.DraftstoreError as exc:  # the recovery sweep will release it
            log.error("draft %s left in publishing: %s", draft_id, exc)

    # ----------------------------------------------------------------- rollback
    def discard_draft(self, project_id: str, *, actor: str | None = None) -> Draft:
        """Roll back unfinished work: drop the draft, the project is back at its head.

        A turn still running on it ends as ``rolled_back`` (its worker's late
        writes are refused); the draft's turns stay readable. Raises
        ``draft.none``, ``draft.busy`` (being published).
        """
        now = utcnow()
        with self._tx() as conn:
            project = self._load_project(conn, project_id, lock=True)
            draft = self._active_draft(conn, project, lock=True)
            if draft is None:
                raise E.DraftNone(f"project {project_id} has no draft to discard", project_id=project_id)
            if draft.status == DraftStatus.PUBLISHING:
                raise E.DraftBusy(f"draft {draft.id} is being published", draft_id=draft.id)
            conn.execute(D.update().where(D.c.id == draft.id).values(
                closed_at=now, closed_reason="discarded", status_changed_at=now, revision=D.c.revision + 1))
            running = conn.execute(sa.select(T.c.id).where(T.c.draft_id == draft.id,
                                                           T.c.status == TurnStatus.RUNNING)).scalars().all()
            conn.execute(T.update().where(T.c.draft_id == draft.id, T.c.status == TurnStatus.RUNNING)
                         .values(status=TurnStatus.ROLLED_BACK, ended_at=now))
            conn.execute(C.delete().where(C.c.draft_id == draft.id))
            conn.execute(P.update().where(P.c.id == project_id).values(active_draft_id=None))
            result = self._draft(conn.execute(sa.select(D).where(D.c.id == draft.id)).first())
        for tid in running:
            self._emit(f"turn:{tid}", "turn.rolled_back", {"turn_id": tid})
        self._emit(f"project:{project_id}", "draft.discarded", {"draft_id": draft.id})
        return result

    def rollback_to(self, project_id: str, version_id: str, *, actor: str | None = None) -> Project:
        """Move head to ``version_id`` (one of the project's versions); deletes nothing.

        The move is recorded in ``head_moves``. An open draft is left alone:
        its base is then no longer head, so publishing it is a conflict.
        Raises ``version.not_found``.
        """
        now = utcnow()
        with self._tx() as conn:
            project = self._load_project(conn, project_id, lock=True)
            version = self._load_version(conn, version_id, project_id)
            if project.current_version_id != version.id:
                conn.execute(P.update().where(P.c.id == project_id).values(current_version_id=version.id))
                conn.execute(H.insert().values(project_id=project_id, from_version_id=project.current_version_id,
                                               to_version_id=version.id, reason="rollback", actor=actor, at=now))
            result = self._project(conn, project_id)
        self._emit(f"project:{project_id}", "head.moved", {"to_version_id": version_id})
        return result

    # -------------------------------------------------------------------- views
    def view(self, project_id: str) -> View:
        """The newest state: the active draft (with its unsealed writes), else head.

        The view is pinned: the draft row and its overlay are read by one
        statement (one snapshot) and copied; later reads never see later
        writes. Raises ``project.not_found``.
        """
        with self._statement(read_only=True) as conn:
            rows = conn.execute(self.q.view, {"project_id": project_id}).all()
        head = next((r for r in rows if r.part == 0), None)
        if head is None:
            raise E.ProjectNotFound(f"no project {project_id!r}", project_id=project_id)
        if head.draft_id is not None and head.d_root is not None:
            overlay = {r.path: overlay_entry(r.digest, r.size)
                       for r in rows if r.part == 1}
            return View(trees=self.trees, project_id=project_id, kind="draft", root=Digest(head.d_root),
                        overlay=overlay, characters=loads(head.d_chars), world_settings=loads(head.d_world),
                        draft_id=head.draft_id, version_id=head.d_base, revision=head.d_rev, limits=self.limits)
        if head.version_id is not None and head.v_root is not None:
            return View(trees=self.trees, project_id=project_id, kind="version", root=Digest(head.v_root),
                        overlay={}, characters=loads(head.v_chars), world_settings=loads(head.v_world),
                        version_id=head.version_id, limits=self.limits)
        return View(trees=self.trees, project_id=project_id, kind="empty", root=EMPTY_TREE, overlay={},
                    characters={}, world_settings={}, limits=self.limits)

    def view_at(self, project_id: str, version_id: str) -> View:
        """The state of one version of the project. Raises ``version.not_found``."""
        with self._tx(read_only=True) as conn:
            self._load_project(conn, project_id)
            return self._version_view(self._load_version(conn, version_id, project_id))

    def view_at_turn(self, turn_id: str, boundary: str = "end") -> View:
        """The state at a turn's ``"start"`` or ``"end"`` (code, characters, world settings).

        Raises ``turn.not_found``, and ``turn.already_running`` for the end of
        a turn that has not ended yet.
        """
        if boundary not in ("start", "end"):
            raise E.InvalidInput('boundary is "start" or "end"', boundary=boundary)
        with self._tx(read_only=True) as conn:
            t = self._load_turn(conn, turn_id)
        root = t.start_root if boundary == "start" else t.end_root
        state_digest = t.start_state_digest if boundary == "start" else t.end_state_digest
        if root is None or state_digest is None:
            raise E.TurnAlreadyRunning(f"turn {turn_id} has no recorded {boundary} yet ({t.status})",
                                       turn_id=turn_id, status=t.status)
        state = json.loads(self.blobs.get(Digest(state_digest)))
        return View(trees=self.trees, project_id=t.project_id, kind=f"turn_{boundary}", root=Digest(root),
                    overlay={}, characters=state["characters"], world_settings=state["world_settings"],
                    draft_id=t.draft_id, limits=self.limits)

    def resolve(self, ref: "View | str") -> View:
        """A state from a reference: a ``View``; a version id; ``draft:<project_id>``
        (the draft, else head); ``head:<project_id>``; ``turn:<turn_id>:start|end``."""
        if isinstance(ref, View):
            return ref
        if not isinstance(ref, str) or not ref:
            raise E.InvalidInput("a state reference is a View or a string", ref=str(ref)[:100])
        kind, _, rest = ref.partition(":")
        if kind == "draft" and rest:
            return self.view(rest)
        if kind == "head" and rest:
            project = self.get_project(rest)
            if project.current_version_id is None:
                raise E.VersionNotFound(f"project {rest} has no version yet", project_id=rest)
            return self.view_at(rest, project.current_version_id)
        if kind == "turn" and rest:
            turn_id, _, boundary = rest.partition(":")
            return self.view_at_turn(turn_id, boundary or "end")
        with self._tx(read_only=True) as conn:
            return self._version_view(self._load_version(conn, ref))

    def diff(self, a: "View | str", b: "View | str", *, text: bool = True, detect_renames: bool = True) -> Any:
        """What changed from state ``a`` to state ``b`` (see ``resolve`` for references).

        Per file: added | modified | deleted | renamed, with a unified diff for
        text files; JSON Patch operations for characters and world settings.
        Identical subtrees are skipped: cost grows with the change, not with
        project size.
        """
        from .diff import diff_views

        return diff_views(self.resolve(a), self.resolve(b), text=text, detect_renames=detect_renames)

    def _version_view(self, v: Any) -> View:
        return View(trees=self.trees, project_id=v.project_id, kind="version", root=Digest(v.code_manifest_key),
                    overlay={}, characters=loads(v.characters_json), world_settings=loads(v.world_settings_json),
                    version_id=v.id, limits=self.limits)

    # ----------------------------------------------------------------- recovery
    def sweep(self) -> dict[str, int]:
        """Recovery sweep: finish what dead workers left.

        - a running turn whose heartbeat lapsed (and that is older than the
          heartbeat TTL) is interrupted, which seals its writes;
        - a draft stuck in ``publishing`` longer than ``publishing_stuck_s``
          is released back to ``interrupted``.
        Safe to run from many replicas at once. Returns counts.
        """
        now = utcnow()
        reaped = released = 0
        with self._tx(read_only=True) as conn:
            running = conn.execute(sa.select(T.c.id, T.c.started_at).where(T.c.status == TurnStatus.RUNNING)).all()
            stuck = conn.execute(sa.select(D.c.id, D.c.status_changed_at)
                                 .where(D.c.status == DraftStatus.PUBLISHING, D.c.closed_at.is_(None))).all()
        for tid, started in running:
            age = (now - aware(started)).total_seconds()
            if age > self.settings.heartbeat_ttl_s and not self.coord.alive(f"turn:{tid}"):
                try:
                    self.interrupt_turn(tid)
                    reaped += 1
                except E.TurnNotRunning:
                    pass
        for did, changed in stuck:
            if (now - aware(changed)).total_seconds() > self.settings.publishing_stuck_s:
                self._release_publishing(did, DraftStatus.INTERRUPTED)
                released += 1
        return {"turns_reaped": reaped, "publishing_released": released}

    # ------------------------------------------------------------------- events
    def events(self, stream: str, after: int = 0, limit: int = 1000) -> list[Any]:
        """Buffered events of ``turn:<id>`` or ``project:<id>`` with id > ``after``.

        Includes every event this store emitted before the call.
        """
        self._events.flush()
        return self.coord.read(stream, after=after, limit=limit)


class _MergedState:
    """Sealed tree + overlay rows + this batch's pending changes, for write checks."""

    def __init__(self, trees: TreeReader, root: Digest, overlay: dict[str, OverlayEntry]) -> None:
        self.trees = trees
        self.root = root
        self.overlay = overlay

    def set(self, path: str, value: OverlayEntry) -> None:
        self.overlay[path] = value

    def file(self, path: str) -> OverlayEntry:
        return merged_file(self.trees, self.root, self.overlay, path)

    def is_dir(self, path: str) -> bool:
        return merged_is_dir(self.trees, self.root, self.overlay, path)
