"""fsck (issue 9), on both stacks: every problem is reported, precisely.

What is proved here:

- A whole store (packed and loose versions, a draft with an overlay, turn boundaries,
  offloaded payloads, a snapshot) is clean; ``verify_objects`` re-reads and re-hashes
  every stored object and every pack, ``quick`` checks references only.
- An object whose stored bytes changed is ``corrupt`` (by key); an object a version
  tree needs that is gone is ``missing``, named by the version and the file's path in
  the tree; a corrupt tree node is ``corrupt`` where the tree reaches it.
- A missing turn state, offloaded payload, snapshot bundle or overlay blob is reported
  with the row that names it.
- Packs: a corrupt pack object, a pack that no longer matches ``pack_object``
  (``inconsistent``), a missing pack and a missing search index are each reported with
  the pack row.
- ``draftstore fsck`` exits 0 when clean and 1 when anything is wrong, printing one
  line per problem; ``--quick`` does not re-hash objects.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from draftstore import Settings, Store
from draftstore.blobs import DirectoryBlobStore, object_key
from draftstore.db.tables import PACKS, PACK_OBJECTS, TURNS
from draftstore.digest import Digest, digest_of
from draftstore.fsck import Problem

INLINE = Settings.model_fields["limits"].default_factory().inline_payload_bytes  # type: ignore[misc]


# =======================================================================================
# helpers
# =======================================================================================
def tag() -> str:
    return uuid.uuid4().hex[:10]


def big_payload(label: str) -> dict[str, str]:
    """A tool payload over the inline limit: offloaded to the blob store."""
    return {"label": label, "text": (label + " ") * (INLINE // len(label) + 16)}


def overwrite_object(store: Store, request: pytest.FixtureRequest, digest: str, data: bytes) -> None:
    """Replace the stored bytes of object ``digest`` behind the store's back (the key stays)."""
    if isinstance(store.blobs, DirectoryBlobStore):
        path = store.blobs.root / object_key(Digest(digest))
        assert path.exists()
        path.write_bytes(data)
        return
    client = request.getfixturevalue("real_s3").client()
    try:
        key = store.blobs.prefix + object_key(Digest(digest))
        client.head_object(Bucket=store.blobs.bucket, Key=key)  # it is there
        client.put_object(Bucket=store.blobs.bucket, Key=key, Body=data)
    finally:
        client.close()


def remove_object(store: Store, digest: str) -> None:
    assert store.blobs.has(Digest(digest))
    store.blobs.delete(Digest(digest))


def stored(store: Store) -> set[str]:
    return {o.digest for o in store.blobs.iter_objects()}


def triples(problems: list[Problem]) -> set[tuple[str, str, str]]:
    return {(p.kind, p.where, p.key) for p in problems}


def pack_rows(store: Store) -> list[Any]:
    with store.engine.connect() as conn:
        return conn.execute(sa.select(PACKS)).all()


def pack_where(row: Any) -> str:
    return f"pack row {row.tree[:12]}/{row.kind}/{row.part}"


def new_project(store: Store, name: str, n: int = 24) -> tuple[Any, dict[str, bytes]]:
    """A project whose version 1 is imported into packs (unique content: packs of its own)."""
    t = tag()
    files = {f"src/pkg{i % 3}/m{i}.py": f"VALUE_{i} = '{t}'\n".encode() for i in range(n)}
    return store.create_project(f"{name}-{t}", files=files), files


# =======================================================================================
# a clean store
# =======================================================================================
def test_a_whole_store_is_clean_and_quick_mode_checks_references_only(store_factory):
    store = store_factory()
    p, _ = new_project(store, "clean")
    t1 = store.start_turn(p.id, "work")
    call = store.tool_started(t1.id, "write_file", big_payload(f"args {tag()}"))
    store.write_file(t1.id, "docs/guide/intro.md", "# intro\n")
    store.tool_completed(t1.id, call.seq, big_payload(f"result {tag()}"))
    store.patch_characters(t1.id, {"hero": "ready"})
    store.complete_turn(t1.id, "done")
    store.publish(p.id, "v2")
    assert store.run_background()["versions_packed"] == 1
    store.create_snapshot(p.id, "head")
    t2 = store.start_turn(p.id, "running")
    store.tool_started(t2.id, "read_file", big_payload(f"running {tag()}"))
    store.write_file(t2.id, "wip.py", "wip = True\n")

    cold = store_factory()
    full = cold.fsck(verify_objects=True)
    assert full.ok, [str(pr) for pr in full.problems]
    packs = pack_rows(cold)
    assert full.objects_verified == len(stored(cold)) and full.packs_verified == len(packs) >= 2
    # 2 versions, the draft, 2 turns' boundaries (the running one has a start only)
    assert full.trees_checked == 2 + 1 + 3
    # payloads (3), states (turn 1 start and end, turn 2 start), the overlay blob, the bundle,
    # the pack rows, the line table each pack's search index names, and each distinct file
    # of the trees (24 imported + 1)
    assert full.references_checked == 3 + 3 + 1 + 1 + len(packs) + len(packs) + 25
    quick = cold.fsck(verify_objects=False)
    assert quick.ok and quick.objects_verified == 0 and quick.packs_verified == 0
    assert (quick.trees_checked, quick.references_checked) == (full.trees_checked, full.references_checked)


