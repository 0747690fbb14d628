"""States: resolving what to read (the draft, a version, a turn boundary) into a ``View``, and diffs.

``view(project)`` is the agent's newest state: the active draft with its
unsealed writes, else head. The draft row and its overlay are read by ONE
statement (one snapshot), so a view is consistent however writers go on.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from . import errors as E
from . import paging
from . import validation as check
from .database import Database
from .db.tables import DRAFTS, DRAFT_CHANGES, PACKS, PROJECTS, TURNS, VERSIONS
from .diff import Diff, diff_views
from .digest import EMPTY_TREE, Digest
from .objects import Objects
from .projects import Projects
from .records import TurnStatus
from .search import CodeSearch
from .settings import Limits
from .trees import file_entry
from .view import View

__all__ = ["States"]


def _view_statement() -> Any:
    """Project, its draft (or head), the tree summary of its root and the draft's overlay, in one statement."""
    null_s, null_i = sa.cast(sa.null(), sa.String), sa.cast(sa.null(), sa.Integer)
    null_j = sa.cast(sa.null(), DRAFTS.c.characters_json.type)
    head = sa.select(
        sa.literal(0).label("part"),
        PROJECTS.c.active_draft_id.label("draft_id"),
        PROJECTS.c.current_version_id.label("version_id"),
        DRAFTS.c.code_manifest_key.label("d_root"),
        DRAFTS.c.characters_json.label("d_chars"),
        DRAFTS.c.world_settings_json.label("d_world"),
        DRAFTS.c.base_version_id.label("d_base"),
        DRAFTS.c.revision.label("d_rev"),
        VERSIONS.c.code_manifest_key.label("v_root"),
        VERSIONS.c.characters_json.label("v_chars"),
        VERSIONS.c.world_settings_json.label("v_world"),
        null_s.label("path"),
        null_s.label("digest"),
        null_i.label("size"),
        sa.cast(sa.null(), sa.Boolean).label("executable"),
        # the tree summary its spine row names (search.linetables): a first search needs no other row
        sa.select(PACKS.c.search_index).where(
            PACKS.c.tree == sa.func.coalesce(DRAFTS.c.code_manifest_key, VERSIONS.c.code_manifest_key),
            PACKS.c.kind == "spine", PACKS.c.part == 0).scalar_subquery().label("summary"),
    ).select_from(
        PROJECTS.outerjoin(DRAFTS, DRAFTS.c.id == PROJECTS.c.active_draft_id).outerjoin(
            VERSIONS, sa.and_(VERSIONS.c.id == PROJECTS.c.current_version_id, PROJECTS.c.active_draft_id.is_(None)))
    ).where(PROJECTS.c.id == sa.bindparam("project_id"))
    rows = sa.select(
        sa.literal(1), null_s, null_s, null_s, null_j, null_j, null_s, null_i, null_s, null_j, null_j,
        DRAFT_CHANGES.c.path, DRAFT_CHANGES.c.digest, DRAFT_CHANGES.c.size, DRAFT_CHANGES.c.executable, null_s,
    ).select_from(PROJECTS.join(DRAFT_CHANGES, DRAFT_CHANGES.c.draft_id == PROJECTS.c.active_draft_id)).where(
        PROJECTS.c.id == sa.bindparam("project_id"))
    return sa.union_all(head, rows)


