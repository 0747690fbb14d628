"""Coordinator backend: Redis or Redis Cluster, via redis-py (production, many replicas).

URL forms (coord/redisurl.py): ``redis://[:password@]host:port/db?prefix=name[&max_events=N]``
for one server (``rediss://`` for TLS, ``unix:///path/redis.sock?db=0`` for a
socket), ``redis+cluster://host:port[,host:port...]?prefix=name`` for a Redis
Cluster (``rediss+cluster://`` for TLS). Every key lives under ``<prefix>:``
(default ``draftstore``), so several deployments or test sessions can share one
server or cluster and none ever needs FLUSHALL.

Key layout (``p`` = prefix; ``{...}`` is the hash tag: a cluster puts keys with
the same tag in one slot)::

    p:lock:{<name>}     string  owner token, PX = lock ttl      (SET NX PX)
    p:events:{<stream>} stream  entries with ids "<n>-0", n = 1, 2, 3, ...; PX set by expire()
    p:epoch:{<stream>}  string  the stream's epoch, SET with entry 1; PX set by expire() too
    p:beat:{<key>}      string  "1", PX = heartbeat ttl
    p:text:{<key>}      string  a running turn's text, PX = text ttl
    p:since             string  "<server run id> <server TIME, seconds>" (one server)
    p:since:{<n>}       the same, one per cluster master (n: a tag hashing into its slots)

A stream's two keys carry the same tag, so the one script or MULTI that writes
them runs on one node of a cluster too; every other script touches one key.
The events key is the stream: an epoch key without it is a leftover (the next
append replaces it), events without an epoch key were appended by a release
that knew no epochs (epoch ``"legacy"``).

Bound to the server process: the epoch a reader is given is the stored one
mixed with the run id of the server that answers, and ``since`` is reset by a
server that did not write it. Replication is asynchronous, so a replica that
took over from a killed master (or a server restarted from a snapshot) may
lack the last writes: its streams may reuse ids, its heartbeats may have
lapsed while no worker could reach it. A new run id gives every such stream a
new epoch (its readers rebuild from the database) and restarts the grace the
recovery sweep gives heartbeats, as after a flush. (Reading the run id, an
INFO call inside the script, took a tail from 18 to 26 µs of server time,
measured on Redis 7.0 with 50 buffered events: small beside the round trip.)
Nothing here is truth, so
renamed keys (an upgrade from the untagged layout) only cost what a flush
costs: locks free themselves, streams are rebuilt from the database, workers
beat again within the grace.

Errors: a connection error, a timeout, a cluster that is down, has no master
for a slot or cannot be reached (``CLUSTERDOWN``, ``TRYAGAIN``, an uncovered
slot, a failover under way, after redis-py's own retries on a fresh slot map)
becomes ``BackendUnavailable`` [backend.unavailable]; any other Redis error
``BackendError`` [backend.error]; both chained with ``from``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import redis
from redis.crc import key_slot
from redis.exceptions import ClusterDownError, RedisClusterException, ReadOnlyError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..errors import BackendError, BackendUnavailable, ConfigInvalid, LockTimeout
from .base import LEGACY_EPOCH, Event, Tail, new_epoch
from .redisurl import DEFAULT_MAX_EVENTS, DEFAULT_PREFIX, RedisTarget, parse_redis_url

__all__ = ["RedisCoordinator", "RedisLock"]

P = ParamSpec("P")
R = TypeVar("R")

# Errors that say "this node, slot or cluster cannot serve now" (a failover under way, a
# master gone, a slot map being refreshed): retryable, as a refused connection is.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, ClusterDownError, TryAgainError, ReadOnlyError, RedisClusterException)

# The run id of the server running a script (INFO is allowed in scripts; CLUSTER MYID is not
# on a single server): what binds epochs and ``since`` to one server process.
_RUN_ID = "string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')"

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
# {epoch or nil, first id, last id, entries after ARGV[1], the server's run id}.
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
return {redis.call('GET', KEYS[2]), first[1][1], last[1][1], entries, """ + _RUN_ID + """}
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

# When this server's coordinator state began, by the server's clock: set by the first
# caller, kept while the same server process answers; a server that did not write it
# (restarted from a snapshot, a replica that took over) starts it again. A value
# without a run id (an older release's) is started again too. The server's TIME, not
# the caller's: a call that waited out a failover in retries must not stamp the
# moment it began, which can be seconds before the new master answered. Returns the
# time as text (seconds).
_SINCE = """
local me = """ + _RUN_ID + """
local held = redis.call('GET', KEYS[1])
if held then
  local id, t = string.match(held, '^(%x+) (.+)$')
  if id == me then
    return t
  end