# =======================================================================================
# corrupt and missing objects
# =======================================================================================
def test_a_corrupt_object_and_a_missing_one_are_each_reported_with_row_and_key(store_factory, request):
    store = store_factory()
    p, _ = new_project(store, "damaged")
    t = store.start_turn(p.id, "add files (stored on their own, not packed)")
    u = tag()
    store.apply_changes(t.id, {"lib/util.py": f"UTIL = '{u}'\n", "docs/guide/intro.md": f"# {u}\n",
                               "assets/logo.txt": f"logo {u}\n"})
    store.complete_turn(t.id, "done")
    v2 = store.publish(p.id, "v2")
    util, intro = digest_of(f"UTIL = '{u}'\n".encode()), digest_of(f"# {u}\n".encode())
    assets = store.trees.dir_digest(Digest(v2.root), "assets")
    assert assets and {util, intro, assets} <= stored(store)
    assert store_factory().fsck().ok

    overwrite_object(store, request, util, b"UTIL = 'tampered'\n")
    overwrite_object(store, request, assets, b"not a tree node at all")
    remove_object(store, intro)

    report = store_factory().fsck(verify_objects=True)
    assert not report.ok
    by_key: dict[str, list[Problem]] = {}
    for pr in report.problems:
        by_key.setdefault(pr.key, []).append(pr)
    assert set(by_key) == {util, intro, assets}, [str(pr) for pr in report.problems]
    assert [pr.kind for pr in by_key[util]] == ["corrupt"]
    # the missing file: the version that needs it and its path in the tree
    [missing] = by_key[intro]
    assert missing.kind == "missing" and missing.where.startswith(f"version {v2.id} root")
    assert missing.where.endswith("intro.md") and "docs/" in missing.where and "guide/" in missing.where, \
        f"the path of the missing file is not named: {missing.where!r}"
    # the corrupt tree node: where the version's tree reaches it, and as a stored object
    assert {pr.kind for pr in by_key[assets]} == {"corrupt"}
    assert any(pr.where.startswith(f"version {v2.id} root") and "assets/" in pr.where for pr in by_key[assets])
    for pr in report.problems:
        assert pr.key in str(pr) and pr.kind in str(pr)

    quick = store_factory().fsck(verify_objects=False)  # references only: the tampered file goes unseen
    assert {(pr.kind, pr.key) for pr in quick.problems} == {("missing", intro), ("corrupt", assets)}


def test_missing_states_payloads_bundles_and_overlay_blobs_are_reported_with_their_rows(store_factory):
    store = store_factory()
    p, _ = new_project(store, "rows")
    t1 = store.start_turn(p.id, "ends with offloaded payloads")
    c1 = store.tool_started(t1.id, "write_file", big_payload(f"args one {tag()}"))
    store.tool_completed(t1.id, c1.seq, big_payload(f"result one {tag()}"))
    store.patch_characters(t1.id, {"mood": tag()})
    store.complete_turn(t1.id, "done")
    store.publish(p.id, "v2")
    snap = store.create_snapshot(p.id, "head")
    t2 = store.start_turn(p.id, "still running")
    c2 = store.tool_started(t2.id, "search", big_payload(f"args two {tag()}"))
    wip = f"wip {tag()}\n"
    store.write_file(t2.id, "src/wip.py", wip)
    draft = store.get_draft(p.id)
    with store.engine.connect() as conn:
        end_state = conn.execute(sa.select(TURNS.c.end_state_digest).where(TURNS.c.id == t1.id)).scalar()
    result = store.get_turn(t1.id).tool_calls[0].result_digest
    args = store.get_turn(t2.id).tool_calls[0].args_digest
    assert end_state and result and args and snap.bundle_key and c2.args_offloaded
    gone = {end_state, result, args, snap.bundle_key, digest_of(wip.encode())}
    for digest in gone:
        remove_object(store, digest)

    report = store_factory().fsck(verify_objects=False)
    found = triples(report.problems)
    for expected in (("missing", f"turn {t1.id} end state", end_state),
                     ("missing", f"turn {t1.id} tool call 1 result", result),
                     ("missing", f"turn {t2.id} tool call 1 args", args),
                     ("missing", f"snapshot {snap.id} bundle", snap.bundle_key),
                     ("missing", f"draft {draft.id} overlay 'src/wip.py'", digest_of(wip.encode()))):
        assert expected in found, (expected, [str(pr) for pr in report.problems])
    # nothing else is wrong: every problem names one of these objects, all missing
    assert {pr.key for pr in report.problems} == gone and {pr.kind for pr in report.problems} == {"missing"}
    assert set(store_factory().fsck(verify_objects=True).problems) == set(report.problems)


