"""Garbage collection and retention (issue 9), on both stacks.

What is proved here:

- ``gc(dry_run=True)`` says what would go (objects, bytes) and deletes nothing;
  ``gc(dry_run=False)`` deletes exactly the unreachable objects older than the grace:
  orphan uploads, overlay writes replaced or deleted before a seal. Everything
  reachable stays: every version's tree (loose and packed), the draft's tree and
  overlay, turn boundary roots and states, offloaded tool payloads, packs, their
  search indexes and snapshot bundles; afterwards a cold store reads every file of
  every state, every payload, materialises from the snapshot and searches.
- The grace protects young objects: an orphan written moments ago survives and is
  swept once the grace is 0; an object written *while a run marks* is young too.
- An object that becomes referenced again while a run is under way (the same
  content written again, a new turn whose state equals a pruned turn's) is not
  swept, and a writer whose cache remembers content that gc swept stores it again.
- A run killed (``kill -9``) at ``gc.before_sweep`` or in the middle of its sweep
  leaves a consistent store (fsck clean); running again finishes the job.
- Retention: per-project settings with documented defaults; ended turns past
  their retention lose boundary roots, states and payloads (the turn is marked
  pruned and reading its boundary says ``state.not_found``), versions never;
  discarded drafts' trees go after their retention.
- ``prune_versions`` refuses head always and versions a head move names unless
  forced (``version.protected``); after pruning and gc the others read fully.
- THE KEY TEST: gc applying again and again (grace 2 s) beside writers, publishes,
  discards, packing and snapshot builds loses no referenced object: fsck with
  object verification is clean and every retained state reads back, verified.
- The CLI: ``draftstore gc`` (dry run) / ``--apply``, ``retention``, ``prune-versions``.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from draftstore import (BlobNotFound, ChecksumMismatch, DraftBusy, DraftstoreError, InvalidInput, LockTimeout,
                        Settings, StateNotFound, Store, VersionNotFound, VersionProtected, faults)
from draftstore.db.tables import PACKS, TURNS
from draftstore.digest import digest_of
from draftstore.gc import Retention

INLINE = Settings.model_fields["limits"].default_factory().inline_payload_bytes  # type: ignore[misc]
# S3 lists modification times in whole seconds: a grace above that tells "written just now"
# from "older than the grace" on every backend.
AGED_GRACE_S = 2.0


# =======================================================================================
# helpers
# =======================================================================================
def tag() -> str:
    return uuid.uuid4().hex[:10]


def big_payload(label: str) -> dict[str, str]:
    """A tool payload over the inline limit: offloaded to the blob store."""
    return {"label": label, "text": (label + " ") * (INLINE // len(label) + 16)}


def listing(store: Store) -> dict[str, int]:
    """digest -> size of every object in the blob store."""
    return {o.digest: o.size for o in store.blobs.iter_objects()}


def grace(store_factory: Callable[..., Store], seconds: float) -> Store:
    return store_factory(settings=Settings(gc_grace_s=seconds))


def pruned_turns(store: Store) -> set[str]:
    with store.engine.connect() as conn:
        return set(conn.execute(sa.select(TURNS.c.id).where(TURNS.c.pruned_at.is_not(None))).scalars())


def flavour(request: pytest.FixtureRequest) -> str:
    return request.node.callspec.params.get("stack", "?")


@dataclass
class Readback:
    """What a cold store read back: files, payloads, bundles; and every object it could not."""

    files: int = 0
    payloads: int = 0
    bundles: int = 0
    turn_boundaries: int = 0
    lost: dict[str, str] = field(default_factory=dict)  # digest -> where it was needed


def _missing(exc: DraftstoreError, fallback: str) -> str:
    return str(exc.details.get("digest") or fallback)


def read_everything(store: Store) -> Readback:
    """Read every file of every version, draft and (unpruned) turn boundary, every offloaded
    payload and every ready snapshot bundle, each verified against its digest."""
    out = Readback()
    pruned = pruned_turns(store)

    def read_view(view: Any, where: str) -> None:
        try:
            files = list(view.iter_files())
        except (BlobNotFound, ChecksumMismatch) as exc:
            out.lost[_missing(exc, view.root)] = f"{where} tree"
            return
        for path, st in files:
            try:
                data = view.read_file(path)
                assert digest_of(data) == st.digest, f"{where} {path}: wrong bytes"
                out.files += 1
            except (BlobNotFound, ChecksumMismatch) as exc:
                out.lost[_missing(exc, st.digest)] = f"{where} {path}"

    for p in store.list_projects():
        for v in store.list_versions(p.id):
            read_view(store.view_at(p.id, v.id), f"version {v.number} of {p.name}")
        if p.active_draft_id:
            read_view(store.view(p.id), f"draft of {p.name}")
        for t in store.list_turns(p.id):
            if t.id in pruned:
                with pytest.raises(StateNotFound):
                    store.view_at_turn(t.id, "start")
                continue
            for boundary in ("start",) if t.status == "running" else ("start", "end"):
                try:
                    read_view(store.view_at_turn(t.id, boundary), f"turn {t.number} {boundary} of {p.name}")
                    out.turn_boundaries += 1
                except (BlobNotFound, ChecksumMismatch) as exc:
                    out.lost[_missing(exc, "?")] = f"turn {t.number} {boundary} state of {p.name}"
            for call in store.get_turn(t.id).tool_calls:
                for digest in (call.args_digest, call.result_digest):
                    if digest:
                        try:
                            store.read_payload(digest)
                            out.payloads += 1
                        except (BlobNotFound, ChecksumMismatch):
                            out.lost[digest] = f"turn {t.number} call {call.seq} payload of {p.name}"
        for s in store.list_snapshots(p.id):
            if s.status == "ready" and s.bundle_key:
                try:
                    store.blobs.get(s.bundle_key)
                    out.bundles += 1
                except (BlobNotFound, ChecksumMismatch):
                    out.lost[s.bundle_key] = f"snapshot {s.id} bundle of {p.name}"
    return out


def assert_whole(store: Store) -> Readback:
    """fsck (objects verified) is clean and every retained state reads back."""
    report = store.fsck(verify_objects=True)
    assert report.ok, [str(p) for p in report.problems]
    back = read_everything(store)
    assert not back.lost, back.lost
    return back


@dataclass
class World:
    """A project with something of every kind gc must keep (see ``build_world``)."""

    project: Any
    v1: Any
    v2: Any
    t1: Any
    t2: Any
    t3: Any
    snapshot: Any
    files: dict[str, bytes]


def build_world(store: Store) -> World:
    """v1 imported into packs; turn 1 (offloaded payloads, patched characters) published as
    v2 and packed (with search indexes); a snapshot of head; turn 2 completed on a new draft
    (a sealed tree of its own); turn 3 still running, with an overlay and an offloaded payload."""
    t = tag()
    files = {f"src/pkg{i // 8}/m{i}.py": f"def f{i}():\n    return {i}  # {t}\n".encode() for i in range(40)}
    files["README.md"] = f"world {t}\n".encode()
    p = store.create_project(f"world-{t}", files=files, characters={"hero": {"hp": 10}},
                             world_settings={"era": "iron"})
    v1 = store.get_version(store.get_project(p.id).current_version_id)
    t1 = store.start_turn(p.id, "add a feature")
    call = store.tool_started(t1.id, "write_file", big_payload(f"args one {t}"))
    store.write_file(t1.id, "src/feature/new.py", f"FEATURE = '{t}'\n")
    store.write_file(t1.id, "src/pkg0/m0.py", f"def f0():\n    return 'changed {t}'\n")
    store.tool_completed(t1.id, call.seq, big_payload(f"result one {t}"))
    store.patch_characters(t1.id, {"hero": {"hp": 11}})
    store.complete_turn(t1.id, "done")
    v2 = store.publish(p.id, "feature")
    assert store.run_background()["versions_packed"] == 1
    snap = store.create_snapshot(p.id, "head")
    assert snap.status == "ready" and snap.bundle_key
    t2 = store.start_turn(p.id, "draft work")
    store.write_file(t2.id, "src/draft_only.py", f"DRAFT = '{t}'\n")
    store.complete_turn(t2.id, "sealed in the draft")
    t3 = store.continue_turn(p.id, "running work")
    store.tool_started(t3.id, "search", big_payload(f"args three {t}"))
    store.write_file(t3.id, "src/overlay_only.py", f"OVERLAY = '{t}'\n")
    return World(p, v1, v2, t1, t2, t3, snap, files)


def make_garbage(store: Store, turn_id: str, n_orphans: int = 3) -> set[str]:
    """Unreachable objects: uploads no row names (a write killed before its commit) and
    overlay writes replaced or deleted before any seal. Returns their digests."""
    t = tag()
    orphans = [f"orphan {i} {t}\n".encode() for i in range(n_orphans)]
    digests = set(store.blobs.put_many(orphans))
    replaced, deleted = f"replaced {t}\n", f"deleted {t}\n"
    store.write_file(turn_id, "scratch.py", replaced)
    store.write_file(turn_id, "scratch.py", f"final {t}\n")
    store.write_file(turn_id, "tmp.py", deleted)
    store.delete_file(turn_id, "tmp.py")
    return digests | {digest_of(replaced.encode()), digest_of(deleted.encode())}


def retry(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``, retrying what says "retry" (a busy embedded database, a lock), 60 s at most."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return fn(*args, **kwargs)
        except (DraftBusy, LockTimeout):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# =======================================================================================
# dry run, apply, reachability
# =======================================================================================
def test_dry_run_reports_and_deletes_nothing_apply_deletes_exactly_the_unreachable(store_factory, tmp_path):
    store = store_factory()
    w = build_world(store)
    garbage = make_garbage(store, w.t3.id)
    time.sleep(0.05)
    before = listing(store)
    assert garbage <= set(before)
    collector = grace(store_factory, 0)

    dry = collector.gc(dry_run=True)
    assert dry.dry_run and set(dry.swept) == garbage
    assert (dry.objects_swept, dry.bytes_swept) == (len(garbage), sum(before[d] for d in garbage))
    assert dry.objects_listed == len(before) and dry.objects_young == 0
    assert dry.objects_reachable >= len(before) - len(garbage)
    assert listing(store) == before, "a dry run deleted something"

    done = collector.gc(dry_run=False)
    assert not done.dry_run and set(done.swept) == garbage
    assert (done.objects_swept, done.bytes_swept) == (dry.objects_swept, dry.bytes_swept)
    after = listing(store)
    assert set(after) == set(before) - garbage
    assert collector.gc(dry_run=False).objects_swept == 0

    # every kind of reachable object is still stored
    with store.engine.connect() as conn:
        packs = conn.execute(sa.select(PACKS.c.digest, PACKS.c.search_index)).all()
    assert len(packs) >= 2 and all(d in after and (i is None or i in after) for d, i in packs)
    assert w.snapshot.bundle_key in after
    payloads = {c.args_digest for c in store.get_turn(w.t1.id).tool_calls} | {
        c.result_digest for c in store.get_turn(w.t1.id).tool_calls} | {
        c.args_digest for c in store.get_turn(w.t3.id).tool_calls}
    assert None not in payloads and len(payloads) == 3 and payloads <= set(after)

    # and a cold store reads all of it
    cold = store_factory()
    back = assert_whole(cold)
    assert back.payloads == 3 and back.bundles == 1 and back.turn_boundaries == 5
    view = cold.view(w.project.id)
    assert view.read_text("src/overlay_only.py").startswith("OVERLAY") and not view.exists("tmp.py")
    assert view.read_text("scratch.py").startswith("final")
    assert cold.view_at_turn(w.t1.id, "start").characters == {"hero": {"hp": 10}}
    assert cold.view_at_turn(w.t1.id, "end").characters == {"hero": {"hp": 11}}
    made = cold.materialize(w.project.id, tmp_path / "head", state="head")
    assert made.path == "snapshot" and made.files == len(w.files) + 1
    assert (tmp_path / "head" / "src/pkg3/m27.py").read_bytes() == w.files["src/pkg3/m27.py"]
    hits = cold.view_at(w.project.id, w.v2.id).search_code("return 27")
    assert [(m.path, m.line_number) for m in hits] == [("src/pkg3/m27.py", 2)]
    assert cold.view_at(w.project.id, w.v1.id).read_file("src/pkg0/m0.py") == w.files["src/pkg0/m0.py"]


def test_objects_younger_than_the_grace_are_never_swept_and_go_once_it_is_zero(store_factory):
    store = store_factory()
    p = store.create_project("young", files={"a.py": "a = 1\n"})
    t = store.start_turn(p.id, "work")
    garbage = make_garbage(store, t.id)

    patient = grace(store_factory, 600)
    for dry_run in (True, False):
        st = patient.gc(dry_run=dry_run)
        assert st.objects_swept == 0 and st.objects_young == len(garbage), st
    assert garbage <= set(listing(store))

    st = grace(store_factory, 0).gc(dry_run=False)
    assert set(st.swept) == garbage and st.objects_young == 0
    assert not garbage & set(listing(store))
    assert store_factory().view(p.id).read_text("scratch.py").startswith("final")


def test_a_turn_end_state_equal_to_its_start_shares_the_start_object_and_gc_keeps_it(store_factory):
    # a turn that did not touch characters or world settings ends with its start state's object,
    # stored once (no second PUT); one that did stores its own; gc keeps both
    store = store_factory()
    p = store.create_project("states", files={"a.py": "a = 1\n"}, characters={"hero": {"hp": 1}})
    quiet = store.start_turn(p.id, "code only")
    store.write_file(quiet.id, "b.py", "b = 1\n")
    puts: list[bytes] = []
    real_put = store.blobs.put
    store.blobs.put = lambda data: puts.append(bytes(data)) or real_put(data)  # type: ignore[method-assign]
    try:
        store.complete_turn(quiet.id, "ok")
        assert not [b for b in puts if b.startswith(b'{"characters"')]  # the end state was not stored again
        busy = store.continue_turn(p.id, "characters too")
        store.patch_characters(busy.id, {"hero": {"hp": 2}})
        store.complete_turn(busy.id, "ok")
        assert [b for b in puts if b.startswith(b'{"characters"')]  # a new end state is stored
    finally:
        store.blobs.put = real_put  # type: ignore[method-assign]
    grace(store_factory, 0).gc(dry_run=False)
    cold = store_factory()
    assert cold.view_at_turn(quiet.id, "end").characters == {"hero": {"hp": 1}}
    assert cold.view_at_turn(busy.id, "start").characters == {"hero": {"hp": 1}}
    assert cold.view_at_turn(busy.id, "end").characters == {"hero": {"hp": 2}}


def test_the_grace_counts_from_the_start_of_a_run_so_a_write_committed_while_it_marks_is_kept(store_factory):
    """A run takes a while to mark a large store. A write that starts after the run read its
    roots is invisible to it: only the grace protects it, so the grace must be measured from
    the run's start, not from whenever marking happened to end."""
    writer = store_factory()
    p = writer.create_project("slow-mark", files={"a.py": "a = 1\n"})
    t = writer.start_turn(p.id, "writes while gc marks")
    writer.write_file(t.id, "early.py", "early = 1\n")
    writer.complete_turn(t.id, "sealed")
    t = writer.continue_turn(p.id, "more")
    grace_s = AGED_GRACE_S
    wrote: list[str] = []

    def slow_marking(phase: str, done: int, total: int | None) -> None:
        if phase == "mark" and not wrote:
            writer.write_file(t.id, "during_mark.py", f"written during the mark {tag()}\n")
            wrote.append("during_mark.py")
            time.sleep(grace_s + 0.5)  # marking a large store takes longer than the grace

    grace(store_factory, grace_s).gc(dry_run=False, progress=slow_marking)
    assert wrote, "the run never reported marking progress"
    cold = store_factory()
    assert cold.view(p.id).read_text("during_mark.py").startswith("written during the mark"), \
        "gc swept an object written after it started, younger than the grace at the run's start"
    assert_whole(cold)


