"""Settings: every ``DRAFTSTORE_*`` value out of its range is refused at load, naming the variable."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from concurrency import Peak

from draftstore import Store
from draftstore.blobs.directory import DirectoryBlobStore
from draftstore.coord import open_coordinator
from draftstore.db.engine import create_db_engine
from draftstore.db.migrate import upgrade
from draftstore.errors import ConfigInvalid
from draftstore.settings import Settings


@pytest.mark.parametrize(("name", "value"), [
    ("DRAFTSTORE_GC_GRACE_S", "-5"),  # gc would delete objects written a moment ago
    ("DRAFTSTORE_GC_GRACE_S", "nan"),
    ("DRAFTSTORE_HEARTBEAT_TTL_S", "0"),  # every running turn would be reaped at once
    ("DRAFTSTORE_PUBLISHING_STUCK_S", "-1"),
    ("DRAFTSTORE_RETAIN_DISCARDED_DAYS", "1000000"),  # gc would overflow the date
    ("DRAFTSTORE_EVENT_TTL_S", "inf"),
    ("DRAFTSTORE_BACKGROUND_INTERVAL_S", "-1"),
    ("DRAFTSTORE_RETAIN_TURNS_DAYS", "-1"),
    ("DRAFTSTORE_SSE_KEEPALIVE_S", "0"),
    ("DRAFTSTORE_SSE_KEEPALIVE_S", "3601"),
    ("DRAFTSTORE_SSE_KEEPALIVE_S", "abc"),
    ("DRAFTSTORE_TURN_THREADS", "0"),  # no thread would ever serve a turn call
    ("DRAFTSTORE_TURN_THREADS", "257"),
    ("DRAFTSTORE_UPLOAD_THREADS", "0"),  # a write would wait for ever for its upload to start
    ("DRAFTSTORE_UPLOAD_THREADS", "257"),
    ("DRAFTSTORE_CACHE_BYTES", "-1"),
    ("DRAFTSTORE_MAX_FILE_BYTES", "0"),
    ("DRAFTSTORE_MAX_PATH_DEPTH", "-3"),
])
def test_a_value_out_of_range_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, name: str,
                                                             value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigInvalid) as info:
        Settings.load()
    assert info.value.code == "config.invalid" and name in str(info.value)


def test_at_the_edges_of_their_ranges_values_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("DRAFTSTORE_GC_GRACE_S", "0"), ("DRAFTSTORE_BACKGROUND_INTERVAL_S", "0"),
                        ("DRAFTSTORE_SSE_KEEPALIVE_S", "3600"), ("DRAFTSTORE_CACHE_BYTES", "0"),
                        ("DRAFTSTORE_INLINE_PAYLOAD_BYTES", "0"), ("DRAFTSTORE_RETAIN_TURNS_DAYS", "0"),
                        ("DRAFTSTORE_TURN_THREADS", "1"), ("DRAFTSTORE_UPLOAD_THREADS", "1")):
        monkeypatch.setenv(name, value)
    s = Settings.load()
    assert (s.gc_grace_s, s.background_interval_s, s.sse_keepalive_s, s.cache_bytes) == (0, 0, 3600, 0)
    assert (s.limits.inline_payload_bytes, s.retain_turns_days, s.turn_threads, s.upload_threads) == (0, 0, 1, 1)


class _HeldPuts(DirectoryBlobStore):
    """A blob directory where storing a probe file holds for a while (``Peak.call``)."""

    def __init__(self, root: Path, peak: Peak) -> None:
        super().__init__(root)
        self.peak = peak

    def _put_raw(self, key: str, data: bytes) -> None:
        if data.startswith(b"upload probe"):
            self.peak.call()
        super()._put_raw(key, data)


def test_a_store_runs_at_most_upload_threads_uploads_at_once(tmp_path: Path) -> None:
    """The setting is the upload pool's size: with 2, six writes made at once store
    their files two at a time."""
    peak = Peak(0.05)
    settings = Settings(home=tmp_path, upload_threads=2)
    engine = create_db_engine(settings.resolved_database_url())
    upgrade(engine)
    store = Store(engine, _HeldPuts(tmp_path / "blobs", peak), open_coordinator(settings.resolved_coord_url()),
                  settings=settings)
    try:
        p = store.create_project("uploads", files={"main.py": b"print(1)\n"})
        turn = store.start_turn(p.id, "six writes at once")
        together = threading.Barrier(6)

        def write(i: int) -> None:
            together.wait(timeout=10)
            store.write_file(turn.id, f"probe/{i}.txt", b"upload probe %d" % i)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=30)
        assert sorted(store.view(p.id).list_files()) == ["main.py"] + [f"probe/{i}.txt" for i in range(6)]
        assert peak.most == 2
    finally:
        store.close()


def test_none_spells_for_ever_for_the_retention_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.load().retain_discarded_days == 30.0
    for spelling in ("none", "None", " NONE "):
        monkeypatch.setenv("DRAFTSTORE_RETAIN_DISCARDED_DAYS", spelling)
        assert Settings.load().retain_discarded_days is None
    monkeypatch.setenv("DRAFTSTORE_DATABASE_URL", "none")  # only the retention settings read it so
    with pytest.raises(ConfigInvalid):
        Store.open()


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:///file:x?mode=memory&uri=true"])
def test_an_in_memory_sqlite_database_is_refused_not_a_crash(tmp_path: Path, url: str) -> None:
    with pytest.raises(ConfigInvalid) as info:
        Store.open(database_url=url, blob_url=f"file://{tmp_path}/blobs")
    assert "in-memory SQLite" in str(info.value)


def test_the_configuration_guide_lists_every_setting_and_every_limit() -> None:
    """The tables of docs/configuration.md name each setting as ``DRAFTSTORE_<NAME>`` and each
    limit as ``<NAME>``: a setting added to the code without a line there fails here."""
    import re

    from draftstore.settings import Limits

    section = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text(encoding="utf-8")
    # the first cell of each table row: `NAME`, or `A` / `B` / `C` for limits sharing a row
    names = {n for row in re.findall(r"^\| (`[^|]+`) \|", section, re.M) for n in re.findall(r"`([A-Z0-9_]+)`", row)}
    missing = [f"DRAFTSTORE_{f.upper()}" for f in Settings.model_fields
               if f != "limits" and f"DRAFTSTORE_{f.upper()}" not in names]
    missing += [f.upper() for f in Limits.model_fields if f.upper() not in names]
    assert not missing, f"docs/configuration.md's tables lack {missing}"
