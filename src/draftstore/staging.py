"""Staging: the draft writes of a running turn (files, batches, moves, JSON patches).

A file write puts the blob, then ONE transaction locks the draft (bumping its
revision), re-reads the turn's status under that lock, checks the merged
state (sealed tree + overlay + this batch) and upserts overlay rows. No tree
object is written until the turn ends (see ``sealing``). The upload runs while
the transaction does its checks, and the transaction commits only after every
blob is stored: a row never names a missing blob, and on any error nothing
changes. The checks under the lock read tree nodes from memory only, and an
upload still running after ``LOCKED_WAIT_S`` is not waited for there: either
rolls the transaction back, the node is read or the upload awaited with
nothing locked, and the write runs again (``draftstore.deferred``). A slow
blob store never holds the draft row for long.

Only a running turn may change its draft: everything that ends a turn locks
the draft row first, so a write that gets the lock after an end sees the
turn ended and is refused with ``turn.not_running``.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import errors as E
from . import faults, patches
from . import validation as check
from .coordination import Coordination
from .database import Database
from .db.tables import DRAFTS, DRAFT_CHANGES, TURNS
from .deferred import awaited, retry_unlocked
from .digest import Digest, digest_of
from .objects import Objects
from .patches import merge_patch
from .paths import normalize_path, parent_dirs
from .records import TurnStatus
from .settings import Limits
from .trees import CachedNodes, FileEntry, StagedTree, file_entry

__all__ = ["Staging", "merge_patch"]

# attempts to patch a document read without a lock before patching it under the lock
_UNLOCKED_PATCH_ATTEMPTS = 3

# above this many paths, a batch reads the whole overlay instead of targeted rows
_TARGETED_OVERLAY_MAX = 16
_RUNNING = TurnStatus.RUNNING.value


@dataclass(frozen=True, slots=True)
class _Move:
    """A change that puts the file at ``src`` (as the draft holds it before the change) at
    the changed path; ``overwrite``: the path may already hold a file, which it replaces."""

    src: str
    overwrite: bool


class _Changed(Exception):
    """The document changed between its unlocked read and the lock."""


def _overlay_condition(n_paths: int) -> Any:
    """Overlay rows deciding the merged state of n paths: the paths and their
    parents (bind ``names``, expanding) and everything below each path
    (binds ``lo0``/``hi0``, ...: '/' is 0x2F and '0' 0x30, so the range
    [p + '/', p + '0') is exactly the paths below p)."""
    conds = [DRAFT_CHANGES.c.path.in_(sa.bindparam("names", expanding=True))]
    conds += [sa.and_(DRAFT_CHANGES.c.path > sa.bindparam(f"lo{i}"), DRAFT_CHANGES.c.path < sa.bindparam(f"hi{i}"))
              for i in range(n_paths)]
    return sa.or_(*conds)


class Staging:
    def __init__(self, db: Database, objects: Objects, coordination: Coordination, limits: Limits) -> None:
        self.db = db
        self.objects = objects
        self.coordination = coordination
        self.limits = limits
        # a write's first statement: lock the draft of the turn, bump its revision
        self._lock_draft = (
            DRAFTS.update()
            .where(DRAFTS.c.id == sa.select(TURNS.c.draft_id).where(TURNS.c.id == sa.bindparam("turn_id"))
                   .scalar_subquery())
            .values(revision=DRAFTS.c.revision + 1)
            .returning(DRAFTS.c.id, DRAFTS.c.revision, DRAFTS.c.code_manifest_key, DRAFTS.c.file_count,
                       DRAFTS.c.project_id, DRAFTS.c.characters_json, DRAFTS.c.world_settings_json)
        )
        self._turn_status = sa.select(TURNS.c.status).where(TURNS.c.id == sa.bindparam("turn_id"))
        self._status_and_overlay: dict[int | None, Any] = {}
        if db.sqlite:
            from sqlalchemy.dialects.sqlite import insert
        else:
            from sqlalchemy.dialects.postgresql import insert
        ins = insert(DRAFT_CHANGES)
        self._upsert_overlay = ins.on_conflict_do_update(
            index_elements=[DRAFT_CHANGES.c.draft_id, DRAFT_CHANGES.c.path],
            set_={"digest": ins.excluded.digest, "size": ins.excluded.size, "executable": ins.excluded.executable,
                  "revision": ins.excluded.revision})
        self._add_file_count = DRAFTS.update().where(DRAFTS.c.id == sa.bindparam("draft_id")).values(
            file_count=DRAFTS.c.file_count + sa.bindparam("delta"))

    # -- locking --------------------------------------------------------------------------
    def _not_running(self, conn: Connection, turn_id: str) -> E.DraftstoreError:
        status = conn.execute(self._turn_status, {"turn_id": turn_id}).scalar()
        return E.turn_refused(turn_id, status)

    def _lock(self, conn: Connection, turn_id: str) -> Any:
        """Lock the draft a running turn writes to (bumping its revision), then
        re-read the turn's status by a new statement: on PostgreSQL's read
        committed, an end that held the lock is seen, so a late write is refused."""
        draft = conn.execute(self._lock_draft, {"turn_id": turn_id}).first()
        status = conn.execute(self._turn_status, {"turn_id": turn_id}).scalar()
        if draft is None or status != _RUNNING:
            raise self._not_running(conn, turn_id)
        return draft

    def _status_overlay_stmt(self, n_paths: int | None) -> Any:
        stmt = self._status_and_overlay.get(n_paths)
        if stmt is None:
            on = DRAFT_CHANGES.c.draft_id == sa.bindparam("draft_id")
            if n_paths is not None:
                on = sa.and_(on, _overlay_condition(n_paths))
            stmt = (sa.select(TURNS.c.status, DRAFT_CHANGES.c.path, DRAFT_CHANGES.c.digest, DRAFT_CHANGES.c.size,
                              DRAFT_CHANGES.c.executable)
                    .select_from(TURNS.outerjoin(DRAFT_CHANGES, on)).where(TURNS.c.id == sa.bindparam("turn_id")))
            self._status_and_overlay[n_paths] = stmt
        return stmt

    def _lock_with_overlay(self, conn: Connection, turn_id: str,
                           paths: list[str]) -> tuple[Any, dict[str, FileEntry | None]]:
        """``_lock`` plus the overlay rows that decide the merged state of
        ``paths``, read with the turn's status in one statement."""
        draft = conn.execute(self._lock_draft, {"turn_id": turn_id}).first()
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
        rows = conn.execute(self._status_overlay_stmt(len(paths) if targeted else None), params).all()
        if not rows or rows[0].status != _RUNNING:
            raise self._not_running(conn, turn_id)
        return draft, {r.path: file_entry(r.digest, r.size, r.executable) for r in rows if r.path is not None}

    # -- files -----------------------------------------------------------------------------
    def write_file(self, turn_id: str, path: str, data: bytes | str, executable: bool = False) -> None:
        check.turn_id(turn_id)
        check.flag("executable", executable)
        p = normalize_path(path, self.limits)
        self._apply(turn_id, {p: check.file_data(p, data, self.limits)}, frozenset([p] if executable else ()))

    def delete_file(self, turn_id: str, path: str) -> None:
        check.turn_id(turn_id)
        self._apply(turn_id, {normalize_path(path, self.limits): None})

    def move_file(self, turn_id: str, src: str, dst: str, overwrite: bool = False) -> None:
        check.turn_id(turn_id)
        check.flag("overwrite", overwrite)
        s = normalize_path(src, self.limits)
        d = normalize_path(dst, self.limits)
        if s == d:
            raise E.PathConflict("move source and destination are the same path", path=s)
        self._apply(turn_id, {s: None, d: _Move(s, overwrite)})

    def apply_changes(self, turn_id: str, changes: Mapping[str, bytes | str | None],
                      executable: Any = ()) -> None:
        check.turn_id(turn_id)
        cleaned = check.batch(changes, self.limits.max_batch_files, "changes", self.limits)
        self._apply(turn_id, cleaned, check.executables(executable, cleaned))

    def _apply(self, turn_id: str, changes: Mapping[str, bytes | _Move | None],
               executable: frozenset[str] = frozenset()) -> None:
        if not changes:
            return
        writes = [(p, v) for p, v in changes.items() if isinstance(v, bytes)]
        stored = {p: FileEntry(digest_of(v), len(v), p in executable) for p, v in writes}
        faults.point("write.before_upload")
        upload = self.objects.upload(self.objects.raw.put_many, [v for _, v in writes]) if writes else None
        nodes = CachedNodes(self.objects.trees)  # the checks under the lock read no node from the blob store
        try:
            retry_unlocked(lambda: self._apply_rows(turn_id, changes, stored, upload, nodes))
        finally:
            if upload is not None and not upload.done():
                upload.cancel() or upload.exception()  # never leave an upload running past the call
        faults.point("write.after_commit")
        self.coordination.emit(f"turn:{turn_id}", "draft.changed", {"turn_id": turn_id, "paths": sorted(changes)[:100]})

    def _apply_rows(self, turn_id: str, changes: Mapping[str, bytes | _Move | None], stored: dict[str, FileEntry],
                    upload: Future[Any] | None, nodes: CachedNodes) -> None:
        limits = self.limits
        with self.db.tx() as conn:
            draft, overlay = self._lock_with_overlay(conn, turn_id, list(changes))
            state = StagedTree(nodes, Digest(draft.code_manifest_key), overlay)
            moved = {}
            for value in changes.values():
                if isinstance(value, _Move):  # resolved before the source is deleted
                    src_file = state.file(value.src)
                    if src_file is None:
                        raise E.PathNotFound(f"no file {value.src!r} to move", path=value.src)
                    moved[value.src] = src_file
            rows: list[dict[str, Any]] = []
            delta = 0
            # deletions (and move sources) first, so a batch may replace a directory by a file
            for path, value in sorted(changes.items(), key=lambda kv: kv[1] is not None):
                entry: FileEntry | None = moved[value.src] if isinstance(value, _Move) else (
                    None if value is None else stored[path])
                existed = state.file(path) is not None
                if existed and isinstance(value, _Move) and not value.overwrite:
                    raise E.PathConflict(f"{path!r} exists: move with overwrite to replace it", path=path)
                if entry is None:
                    if not existed:
                        raise E.PathNotFound(f"no file {path!r} in the draft", path=path)
                else:
                    for parent in parent_dirs(path):
                        if state.file(parent) is not None:
                            raise E.PathConflict(f"{parent!r} is a file, cannot hold {path!r}", path=path)
                    if state.is_dir(path):
                        raise E.PathConflict(f"{path!r} is a directory", path=path)
                state.stage(path, entry)
                delta += (entry is not None) - existed
                rows.append({"draft_id": draft.id, "path": path, "digest": None if entry is None else entry.digest,
                             "size": 0 if entry is None else entry.size,
                             "executable": entry is not None and entry.executable, "revision": draft.revision})
            if draft.file_count + delta > limits.max_files_per_draft:
                raise E.LimitExceeded(f"the draft would hold more than {limits.max_files_per_draft} files",
                                      limit=limits.max_files_per_draft)
            conn.execute(self._upsert_overlay, rows)
            if delta:
                conn.execute(self._add_file_count, {"draft_id": draft.id, "delta": delta})
            faults.point("write.before_commit")
            if upload is not None:
                awaited(upload)  # raises the upload's error, which rolls the transaction back

    # -- characters and world settings ---------------------------------------------------------
    def patch(self, turn_id: str, column: str, field: str, patch: Any) -> Any:
        """Apply a JSON Patch (a list, RFC 6902) or Merge Patch (a dict, RFC 7386)
        to one JSON document of the draft; returns the new value. Atomic. The
        work is bounded (``draftstore.patches``) and done with nothing locked: the
        document is read, patched, and written under the draft's lock only if it
        is still the one patched (else patched again; after a few lost races,
        under the lock, where the same bounds hold). Raises ``patch.invalid``,
        ``payload.too_large``, ``turn.not_running``."""
        check.turn_id(turn_id)
        if not isinstance(patch, (list, dict)):
            raise E.PatchInvalid("a patch is a JSON Patch list or a JSON Merge Patch object", field=field)
        # the patch itself must be JSON (a non-JSON value is the patch's fault, not the result's)
        check.json_value("patch", patch, self.limits.max_json_state_bytes, error=E.PatchInvalid)
        read = (sa.select(TURNS.c.status, DRAFTS.c[column])
                .select_from(TURNS.join(DRAFTS, DRAFTS.c.id == TURNS.c.draft_id))
                .where(TURNS.c.id == sa.bindparam("turn_id")))
        seen: Any = None
        for attempt in range(_UNLOCKED_PATCH_ATTEMPTS + 1):
            unlocked = attempt < _UNLOCKED_PATCH_ATTEMPTS
            if unlocked:
                with self.db.tx(read_only=True) as conn:
                    row = conn.execute(read, {"turn_id": turn_id}).first()
                if row is None or row.status != _RUNNING:  # the lock below says why it is refused
                    unlocked = False
                else:
                    seen = row[1]
                    new, text = self._patched(seen, patch, field)
            try:
                with self.db.tx() as conn:
                    draft = self._lock(conn, turn_id)
                    current = getattr(draft, column)
                    if not unlocked:
                        new, text = self._patched(current, patch, field)
                    elif current != seen:
                        raise _Changed  # rolls the transaction back: patch the new document
                    conn.execute(DRAFTS.update().where(DRAFTS.c.id == draft.id).values(**{column: text}))
            except _Changed:
                continue
            break
        self.coordination.emit(f"turn:{turn_id}", f"{field}.changed", {"turn_id": turn_id})
        return new

    def _patched(self, current: Any, patch: Any, field: str) -> tuple[Any, check.JSONText]:
        """The patched document and its stored text; the patch's fault if it cannot be kept."""
        limit = self.limits.max_json_state_bytes
        new = patches.apply(current, patch, field, limit) if isinstance(patch, list) else merge_patch(current, patch)
        # a result that is not a document the store keeps (too deep, too large) is the patch's fault
        return new, check.json_value(field, new, limit, error=E.PatchInvalid)