@pytest.mark.parametrize("revival", ["same-content", "same-turn-state"])
def test_an_object_referenced_again_while_a_run_is_under_way_is_not_swept(store_factory, monkeypatch, revival):
    """Content addressing deduplicates: a write of bytes already stored stores nothing new. An
    unreachable object that a writer references again between a run's marking and its sweep
    (the same file content written again; a new turn whose state equals the state of a turn
    whose retention ended) must survive the run."""
    store = grace(store_factory, AGED_GRACE_S)
    writer = store_factory()
    p = writer.create_project("revive", files={"a.py": "a = 1\n"}, characters={"c": tag()})
    chars = writer.get_version(writer.get_project(p.id).current_version_id).characters
    content = f"content written, dropped, written again {tag()}\n"
    if revival == "same-content":
        t = writer.start_turn(p.id, "write then drop")
        writer.write_file(t.id, "first.py", content)
        writer.delete_file(t.id, "first.py")
    else:
        store.set_retention(p.id, turns_days=0)
        t = writer.start_turn(p.id, "a turn past its retention at once")
        writer.complete_turn(t.id, "done")
    time.sleep(AGED_GRACE_S + 0.2)  # unreachable and older than the grace: a run sweeps it
    revived: dict[str, str] = {}
    real_point = faults.point

    def at_the_sweep(name: str) -> None:  # marked, listed, nothing deleted yet
        if name == "gc.before_sweep" and not revived:
            if revival == "same-content":
                writer.write_file(t.id, "again.py", content)
                revived["path"] = "again.py"
            else:
                revived["turn"] = writer.continue_turn(p.id, "same state as the pruned turn").id
        real_point(name)

    monkeypatch.setattr(faults, "point", at_the_sweep)
    store.gc(dry_run=False)
    monkeypatch.undo()
    assert revived, "the run never reached gc.before_sweep"
    cold = store_factory()
    if revival == "same-content":
        assert cold.view(p.id).read_text("again.py") == content, "gc swept content a write had just named"
    else:
        assert cold.view_at_turn(revived["turn"], "start").characters == chars, \
            "gc swept the state a new turn had just named"
    assert_whole(cold)


