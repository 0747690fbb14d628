"""The ``Store``: one facade over the components, each of which owns its SQL.

::

    Store
    ├── projects    projects, versions, head moves, rollback      (projects.py)
    ├── drafts      the open draft of a project                   (drafts.py)
    ├── staging     a running turn's writes and JSON patches      (staging.py)
    ├── sealing     overlay -> tree objects, inside the caller's transaction (sealing.py)
    ├── turns       begin, end, heartbeats, recovery sweep        (turns.py)
    ├── toolcalls   record, offload, compact, read the history    (toolcalls.py)
    ├── publishing  publish, discard                              (publishing.py)
    ├── reverting   revert the draft to a turn's start            (reverting.py)
    ├── snapshots   sandbox snapshots, the best one of a state, materialise (snapshots.py)
    ├── sandboxes   sandbox sessions: open, heartbeat, close, lost (sandboxes.py)
    └── states      views, pinned views, references, diffs        (states.py)
    each built from the narrow handles it uses, passed to its constructor:
    ├── Database      engine, transactions, one-shot statements, group commit   (database.py)
    ├── Objects       blob store (raw), pack-aware reader, trees, upload pool   (objects.py)
    └── Coordination  coordinator, event publisher, activity                    (coordination.py)

Correctness comes from the relational database alone: each operation is one
transaction guarded by row locks and compare-and-swap on rows; the blob store
only ever receives immutable, content-addressed objects *before* the
transaction that refers to them commits; the coordinator carries events and
heartbeats and may be flushed at any time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine

from . import errors as E
from . import idprefix
from .blobs import BlobStore, ObjectCache, open_blob_store
from .coord import Coordinator, open_coordinator
from .coord.base import Event
from .coordination import Coordination
from .database import Database
from .db.engine import create_db_engine, is_sqlite
from .db.migrate import check_schema, upgrade
from .deltas import Deltas
from .diff import Diff
from .drafts import Drafts
from .events import MAX_PAGE as MAX_EVENT_PAGE
from .events import Activity
from .fsck import FsckReport
from .gc import GCStats, Retention
from .maintenance import Maintenance
from .objects import Objects
from .packing import Packing
from .packlocator import PackLocator
from .projects import Projects
from .publishing import Publishing
from .records import (ContinuedTurn, Draft, HeadMove, Page, Project, ResumeContext, SandboxSession, SandboxStatus,
                      Snapshot, ToolCall, Turn, TurnEndReason, Version)
from .resume import Resume
from .reverting import Reverting
from .sandboxes import Sandboxes
from .search import PackedIndexes, Planner
from .sealing import Sealing
from .settings import Settings
from .snapshots import Materialized, Snapshots
from .staging import Staging
from .states import States
from .tokens import Tokens
from .toolcalls import ToolCalls
from .turns import Turns
from .view import View

__all__ = ["Store"]


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
        settings = settings or Settings.load()
        cache = cache if cache is not None else getattr(blobs, "cache", ObjectCache(settings.cache_bytes))
        self.settings, self.limits = settings, settings.limits
        #: work running on this store in this process: ``with store.activity.running(): ...`` marks a
        #: span (the service marks each hot request); background work (event appends) waits for a gap
        self.activity = activity = Activity()
        # the three handles, each whole when built: the pack locator reads the database, the
        # pack-aware reader is handed the locator, and the components get only what they use
        #: the relational database handle: ``engine`` (transactions), ``autocommit`` (the pool of
        #: one-statement connections), ``group_commit`` (its counters say how records were grouped)
        self.database = db = Database(engine, activity, group_commit=settings.group_commit)
        self._objects = objects = Objects(blobs, cache, PackLocator(db).locate,
                                          pack_cache_bytes=settings.pack_cache_bytes,
                                          upload_threads=settings.upload_threads)
        self._coordination = coordination = Coordination(coord, activity, event_ttl_s=settings.event_ttl_s)
        self.engine, self.blobs, self.coord, self.cache, self.trees = engine, blobs, coord, cache, objects.trees
        limits = settings.limits
        sealing = Sealing(db, objects)
        self._packing = Packing(db, objects)
        self._projects = Projects(db, coordination, limits, self._packing)
        self._drafts = Drafts(db)
        self._staging = Staging(db, objects, coordination, limits)
        self._toolcalls = ToolCalls(db, objects, coordination, limits)
        self._turns = Turns(db, objects, coordination, settings, self._projects, self._drafts, sealing,
                            self._toolcalls, Deltas(db, coordination, limits))
        #: API tokens of the HTTP service: ``create``, ``page``, ``revoke``, ``authenticate``
        self.tokens = Tokens(db)
        search = Planner(PackedIndexes(packs=self._packing, blobs=objects.raw, objects=objects.pack_aware,
                                       cache=objects.cache, in_parallel=objects.in_parallel))
        self._states = States(db, objects, limits, self._projects, search)
        self._snapshots = Snapshots(db, objects, coordination, limits, self._packing, self._states.state_of)
        self._sandboxes = Sandboxes(db, self._states.state_of, heartbeat_ttl_s=settings.sandbox_heartbeat_ttl_s)
        self._resume = Resume(db, objects.trees, settings, self._states, self._toolcalls)
        self._maintenance = Maintenance(db, objects, settings)
        self._publishing = Publishing(db, coordination, settings, self._projects, self._drafts, sealing,
                                      self._turns, self._snapshots)
        self._reverting = Reverting(db, objects, coordination, self._projects, self._drafts)

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
        ``schema.outdated`` is raised; ``migrate=True`` forces an upgrade. Opening
        also runs the statements of a first read once (for nothing), so a fresh
        process's first request does not pay their compilation.
        """
        s = settings or Settings.load()
        updates = {k: v for k, v in (("database_url", database_url), ("blob_url", blob_url),
                                     ("coord_url", coord_url)) if v is not None}
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
        except sa_exc.SQLAlchemyError as exc:  # a migration the database refused: it rolled back
            engine.dispose()
            raise E.BackendError(f"schema migration failed, nothing was changed: {exc}") from exc
        cache = ObjectCache(s.cache_bytes)
        blobs = open_blob_store(s.resolved_blob_url(), cache=cache)
        coord = open_coordinator(s.resolved_coord_url())
        store = cls(engine, blobs, coord, settings=s, cache=cache)
        store._warm_up()
        return store

    def _warm_up(self) -> None:
        """Compile the statements of a first read (a view, the pack rows of a tree) and
        start the read pool on open, so the first request does not pay it. Failures are
        left to that request."""
        self._objects.start_readers()
        try:
            self._states.warm_up()
            self._packing.warm_up()
        except (E.DraftstoreError, sa_exc.SQLAlchemyError):
            pass

    @classmethod
    def from_env(cls) -> "Store":
        """Open the store the ``DRAFTSTORE_*`` environment describes (embedded if none)."""
        return cls.open()

    def close(self) -> None:
        """Wait for the uploads, reads and event appends in flight, then close the backends."""
        self._objects.close()
        self._coordination.close()
        self.database.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- projects
    def create_project(self, name: str, files: Mapping[str, bytes | str] | None = None, characters: Any = None,
                       world_settings: Any = None, *, actor: str | None = None, executable: Any = ()) -> Project:
        """Create a project. Given any initial content, it becomes version 1 (the head).

        The files are stored in packs (a few objects, not one per file); the
        paths in ``executable`` are executable files. Atomic: on any error
        (``path.denied``, ``payload.too_large``, ...) no project exists.
        """
        return self._projects.create(name, files, characters, world_settings, actor, executable)

    def fork_project(self, version_id: str, name: str, *, actor: str | None = None) -> Project:
        """A new project whose version 1 is ``version_id`` of another project.

        Restores an old state without touching the original project; objects
        are shared (content addressing), nothing is copied.
        """
        return self._projects.fork(version_id, name, actor)

    def get_project(self, project_id: str) -> Project:
        """The project's row: head (``current_version_id``) and ``active_draft_id``."""
        return self._projects.get(project_id)

    def resolve_id(self, kind: str, text: str, *, project_id: str | None = None) -> str:
        """The full id of the ``kind`` record (project, version, turn, token,
        snapshot) whose id starts with ``text`` (a unique prefix of at least 6
        characters). Raises ``input.invalid`` or the kind's not-found code."""
        return idprefix.resolve(self.database, kind, text, project_id=project_id)

    def list_projects(self) -> list[Project]:
        """Every project, oldest first."""
        return self._projects.list()

    def get_version(self, version_id: str, *, project_id: str | None = None) -> Version:
        """One version (of ``project_id``, if given). Raises ``version.not_found``."""
        return self._projects.get_version(version_id, project_id)

    def list_versions(self, project_id: str) -> list[Version]:
        """Every version of the project, oldest first (rollback deletes none)."""
        return self._projects.list_versions(project_id)

    def head_moves(self, project_id: str) -> list[HeadMove]:
        """Every head move of the project, oldest first: who, when, from, to, why."""
        return self._projects.head_moves(project_id)

    def get_draft(self, project_id: str) -> Draft:
        """The project's active draft. Raises ``draft.none``."""
        return self._drafts.get(project_id)

    # ------------------------------------------------------------------- turns
    def start_turn(self, project_id: str, user_message: Any, *, actor: str | None = None) -> Turn:
        """Start a QA turn; derive a draft from head if the project has none.

        ``user_message`` is any JSON value (a string, or a structured chat
        message such as ``{"role": "user", "content": [...]}``); ``actor`` is
        recorded on the turn. Raises ``turn.already_running`` while another
        turn of the project runs (the database enforces one running turn per
        project) and ``draft.busy`` while the draft is being published.
        """
        return self._turns.begin(project_id, user_message, actor, require_draft=False)

    def continue_turn(self, project_id: str, user_message: Any, *, actor: str | None = None,
                      from_turn_id: str | None = None) -> ContinuedTurn:
        """A new turn on the same draft, answered with its resume context inline.

        Continuing never resumes an old process: whatever the previous turn
        left in the draft (sealed when it ended) is where the new one starts.
        The answer is the new ``Turn`` plus ``context``: the first page of
        ``resume_context`` for it (the draft's earlier turns, unfinished tool
        calls flagged, and what the draft changed), so one call is enough.
        ``from_turn_id`` names the turn continued (default: the draft's last);
        it must be an ended turn of the draft, else ``turn.conflict`` (nothing
        changes). Raises ``draft.none`` if the project has no draft to continue.
        ``context`` is None only if it could not be read once the turn started
        (a backend error): ``resume_context(turn.id)`` reads it then.
        """
        return self._resume.continued(
            self._turns.begin(project_id, user_message, actor, require_draft=True, from_turn_id=from_turn_id))

    def resume_context(self, turn_id: str, *, max_turns: int | None = None, max_bytes: int | None = None,
                       cursor: str | None = None) -> ResumeContext:
        """Everything a backend needs to rebuild the model's context for ``turn_id``:
        the earlier turns of its draft since the base version, oldest first
        (messages or partial response, end status and reason, tool calls with
        args and results or digests and previews, unfinished calls flagged;
        reverted turns left out), and the paths the draft added, modified and
        deleted. At most ``max_turns`` turns (``DRAFTSTORE_RESUME_MAX_TURNS``)
        and about ``max_bytes`` (``DRAFTSTORE_RESUME_MAX_BYTES``; one turn at
        least) a page: ``truncated`` and ``cursor`` fetch the rest. Reads only.
        Raises ``turn.not_found``, ``input.invalid`` (a bound, a cursor).
        """
        return self._resume.context(turn_id, max_turns, max_bytes, cursor)

    def heartbeat(self, turn_id: str) -> None:
        """Mark a running turn's worker alive; the recovery sweep reaps turns whose beat lapsed.

        Raises ``turn.not_running`` once the turn has ended (interrupted by a
        sweep, cancelled, ...): that is how a worker learns to stop.
        """
        self._turns.heartbeat(turn_id)

    def complete_turn(self, turn_id: str, assistant_message: Any) -> Turn:
        """End a running turn successfully; seal its writes; the draft waits (``paused``).

        ``assistant_message`` is any JSON value. Atomic: the turn's status, its
        end root, its end state and its compacted tool history commit together.
        """
        return self._turns.complete(turn_id, assistant_message)

    def interrupt_turn(self, turn_id: str, partial_response: Any = None) -> Turn:
        """Stop a running turn; its writes so far stay in the draft (sealed).

        ``partial_response`` is a UI cache kept on the turn and the draft;
        never model context. After this, any write through the turn is
        refused with ``turn.not_running``.
        """
        return self._turns.interrupt(turn_id, partial_response)

    def fail_turn(self, turn_id: str, error: Any) -> Turn:
        """End a running turn as failed with ``error`` (any JSON value); its writes stay in the draft (sealed)."""
        return self._turns.fail(turn_id, error)

    def get_turn(self, turn_id: str, *, tool_calls: bool = True) -> Turn:
        """A turn with its whole tool-call history, in ``seq`` order (``tool_calls=False``: without it)."""
        return self._turns.get(turn_id) if tool_calls else self._turns.summary(turn_id)

    def cancel_turn(self, turn_id: str) -> Turn:
        """Stop a running turn at a user's request: ``interrupted`` with ``end_reason``
        ``cancelled`` (not a failure); its writes stay in the draft, sealed."""
        return self._turns.interrupt(turn_id, reason=TurnEndReason.CANCELLED)

    def append_delta(self, turn_id: str, text: str) -> None:
        """Stream assistant text of a running turn to its event buffer (``assistant.delta``);
        never a row per delta: the partial response is refreshed at most once a second.
        The delta is in the buffer when this returns (it is recorded nowhere else);
        raises ``backend.unavailable`` if the coordinator refused it, ``turn.not_running``."""
        self._turns.deltas.append(turn_id, text)

    def list_turns(self, project_id: str) -> list[Turn]:
        """Every turn of the project, oldest first (tool calls not loaded: see ``get_turn``)."""
        return self._turns.list(project_id)

    # Pages: keyset paging with opaque cursors (``Page.next_cursor``), at most 200 items a page.
    def page_projects(self, cursor: str | None = None, limit: int | None = None) -> Page[Project]:
        return self._projects.page(cursor, limit)

    # Versions, head moves and turns page oldest first, or newest first with ``newest_first=True``
    # (a cursor of one order is ``input.invalid`` in the other).
    def page_versions(self, project_id: str, cursor: str | None = None, limit: int | None = None, *,
                      newest_first: bool = False) -> Page[Version]:
        return self._projects.versions_page(project_id, cursor, limit, newest_first)

    def page_head_moves(self, project_id: str, cursor: str | None = None, limit: int | None = None, *,
                        newest_first: bool = False) -> Page[HeadMove]:
        return self._projects.head_moves_page(project_id, cursor, limit, newest_first)

    def page_turns(self, project_id: str, cursor: str | None = None, limit: int | None = None, *,
                   newest_first: bool = False) -> Page[Turn]:
        return self._turns.page(project_id, cursor, limit, newest_first)

    def page_tool_calls(self, turn_id: str, cursor: str | None = None, limit: int | None = None) -> Page[ToolCall]:
        return self._toolcalls.page(turn_id, cursor, limit)

    # -------------------------------------------------------------- tool calls
    def tool_started(self, turn_id: str, tool_name: str, args: Any = None, *,
                     needs_approval: bool = False, idempotency_key: str | None = None) -> ToolCall:
        """Record that a tool call began; returns it with its ``seq`` (1, 2, 3, ... per turn).

        One row insert whatever the length of the history (O(1)). Raises
        ``turn.not_running`` once the turn has ended. ``needs_approval=True``
        records it ``awaiting_approval`` until ``decide_tool_call``.
        ``idempotency_key`` (1-200 visible ASCII characters) makes a retry safe: while
        the turn runs, a start with a key it already recorded returns that call as it
        stands now (same ``seq``) and records nothing; the same key with another tool
        name, args or ``needs_approval`` raises ``idempotency.conflict``.
        """
        return self._toolcalls.started(turn_id, tool_name, args, needs_approval, idempotency_key)

    def decide_tool_call(self, turn_id: str, seq: int, approved: bool, reason: Any = None, *,
                         actor: str | None = None) -> ToolCall:
        """Approve (the call becomes ``started``) or deny (``denied``: final, not a turn
        failure) a call awaiting approval; the decision stays in the history."""
        return self._toolcalls.decide(turn_id, seq, approved, reason, actor)

    def tool_completed(self, turn_id: str, seq: int, result: Any = None) -> None:
        """Record a started call's result. Raises ``toolcall.not_found``,
        ``toolcall.already_finished``, ``turn.not_running``."""
        self._toolcalls.completed(turn_id, seq, result)

    def tool_failed(self, turn_id: str, seq: int, error: Any) -> None:
        """Record that a started call failed with ``error`` (any JSON value; a string stays valid)."""
        self._toolcalls.failed(turn_id, seq, error)

    def read_payload(self, digest: str) -> Any:
        """An offloaded tool-call payload (``args_digest`` / ``result_digest``), decoded."""
        return self._toolcalls.read_payload(digest)

    def tool_call_payload(self, turn_id: str, seq: int, part: str) -> Any:
        """The whole ``args`` or ``result`` (``part``) of call ``seq`` of the turn, decoded,
        whether inline or offloaded (None: no result yet, or none). Reads only. Raises
        ``turn.not_found``, ``toolcall.not_found``, ``input.invalid``."""
        return self._toolcalls.payload(turn_id, seq, part)

    # ------------------------------------------------------------------ writes
    def write_file(self, turn_id: str, path: str, data: bytes | str, *, executable: bool = False) -> None:
        """Write one file into the draft of a running turn.

        The blob is stored first, then one transaction upserts the overlay
        row and bumps the draft revision; no tree object is written until the
        turn ends. Raises ``path.denied``, ``payload.too_large``,
        ``path.conflict`` (a file where a directory is, or under a file),
        ``limit.exceeded``, ``turn.not_running``, ``input.invalid`` (``data``
        is None: deleting is ``delete_file``); on error nothing changes.
        ``executable=True`` marks it an executable file.
        """
        self._staging.write_file(turn_id, path, data, executable)

    def delete_file(self, turn_id: str, path: str) -> None:
        """Delete one file from the draft. Raises ``path.not_found`` if absent."""
        self._staging.delete_file(turn_id, path)

    def move_file(self, turn_id: str, src: str, dst: str, *, overwrite: bool = False) -> None:
        """Rename a file, atomically (no content is copied). Raises ``path.not_found``;
        ``path.conflict`` if ``dst`` is a directory, or a file and ``overwrite`` is not set."""
        self._staging.move_file(turn_id, src, dst, overwrite)

    def apply_changes(self, turn_id: str, changes: Mapping[str, bytes | str | None], *,
                      executable: Any = ()) -> None:
        """Apply a batch ``{path: content | None}`` (None deletes) atomically: all or nothing.
        Written paths listed in ``executable`` are executable files."""
        self._staging.apply_changes(turn_id, changes, executable)

    def patch_characters(self, turn_id: str, patch: Any) -> Any:
        """Patch the draft's characters JSON; returns the new value.

        A list is a JSON Patch (RFC 6902), a dict a JSON Merge Patch (RFC 7386).
        Atomic; raises ``patch.invalid``, ``payload.too_large``, ``turn.not_running``.
        """
        return self._staging.patch(turn_id, "characters_json", "characters", patch)

    def patch_world_settings(self, turn_id: str, patch: Any) -> Any:
        """Patch the draft's world-settings JSON (as ``patch_characters``)."""
        return self._staging.patch(turn_id, "world_settings_json", "world_settings", patch)

    # ------------------------------------------------------- publish, rollback
    def publish(self, project_id: str, summary: str = "", *, force: bool = False,
                actor: str | None = None) -> Version:
        """Turn the active draft into a new version and make it head; clears the draft.

        Atomic: the version row, the head move and the draft's closing commit
        together or not at all. Raises ``draft.none``; ``draft.busy`` while a
        turn runs; ``draft.conflict`` when the draft's base is no longer head
        (``force=True`` publishes anyway, on top of the current head). Two
        racing publishes produce exactly one version.
        """
        return self._publishing.publish(project_id, summary, force, actor)

    def discard_draft(self, project_id: str, *, actor: str | None = None) -> Draft:
        """Roll back unfinished work: drop the draft, the project is back at its head.

        A turn still running on it ends as ``rolled_back`` (its worker's late
        writes are refused); the draft's turns stay readable. ``actor`` is
        recorded as the draft's ``closed_by``. Raises ``draft.none``,
        ``draft.busy`` (being published).
        """
        return self._publishing.discard(project_id, actor)

    def revert_draft(self, project_id: str, to_turn_id: str, *, actor: str | None = None) -> Draft:
        """Undo the draft's turns from ``to_turn_id`` on: its files, characters and world
        settings become exactly that turn's start state.

        Atomic (one transaction, compare-and-swap on the draft row); a refused revert
        changes nothing. The undone turns (``to_turn_id`` and the later ones of the
        draft) stay readable, with ``reverted_at``/``reverted_by`` set; the revert is
        recorded in ``head_moves`` (reason ``revert``, head unchanged, ``turn_id``).
        Raises ``turn.not_found`` (also for another project's turn), ``draft.none``,
        ``draft.busy`` while a turn runs or a publish is under way, ``turn.conflict``
        for a turn of an earlier draft or one reverted already, ``state.not_found``
        when the turn's start state is no longer kept.
        """
        return self._reverting.revert(project_id, to_turn_id, actor)

    def rollback_to(self, project_id: str, version_id: str, *, actor: str | None = None) -> Project:
        """Move head to ``version_id`` (one of the project's versions); deletes nothing.

        The move is recorded in ``head_moves``. An open draft is left alone:
        its base is then no longer head, so publishing it is a conflict.
        Raises ``version.not_found``.
        """
        return self._projects.rollback_to(project_id, version_id, actor)

    # -------------------------------------------------------------------- views
    def view(self, project_id: str) -> View:
        """The newest state: the active draft (with its unsealed writes), else head.

        The view is pinned: the draft row and its overlay are read by one
        statement (one snapshot) and copied; later reads never see later
        writes. Raises ``project.not_found``.
        """
        return self._states.view(project_id)

    def view_at(self, project_id: str, version_id: str) -> View:
        """The state of one version of the project. Raises ``version.not_found``."""
        return self._states.view_at(project_id, version_id)

    def view_at_turn(self, turn_id: str, boundary: str = "end") -> View:
        """The state at a turn's ``"start"`` or ``"end"`` (code, characters, world settings).

        Raises ``turn.not_found``, and ``turn.already_running`` for the end of
        a turn that has not ended yet.
        """
        return self._states.view_at_turn(turn_id, boundary)

    def resolve(self, ref: View | str) -> View:
        """A state from a reference: a ``View``; a version id; ``draft:<project_id>``
        (the draft, else head); ``head:<project_id>``; ``turn:<turn_id>:start|end``."""
        return self._states.resolve(ref)

    def diff(self, a: View | str, b: View | str, *, text: bool = True, detect_renames: bool = True,
             cursor: str | None = None, limit: int | None = None) -> Diff:
        """What changed from state ``a`` to state ``b`` (see ``resolve`` for references).

        Per file: added | modified | deleted | renamed, with a unified diff for
        text files; JSON Patch operations for characters and world settings.
        Identical subtrees are skipped: cost grows with the change, not with
        project size. With ``cursor`` or ``limit``: one page of the changed files
        (path order; ``limit`` capped, and a page also ends once its text diffs
        reach 4 MiB), ``next_cursor`` for the next; the JSON Patch operations come
        with the first page only.
        """
        return self._states.diff(a, b, text=text, detect_renames=detect_renames, cursor=cursor, limit=limit)

    # ------------------------------------------------------- snapshots, packs
    def create_snapshot(self, project_id: str, source: str = "head", *, progress: Any = None) -> Snapshot:
        """Build a sandbox snapshot (tar + zstd bundle) of ``source`` — ``head``, ``draft`` or a
        version id — now. ``draft.busy`` while a turn has unsealed writes in the draft."""
        return self._snapshots.create(project_id, source, progress)

    def record_snapshot(self, project_id: str, source: str, external_ref: str) -> Snapshot:
        """Record an external sandbox snapshot (e.g. a provider's snapshot id) of ``source`` as ready."""
        return self._snapshots.record(project_id, source, external_ref)

    def list_snapshots(self, project_id: str) -> list[Snapshot]:
        """The project's snapshots, oldest first (a cache: any of them may be deleted)."""
        return self._snapshots.list(project_id)

    def page_snapshots(self, project_id: str, cursor: str | None = None, limit: int | None = None) -> Page[Snapshot]:
        """One page of ``list_snapshots``, ``next_cursor`` for the next."""
        return self._snapshots.page(project_id, cursor, limit)

    def best_snapshot(self, project_id: str, state: str = "draft") -> Snapshot | None:
        """The ready snapshot that restores ``state`` (``draft``: the draft, else head; ``head``; a
        version id) exactly, its root being the state's root: an external one first, else a bundle;
        None when none fits (then rebuild from the blobs). Raises ``project.not_found``,
        ``version.not_found``, ``state.not_found``."""
        return self._snapshots.best(project_id, state)

    def materialize(self, project_id: str, dest_dir: Any, state: str = "draft", *, replace: bool = False,
                    progress: Any = None, use_snapshot: bool = True) -> Materialized:
        """Write the exact files of ``state`` (``draft``: the draft, else head; ``head``; a version id)
        into ``dest_dir`` (executable bits kept; nothing outside it touched; a non-empty one is refused
        with ``path.conflict`` unless ``replace``). From a ready snapshot of that very tree, else rebuilt
        from the blobs (always, with ``use_snapshot=False``); the answer says which (``path``) with counts.
        If it fails (an object missing from the blob store, say), ``dest_dir`` is left empty: never a
        partial tree."""
        return self._snapshots.materialize(project_id, dest_dir, state, replace, progress, use_snapshot)

    def run_background(self, limit: int = 10) -> dict[str, int]:
        """The work kept off request paths: write the packs of newly published versions and
        of open drafts' sealed trees, build pending snapshots. Safe to run from many
        processes. Returns counts."""
        packed = self._projects.pack_pending(limit)  # a failing version is logged and skipped
        drafts = self._projects.pack_open_drafts(limit)
        return {"versions_packed": packed, "drafts_packed": drafts,
                "snapshots_built": self._snapshots.build_pending(limit)}

    # ---------------------------------------------------------- sandbox sessions
    def open_sandbox(self, project_id: str, provider: str, external_id: str, *, state: str = "draft",
                     turn_id: str | None = None, snapshot_id: str | None = None,
                     status: str = "starting") -> SandboxSession:
        """Record a sandbox a ``provider`` runs (its id there: ``external_id``) on ``state``
        (``draft``: the draft, else head; ``head``; a version id), for ``turn_id``, restored from
        ``snapshot_id``; its first status is ``starting``, ``ready`` or ``paused``, and it counts as
        seen now. Raises ``project.not_found``, ``version.not_found``, ``state.not_found``,
        ``turn.not_found`` / ``snapshot.not_found`` (not of this project), ``input.invalid``."""
        return self._sandboxes.open(project_id, state, provider, external_id, turn_id, snapshot_id, status)

    def sandbox_heartbeat(self, session_id: str, status: str | None = None, *,
                          project_id: str | None = None) -> SandboxSession:
        """Mark the session seen now, and set ``status`` (``ready``, ``paused``, ``closed``,
        ``lost``; ``starting`` only while it starts) if given. Atomic. Raises ``sandbox.not_found``
        (also for a session of another project than ``project_id``), ``sandbox.conflict`` once
        it is ``closed`` or ``lost`` (final: nothing changes), ``input.invalid``."""
        return self._sandboxes.change(session_id, project_id, status, frozenset(SandboxStatus))

    def close_sandbox(self, session_id: str, *, project_id: str | None = None) -> SandboxSession:
        """Close the session (final). Idempotent: a closed one is returned unchanged. Raises
        ``sandbox.not_found``, ``sandbox.conflict`` for a ``lost`` one."""
        return self._sandboxes.close(session_id, project_id)

    def get_sandbox(self, session_id: str, *, project_id: str | None = None) -> SandboxSession:
        """One session. Raises ``sandbox.not_found`` (also for one of another project than ``project_id``)."""
        return self._sandboxes.get(session_id, project_id)

    def page_sandboxes(self, project_id: str, status: str | None = None, cursor: str | None = None,
                       limit: int | None = None) -> Page[SandboxSession]:
        """One page of the project's sessions, oldest first (only those of ``status``, if given).
        Raises ``project.not_found``, ``input.invalid``."""
        return self._sandboxes.page(project_id, status, cursor, limit)

    # ------------------------------------------------------------- maintenance
    def gc(self, dry_run: bool = True, *, progress: Any = None) -> GCStats:
        """Garbage collection: mark everything retained, sweep unreachable objects older than
        ``gc_grace_s`` (see ``draftstore.gc``). ``dry_run`` (the default) deletes nothing."""
        return self._maintenance.gc(dry_run, progress)

    def fsck(self, *, verify_objects: bool = True, progress: Any = None) -> FsckReport:
        """Check that every reference resolves and (``verify_objects``) every object hashes to its
        key; ``report.problems`` names each row and key at fault."""
        return self._maintenance.fsck(verify_objects, progress)

    def retention(self, project_id: str) -> Retention:
        """A project's retention (its own settings, else the store's defaults)."""
        return self._maintenance.retention(project_id)

    def set_retention(self, project_id: str, **days: Any) -> Retention:
        """Per-project retention: ``turns_days`` (ended turns' boundary states and payloads),
        ``discarded_days`` (discarded drafts' trees); a number of days, or None for the default."""
        return self._maintenance.set_retention(project_id, days)

    def prune_versions(self, project_id: str, version_ids: Any, *, force: bool = False) -> int:
        """Delete versions (an explicit admin act; retention never does). Refuses head always, and
        versions a head move names (``version.protected``) unless ``force``. Returns how many."""
        return self._maintenance.prune_versions(project_id, version_ids, force)

    # ----------------------------------------------------------------- recovery
    def sweep(self) -> dict[str, int]:
        """Recovery sweep: finish what dead workers left.

        - a running turn whose heartbeat lapsed (and that is older than the
          heartbeat TTL) is interrupted, which seals its writes;
        - a draft stuck in ``publishing`` longer than ``publishing_stuck_s``
          (left by an older release) is released back to ``interrupted``;
        - an open sandbox session not seen for ``sandbox_heartbeat_ttl_s`` is ``lost``.
        Safe to run from many replicas at once. Returns counts
        (``turns_reaped``, ``turns_failed``: could not be ended now, logged and
        left for the next sweep; ``publishing_released``; ``sandboxes_lost``).
        """
        reaped, failed = self._turns.reap()
        return {"turns_reaped": reaped, "turns_failed": failed,
                "publishing_released": self._publishing.release_stuck(),
                "sandboxes_lost": self._sandboxes.mark_lost()}

    def check_backends(self) -> dict[str, str | None]:
        """Each backend (``database``, ``blobs``, ``coordinator``) -> None if usable, else why not.
        Never raises: a probe that fails is reported (for readiness probes)."""
        return {name: _probe(ping) for name, ping in (("database", self.database.ping), ("blobs", self._objects.ping),
                                                      ("coordinator", self._coordination.ping))}

    # ------------------------------------------------------------------- memory
    def clear_caches(self) -> None:
        """Forget every object, tree and pack this store holds in memory, so the next
        reads fetch from the blob store (what a fresh process would do). Objects are
        immutable: reads return the same before and after; nothing stored changes."""
        self._objects.clear_caches()

    def cached_packs(self) -> frozenset[str]:
        """Digests of the packs this store holds decoded in memory: packs a read
        fetched whole (a read that needed a few files of a pack fetches only their
        frames, and leaves the pack out of this set)."""
        return self._objects.pack_aware.packs.digests()

    # ------------------------------------------------------------------- events
    def events(self, stream: str, after: int = 0, limit: int = MAX_EVENT_PAGE) -> list[Event]:
        """Buffered events of ``turn:<id>`` or ``project:<id>`` with id > ``after``, at most
        ``limit`` (1 to 1000, as the HTTP page: else ``input.invalid``).

        Includes every event this store emitted before the call.
        """
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_EVENT_PAGE:
            raise E.InvalidInput(f"limit is an integer from 1 to {MAX_EVENT_PAGE}", field="limit")
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise E.InvalidInput("after is an event id: an integer from 0", field="after")
        self._coordination.flush()
        return self.coord.read(stream, after=after, limit=limit)

    def flush_events(self, timeout: float = 10.0) -> bool:
        """Wait until every event this store queued before the call is appended to the
        coordinator's buffers (events are appended off the caller's path, a few
        milliseconds later). True once they are; False if ``timeout`` seconds passed first."""
        return self._coordination.flush(timeout)

    def durable_events(self, turn_id: str) -> list[tuple[str, dict[str, Any]]]:
        """A turn's events rebuilt from the database (``(type, data)``, in order), for a
        stream whose buffer was lost; text deltas are not durable and not included."""
        return self._turns.durable_events(turn_id)

    def durable_project_events(self, project_id: str, limit: int = 1000) -> list[tuple[str, dict[str, Any]]]:
        """A project's committed events rebuilt from the database (``(type, data)``, oldest
        first, the newest ``limit``): publishes, rollbacks, discarded drafts. For a
        project stream whose buffer was lost."""
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 10_000:
            raise E.InvalidInput("limit is an integer from 1 to 10000", field="limit")
        return self._projects.durable_events(project_id, limit)


def _probe(ping: Callable[[], None]) -> str | None:
    """None if ``ping()`` returns, else why it failed (a probe reports; it never raises)."""
    try:
        ping()
        return None
    except Exception as exc:
        return str(exc) or type(exc).__name__