end
local now = redis.call('TIME')
local t = now[1] .. '.' .. string.format('%06d', tonumber(now[2]))
redis.call('SET', KEYS[1], me .. ' ' .. t)
return t
"""


def _mapped(op: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Map redis-py errors raised by the wrapped method to the draftstore family."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except _UNAVAILABLE as exc:
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
        client: "redis.Redis[Any] | Callable[[], Any]",
        prefix: str = DEFAULT_PREFIX,
        max_events: int = DEFAULT_MAX_EVENTS,
        url: str = "redis://",
        cluster: bool = False,
    ) -> None:
        """``client``: a redis-py client, or a function that builds one on first use
        (a ``RedisCluster`` learns its slot map as it is built: lazily, an unreachable
        cluster is ``backend.unavailable`` on the first operation, not at open)."""
        if not prefix:
            raise ConfigInvalid("the Redis coordinator prefix must not be empty")
        if max_events < 1:
            raise ConfigInvalid("max_events must be at least 1", max_events=max_events)
        self.prefix = prefix
        self.max_events = int(max_events)
        self.url = url
        self.cluster = cluster
        self._connect_lock = threading.Lock()
        self._client: Any = None
        self._factory: Callable[[], Any] | None = None
        if callable(client) and not isinstance(client, redis.Redis):
            self._factory = client
        else:
            self._use(client)

    def _use(self, client: Any) -> None:
        self._release_script = client.register_script(_RELEASE)
        self._append_script = client.register_script(_APPEND)
        self._tail_script = client.register_script(_TAIL)
        self._since_script = client.register_script(_SINCE)
        self._append_text_script = client.register_script(_APPEND_TEXT)
        self._client = client

    @property
    def _r(self) -> Any:
        """The redis-py client, built on first use from the factory (redis-py errors raised
        here are mapped by the operation that asked)."""
        client = self._client
        if client is None:
            with self._connect_lock:
                if self._client is None:
                    assert self._factory is not None
                    self._use(self._factory())
                client = self._client
        return client

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> "RedisCoordinator":
        """Open ``redis://host:port/db?prefix=name&max_events=N`` or
        ``redis+cluster://host:port,host:port?prefix=name`` (coord/redisurl.py).

        Connects lazily: an unreachable server or cluster surfaces as
        ``backend.unavailable`` on the first operation (or call ``ping()`` to check
        at once). A malformed URL is ``config.invalid``.
        """
        target: RedisTarget = parse_redis_url(url, **kwargs)
        client: Any = target.connect if target.cluster else target.connect()
        return cls(client, prefix=target.prefix, max_events=target.max_events, url=target.public_url,
                   cluster=target.cluster)

    def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        """Run the registered script named ``script`` (its attribute) on the client,
        building the client first if need be."""
        client = self._r
        return getattr(self, script)(keys=keys, args=args, client=client)

    # -- keys --------------------------------------------------------------------
    def _key(self, kind: str, name: str) -> str:
        # the name is the hash tag: whatever one script touches shares a cluster slot
        return f"{self.prefix}:{kind}:{{{name}}}"

    def _stream_keys(self, stream: str) -> list[str]:
        """The events key first (it is the stream), then the epoch key (same hash tag)."""
        return [self._key("events", stream), self._key("epoch", stream)]

    def _since_keys(self) -> list[str]:
        """One ``since`` key per master: one key on a single server; on a cluster, a key
        whose tag hashes into a slot of each master of the client's slot map."""
        if not self.cluster:
            return [f"{self.prefix}:since"]
        owners = {nodes[0].name for nodes in self._r.nodes_manager.slots_cache.values() if nodes}
        return [f"{self.prefix}:since:{{{tag}}}" for tag in _tags_for(owners, self._r.nodes_manager.slots_cache)]

    @_mapped("since")
    def since(self) -> float:
        """When the coordinator's state began: the latest of its masters' (a cluster
        whose one master was replaced or restarted began then)."""
        # created by the first caller after a flush, a restart or a failover, then stable
        return max(float(self._run("_since_script", keys=[key], args=[])) for key in self._since_keys())

    @_mapped("ping")
    def ping(self) -> None:
        """Raise ``backend.unavailable`` unless the server (every cluster master) answers PING."""
        if self.cluster:
            self._r.ping(target_nodes=self._r.PRIMARIES)
        else:
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
        return bool(self._run("_release_script", keys=[self._key("lock", name)], args=[token]))

    # -- event buffers ---------------------------------------------------------------
    @_mapped("event append")
    def append(self, stream: str, type: str, data: dict[str, Any] | None = None) -> int:
        """Append an event; returns its id (1, 2, 3, ... per stream). Atomic."""
        payload = json.dumps(data or {}, separators=(",", ":"), ensure_ascii=False)
        args = [self.max_events, type, payload, new_epoch()]  # the epoch is used only if this creates the stream
        return int(self._run("_append_script", keys=self._stream_keys(stream), args=args))

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
        self._r  # noqa: B018 (built on first use: the script is registered with the client)
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
        reply = self._run("_tail_script", keys=self._stream_keys(stream), args=[start, max(0, int(limit))])
        if not reply:
            return Tail(None, [], 0, 0)
        epoch, first_id, last_id, entries, run_id = reply
        epoch_text = LEGACY_EPOCH if epoch is None else _served_epoch(_text(epoch), _text(run_id))
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
        return int(self._run("_append_text_script", keys=[self._key("text", key)], args=[text, _ms(ttl_s), max_bytes]))

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
            if self._client is not None:
                self._client.close()
        except RedisError:  # closing a dead connection has nothing to report
            pass

    def __repr__(self) -> str:
        return f"RedisCoordinator({self.url!r})"


def _served_epoch(stored: str, run_id: str) -> str:
    """The epoch a reader is given: the stream's stored epoch mixed with the run id of the
    server answering, 16 hex digits like a stored one. The same stream served by another
    server process (a replica that took over, a restart from a snapshot) reads as a new
    epoch, so its readers rebuild from the database rather than trust ids it may reuse."""
    return hashlib.blake2b(f"{stored}:{run_id}".encode(), digest_size=8).hexdigest()


def _tags_for(owners: set[str], slots: dict[int, list[Any]]) -> list[str]:
    """For each master named in ``owners``, the first of "0", "1", "2", ... whose hash slot
    it serves in the slot map ``slots`` (slot -> [master, replicas...]). A handful of
    CRC16s for a few masters; a master serving no slot has no state and needs no tag."""
    tags: dict[str, str] = {}
    n = 0
    while len(tags) < len(owners) and n < 1_000_000:
        nodes = slots.get(key_slot(str(n).encode()))
        if nodes and nodes[0].name not in tags:
            tags[nodes[0].name] = str(n)
        n += 1
    return sorted(tags.values(), key=int)