def test_a_writer_whose_cache_remembers_swept_content_stores_it_again(store_factory):
    """Two processes: a writer that once wrote some bytes (they are in its object cache), and
    gc elsewhere that swept them once nothing named them. Writing the same bytes again must
    store them again, not trust the cache."""
    writer = store_factory()
    p = writer.create_project("cache", files={"a.py": "a = 1\n"})
    t = writer.start_turn(p.id, "write, overwrite, write again")
    content = f"remembered by the writer's cache {tag()}\n"
    writer.write_file(t.id, "x.py", content)
    writer.write_file(t.id, "x.py", "something else\n")
    time.sleep(0.05)
    st = grace(store_factory, 0).gc(dry_run=False)
    assert digest_of(content.encode()) in st.swept
    writer.write_file(t.id, "y.py", content)
    cold = store_factory()
    assert cold.view(p.id).read_text("y.py") == content, "the write named an object that is not stored"
    assert_whole(cold)


# =======================================================================================
# interrupted runs
# =======================================================================================
GC_WORKER = textwrap.dedent(
    """
    import json, sys, time
    from draftstore import Settings, Store

    urls, mode = json.loads(sys.argv[1]), sys.argv[2]

    def progress(phase, done, total):
        if mode == "mid-sweep" and phase == "sweep" and total and 0 < done < total:
            sys.stderr.write("draftstore: paused at mid-sweep\\n")
            sys.stderr.flush()
            while True:
                time.sleep(3600)

    with Store.open(**urls, settings=Settings(gc_grace_s=0)) as store:
        print(json.dumps({"ready": True}), flush=True)
        st = store.gc(dry_run=False, progress=progress)
        print(json.dumps({"finished": st.objects_swept}), flush=True)
    """
)


