"""The command line as a new user meets it: each test runs the real command in a subprocess.

Stored text is printed as typed (markup-looking text included); ids are never
cut and any unique prefix of 6+ characters names a record; every read command
has ``--json``; failures are one line with a code, a hint and a documented exit
status (never a traceback unless ``--debug``); export and import round-trip a
state, characters and world settings included; import honours
``.draftstoreignore``. Runs on the embedded default, as a new user would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from draftstore import Settings, Store
from draftstore.idprefix import MIN_PREFIX

ID = re.compile(r"\b[0-9a-f]{32}\b")
MARKUP = "fix [/x] and [bold]this[/bold] <b>now</b> [link=http://x]y[/link]"


def run(home: Path, *args: str, cols: int = 80, **env: str) -> subprocess.CompletedProcess[str]:
    """The real command, piped (not a terminal), at ``cols`` columns."""
    base = {"DRAFTSTORE_HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": str(cols),
            "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    base.update(env)
    return subprocess.run([sys.executable, "-m", "draftstore.cli", *args], capture_output=True, text=True,
                          env=base, cwd=home, timeout=120, stdin=subprocess.DEVNULL)


def ok(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 0, f"exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    assert "Traceback" not in p.stderr
    return p.stdout


def failed(p: subprocess.CompletedProcess[str], status: int, code: str) -> str:
    """A clean failure: the status, one stderr line naming the code, no traceback."""
    assert p.returncode == status, f"exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"error [{code}] "), p.stderr
    return lines[0]


def as_json(p: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(ok(p))


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "store"
    h.mkdir()
    return h


@pytest.fixture
def world(home: Path) -> dict[str, Any]:
    """A project with markup-looking text everywhere: a name, a summary, messages, a
    partial response, a failed tool call; two versions and an open draft."""
    with Store.open(settings=Settings(home=home)) as store:
        p = store.create_project(f"game {MARKUP}", files={"src/a.py": "A = 1\n", "README.md": "# r\n"},
                                 characters={"hero": {"name": "Ada [/x]"}}, world_settings={"era": "bronze"})
        t1 = store.start_turn(p.id, MARKUP)
        c = store.tool_started(t1.id, "view_file", {"path": "src/a.py"})
        store.tool_completed(t1.id, c.seq, {"content": "A = 1\n"})
        c = store.tool_started(t1.id, "run_tests", {"cmd": "pytest [/x]"})
        store.tool_failed(t1.id, c.seq, "exit status 1: [/x] failed")
        store.write_file(t1.id, "src/b.py", "B = 2\n")
        store.interrupt_turn(t1.id, {"text": f"half done {MARKUP}"})
        t2 = store.continue_turn(p.id, "go on")
        store.patch_characters(t2.id, [{"op": "replace", "path": "/hero/name", "value": "Ada II"}])
        store.complete_turn(t2.id, {"role": "assistant", "content": [{"type": "text", "text": f"done {MARKUP}"}]})
        v2 = store.publish(p.id, f"summary {MARKUP}")
        t3 = store.start_turn(p.id, "third")
        store.write_file(t3.id, "src/c.py", "C = 3\n")
        store.complete_turn(t3.id, "ok")
        v1 = store.list_versions(p.id)[0]
    return {"project": p.id, "v1": v1.id, "v2": v2.id, "t1": t1.id, "t2": t2.id, "t3": t3.id}


# -------------------------------------------------------------------------------- text and ids
def test_stored_markup_is_printed_as_typed_by_every_command(home: Path, world: dict[str, Any]) -> None:
    out = ok(run(home, "projects", cols=250))
    assert f"game {MARKUP}"[:40 - 1] in out  # names are clipped to one column, never interpreted
    log = ok(run(home, "log", world["project"], cols=400))
    assert f"summary {MARKUP}"[:59] in log and MARKUP[:59] in log
    turn = ok(run(home, "turn", world["t1"]))
    assert MARKUP in turn  # the user message, whole, as typed
    assert f"half done {MARKUP}" in turn  # the partial response
    assert "exit status 1: [/x] failed" in turn and '"pytest [/x]"' in turn
    done = ok(run(home, "show", world["t2"]))  # the earlier name of `turn`
    assert f"done {MARKUP}" in done


@pytest.mark.parametrize("cols", [80, 40])
def test_ids_are_printed_whole_when_piped_and_narrow(home: Path, world: dict[str, Any], cols: int) -> None:
    projects = ok(run(home, "projects", cols=cols))
    assert world["project"] in projects and world["v2"] in projects
    log = ok(run(home, "log", world["project"], cols=cols))
    for key in ("v1", "v2", "t1", "t2", "t3"):
        assert world[key] in log, key
    turns = ok(run(home, "turns", world["project"], cols=cols))
    assert all(world[k] in turns for k in ("t1", "t2", "t3"))
    assert "…" not in "".join(ID.findall(projects + log + turns))
    published = ok(run(home, "publish", world["project"], "-m", "x", cols=cols))
    assert len(published.strip().splitlines()) == 1 and ID.search(published)  # a message is never wrapped


def test_any_unique_prefix_of_six_characters_names_a_record(home: Path, world: dict[str, Any]) -> None:
    p, v1, t1 = world["project"], world["v1"], world["t1"]
    assert as_json(run(home, "log", p[:MIN_PREFIX], "--json"))["project"]["id"] == p
    assert as_json(run(home, "turn", t1[:8], "--json"))["id"] == t1
    assert ok(run(home, "cat", p[:7], "src/a.py", "--version", v1[:6])) == "A = 1\n"
    assert "src/b.py" in ok(run(home, "diff", v1[:6], f"draft:{p[:6]}", "--stat"))
    assert "src/b.py" in ok(run(home, "diff", f"turn:{t1[:6]}:start", f"turn:{t1[:6]}:end", "--stat"))
    short = failed(run(home, "log", p[:MIN_PREFIX - 1]), 2, "input.invalid")
    assert "at least 6" in short
    failed(run(home, "log", "0" * 32), 2, "project.not_found")
    failed(run(home, "turn", "xyz-not-an-id"), 2, "input.invalid")


def test_an_ambiguous_prefix_is_refused_naming_the_candidates(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uuid

    import draftstore.projects as projects_module

    monkeypatch.setattr(projects_module, "new_id", lambda: "abcdef" + uuid.uuid4().hex[6:])
    with Store.open(settings=Settings(home=home)) as store:
        a = store.create_project("a")
        b = store.create_project("b")
    assert a.id[:6] == b.id[:6] == "abcdef"
    line = failed(run(home, "log", "abcdef"), 2, "input.invalid")
    assert a.id in line and b.id in line and "more than one project" in line
    longer = next(n for n in range(7, 33) if a.id[:n] != b.id[:n])
    assert as_json(run(home, "log", a.id[:longer], "--json"))["project"]["id"] == a.id


def test_log_last_shows_only_the_newest_of_each_list(home: Path, world: dict[str, Any]) -> None:
    p = world["project"]
    one = as_json(run(home, "log", p, "-n", "1", "--json"))
    assert [v["id"] for v in one["versions"]] == [world["v2"]]
    assert [m["reason"] for m in one["head_moves"]] == ["publish"]
    assert [t["id"] for t in one["turns"]] == [world["t3"]]
    two = as_json(run(home, "log", p, "--last", "2", "--json"))
    assert [t["id"] for t in two["turns"]] == [world["t2"], world["t3"]]  # oldest first, as in the full log
    assert [v["id"] for v in two["versions"]] == [world["v1"], world["v2"]]
    text = ok(run(home, "log", p, "-n", "1", cols=400))
    assert world["t3"] in text and world["t1"] not in text and world["t2"] not in text
    for bad in ("0", "-1", "many"):
        refused = run(home, "log", p, "-n", bad)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr and "--last" in refused.stderr, bad


# ------------------------------------------------------------------------------------- --json
def test_every_read_command_speaks_json(home: Path, world: dict[str, Any]) -> None:
    p, v1, t1 = world["project"], world["v1"], world["t1"]
    assert [x["id"] for x in as_json(run(home, "projects", "--json"))] == [p]
    log = as_json(run(home, "log", p, "--json"))
    assert [v["id"] for v in log["versions"]] == [v1, world["v2"]]
    assert [m["reason"] for m in log["head_moves"]] == ["create", "publish"]
    assert [t["status"] for t in as_json(run(home, "turns", p, "--json"))] == ["interrupted", "completed",
                                                                               "completed"]
    turn = as_json(run(home, "turn", t1, "--json"))
    assert [(c["tool_name"], c["status"]) for c in turn["tool_calls"]] == [("view_file", "completed"),
                                                                          ("run_tests", "failed")]
    assert turn["tool_calls"][1]["error"] == "exit status 1: [/x] failed"
    listing = as_json(run(home, "ls", p, "src", "--json"))
    assert [(e["name"], e["kind"]) for e in listing] == [("a.py", "file"), ("b.py", "file"), ("c.py", "file")]
    files = as_json(run(home, "ls", p, "--recursive", "--version", v1, "--json"))
    assert [f["path"] for f in files] == ["README.md", "src/a.py"]
    d = as_json(run(home, "diff", v1, f"draft:{p}", "--json"))
    assert {f["path"]: f["status"] for f in d["files"]} == {"src/b.py": "added", "src/c.py": "added"}
    assert d["characters"] == [{"op": "replace", "path": "/hero/name", "value": "Ada II"}]
    assert as_json(run(home, "db", "current", "--json"))["current"] is True
    assert as_json(run(home, "config", "--json"))["settings"]["DRAFTSTORE_HEARTBEAT_TTL_S"] == 60.0
    assert as_json(run(home, "retention", p, "--json")) == {"turns_days": None, "discarded_days": 30.0}
    assert as_json(run(home, "sweep", "--json")) == {"turns_reaped": 0, "turns_failed": 0, "publishing_released": 0,
                                                     "sandboxes_lost": 0}
    assert as_json(run(home, "gc", "--json"))["dry_run"] is True
    assert as_json(run(home, "fsck", "--quick", "--json"))["ok"] is True
    ok(run(home, "token", "create", "--role", "observer", "--name", "[/x] viewer"))
    assert [t["name"] for t in as_json(run(home, "token", "list", "--json"))] == ["[/x] viewer"]


# ----------------------------------------------------------------------------- failures
def test_failures_are_one_line_with_code_hint_and_exit_status(home: Path, tmp_path: Path,
                                                              world: dict[str, Any]) -> None:
    down = "postgresql://nobody@127.0.0.1:1/none"
    for cmd in (("db", "upgrade"), ("db", "current"), ("projects",)):
        line = failed(run(home, *cmd, DRAFTSTORE_DATABASE_URL=down), 3, "backend.unavailable")
        assert "127.0.0.1:1" in line and "hint:" in line
    line = failed(run(home, "projects", DRAFTSTORE_DATABASE_URL="mysql://u@h/db"), 4, "config.invalid")
    assert "unsupported database URL scheme 'mysql'" in line
    for name, value in (("DRAFTSTORE_MAX_FILE_BYTES", "16MB"), ("DRAFTSTORE_HEARTBEAT_TTL_S", "abc")):
        line = failed(run(home, "projects", **{name: value}), 4, "config.invalid")
        assert f"{name}='{value}'" in line and "hint:" in line
        failed(run(home, "db", "current", **{name: value}), 4, "config.invalid")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    failed(run(home, "export", world["project"], str(a_file)), 2, "input.invalid")
    failed(run(home, "export", world["project"], str(a_file / "below")), 5, "io.error")
    failed(run(home, "export", world["project"], "/proc/draftstore-export"), 5, "io.error")
    debug = run(home, "--debug", "projects", DRAFTSTORE_MAX_FILE_BYTES="16MB")
    assert debug.returncode == 4 and "Traceback" in debug.stderr and "error [config.invalid]" in debug.stderr


def test_publishing_a_stale_draft_says_to_use_force(home: Path, world: dict[str, Any]) -> None:
    p = world["project"]
    ok(run(home, "rollback", p, world["v1"][:8]))  # head moves away from the draft's base
    line = failed(run(home, "publish", p, "-m", "late"), 2, "draft.conflict")
    assert "--force" in line and "no rebase" in line
    out = ok(run(home, "publish", p, "-m", "late", "--force"))
    assert re.match(r"published version 3 [0-9a-f]{32} \(4 files\)$", out.strip()), out


def test_maintenance_commands_print_sentences_not_dicts(home: Path, world: dict[str, Any]) -> None:
    for cmd, expected in ((("sweep",), "0 turns interrupted"), (("gc",), "would delete"),
                          (("fsck", "--quick"), "0 problems;")):
        out = ok(run(home, *cmd))
        assert expected in out and "{" not in out and "'" not in out, out


# ------------------------------------------------------------------------------ new commands
def test_turn_shows_the_timeline_with_durations_errors_and_partial_response(home: Path,
                                                                           world: dict[str, Any]) -> None:
    out = ok(run(home, "turn", world["t1"]))
    assert re.search(rf"^turn {world['t1']}  #1  interrupted", out, re.M)
    assert "partial response:" in out
    rows = [line for line in out.splitlines() if re.match(r"^[12]\s+\+\d+\.\d\ds\s", line)]
    assert len(rows) == 2, out
    assert re.search(r"\d+(ms|\.\ds)\s+completed\s+view_file", rows[0]) and "A = 1" in rows[0]
    assert re.search(r"\d+(ms|\.\ds)\s+failed\s+run_tests", rows[1]) and "error: exit status 1" in rows[1]


def test_cat_ls_discard_and_fork(home: Path, world: dict[str, Any]) -> None:
    p = world["project"]
    assert ok(run(home, "cat", p, "src/c.py")) == "C = 3\n"  # the draft
    failed(run(home, "cat", p, "src/c.py", "--head"), 2, "path.not_found")
    assert ok(run(home, "cat", p, "src/b.py", "--version", world["v2"])) == "B = 2\n"
    listing = ok(run(home, "ls", p))
    assert re.search(r"^dir\s+3\s+src/$", listing, re.M) and re.search(r"^file\s+4\s+README.md$", listing, re.M)
    failed(run(home, "ls", p, "nope"), 2, "path.not_found")
    refused = run(home, "discard", p)  # asks; no terminal answers: nothing is discarded
    assert refused.returncode != 0 and as_json(run(home, "projects", "--json"))[0]["active_draft_id"]
    out = ok(run(home, "discard", p, "--yes"))
    assert "back at its head" in out
    assert as_json(run(home, "projects", "--json"))[0]["active_draft_id"] is None
    failed(run(home, "discard", p, "--yes"), 2, "draft.none")
    forked = ok(run(home, "fork", world["v1"][:10], "--name", "copy [/x]"))
    new_id = re.search(r"project ([0-9a-f]{32}) forked from version 1", forked).group(1)
    assert ok(run(home, "cat", new_id, "src/a.py")) == "A = 1\n"
    names = {x["name"] for x in as_json(run(home, "projects", "--json"))}
    assert "copy [/x]" in names


def test_token_commands_take_prefixes(home: Path, world: dict[str, Any]) -> None:
    made = run(home, "token", "create", "--role", "agent", "--project", world["project"][:6])
    secret = ok(made).strip()
    token_id = re.search(r"token ([0-9a-f]{32}) \(agent, " + world["project"], made.stderr).group(1)
    assert secret.startswith(f"dst_{token_id}_")  # the secret names its token; only this once
    assert ok(run(home, "token", "revoke", token_id[:6])).strip() == f"revoked {token_id}"
    assert as_json(run(home, "token", "list", "--json"))[0]["revoked_at"] is not None


# ------------------------------------------------------------------------------ export / import
def test_export_then_import_round_trips_files_modes_characters_and_world_settings(home: Path, tmp_path: Path,
                                                                                  world: dict[str, Any]) -> None:
    p = world["project"]
    out = tmp_path / "out"
    ok(run(home, "export", p, str(out)))
    state = json.loads((out / ".draftstore-state.json").read_text())
    assert state["characters"] == {"hero": {"name": "Ada II"}} and state["world_settings"] == {"era": "bronze"}
    (out / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(out / "run.sh", 0o755)
    failed(run(home, "export", p, str(out)), 2, "path.conflict")  # not empty: refused
    assert (out / "run.sh").exists()
    imported = ok(run(home, "import", str(out), "--name", "again"))
    new_id = re.search(r"project ([0-9a-f]{32})", imported).group(1)
    with Store.open(settings=Settings(home=home)) as store:
        src, dst = store.view(p), store.view(new_id)
        assert dst.characters == src.characters and dst.world_settings == src.world_settings
        assert dst.list_files() == sorted(src.list_files() + ["run.sh"])  # no state file among the files
        assert all(dst.read_file(f) == src.read_file(f) for f in src.list_files())
        assert dst.stat("run.sh").executable and not dst.stat("src/a.py").executable
    again = tmp_path / "again"
    ok(run(home, "export", new_id, str(again)))
    ok(run(home, "export", p, str(again), "--replace"))  # clears it first
    assert not (again / "run.sh").exists()


def test_import_honours_draftstoreignore_skips_vcs_and_reports_symlinks(home: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    for rel, text in {"app/main.py": "main\n", "app/gen/out.js": "gen\n", "notes.log": "log\n",
                      "keep.log": "keep\n", ".git/HEAD": "ref\n", "app/__pycache__/m.pyc": "pyc\n",
                      ".draftstore/draftstore.db": "db\n"}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    (src / ".draftstoreignore").write_text("# build output\napp/gen/\n*.log\n!keep.log\n")
    (src / "link.py").symlink_to(src / "app/main.py")
    (src / "linkdir").symlink_to(src / "app")
    run_ = run(home, "import", str(src), "--name", "ignored")
    out = ok(run_)
    assert "skipped 2 symlinks: link.py, linkdir" in run_.stderr
    new_id = re.search(r"project ([0-9a-f]{32})", out).group(1)
    with Store.open(settings=Settings(home=home)) as store:
        assert store.view(new_id).list_files() == [".draftstoreignore", "app/main.py", "keep.log"]


def test_a_reader_that_stops_early_ends_the_command_quietly(home: Path) -> None:
    with Store.open(settings=Settings(home=home)) as store:
        p = store.create_project("big", files={"big.txt": b"line\n" * 400_000})  # 2 MB: more than a pipe holds
    env = {"DRAFTSTORE_HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "draftstore.cli", "cat", p.id, "big.txt"], env=env, cwd=home,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None and proc.stdout.read(5) == b"line\n"
    proc.stdout.close()  # as `| head -1` does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err
    assert err == b""  # no error line, no "Exception ignored" from the final flush


def test_json_output_carries_any_json_value_a_turn_recorded(home: Path) -> None:
    # integers beyond 64 bits are valid JSON an agent may send; --json must still print the turn
    with Store.open(settings=Settings(home=home)) as store:
        p = store.create_project("big numbers")
        t = store.start_turn(p.id, {"n": 2**70})
        c = store.tool_started(t.id, "view_file", {"path": "a.py", "end_line": 99999999999999999999})
        store.tool_completed(t.id, c.seq, {"total": -(2**80)})
    turn = as_json(run(home, "turn", t.id, "--json"))
    assert turn["user_message"] == {"n": 2**70}
    assert turn["tool_calls"][0]["args"]["end_line"] == 99999999999999999999
    assert turn["tool_calls"][0]["result"] == {"total": -(2**80)}


# -- import: nothing dropped silently, every bad input typed -------------------------------------
def _chown_tree(top: Path, uid: int) -> None:
    for root, dirs, names in os.walk(top):
        for name in [*dirs, *names]:
            os.lchown(os.path.join(root, name), uid, uid)
    os.lchown(top, uid, uid)


def test_import_of_a_tree_with_an_unreadable_directory_fails_and_creates_nothing(tmp_path: Path) -> None:
    """Root reads any directory, so the import runs as nobody on a tree nobody owns, with one
    directory it may not read: the import stops with io.error (exit 5) naming it, rather than
    create a project without that directory's files."""
    import shutil
    import tempfile

    nobody = 65534
    as_root = os.geteuid() == 0
    if as_root and shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to drop root")
    work = Path(tempfile.mkdtemp(prefix="ds-import-", dir="/tmp"))  # pytest's tmp_path is root's alone
    try:
        os.chmod(work, 0o755)
        home, src = work / "home", work / "src"
        home.mkdir()
        (src / "secret").mkdir(parents=True)
        (src / "main.py").write_text("main\n")
        (src / "secret" / "plan.txt").write_text("plan\n")
        prefix: list[str] = []
        if as_root:
            _chown_tree(work, nobody)
            prefix = ["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups"]
        os.chmod(src / "secret", 0)
        env = {"DRAFTSTORE_HOME": str(home), "HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": "200",
               "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        p = subprocess.run([*prefix, sys.executable, "-m", "draftstore.cli", "import", str(src)],
                           capture_output=True, text=True, env=env, cwd=home, timeout=120, stdin=subprocess.DEVNULL,
                           check=False)
        line = failed(p, 5, "io.error")
        assert str(src / "secret") in line
        with Store.open(settings=Settings(home=home)) as store:
            assert store.list_projects() == []
    finally:
        os.chmod(work / "src" / "secret", 0o755)
        shutil.rmtree(work)


def test_import_of_a_state_file_nested_too_deep_is_bad_input(home: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "main.py").write_text("main\n")
    (src / ".draftstore-state.json").write_text('{"characters": ' + "[" * 100_000 + "]" * 100_000 + "}")
    line = failed(run(home, "import", str(src)), 2, "input.invalid")
    assert "nested too deep" in line


def test_import_never_follows_a_draftstoreignore_that_is_a_link(home: Path, tmp_path: Path) -> None:
    """The import says it skipped the link; so its rules are not applied either."""
    src, elsewhere = tmp_path / "src", tmp_path / "elsewhere"
    src.mkdir()
    elsewhere.mkdir()
    (elsewhere / "rules").write_text("*.py\n")
    (src / "main.py").write_text("main\n")
    (src / ".draftstoreignore").symlink_to(elsewhere / "rules")
    p = run(home, "import", str(src), "--name", "linked")
    out = ok(p)
    assert "skipped 1 symlinks: .draftstoreignore" in p.stderr
    new_id = re.search(r"project ([0-9a-f]{32})", out).group(1)
    with Store.open(settings=Settings(home=home)) as store:
        assert store.view(new_id).list_files() == ["main.py"]
