"""Coordinator backend: Redis, via redis-py (production, many replicas).

URL form: ``redis://[:password@]host:port/db?prefix=name[&max_events=N]``
(``rediss://`` for TLS, ``unix:///path/redis.sock?db=0`` for a socket).
Every key lives under ``<prefix>:`` (default ``draftstore``), so several
deployments or test sessions can share one server and none ever needs
FLUSHALL.

Key layout (``p`` = prefix)::

    p:lock:<name>     string  owner token, PX = lock ttl      (SET NX PX)
    p:events:<stream> stream  entries with ids "<n>-0", n = 1, 2, 3, ...; PX set by expire()
    p:epoch:<stream>  string  the stream's epoch, SET with entry 1; PX set by expire() too
    p:beat:<key>      string  "1", PX = heartbeat ttl

The events key is the stream: an epoch key without it is a leftover (the next
append replaces it), events without an epoch key were appended by a release
that knew no epochs (epoch ``"legacy"``). Both keys of a stream are written
together by one script or MULTI, so they need one server (no Redis Cluster).

Redis connection errors and timeouts become ``BackendUnavailable``
[backend.unavailable]; any other Redis error becomes ``BackendError``
[backend.error]; both chained with ``from``.
"""

from __future__ import annotations

import functools
import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..errors import BackendError, BackendUnavailable, ConfigInvalid, LockTimeout
from .base import LEGACY_EPOCH, Event, Tail, new_epoch

__all__ = ["RedisCoordinator", "RedisLock"]

DEFAULT_PREFIX = "draftstore"
DEFAULT_MAX_EVENTS = 10_000

P = ParamSpec("P")
R = TypeVar("R")

# Delete the lock only if it still holds our token: a holder whose ttl ran out
# must not free a lock that someone else has taken since.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# Next id = last id + 1, taken from the stream itself, and XADD in the same
# script so concurrent appenders get unique, gap-free ids. The stream's last
# entry survives MAXLEN trimming (max_events >= 1), so numbering never restarts
# while the stream exists; trim() deletes it, and numbering starts again at 1,
# as in the in-process coordinator. Entry 1 creates the stream, so it sets the
# epoch (ARGV[4]) in the same script: a reader never sees one without the
# other. SET overwrites a leftover epoch key and drops its TTL, as the new
# stream has none. Later appends leave the epoch key alone: a stream without
# one stays "legacy" until it is dropped.
_APPEND = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local n = 1
if #last > 0 then
  n = tonumber(string.match(last[1][1], '^(%d+)')) + 1
else
  redis.call('SET', KEYS[2], ARGV[4])
end
redis.call('XADD', KEYS[1], 'MAXLEN', ARGV[1], n .. '-0', 't', ARGV[2], 'd', ARGV[3])
return n
"""

# One snapshot: a script runs alone and sees one frozen clock, so the stream
# cannot expire half-way (within MULTI the clock may move on older servers). No
# entries, no stream: a leftover epoch key is not looked at. Returns
# {epoch or nil, first id, last id, entries after ARGV[1]}.
_TAIL = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last == 0 then
  return false
end
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
local entries = {}
if tonumber(ARGV[2]) > 0 then
  entries = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
end
return {redis.call('GET', KEYS[2]), first[1][1], last[1][1], entries}
"""


# append to a text unless it would grow past ARGV[3] bytes (-1: refused, unchanged); keep it ARGV[2] ms
_APPEND_TEXT = """
local n = redis.call('STRLEN', KEYS[1])
if n + string.len(ARGV[1]) > tonumber(ARGV[3]) then
  return -1
end
n = redis.call('APPEND', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return n
"""

