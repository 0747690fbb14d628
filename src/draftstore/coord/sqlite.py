"""Coordinator backend: one SQLite file (embedded default).

Every process and Store that opens the file shares its locks, event buffers
and heartbeats, so a sweeper sees the beats of workers in other processes.
URL: ``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db``
(SQLAlchemy's convention), optional ``?max_events=N``; the parent directory is
created if missing. Times are wall-clock epoch seconds (``time.time()``):
every process must agree on them, and a monotonic clock is per process.

Table layout (``PRAGMA user_version`` = schema version, so it can evolve)::

    locks   (name PK, token, expires_at)              one row per held lock
    streams (stream PK, last_id, expires_at?, epoch)  id counter, epoch set at creation; expiry set by expire()
    events  (stream, id, type, data JSON)             PK (stream, id); newest max_events kept
    beats   (key PK, expires_at)                      one row per heartbeat
    meta    (name PK, value)                          facts about the file (since)
    texts   (key PK, size, chunks, expires_at)        a text appended to in chunks ...
    text_chunks (key, n, chunk)                       ... PK (key, n), in order

Opening a file upgrades it in place, in one transaction (v1 -> v2 added
``streams.epoch``; streams created before read ``"legacy"``), and refuses a
file written by a newer release. A process of a v1 release still running on
an upgraded file fails its appends (its INSERT no longer fits ``streams``):
restart it, rather than let it create streams without an epoch.

Every write runs in ``BEGIN IMMEDIATE``: SQLite's one writer lock serialises
the writers of all processes (they queue up to the busy timeout), which makes
lock takeover and id assignment atomic. WAL lets readers run beside a writer;
it needs a local filesystem (not NFS/SMB).

``sqlite3.OperationalError`` (locked past the busy timeout, I/O, cannot open,
read-only, disk full) becomes ``BackendUnavailable`` [backend.unavailable], any
other ``sqlite3.Error`` ``BackendError`` [backend.error]; chained with ``from``.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from ..errors import BackendError, BackendUnavailable, ConfigInvalid, LockTimeout
from ..private import private_file
from .base import LEGACY_EPOCH, Event, Tail, new_epoch

__all__ = ["SqliteCoordinator", "SqliteLock"]

DEFAULT_MAX_EVENTS = 10_000
BUSY_TIMEOUT_S = 5.0  # how long a writer queues for the file's write lock
POOL_SIZE = 8  # idle connections kept for reuse; busier moments open (and close) more
PURGE_BATCH = 8  # expired rows of each kind deleted per append: bounds an append's cost

# _MIGRATIONS[v] takes a file from schema version v to v + 1. A new file runs
# them all, so new and upgraded files have the same shape. Never edit a step
# that has shipped: add one.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # v1: the first release
        "CREATE TABLE IF NOT EXISTS locks (name TEXT PRIMARY KEY, token TEXT NOT NULL, expires_at REAL NOT NULL)",
        "CREATE TABLE IF NOT EXISTS streams (stream TEXT PRIMARY KEY, last_id INTEGER NOT NULL, expires_at REAL)",
        # A rowid table, not WITHOUT ROWID: event payloads can be kilobytes.
        "CREATE TABLE IF NOT EXISTS events (stream TEXT NOT NULL, id INTEGER NOT NULL,"
        " type TEXT NOT NULL, data TEXT NOT NULL, PRIMARY KEY (stream, id))",
        "CREATE TABLE IF NOT EXISTS beats (key TEXT PRIMARY KEY, expires_at REAL NOT NULL)",
        "CREATE INDEX IF NOT EXISTS streams_expiry ON streams (expires_at) WHERE expires_at IS NOT NULL",
        "CREATE INDEX IF NOT EXISTS beats_expiry ON beats (expires_at)",
        "CREATE INDEX IF NOT EXISTS locks_expiry ON locks (expires_at)",
    ),
    (  # v2: stream epochs. The default marks the streams that exist now, made
        # without one, as "legacy" (no table rewrite); every insert names its epoch.
        f"ALTER TABLE streams ADD COLUMN epoch TEXT NOT NULL DEFAULT '{LEGACY_EPOCH}'",
    ),
    (  # v3: facts about the file itself (since: when its state began)
        "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    ),
    (  # v4: texts appended to in chunks (an append writes its chunk, never the whole text again)
        "CREATE TABLE IF NOT EXISTS texts (key TEXT PRIMARY KEY, size INTEGER NOT NULL,"
        " chunks INTEGER NOT NULL, expires_at REAL NOT NULL)",
        "CREATE TABLE IF NOT EXISTS text_chunks (key TEXT NOT NULL, n INTEGER NOT NULL, chunk TEXT NOT NULL,"
        " PRIMARY KEY (key, n))",
        "CREATE INDEX IF NOT EXISTS texts_expiry ON texts (expires_at)",
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)
# The epoch is written only when the row is created: an increment keeps it.
_NEXT_ID = (
    "INSERT INTO streams (stream, last_id, expires_at, epoch) VALUES (?, 1, NULL, ?)"
    " ON CONFLICT (stream) DO UPDATE SET last_id = last_id + 1"
)


def _backend_error(exc: sqlite3.Error, op: str, url: str) -> BackendError:
    code = getattr(exc, "sqlite_errorname", None)
    if isinstance(exc, sqlite3.OperationalError):
        return BackendUnavailable(f"SQLite coordinator {url} unavailable during {op}: {exc}", operation=op, sqlite=code)
    return BackendError(f"SQLite error during {op} on {url}: {exc}", operation=op, sqlite=code)


def _drop_expired(db: sqlite3.Connection, now: float, stream: str | None = None) -> None:
    """Delete ``stream`` if expired; or (no stream) a bounded batch of expired streams,
    beats and abandoned locks. Those read as absent already: this stops them piling
    up (a stream per ended turn) without one append paying for a whole backlog."""
    if stream is not None:
        names = db.execute("SELECT stream FROM streams WHERE stream = ? AND expires_at <= ?", (stream, now)).fetchall()
    else:
        names = db.execute("SELECT stream FROM streams WHERE expires_at <= ? LIMIT ?", (now, PURGE_BATCH)).fetchall()
        for table, key in (("beats", "key"), ("locks", "name")):
            batch = f"SELECT {key} FROM {table} WHERE expires_at <= ? LIMIT ?"
            db.execute(f"DELETE FROM {table} WHERE {key} IN ({batch})", (now, PURGE_BATCH))
    db.executemany("DELETE FROM events WHERE stream = ?", names)
    db.executemany("DELETE FROM streams WHERE stream = ?", names)
    if stream is None:
        keys = db.execute("SELECT key FROM texts WHERE expires_at <= ? LIMIT ?", (now, PURGE_BATCH)).fetchall()
        db.executemany("DELETE FROM text_chunks WHERE key = ?", keys)
        db.executemany("DELETE FROM texts WHERE key = ?", keys)


@dataclass
class SqliteLock:
    """A held lock; ``token`` proves ownership."""

    name: str
    token: str
    coord: "SqliteCoordinator"

    def release(self) -> bool:
        """Release if still ours; False if it had expired (and maybe been taken)."""
        return self.coord._release(self.name, self.token)


class SqliteCoordinator:
    """Locks, bounded event buffers and heartbeats in one SQLite file.

    Guarantees, across every thread and process using the file: a lock is held
    by at most one owner at a time and frees itself after its ttl; only the
    token that took it can release it. Event ids are 1, 2, 3, ... per stream,
    with no duplicates or gaps under concurrent appenders; the newest
    ``max_events`` are kept. ``expire(stream, ttl_s)`` deletes a stream ttl_s
    from now (appending does not cancel it). A heartbeat is alive until its
    ttl passes. A stream gets a new epoch in the transaction that creates it,
    and keeps it until deleted; ``tail`` reads one snapshot. TTLs follow the
    wall clock: a clock step shortens or stretches them, acceptable as nothing
    here is truth. Thread-safe (a small pool of connections, each used by one
    thread at a time).
    """

    def __init__(self, path: str | os.PathLike[str], max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if max_events < 1:
            raise ConfigInvalid("max_events must be at least 1", max_events=max_events)
        # Absolute: connections open later, and a chdir meanwhile must not change the file.
        self.path = os.path.abspath(os.fspath(path))
        self.max_events = int(max_events)
        query = "" if self.max_events == DEFAULT_MAX_EVENTS else f"?max_events={self.max_events}"
        self.url = f"sqlite:///{quote(self.path)}{query}"
        self._mutex = threading.Lock()
        self._idle: list[sqlite3.Connection] = []
        self._pid = os.getpid()
        self._inherited: list[sqlite3.Connection] = []
        self._closed = False
        try:
            private_file(self.path)  # 0600 in a 0700 directory, before SQLite creates it 0644 (private.py)
        except OSError as exc:
            raise BackendUnavailable(f"cannot create {self.path}: {exc}", operation="open") from exc
        with self._write("open") as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:  # written by a newer release: refuse rather than misread
                msg = f"{self.path} has coordinator schema v{version}; this draftstore knows v{SCHEMA_VERSION}"
                raise BackendError(msg, operation="open")
            if version < SCHEMA_VERSION:
                # Under BEGIN IMMEDIATE: a concurrent opener waits, then sees the new version.
                for step in _MIGRATIONS[version:]:
                    for statement in step:
                        db.execute(statement)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @classmethod
    def from_url(cls, url: str) -> "SqliteCoordinator":
        """Open ``sqlite:///relative.db`` or ``sqlite:////absolute.db`` (``?max_events=N``)."""
        parts = urlsplit(url)
        if parts.scheme != "sqlite" or parts.netloc or len(parts.path) < 2:
            raise ConfigInvalid("expected sqlite:///relative/path.db or sqlite:////absolute/path.db", url=url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        try:
            max_events = int(query.pop("max_events", DEFAULT_MAX_EVENTS))
        except ValueError as exc:
            raise ConfigInvalid("max_events must be an integer", url=url) from exc
        if query:
            raise ConfigInvalid(f"unknown SQLite coordinator option(s): {', '.join(sorted(query))}", url=url)
        return cls(unquote(parts.path[1:]), max_events=max_events)

    # -- connections ---------------------------------------------------------------
    @contextmanager
    def _connection(self, op: str) -> Iterator[sqlite3.Connection]:
        """A pooled connection for one operation; sqlite3 errors leave as draftstore errors."""
        db: sqlite3.Connection | None = None
        reusable = False
        try:
            with self._mutex:
                if self._closed:
                    raise BackendUnavailable(f"SQLite coordinator {self.url} is closed", operation=op)
                if self._pid != os.getpid():
                    # Forked: an SQLite connection must not cross fork(). Set the parent's
                    # aside unused (kept referenced, so no close in this process touches them).
                    self._inherited, self._idle, self._pid = self._idle, [], os.getpid()
                db = self._idle.pop() if self._idle else None
            if db is None:
                # check_same_thread=False: pooled, so one thread at a time but not always the same.
                db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")  # durable enough for data that is never truth
            yield db
            reusable = True
        except sqlite3.Error as exc:
            raise _backend_error(exc, op, self.url) from exc
        finally:
            if db is not None:
                with self._mutex:
                    if reusable and not self._closed and len(self._idle) < POOL_SIZE:
                        self._idle.append(db)
                        db = None
                if db is not None:
                    db.close()  # broken, surplus or closed: a failed one never returns to the pool

    def _write(self, op: str) -> Any:
        """A write transaction. BEGIN IMMEDIATE queues for the write lock up front, so
        two writers never both read and then fail to upgrade (SQLITE_BUSY)."""
        return self._transaction(op, "BEGIN IMMEDIATE")

    def _read(self, op: str) -> Any:
        """A read transaction: every statement in it sees the same snapshot (WAL),
        which autocommit statements do not."""
        return self._transaction(op, "BEGIN")

    @contextmanager
    def _transaction(self, op: str, begin: str) -> Iterator[sqlite3.Connection]:
        with self._connection(op) as db:
            db.execute(begin)
            try:
                yield db
            except BaseException:
                db.rollback()
                raise
            db.execute("COMMIT")

    # -- locks ---------------------------------------------------------------------
    def acquire(self, name: str, ttl_s: float = 30.0, timeout_s: float = 10.0) -> SqliteLock:
        """Take lock ``name`` for ``ttl_s``, waiting up to ``timeout_s`` (0: try once);
        ``lock.timeout`` if it stays held by someone else."""
        token = secrets.token_hex(16)
        deadline = time.monotonic() + max(0.0, timeout_s)  # our own wait: a local clock is right
        backoff = 0.002
        while True:
            with self._write("lock acquire") as db:
                now = time.time()
                row = db.execute("SELECT expires_at FROM locks WHERE name = ?", (name,)).fetchone()
                if row is None or row[0] <= now:  # free, or its holder's ttl ran out
                    db.execute("INSERT OR REPLACE INTO locks VALUES (?, ?, ?)", (name, token, now + ttl_s))
                    return SqliteLock(name, token, self)
                holder_left = row[0] - now
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockTimeout(f"lock {name!r} not acquired within {timeout_s}s", lock=name)
            # Poll (no cross-process wake-up), capped backoff, never past the holder's expiry.
            time.sleep(max(0.001, min(backoff, left, holder_left)))
            backoff = min(backoff * 2, 0.05)

    def _release(self, name: str, token: str) -> bool:
        with self._write("lock release") as db:
            row = db.execute("SELECT expires_at FROM locks WHERE name = ? AND token = ?", (name, token)).fetchone()
            if row is None:
                return False
            db.execute("DELETE FROM locks WHERE name = ? AND token = ?", (name, token))
            return bool(row[0] > time.time())

    # -- event buffers -------------------------------------------------------------
    def append(self, stream: str, type: str, data: dict[str, Any] | None = None) -> int:
        """Append an event; returns its id (1, 2, 3, ... per stream). Atomic."""
        return self.append_many([(stream, type, data)])[0]

    def append_many(self, events: Sequence[tuple[str, str, dict[str, Any] | None]]) -> list[int]:
        """Append several events in order, in one transaction; returns their ids."""
        if not events:
            return []
        ids: list[int] = []
        with self._write("event append") as db:
            now = time.time()
            _drop_expired(db, now)
            for stream, type, data in events:
                _drop_expired(db, now, stream)  # an expired stream starts again at 1
                # The counter lives in `streams`, not in max(events.id): trimming
                # old events must never restart the numbering. Under the write
                # lock, increment-then-read is atomic across processes.
                db.execute(_NEXT_ID, (stream, new_epoch()))
                n = db.execute("SELECT last_id FROM streams WHERE stream = ?", (stream,)).fetchone()[0]
                payload = json.dumps(data or {}, separators=(",", ":"), ensure_ascii=False)
                db.execute("INSERT INTO events VALUES (?, ?, ?, ?)", (stream, n, type, payload))
                db.execute("DELETE FROM events WHERE stream = ? AND id <= ?", (stream, n - self.max_events))
                ids.append(n)
        return ids

    def read(self, stream: str, after: int = 0, limit: int = 1000) -> list[Event]:
        """Buffered events with id > ``after``, oldest first, at most ``limit``."""
        if limit <= 0:
            return []
        with self._connection("event read") as db:
            row = db.execute("SELECT expires_at FROM streams WHERE stream = ?", (stream,)).fetchone()
            if row is None:
                return []
            if row[0] is None or row[0] > time.time():
                query = "SELECT id, type, data FROM events WHERE stream = ? AND id > ? ORDER BY id LIMIT ?"
                rows = db.execute(query, (stream, max(0, int(after)), limit)).fetchall()
                return [Event(n, t, json.loads(d)) for n, t, d in rows]
        # Expired: it reads as empty, and the first reader to notice deletes it.
        with self._write("event read") as db:
            _drop_expired(db, time.time(), stream)
        return []

    def tail(self, stream: str, after: int = 0, limit: int = 1000) -> Tail:
        """Epoch, buffered id range and events with id > ``after`` (at most
        ``limit``), from one read transaction; ``Tail(None, [], 0, 0)`` if absent."""
        with self._read("event tail") as db:
            row = db.execute("SELECT last_id, epoch, expires_at FROM streams WHERE stream = ?", (stream,)).fetchone()
            if row is not None and (row[2] is None or row[2] > time.time()):
                last_id, epoch, _ = row
                first = db.execute("SELECT min(id) FROM events WHERE stream = ?", (stream,)).fetchone()[0]
                rows = []
                if limit > 0:
                    query = "SELECT id, type, data FROM events WHERE stream = ? AND id > ? ORDER BY id LIMIT ?"
                    rows = db.execute(query, (stream, max(0, int(after)), limit)).fetchall()
                # last_id is the counter: the newest event always survives trimming, so it is buffered.
                return Tail(epoch, [Event(n, t, json.loads(d)) for n, t, d in rows], first or 0, last_id)
        if row is not None:  # expired: absent, and the first reader to notice deletes it
            with self._write("event tail") as db:
                _drop_expired(db, time.time(), stream)
        return Tail(None, [], 0, 0)

    def trim(self, stream: str) -> None:
        """Drop a stream's buffer, epoch and any expiry (its ids start again at 1)."""
        with self._write("event trim") as db:
            db.execute("DELETE FROM events WHERE stream = ?", (stream,))
            db.execute("DELETE FROM streams WHERE stream = ?", (stream,))

    def expire(self, stream: str, ttl_s: float) -> None:
        """Delete the stream ``ttl_s`` from now (replacing an earlier expiry); no-op if absent."""
        with self._write("event expire") as db:
            now = time.time()
            _drop_expired(db, now, stream)  # an already expired stream is absent
            db.execute("UPDATE streams SET expires_at = ? WHERE stream = ?", (now + ttl_s, stream))

    # -- heartbeats ----------------------------------------------------------------
    def beat(self, key: str, ttl_s: float) -> None:
        with self._write("heartbeat") as db:
            db.execute("INSERT OR REPLACE INTO beats VALUES (?, ?)", (key, time.time() + ttl_s))

    def alive(self, key: str) -> bool:
        with self._connection("heartbeat check") as db:
            row = db.execute("SELECT 1 FROM beats WHERE key = ? AND expires_at > ?", (key, time.time())).fetchone()
            return row is not None

    def forget(self, key: str) -> None:
        with self._write("heartbeat forget") as db:
            db.execute("DELETE FROM beats WHERE key = ?", (key,))

    # -- texts ----------------------------------------------------------------------------
    def append_text(self, key: str, text: str, ttl_s: float, max_bytes: int) -> int:
        size = len(text.encode("utf-8"))
        with self._write("text append") as db:
            now = time.time()
            row = db.execute("SELECT size, chunks, expires_at FROM texts WHERE key = ?", (key,)).fetchone()
            total, chunks = (row[0], row[1]) if row is not None and row[2] > now else (0, 0)
            if row is not None and row[2] <= now:  # expired: it starts again
                db.execute("DELETE FROM text_chunks WHERE key = ?", (key,))
            if total + size > max_bytes:
                return -1
            db.execute("INSERT INTO text_chunks VALUES (?, ?, ?)", (key, chunks, text))
            db.execute("INSERT OR REPLACE INTO texts VALUES (?, ?, ?, ?)", (key, total + size, chunks + 1, now + ttl_s))
            return total + size

    def get_text(self, key: str) -> str | None:
        with self._connection("text read") as db:
            if db.execute("SELECT 1 FROM texts WHERE key = ? AND expires_at > ?", (key, time.time())).fetchone() is None:
                return None
            return "".join(c for (c,) in db.execute("SELECT chunk FROM text_chunks WHERE key = ? ORDER BY n", (key,)))

    def drop_text(self, key: str) -> None:
        with self._write("text drop") as db:
            db.execute("DELETE FROM text_chunks WHERE key = ?", (key,))
            db.execute("DELETE FROM texts WHERE key = ?", (key,))

    def since(self) -> float:
        with self._write("since") as db:
            db.execute("INSERT OR IGNORE INTO meta VALUES ('since', ?)", (repr(time.time()),))
            return float(db.execute("SELECT value FROM meta WHERE name = 'since'").fetchone()[0])

    def ping(self) -> None:
        """Raise ``backend.unavailable`` unless the file can be read (also once closed)."""
        with self._connection("ping") as db:
            db.execute("PRAGMA user_version").fetchone()  # reads the file's header, unlike SELECT 1

    def close(self) -> None:
        """Close every connection; one in use closes when its operation ends. Idempotent."""
        with self._mutex:
            self._closed = True
            idle, self._idle = self._idle, []
        for db in idle:
            db.close()

    def __repr__(self) -> str:
        return f"SqliteCoordinator({self.url!r})"