class GcProcess:
    """``draftstore`` gc in a subprocess, paused at a point and then killed with SIGKILL;
    its output is read on threads, so every wait has a deadline."""

    def __init__(self, stack: dict[str, str], mode: str) -> None:
        env = dict(os.environ)
        env.pop(faults.PAUSE_ENV, None)
        if mode == "before-sweep":
            env[faults.PAUSE_ENV] = "gc.before_sweep"
        self.proc = subprocess.Popen([sys.executable, "-c", GC_WORKER, json.dumps(stack), mode],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.err: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [self.err.put(line) for line in self.proc.stderr], daemon=True).start()

    def kill_when_paused(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not any("draftstore: paused at" in line for line in self.seen):
            try:
                self.seen.append(self.err.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                self.close()
                pytest.fail(f"gc never paused (exit {self.proc.poll()}):\n{''.join(self.seen)}")
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(timeout=30) == -signal.SIGKILL

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.mark.parametrize("mode", ["before-sweep", "mid-sweep"])
def test_a_gc_run_killed_midway_leaves_a_consistent_store_and_the_next_run_finishes(store_factory, stack, mode):
    store = store_factory()
    w = build_world(store)
    garbage = make_garbage(store, w.t3.id, n_orphans=260)  # the sweep reports progress every 200 objects
    # a discarded draft whose turn is past its retention: the run marks the turn pruned before
    # it sweeps; everything that turn stored (file, tree nodes, states) is garbage
    short = store.create_project("short", files={"s.py": "s = 1\n"})
    store.set_retention(short.id, turns_days=0, discarded_days=0)
    stored_before = set(listing(store))
    ts = store.start_turn(short.id, "soon pruned")
    store.write_file(ts.id, "only.py", f"only in a pruned turn's boundary {tag()}\n")
    store.complete_turn(ts.id, "done")
    store.discard_draft(short.id)
    garbage |= set(listing(store)) - stored_before
    time.sleep(0.05)
    before = listing(store)

    gc = GcProcess(stack, mode)
    try:
        gc.kill_when_paused()
    finally:
        gc.close()

    left = listing(store)
    gone = set(before) - set(left)
    assert gone <= garbage, "the killed run deleted something reachable"
    if mode == "before-sweep":
        assert not gone
    else:
        assert 200 <= len(gone) < len(garbage)
    assert ts.id in pruned_turns(store), "the run marks turns pruned before it sweeps"
    with pytest.raises(StateNotFound) as err:
        store.view_at_turn(ts.id, "end")
    assert err.value.code == "state.not_found"
    cold = store_factory()
    assert_whole(cold)  # consistent at the moment of the kill

    again = grace(store_factory, 0).gc(dry_run=False)
    assert again.objects_swept >= len(garbage) - len(gone)
    assert not garbage & set(listing(store))
    assert set(listing(store)) >= set(before) - garbage - set(again.swept)
    assert_whole(store_factory())


# =======================================================================================
# retention
# =======================================================================================
def test_retention_defaults_and_per_project_settings(store_factory):
    assert Settings.model_fields["gc_grace_s"].default == 3600.0
    assert Settings.model_fields["retain_turns_days"].default is None
    assert Settings.model_fields["retain_discarded_days"].default == 30.0
    store = store_factory()
    p = store.create_project("retained", files={"a.py": "a\n"})
    assert store.retention(p.id) == Retention(turns_days=None, discarded_days=30.0)
    assert store.set_retention(p.id, turns_days=0.25) == Retention(0.25, 30.0)
    assert store.set_retention(p.id, discarded_days=0) == Retention(0.25, 0.0)
    assert store_factory().retention(p.id) == Retention(0.25, 0.0)  # stored, not remembered
    assert store.set_retention(p.id, turns_days=None) == Retention(None, 0.0)  # back to the default
    other = store.create_project("other")
    assert store.retention(other.id) == Retention(None, 30.0)
    for bad in ({"turns_days": -1}, {"discarded_days": "7"}, {"turns_days": True}, {"weeks": 1},
                {"turns_days": 40_000}):
        with pytest.raises(InvalidInput) as err:
            store.set_retention(p.id, **bad)
        assert err.value.code == "input.invalid"
    assert store.retention(p.id) == Retention(None, 0.0)
    with pytest.raises(DraftstoreError) as err:
        store.set_retention("0" * 32, turns_days=1)
    assert err.value.code == "project.not_found"
    tuned = store_factory(settings=Settings(retain_turns_days=7, retain_discarded_days=None))
    assert tuned.retention(other.id) == Retention(7, None)


def test_ended_turns_past_their_retention_lose_boundaries_and_payloads_versions_never(store_factory):
    store = store_factory()
    collector = grace(store_factory, 0)
    p = store.create_project("turns", files={"keep.py": "keep = 1\n"}, characters={"mood": "calm"})
    t = tag()
    t1 = store.start_turn(p.id, "a turn that will be pruned")
    c1 = store.tool_started(t1.id, "write_file", big_payload(f"pruned args {t}"))
    store.tool_completed(t1.id, c1.seq, big_payload(f"pruned result {t}"))
    store.write_file(t1.id, "only_in_turn_1.py", f"between turns {t}\n")
    store.patch_characters(t1.id, {"mood": "tense"})
    store.complete_turn(t1.id, "done")
    t2 = store.continue_turn(p.id, "undo turn 1")
    store.delete_file(t2.id, "only_in_turn_1.py")
    store.patch_characters(t2.id, {"mood": "calm"})
    store.complete_turn(t2.id, "undone")
    v2 = store.publish(p.id, "back to calm")
    t3 = store.start_turn(p.id, "still running: kept whatever the retention")
    c3 = store.tool_started(t3.id, "read_file", big_payload(f"running args {t}"))
    unique = digest_of(f"between turns {t}\n".encode())
    call1 = store.get_turn(t1.id).tool_calls[0]
    time.sleep(0.05)

    # the default keeps turns for ever
    assert collector.gc(dry_run=False).turns_pruned == 0
    assert store_factory().view_at_turn(t1.id, "end").read_text("only_in_turn_1.py").startswith("between")

    store.set_retention(p.id, turns_days=0)
    dry = collector.gc(dry_run=True)
    assert dry.turns_pruned == 2 and unique in dry.swept and not pruned_turns(store)
    st = collector.gc(dry_run=False)
    assert st.turns_pruned == 2 and unique in st.swept
    assert {call1.args_digest, call1.result_digest} <= set(st.swept)
    assert pruned_turns(store) == {t1.id, t2.id}
    assert collector.gc(dry_run=False).turns_pruned == 0  # marked once

    cold = store_factory()
    for turn in (t1, t2):
        for boundary in ("start", "end"):
            with pytest.raises(StateNotFound) as err:
                cold.view_at_turn(turn.id, boundary)
            assert err.value.code == "state.not_found" and "pruned" in err.value.message
    with pytest.raises(BlobNotFound):
        cold.read_payload(call1.result_digest)
    kept = cold.get_turn(t1.id)  # the row, its messages and its tool history stay
    assert kept.status == "completed" and kept.assistant_message == "done"
    assert [(c.seq, c.status, c.result_preview[:12]) for c in kept.tool_calls] == [(1, "completed", '{"label":"pr')]
    # versions are never removed by retention; the running turn keeps its payload
    assert [v.number for v in cold.list_versions(p.id)] == [1, 2]
    assert cold.view_at(p.id, v2.id).list_files() == ["keep.py"]
    assert cold.read_payload(store.get_turn(t3.id).tool_calls[0].args_digest)["label"] == f"running args {t}"
    assert cold.view_at_turn(t3.id, "start").characters == {"mood": "calm"}
    assert c3.args_offloaded
    assert_whole(cold)


def test_discarded_drafts_trees_go_after_their_retention(store_factory):
    """A discarded draft's tree is held by its draft's retention and by its turns' boundary
    roots; it goes once both have ended."""
    store = store_factory()
    collector = grace(store_factory, 0)
    p = store.create_project("discarded", files={"keep.py": "keep = 1\n"})
    content = f"only in a discarded draft {tag()}\n"
    t = store.start_turn(p.id, "work that will be thrown away")
    store.write_file(t.id, "thrown/away.py", content)
    store.complete_turn(t.id, "done")
    store.discard_draft(p.id)
    digest = digest_of(content.encode())
    time.sleep(0.05)

    def swept() -> bool:
        st = collector.gc(dry_run=False)
        return digest in st.swept

    assert not swept()  # defaults: the turn for ever, the discarded draft 30 days
    store.set_retention(p.id, turns_days=0)
    assert not swept() and t.id in pruned_turns(store)  # the turn is pruned; the draft's retention holds
    store.set_retention(p.id, discarded_days=0)
    assert swept()
    assert digest not in listing(store)
    cold = store_factory()
    assert cold.view(p.id).list_files() == ["keep.py"]
    assert_whole(cold)

    # the other order: the discarded draft's retention over, its turn still retained
    q = store.create_project("discarded-2", files={"keep.py": "keep = 2\n"}, characters={"q": tag()})
    store.set_retention(q.id, discarded_days=0)
    content = f"held by a retained turn {tag()}\n"
    t = store.start_turn(q.id, "thrown away, turn kept")
    store.write_file(t.id, "held.py", content)
    store.complete_turn(t.id, "done")
    store.discard_draft(q.id)
    time.sleep(0.05)
    assert digest_of(content.encode()) not in collector.gc(dry_run=False).swept
    assert store_factory().view_at_turn(t.id, "end").read_text("held.py") == content


# =======================================================================================
# prune_versions
# =======================================================================================
def test_prune_versions_refuses_head_and_versions_a_head_move_names_unless_forced(store_factory):
    store = store_factory()
    p = store.create_project("prune", characters={"v": 0})
    versions = [store.get_version(store.get_project(p.id).current_version_id)]
    t = tag()
    contents = {}
    for n, change in enumerate(({"a.py": f"one {t}\n", "b.py": "shared\n"}, {"a.py": f"two {t}\n"},
                                {"c.py": f"three {t}\n"}), start=2):
        turn = store.start_turn(p.id, f"make v{n}")
        store.apply_changes(turn.id, change)
        store.complete_turn(turn.id, "done")
        versions.append(store.publish(p.id, f"v{n}"))
        contents[n] = change
    v1, v2, v3, v4 = versions
    snap = store.create_snapshot(p.id, v2.id)
    head_moves = store.head_moves(p.id)
    assert {m.to_version_id for m in head_moves} == {v.id for v in versions}  # every version was head once

    with pytest.raises(InvalidInput) as err:
        store.prune_versions(p.id, [v4.id], force=True)
    assert err.value.code == "input.invalid" and "head" in err.value.message
    with pytest.raises(VersionProtected) as err:
        store.prune_versions(p.id, [v2.id])
    assert err.value.code == "version.protected" and err.value.details["version_ids"] == [v2.id]
    with pytest.raises(InvalidInput):
        store.prune_versions(p.id, [v2.id, v4.id], force=True)  # all or nothing
    with pytest.raises(VersionNotFound):
        store.prune_versions(p.id, [v2.id, "f" * 32], force=True)
    other = store.create_project("other", characters={})
    with pytest.raises(VersionNotFound):
        store.prune_versions(other.id, [v2.id], force=True)  # not one of this project's versions
    assert [v.number for v in store.list_versions(p.id)] == [1, 2, 3, 4]

    assert store.prune_versions(p.id, [v2.id], force=True) == 1
    assert [v.number for v in store.list_versions(p.id)] == [1, 3, 4]
    with pytest.raises(VersionNotFound):
        store.get_version(v2.id)
    assert snap.id not in {s.id for s in store.list_snapshots(p.id)}  # its snapshot went with it
    assert store.head_moves(p.id) == head_moves  # the history of head stays as it was

    only_v2 = digest_of(contents[2]["a.py"].encode())
    collector = grace(store_factory, 0)
    time.sleep(0.05)
    first = collector.gc(dry_run=False)
    assert snap.bundle_key in first.swept  # the pruned version's snapshot is garbage at once
    assert only_v2 not in first.swept  # the turns that made v2 still hold its tree
    store.set_retention(p.id, turns_days=0)
    st = collector.gc(dry_run=False)
    assert only_v2 in st.swept and st.turns_pruned == 3, "a pruned version's tree outlives its turns"
    assert v2.root in st.swept
    cold = store_factory()
    assert cold.view_at(p.id, v3.id).read_text("a.py") == contents[3]["a.py"]
    assert cold.view_at(p.id, v3.id).read_text("b.py") == "shared\n"
    assert cold.view_at(p.id, v4.id).list_files() == ["a.py", "b.py", "c.py"]
    assert cold.view_at(p.id, v1.id).characters == {"v": 0}
    assert_whole(cold)


# =======================================================================================
# THE KEY TEST: gc beside writers, publishes and snapshot builds
# =======================================================================================
KEY_GRACE_S = AGED_GRACE_S
KEY_SECONDS = 6.0


def test_gc_beside_writers_publishes_and_snapshot_builds_loses_no_referenced_object(
        store_factory, request, tmp_path):
    setup = store_factory()
    t0 = tag()
    busy = setup.create_project("busy", files={f"lib/m{i}.py": f"M{i} = '{t0}'\n" for i in range(30)},
                                characters={"count": 0})
    short = setup.create_project("short-lived", files={f"base/b{i}.txt": f"b{i}\n" for i in range(10)})
    setup.set_retention(short.id, turns_days=0, discarded_days=0)
    stop = threading.Event()
    errors: list[str] = []
    counts = {"gc_runs": 0, "swept": 0, "freed": 0, "turns": 0, "publishes": 0, "discards": 0,
              "snapshots": 0, "materialized": 0, "packed": 0}
    lock = threading.Lock()

    def count(key: str, n: int = 1) -> None:
        with lock:
            counts[key] += n

    def guarded(name: str, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
                stop.set()
        return run

    def writer(project_id: str, label: str, patch: bool, discard_every: int) -> Callable[[], None]:
        def body() -> None:
            s = store_factory()
            i = 0
            while not stop.is_set():
                i += 1
                u = f"{label} {i} {tag()}"
                turn = retry(s.start_turn, project_id, f"turn {u}")
                call = retry(s.tool_started, turn.id, "edit", big_payload(f"args {u}"))
                retry(s.write_file, turn.id, f"work/{label}_{i % 4}.py", f"# {u}\n")
                retry(s.write_file, turn.id, "notes.md", f"a first thought {u}\n")  # replaced: garbage
                retry(s.apply_changes, turn.id, {"notes.md": f"notes {u}\n", f"tmp/{i}.txt": f"tmp {u}\n"})
                retry(s.delete_file, turn.id, f"tmp/{i}.txt")  # never sealed: garbage
                retry(s.tool_completed, turn.id, call.seq, big_payload(f"result {u}"))
                if patch:
                    retry(s.patch_characters, turn.id, {"count": i})
                retry(s.complete_turn, turn.id, "done")
                count("turns")
                if i % discard_every == 0:
                    retry(s.discard_draft, project_id)
                    count("discards")
                else:
                    retry(s.publish, project_id, f"publish {u}")
                    count("publishes")
        return body

    def builder() -> None:
        s = store_factory()
        k = 0
        while not stop.is_set():
            k += 1
            snap = retry(s.create_snapshot, busy.id, "head")
            assert snap.status == "ready", snap
            count("snapshots")
            count("packed", retry(s.run_background)["versions_packed"])
            if k % 3 == 0:
                dest = tmp_path / f"sandbox{k}"
                made = retry(s.materialize, busy.id, dest, state=snap.source_id)
                view = s.view_at(busy.id, snap.source_id)
                assert made.files == view.file_count()
                for path in ("lib/m7.py", "notes.md"):
                    if view.exists(path):
                        assert (dest / path).read_bytes() == view.read_file(path)
                count("materialized")
            time.sleep(0.05)

    def collector() -> None:
        s = grace(store_factory, KEY_GRACE_S)
        while not stop.is_set():
            st = s.gc(dry_run=False)
            count("gc_runs")
            count("swept", st.objects_swept)
            count("freed", st.bytes_swept)
            time.sleep(0.05)

    threads = [threading.Thread(target=guarded(name, body), name=name, daemon=True) for name, body in (
        ("writer busy", writer(busy.id, "busy", True, 5)),
        ("writer short", writer(short.id, "short", False, 3)),
        ("builder", builder),
        ("gc", collector))]
    for th in threads:
        th.start()
    stop.wait(KEY_SECONDS)
    stop.set()
    for th in threads:
        th.join(timeout=120)
        assert not th.is_alive(), f"{th.name} did not stop"
    assert not errors, errors

    # what is unreachable now ages past the grace and goes; nothing reachable may
    time.sleep(KEY_GRACE_S + 1.1)
    last = grace(store_factory, 0).gc(dry_run=False)
    counts["gc_runs"] += 1
    counts["swept"] += last.objects_swept
    counts["freed"] += last.bytes_swept

    cold = store_factory()
    report = cold.fsck(verify_objects=True)
    back = read_everything(cold)
    lost = set(back.lost) | {pr.key for pr in report.problems}
    made = cold.materialize(busy.id, tmp_path / "final", state="head")
    hits = cold.view(busy.id).search_code(f"M7 = '{t0}'")
    print(f"\n[{flavour(request)}] gc runs: {counts['gc_runs']}, objects swept: {counts['swept']}, "
          f"bytes freed: {counts['freed']}, referenced objects lost: {len(lost)}"
          f"  ({counts['turns']} turns, {counts['publishes']} publishes, {counts['discards']} discards, "
          f"{counts['snapshots']} snapshots, {counts['materialized']} materialized, {counts['packed']} versions "
          f"packed; read back {back.files} files, {back.payloads} payloads, {back.bundles} bundles)")
    assert not lost, {"fsck": [str(pr) for pr in report.problems], "reads": back.lost}
    assert report.ok and report.objects_verified > 0
    assert counts["gc_runs"] >= 3 and counts["swept"] > 0 and counts["turns"] >= 4
    assert counts["publishes"] >= 2 and counts["snapshots"] >= 2
    assert made.files == cold.view(busy.id).file_count()
    assert [m.path for m in hits] == ["lib/m7.py"]
    assert pruned_turns(cold), "the short-lived project's turns were never pruned"


# =======================================================================================
# the command line (embedded default)
# =======================================================================================
def _cli(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {"DRAFTSTORE_HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": "250",
               "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **env}
    return subprocess.run([sys.executable, "-m", "draftstore.cli", *args], capture_output=True, text=True,
                          env=environ, cwd=home, timeout=120)


def test_cli_gc_is_a_dry_run_unless_applied_and_manages_retention_and_pruning(tmp_path):
    home = tmp_path / "store"
    home.mkdir()
    with Store.open(settings=Settings(home=home)) as store:
        p = store.create_project("cli", files={"a.py": "a = 1\n"})
        t = store.start_turn(p.id, "work")
        garbage = make_garbage(store, t.id)
        store.complete_turn(t.id, "done")
        v2 = store.publish(p.id, "v2")
        v1 = store.list_versions(p.id)[0]
        before = listing(store)
    time.sleep(0.05)

    dry = _cli(home, "gc", DRAFTSTORE_GC_GRACE_S="0")
    assert dry.returncode == 0, dry.stderr
    m = re.search(r"would delete (\d+) objects \(([\d,]+) bytes\) of (\d+) stored; (\d+) unreachable", dry.stdout)
    assert m, dry.stdout
    assert (int(m[1]), int(m[2].replace(",", "")), int(m[3])) == (
        len(garbage), sum(before[d] for d in garbage), len(before))
    assert "dry run: add --apply to delete" in dry.stdout
    with Store.open(settings=Settings(home=home)) as store:
        assert listing(store) == before

    applied = _cli(home, "gc", "--apply", DRAFTSTORE_GC_GRACE_S="0")
    assert applied.returncode == 0, applied.stderr
    assert re.search(rf"deleted {len(garbage)} objects", applied.stdout) and "dry run" not in applied.stdout
    with Store.open(settings=Settings(home=home)) as store:
        assert set(listing(store)) == set(before) - garbage

    changed = _cli(home, "retention", p.id, "--turns-days", "0", "--discarded-days", "0.5")
    assert changed.returncode == 0 and "turns: 0 days; discarded drafts: 0.5 days" in changed.stdout, changed.stdout
    reset = _cli(home, "retention", p.id, "--default", "turns")
    assert "turns: for ever; discarded drafts: 0.5 days" in reset.stdout, reset.stdout
    with Store.open(settings=Settings(home=home)) as store:
        assert store.retention(p.id) == Retention(None, 0.5)

    refused = _cli(home, "prune-versions", p.id, v1.id)
    assert refused.returncode == 2 and "[version.protected]" in refused.stderr, refused.stderr
    forced = _cli(home, "prune-versions", p.id, v1.id, "--force")
    assert forced.returncode == 0 and "1 versions pruned" in forced.stdout, forced.stderr
    with Store.open(settings=Settings(home=home)) as store:
        assert [v.number for v in store.list_versions(p.id)] == [2] and v2.number == 2
