"""The one path validator (draftstore.paths), by rule and by property."""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from draftstore import Limits, PathDenied, Store
from draftstore.paths import normalize_path

# -- every rule, one example each ---------------------------------------------------------
DENIED = {
    "absolute": "/etc/passwd",
    "absolute-double": "//server/share/x",
    "dotdot-leading": "../x.py",
    "dotdot-inner": "a/../../b.py",
    "dotdot-alone": "..",
    "dotdot-trailing": "a/b/..",
    "dot-segment": "a/./b.py",
    "dot-alone": ".",
    "empty": "",
    "empty-segment": "a//b.py",
    "trailing-slash": "a/b/",
    "nul": "a\x00b.py",
    "newline": "a\nb.py",
    "tab": "a\tb.py",
    "escape": "a\x1b[31m.py",
    "delete-char": "a\x7f.py",
    "c1-control": "a\x85b.py",
    "line-separator": "a\u2028b.py",
    "lone-surrogate": "a\ud800b.py",
    "backslash": "a\\b.py",
    "backslash-dotdot": "..\\..\\etc\\passwd",
    "drive": "C:",
    "drive-relative": "C:foo.py",
    "drive-absolute": "c:/windows/system32",
    "too-long": "a/" * 300 + "b",
    "too-long-segment": "x" * 256,
    "too-deep": "/".join(["d"] * 65),
}


@pytest.mark.parametrize("path", [*DENIED.values(), "./C:/windows/x.py", "./c:evil"],
                         ids=[*DENIED, "dot-slash-drive", "dot-slash-drive-relative"])
def test_a_bad_path_is_denied(path):
    with pytest.raises(PathDenied) as exc:
        normalize_path(path)
    assert exc.value.code == "path.denied"
    assert exc.value.details["reason"]


@pytest.mark.parametrize("value", [None, 42, b"a.py", ["a.py"], 3.5, object()],
                         ids=lambda v: type(v).__name__ if type(v) is object else repr(v))  # no address: xdist workers must agree
def test_a_path_that_is_not_a_string_is_denied(value):
    with pytest.raises(PathDenied) as exc:
        normalize_path(value)
    assert exc.value.code == "path.denied"


def test_the_length_and_depth_limits_come_from_limits():
    tight = Limits(max_path_bytes=10, max_path_depth=2, max_segment_bytes=4)
    assert normalize_path("ab/cd", tight) == "ab/cd"
    for bad in ("abcdefghijk", "a/b/c", "abcde"):
        with pytest.raises(PathDenied):
            normalize_path(bad, tight)
    # bytes, not characters: 4 x 3-byte characters are 12 bytes
    with pytest.raises(PathDenied):
        normalize_path("日本語字", tight)


def test_at_the_limits_a_path_is_accepted():
    lim = Limits()
    deep = "/".join(["d"] * lim.max_path_depth)
    assert normalize_path(deep) == deep
    assert normalize_path("x" * lim.max_segment_bytes) == "x" * lim.max_segment_bytes


@pytest.mark.parametrize(
    "path, canonical",
    [
        ("main.py", "main.py"),
        ("src/pkg/mod.py", "src/pkg/mod.py"),
        ("./src/a.py", "src/a.py"),
        ("...", "..."),
        ("a..b/..c", "a..b/..c"),
        (".hidden/.env", ".hidden/.env"),
        ("dir with spaces/ünïcødé 日本.txt", "dir with spaces/ünïcødé 日本.txt"),
        ("C", "C"),
        ("ab:c", "ab:c"),
    ],
)
def test_a_good_path_is_accepted_in_canonical_form(path, canonical):
    assert normalize_path(path) == canonical


# -- properties ------------------------------------------------------------------------------
# arbitrary text, plus '/'-joined segments biased towards the tricky ones
SEGMENT = st.sampled_from(["a", "b.py", ".", "..", "", "C:", "c:x", "a\\b", "\x00", "\n", "\u2028", "\x7f",
                           "é", "\ud800", " ", "...", "~", "x" * 256]) | st.text(max_size=8)
PATHISH = st.text(max_size=40) | st.lists(SEGMENT, min_size=1, max_size=8).map("/".join) | st.lists(
    SEGMENT, min_size=1, max_size=4).map(lambda segs: "/" + "/".join(segs))


@settings(max_examples=1000, deadline=None)
@given(PATHISH)
def test_an_accepted_path_always_stays_inside_the_root(path):
    try:
        p = normalize_path(path)
    except PathDenied as exc:
        assert exc.code == "path.denied"
        return
    root = "/root/x"
    resolved = os.path.normpath(os.path.join(root, p))
    assert resolved.startswith(root + "/")
    assert ".." not in p.split("/") and "." not in p.split("/")
    assert "\\" not in p and not p.startswith("/")
    assert not any(unicodedata.category(ch) == "Cc" for ch in p)
    assert not p.startswith("./")


@settings(max_examples=500, deadline=None)
@example("./A:")
@given(PATHISH)
def test_the_canonical_form_of_an_accepted_path_is_accepted_unchanged(path):
    try:
        p = normalize_path(path)
    except PathDenied:
        return
    assert normalize_path(p) == p