_SINCE = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])
"""


def _mapped(op: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Map redis-py errors raised by the wrapped method to the draftstore family."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                # AuthenticationError is a ConnectionError in redis-py: a refused
                # password is "cannot use the coordinator" as well.
                url = getattr(args[0], "url", "redis") if args else "redis"
                raise BackendUnavailable(f"Redis coordinator {url} unavailable during {op}: {exc}", operation=op) from exc
            except RedisError as exc:
                raise BackendError(f"Redis error during {op}: {exc}", operation=op) from exc

        return inner

    return wrap


def _ms(seconds: float) -> int:
    return max(1, int(round(seconds * 1000)))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _id(entry_id: Any) -> int:
    return int(_text(entry_id).split("-", 1)[0])


def _event(entry: Any) -> Event:
    """A stream entry ``("<n>-0", fields)`` as an Event. ``fields`` is a dict from
    XRANGE, or a flat ``[k, v, ...]`` list when it comes through a script."""
    entry_id, fields = entry
    pairs = fields.items() if isinstance(fields, dict) else zip(fields[::2], fields[1::2])
    f = {_text(k): _text(v) for k, v in pairs}
    return Event(_id(entry_id), f.get("t", ""), json.loads(f.get("d", "{}")))


@dataclass
class RedisLock:
    """A held lock; ``token`` proves ownership."""

    name: str
    token: str
    coord: "RedisCoordinator"

    def release(self) -> bool:
        """Release if still ours; False if it had expired (and maybe been taken)."""
        return self.coord._release(self.name, self.token)


class RedisCoordinator:
    """Locks, bounded event buffers and heartbeats in Redis.

    Guarantees: a lock is held by at most one owner at a time and frees itself
    after its ttl; only the token that took it can release it. Event ids are
    1, 2, 3, ... per stream, assigned atomically (no duplicates or gaps under
    concurrent appenders, across processes); the newest ``max_events`` are
    kept. A stream gets a new epoch atomically with its entry 1 and keeps it
    until dropped; ``tail`` reads one snapshot (a script). A heartbeat is
    alive until its ttl passes. Thread-safe (redis-py pools connections).
    """

    def __init__(
        self,
        client: "redis.Redis[Any]",
        prefix: str = DEFAULT_PREFIX,
        max_events: int = DEFAULT_MAX_EVENTS,
        url: str = "redis://",
    ) -> None:
        if not prefix:
            raise ConfigInvalid("the Redis coordinator prefix must not be empty")
        if max_events < 1:
            raise ConfigInvalid("max_events must be at least 1", max_events=max_events)
        self._r = client
        self.prefix = prefix
        self.max_events = int(max_events)
        self.url = url
        self._release_script = client.register_script(_RELEASE)
        self._append_script = client.register_script(_APPEND)
        self._tail_script = client.register_script(_TAIL)
        self._since_script = client.register_script(_SINCE)
        self._append_text_script = client.register_script(_APPEND_TEXT)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> "RedisCoordinator":
        """Open ``redis://host:port/db?prefix=name&max_events=N``.

        Connects lazily: an unreachable server surfaces as ``backend.unavailable``
        on the first operation (or call ``ping()`` to check at once).
        """
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        prefix = query.pop("prefix", None) or DEFAULT_PREFIX
        try:
            max_events = int(query.pop("max_events", DEFAULT_MAX_EVENTS))
        except ValueError as exc:
            raise ConfigInvalid("max_events must be an integer", url=url) from exc
        redis_url = urlunsplit(parts._replace(query=urlencode(query)))
        options: dict[str, Any] = {
            # Coordination is on the hot path of every turn: give up quickly on a
            # dead server rather than stall a request for the OS default (minutes).
            "socket_connect_timeout": 3.0,
            "socket_timeout": 5.0,
            "socket_keepalive": True,
            "health_check_interval": 30,
            "decode_responses": True,
        }
        options.update(kwargs)
        try:
            client = redis.Redis.from_url(redis_url, **options)
        except ValueError as exc:
            raise ConfigInvalid(f"bad Redis URL: {exc}", url=_redact(url)) from exc
        public = _redact(urlunsplit(parts._replace(query=urlencode({"prefix": prefix}))))
        return cls(client, prefix=prefix, max_events=max_events, url=public)

    # -- keys --------------------------------------------------------------------
    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}:{kind}:{name}"

    def _stream_keys(self, stream: str) -> list[str]:
        """The events key first (it is the stream), then the epoch key."""
        return [self._key("events", stream), self._key("epoch", stream)]

    @_mapped("since")
    def since(self) -> float:
        # created by the first caller after a flush or restart, then stable
        return float(self._since_script(keys=[f"{self.prefix}:since"], args=[repr(time.time())]))

    @_mapped("ping")
    def ping(self) -> None:
        """Raise ``backend.unavailable`` unless the server answers PING."""
        self._r.ping()

    # -- locks ---------------------------------------------------------------------
    @_mapped("lock acquire")
    def acquire(self, name: str, ttl_s: float = 30.0, timeout_s: float = 10.0) -> RedisLock:
        """Take lock ``name`` for ``ttl_s``, waiting up to ``timeout_s``.

        Raises ``lock.timeout`` if it stays held by someone else. ``timeout_s=0``
        tries once.
        """
        key = self._key("lock", name)
        token = secrets.token_hex(16)
        ttl_ms = _ms(ttl_s)
        deadline = time.monotonic() + max(0.0, timeout_s)
        backoff = 0.002
        while True:
            if self._r.set(key, token, nx=True, px=ttl_ms):
                return RedisLock(name, token, self)
            now = time.monotonic()
            if now >= deadline:
                raise LockTimeout(f"lock {name!r} not acquired within {timeout_s}s", lock=name)
            # Poll with capped exponential backoff, but never sleep past the
            # holder's expiry or our own deadline. (Pub/sub wake-ups would save a
            # few ms on release; polling keeps no extra connection per waiter.)
            pttl = self._r.pttl(key)
            wait = min(backoff, deadline - now)
            if pttl is not None and pttl > 0:
                wait = min(wait, pttl / 1000)
            time.sleep(max(wait, 0.001))
            backoff = min(backoff * 2, 0.05)

    @_mapped("lock release")
    def _release(self, name: str, token: str) -> bool:
        return bool(self._release_script(keys=[self._key("lock", name)], args=[token]))

    # -- event buffers ---------------------------------------------------------------
    @_mapped("event append")
    def append(self, stream: str, type: str, data: dict[str, Any] | None = None) -> int:
        """Append an event; returns its id (1, 2, 3, ... per stream). Atomic."""
        payload = json.dumps(data or {}, separators=(",", ":"), ensure_ascii=False)
        args = [self.max_events, type, payload, new_epoch()]  # the epoch is used only if this creates the stream
        return int(self._append_script(keys=self._stream_keys(stream), args=args))

    @_mapped("event append")
    def append_many(self, events: Sequence[tuple[str, str, dict[str, Any] | None]]) -> list[int]:
        """Append several events in order, in one round trip; returns their ids."""
        if not events:
            return []
        calls = []
        for stream, type, data in events:
            payload = json.dumps(data or {}, separators=(",", ":"), ensure_ascii=False)
            keys = self._stream_keys(stream)
            calls.append((len(keys), *keys, self.max_events, type, payload, new_epoch()))
        return self._evalsha_all(self._append_script, calls)

    def _evalsha_all(self, script: Any, calls: list[tuple[Any, ...]]) -> list[int]:
        """Run ``script`` once per ``(numkeys, *keys, *args)`` in one pipelined round trip.

        Not redis-py's ``Script`` in a pipeline: that asks ``SCRIPT EXISTS`` first, a second
        round trip on every batch. Here a script the server lost (restart, ``SCRIPT FLUSH``)
        fails only the calls from the loss on (it runs nothing), so those are re-run, in
        order, once the script is loaded again."""
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in (0, 1):
            pipe = self._r.pipeline(transaction=False)
            for i in todo:
                pipe.evalsha(script.sha, *calls[i])
            replies = pipe.execute(raise_on_error=False)
            missing = []
            for i, reply in zip(todo, replies):
                if isinstance(reply, NoScriptError) and not attempt:
                    missing.append(i)
                elif isinstance(reply, Exception):
                    raise reply
                else:
                    results[i] = int(reply)
            if not missing:
                break
            script.sha = self._r.script_load(script.script)
            todo = missing
        return results

    @_mapped("event read")
    def read(self, stream: str, after: int = 0, limit: int = 1000) -> list[Event]:
        """Buffered events with id > ``after``, oldest first, at most ``limit``."""
        if limit <= 0:
            return []
        start = f"{max(0, int(after)) + 1}-0"
        entries = self._r.xrange(self._key("events", stream), min=start, max="+", count=limit)
        return [_event(entry) for entry in entries]

    @_mapped("event tail")
    def tail(self, stream: str, after: int = 0, limit: int = 1000) -> Tail:
        """Epoch, buffered id range and events with id > ``after`` (at most
        ``limit``), read by one script; ``Tail(None, [], 0, 0)`` if absent."""
        start = f"{max(0, int(after)) + 1}-0"
        reply = self._tail_script(keys=self._stream_keys(stream), args=[start, max(0, int(limit))])
        if not reply:
            return Tail(None, [], 0, 0)
        epoch, first_id, last_id, entries = reply
        epoch_text = LEGACY_EPOCH if epoch is None else _text(epoch)
        return Tail(epoch_text, [_event(entry) for entry in entries], _id(first_id), _id(last_id))

    @_mapped("event trim")
    def trim(self, stream: str) -> None:
        """Drop a stream's buffer and epoch (its ids start again at 1)."""
        self._r.delete(*self._stream_keys(stream))

    @_mapped("event expire")
    def expire(self, stream: str, ttl_s: float) -> None:
        """Delete the stream ``ttl_s`` from now (replacing an earlier expiry); no-op if absent.

        PEXPIRE: XADD keeps a key's TTL, so later appends do not cancel it. One
        MULTI, events key first: the epoch key never expires before its events
        (a stream without its epoch would read as "legacy"); outliving them by
        a millisecond is harmless, as a stream without events is absent.
        """
        pipe = self._r.pipeline(transaction=True)
        for key in self._stream_keys(stream):
            pipe.pexpire(key, _ms(ttl_s))
        pipe.execute()

    # -- heartbeats ---------------------------------------------------------------------
    @_mapped("heartbeat")
    def beat(self, key: str, ttl_s: float) -> None:
        self._r.set(self._key("beat", key), "1", px=_ms(ttl_s))

    @_mapped("heartbeat check")
    def alive(self, key: str) -> bool:
        return bool(self._r.exists(self._key("beat", key)))

    @_mapped("heartbeat forget")
    def forget(self, key: str) -> None:
        self._r.delete(self._key("beat", key))

    # -- texts ----------------------------------------------------------------------------
    @_mapped("text append")
    def append_text(self, key: str, text: str, ttl_s: float, max_bytes: int) -> int:
        return int(self._append_text_script(keys=[self._key("text", key)], args=[text, _ms(ttl_s), max_bytes]))

    @_mapped("text read")
    def get_text(self, key: str) -> str | None:
        raw = self._r.get(self._key("text", key))
        return raw.decode("utf-8") if isinstance(raw, bytes) else raw

    @_mapped("text drop")
    def drop_text(self, key: str) -> None:
        self._r.delete(self._key("text", key))

    def close(self) -> None:
        """Close pooled connections. Idempotent."""
        try:
            self._r.close()
        except RedisError:  # closing a dead connection has nothing to report
            pass

    def __repr__(self) -> str:
        return f"RedisCoordinator({self.url!r})"


def _redact(url: str) -> str:
    """The URL without its password, for messages and ``.url``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))