# =======================================================================================
# packs
# =======================================================================================
def test_pack_damage_is_reported_with_the_pack_row(store_factory, request):
    """Four projects, each imported into its own pack, each damaged differently."""
    store = store_factory()
    (corrupt, _), (inconsistent, files), (no_pack, _), (no_index, _) = (
        new_project(store, name) for name in ("corrupt", "inconsistent", "no-pack", "no-index"))
    rows = {r.tree: r for r in pack_rows(store)}

    def pack_of(project: Any) -> Any:
        return rows[store.get_version(store.get_project(project.id).current_version_id).root]

    assert len({pack_of(x).digest for x in (corrupt, inconsistent, no_pack, no_index)}) == 4
    assert store_factory().fsck().ok

    bad = pack_of(corrupt)
    overwrite_object(store, request, bad.digest, b"DSPACK1\n" + b"\x00" * 64)
    dropped = digest_of(files["src/pkg1/m7.py"])
    odd = pack_of(inconsistent)
    with store.engine.begin() as conn:
        assert conn.execute(PACK_OBJECTS.delete().where(PACK_OBJECTS.c.pack == odd.digest,
                                                        PACK_OBJECTS.c.digest == dropped)).rowcount == 1
    lost = pack_of(no_pack)
    remove_object(store, lost.digest)
    unindexed = pack_of(no_index)
    assert unindexed.search_index
    remove_object(store, unindexed.search_index)

    report = store_factory().fsck(verify_objects=True)
    found = triples(report.problems)
    problems = [str(pr) for pr in report.problems]
    assert ("corrupt", pack_where(bad), bad.digest) in found, problems
    assert ("corrupt", "blob store", bad.digest) in found, problems
    assert ("inconsistent", pack_where(odd), odd.digest) in found, problems
    [detail] = [pr.detail for pr in report.problems if pr.kind == "inconsistent"]
    assert detail == f"pack_object lists {odd.objects - 1} objects, the pack holds {odd.objects}"
    missing_file = [pr for pr in report.problems if pr.key == dropped]
    assert [pr.kind for pr in missing_file] == ["missing"] and missing_file[0].where.endswith("m7.py")
    assert ("missing", pack_where(lost), lost.digest) in found, problems
    lost_version = store.get_project(no_pack.id).current_version_id
    assert ("missing", f"version {lost_version} root", lost.tree) in found, problems  # its root lived in it
    assert ("missing", pack_where(unindexed), unindexed.search_index) in found, problems
    corrupt_version = store.get_project(corrupt.id).current_version_id
    assert ("corrupt", f"version {corrupt_version} root", bad.tree) in found, problems  # its root lived in it
    damaged = {bad.digest, bad.tree, odd.digest, dropped, lost.digest, lost.tree, unindexed.search_index}
    assert {pr.key for pr in report.problems} == damaged, problems  # and nothing else


# =======================================================================================
# the command line (embedded default)
# =======================================================================================
def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"DRAFTSTORE_HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": "250",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "draftstore.cli", *args], capture_output=True, text=True,
                          env=env, cwd=home, timeout=120)


def test_cli_fsck_exits_0_when_clean_and_1_listing_each_problem(tmp_path):
    home = tmp_path / "store"
    home.mkdir()
    with Store.open(settings=Settings(home=home)) as store:
        p, _ = new_project(store, "cli")
        t = store.start_turn(p.id, "work")
        store.apply_changes(t.id, {"a.py": f"a = '{tag()}'\n", "b.py": f"b = '{tag()}'\n"})
        store.complete_turn(t.id, "done")
        v2 = store.publish(p.id, "v2")
        view = store.view(p.id)
        a, b = view.stat("a.py").digest, view.stat("b.py").digest

    clean = _cli(home, "fsck")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert re.search(r"^0 problems; \d+ trees, \d+ references, \d+ objects, 1 packs checked", clean.stdout, re.M), \
        clean.stdout

    (home / "blobs" / object_key(a)).write_bytes(b"a = 'tampered'\n")
    corrupt = _cli(home, "fsck")
    assert corrupt.returncode == 1, corrupt.stdout + corrupt.stderr
    assert re.search(rf"^corrupt\s+{a}\s+\(blob store\)", corrupt.stdout, re.M), corrupt.stdout
    assert "1 problems;" in corrupt.stdout
    assert _cli(home, "fsck", "--quick").returncode == 0  # references only: they all resolve

    (home / "blobs" / object_key(b)).unlink()
    missing = _cli(home, "fsck", "--quick")
    assert missing.returncode == 1, missing.stdout + missing.stderr
    assert re.search(rf"^missing\s+{b}\s+\(version {v2.id} root > b\.py\): file$", missing.stdout, re.M), \
        missing.stdout
    assert "Traceback" not in corrupt.stdout + corrupt.stderr + missing.stdout + missing.stderr