# -- a rejected path never reaches the draft ---------------------------------------------------
@pytest.fixture(scope="module")
def embedded_turn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Store, str, str]]:
    home = tmp_path_factory.mktemp("paths-store")
    store = Store.open(f"sqlite:///{home}/ds.db", f"file://{home}/blobs", "memory://")
    p = store.create_project("paths", files={"keep.py": "keep\n"})
    t = store.start_turn(p.id, "fuzz the paths")
    yield store, p.id, t.id
    store.close()


def _is_rejected(path: str) -> bool:
    try:
        normalize_path(path)
    except PathDenied:
        return True
    return False


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.filter_too_much])
@given(path=PATHISH.filter(_is_rejected))
def test_writing_to_a_rejected_path_is_denied_and_changes_nothing(embedded_turn, path):
    store, project_id, turn_id = embedded_turn
    before = store.get_draft(project_id)
    files_before = store.view(project_id).list_files()
    with pytest.raises(PathDenied) as exc:
        store.write_file(turn_id, path, b"evil")
    assert exc.value.code == "path.denied"
    after = store.get_draft(project_id)
    assert after.revision == before.revision
    assert store.view(project_id).list_files() == files_before == ["keep.py"]


def test_control_characters_are_refused_exactly_as_their_unicode_category_says():
    """ASCII paths take a shortcut (one scan for C0 controls and DEL); every path is judged
    as the rule says: categories Cc and Cs, U+2028 and U+2029 are refused, nothing else."""
    for cp in [*range(0x3000), 0xFEFF, 0xFFFD, 0x1F600, 0xE0001, 0x10FFFD]:
        ch = chr(cp)
        if ch in "/\\" or 0xD800 <= cp <= 0xDFFF:  # separators; surrogates fail as "not valid UTF-8"
            continue
        refused = unicodedata.category(ch) in ("Cc", "Cs") or ch in "\u2028\u2029"
        if not refused and (ch == "\ufffd" or not unicodedata.is_normalized("NFC", f"a{ch}b")):
            continue  # refused for another reason (below)
        try:
            normalize_path(f"dir/a{ch}b.py")
        except PathDenied as exc:
            assert refused, f"U+{cp:04X} was refused: {exc}"
            assert exc.details["reason"] == "control character"
            continue
        assert not refused, f"U+{cp:04X} should be refused"


def test_a_segment_is_limited_in_bytes_not_characters():
    assert normalize_path("d/" + "\u00e9" * 127) == "d/" + "\u00e9" * 127  # 254 bytes
    with pytest.raises(PathDenied) as exc:
        normalize_path("d/" + "\u00e9" * 128)  # 256 bytes in 128 characters
    assert "segment longer" in exc.value.details["reason"]
    assert normalize_path("d/" + "x" * 255) == "d/" + "x" * 255


# -- one name, one spelling ------------------------------------------------------------------
def test_the_replacement_character_is_refused_because_it_hides_which_bytes_were_meant():
    """An HTTP server decodes %FF and %FE both to U+FFFD: accepting it would land both on one file."""
    for path in ["\ufffdq", "dir/a\ufffd.py", "\ufffd\ufffd"]:
        with pytest.raises(PathDenied) as exc:
            normalize_path(path)
        assert "U+FFFD" in exc.value.details["reason"]


def test_a_path_not_in_nfc_is_refused_with_its_nfc_spelling():
    decomposed, composed = "caf\u0065\u0301/men\u0075\u0308.txt", "caf\u00e9/men\u00fc.txt"
    assert normalize_path(composed) == composed
    with pytest.raises(PathDenied) as exc:
        normalize_path(decomposed)
    assert exc.value.details["nfc"] == composed
    assert "normal form C" in exc.value.details["reason"]
    assert normalize_path("\ud55c\uae00.md") == "\ud55c\uae00.md"  # precomposed Hangul is NFC


BAD_URL_PATHS = {"invalid-ff": "%FFq", "invalid-fe": "%FEq", "overlong-dot": "%C0%AE", "surrogate": "%ED%A0%80",
                 "nfd": "cafe%CC%81.txt"}


def test_a_url_path_that_is_not_valid_nfc_utf8_is_denied_over_http_and_writes_nothing(service):
    """The service decodes a URL path leniently (bad bytes become U+FFFD); the validator
    refuses what that leaves, on the fast lane (PUT) and the general routes alike. One
    service for every path (each on a project of its own): a service's start costs more
    than the requests."""
    c = service.client()
    for name, raw in BAD_URL_PATHS.items():
        pid = c.post("/v1/projects", json={"name": f"urls-{name}"}).json()["id"]
        tid = c.post(f"/v1/projects/{pid}/turns", json={"user_message": "x"}).json()["id"]
        for method in ("PUT", "DELETE"):
            r = c.request(method, f"/v1/turns/{tid}/files/{raw}", content=b"x" if method == "PUT" else None)
            assert r.status_code == 422, (name, method, r.text)
            assert r.json()["code"] == "path.denied", (name, method)
        r = c.get(f"/v1/projects/{pid}/view/files/{raw}")
        assert r.status_code == 422 and r.json()["code"] == "path.denied", (name, r.text)
        assert service.store.view(pid).list_files() == [], name
        assert c.put(f"/v1/turns/{tid}/files/caf%C3%A9.txt", content=b"ok").status_code == 204  # NFC UTF-8: taken
        assert service.store.view(pid).list_files() == ["caf\u00e9.txt"], name