class States:
    def __init__(self, db: Database, objects: Objects, limits: Limits, projects: Projects, search: CodeSearch) -> None:
        self.db = db
        self.objects = objects
        self.limits = limits
        self.projects = projects
        self.search = search
        self._view = _view_statement()

    def _version_view(self, v: Any) -> View:
        return View(trees=self.objects.trees, project_id=v.project_id, kind="version", root=Digest(v.code_manifest_key),
                    overlay={}, characters=v.characters_json, world_settings=v.world_settings_json,
                    version_id=v.id, limits=self.limits, search=self.search)

    def warm_up(self) -> None:
        """Run the view statement once, on one project if the database holds any (no
        project otherwise): SQLAlchemy compiles it, and the driver's and our row paths
        run once, now rather than in the first request that reads a state (which took
        1.5 ms against 0.7 ms after, measured). Reads only."""
        with self.db.statement(read_only=True) as conn:
            some = conn.execute(sa.select(PROJECTS.c.id).limit(1)).scalar()
            if some is None:
                conn.execute(self._view, {"project_id": ""}).all()
        if some is not None:
            self.view(some)

    def view(self, project_id: str) -> View:
        check.project_id(project_id)
        with self.db.statement(read_only=True) as conn:
            rows = conn.execute(self._view, {"project_id": project_id}).all()
        head = next((r for r in rows if r.part == 0), None)
        if head is None:
            raise E.ProjectNotFound(f"no project {project_id!r}", project_id=project_id)
        limits = self.limits
        if head.draft_id is not None and head.d_root is not None:
            overlay = {r.path: file_entry(r.digest, r.size, r.executable) for r in rows if r.part == 1}
            return View(trees=self.objects.trees, project_id=project_id, kind="draft", root=Digest(head.d_root),
                        overlay=overlay, characters=head.d_chars, world_settings=head.d_world,
                        draft_id=head.draft_id, version_id=head.d_base, revision=head.d_rev, limits=limits,
                        search=self.search, summary=head.summary or "")
        if head.version_id is not None and head.v_root is not None:
            return View(trees=self.objects.trees, project_id=project_id, kind="version", root=Digest(head.v_root),
                        overlay={}, characters=head.v_chars, world_settings=head.v_world,
                        version_id=head.version_id, limits=limits, search=self.search,
                        summary=head.summary or "")
        return View(trees=self.objects.trees, project_id=project_id, kind="empty", root=EMPTY_TREE, overlay={},
                    characters={}, world_settings={}, limits=limits, search=self.search)

    def view_at(self, project_id: str, version_id: str) -> View:
        with self.db.tx(read_only=True) as conn:
            self.projects.load(conn, project_id)
            return self._version_view(self.projects.load_version(conn, version_id, project_id))

    def view_at_turn(self, turn_id: str, boundary: str) -> View:
        check.turn_id(turn_id)
        if boundary not in ("start", "end"):
            raise E.InvalidInput('boundary is "start" or "end"', boundary=str(boundary)[:20])
        with self.db.tx(read_only=True) as conn:
            t = conn.execute(sa.select(TURNS.c.project_id, TURNS.c.draft_id, TURNS.c.status, TURNS.c.start_root,
                                       TURNS.c.end_root, TURNS.c.start_state_digest, TURNS.c.end_state_digest,
                                       TURNS.c.pruned_at)
                             .where(TURNS.c.id == turn_id)).first()
        if t is None:
            raise E.turn_not_found(turn_id)
        if t.pruned_at is not None:
            raise E.StateNotFound(f"turn {turn_id}'s boundary states were pruned (its retention ended)",
                                  turn_id=turn_id)
        root = t.start_root if boundary == "start" else t.end_root
        state_digest = t.start_state_digest if boundary == "start" else t.end_state_digest
        if root is None or state_digest is None:
            if t.status == TurnStatus.RUNNING:
                raise E.TurnAlreadyRunning(f"turn {turn_id} is still running: it has no end yet",
                                           turn_id=turn_id, status=t.status)
            raise E.StateNotFound(f"turn {turn_id} ({t.status}) has no recorded {boundary} state",
                                 turn_id=turn_id, status=t.status)
        state = json.loads(self.objects.raw.get(Digest(state_digest)))
        return View(trees=self.objects.trees, project_id=t.project_id, kind=f"turn_{boundary}", root=Digest(root),
                    overlay={}, characters=state["characters"], world_settings=state["world_settings"],
                    draft_id=t.draft_id, limits=self.limits, search=self.search)

    def resolve(self, ref: View | str) -> View:
        if isinstance(ref, View):
            return ref
        if not isinstance(ref, str) or not ref:
            raise E.InvalidInput("a state reference is a View or a string", ref=str(ref)[:100])
        kind, _, rest = ref.partition(":")
        if kind == "draft" and rest:
            return self.view(rest)
        if kind == "head" and rest:
            project = self.projects.get(rest)
            if project.current_version_id is None:
                raise E.VersionNotFound(f"project {rest} has no version yet", project_id=rest)
            return self.view_at(rest, project.current_version_id)
        if kind == "turn" and rest:
            turn_id, _, boundary = rest.partition(":")
            return self.view_at_turn(turn_id, boundary or "end")
        with self.db.tx(read_only=True) as conn:
            return self._version_view(self.projects.load_version(conn, ref))

    def state_of(self, project_id: str, state: str) -> tuple[View, str, str]:
        """``draft`` (the draft, else head), ``head`` or a version id -> (view, source kind, source id)."""
        view = (self.view(project_id) if state == "draft" else
                self.resolve(f"head:{project_id}") if state == "head" else self.view_at(project_id, state))
        if view.kind == "empty":
            raise E.StateNotFound(f"project {project_id} has no version or draft yet", project_id=project_id)
        kind = "draft" if view.kind == "draft" else "version"
        return view, kind, (view.draft_id if kind == "draft" else view.version_id) or ""

    def diff(self, a: View | str, b: View | str, *, text: bool, detect_renames: bool,
             cursor: str | None = None, limit: int | None = None) -> Diff:
        key = paging.decode("diff", cursor, (str,))
        paged = cursor is not None or limit is not None  # else the whole diff, in one answer
        return diff_views(self.resolve(a), self.resolve(b), text=text, detect_renames=detect_renames,
                          after=key[0] if key else None, limit=paging.limit(limit) if paged else None)
