"""Redis coordinator URLs: what a URL names, and the redis-py client that reaches it.

- ``redis://[:password@]host:port/db?prefix=name[&max_events=N]`` (``rediss://``
  for TLS, ``unix:///path/redis.sock?db=0`` for a socket): one server, through
  ``redis.Redis``.
- ``redis+cluster://[[user]:password@]host:port[,host:port...]?prefix=name[&max_events=N]``
  (``rediss+cluster://`` for TLS): a Redis Cluster, through redis-py's
  ``RedisCluster``. Every listed node is a startup node: any one that answers
  is enough to learn the slot map, so list more than one. A cluster has no
  database number (only db 0), so the URL takes no path.

Any other query parameter goes to redis-py as a connection option (as
``redis.Redis.from_url`` reads it, e.g. ``socket_timeout=2``). Parsing is
eager (a malformed URL is ``config.invalid`` at once); connecting is lazy
(an unreachable server or cluster is ``backend.unavailable`` on the first
operation). No I/O here but the client the returned factory builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from ..errors import ConfigInvalid

__all__ = ["CLUSTER_SCHEMES", "DEFAULT_MAX_EVENTS", "DEFAULT_PREFIX", "RedisTarget", "parse_redis_url", "redact"]

DEFAULT_PREFIX = "draftstore"
DEFAULT_MAX_EVENTS = 10_000
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

# Coordination is on the hot path of every turn: give up quickly on a dead server
# rather than stall a request for the OS default (minutes).
_OPTIONS: dict[str, Any] = {
    "socket_connect_timeout": 3.0,
    "socket_timeout": 5.0,
    "socket_keepalive": True,
    "health_check_interval": 30,
    "decode_responses": True,
}

# A cluster command that meets a dead master, CLUSTERDOWN or a moved slot is tried
# again on a fresh slot map (redis-py refreshes it at most once a second) for about
# 1.5 s of back-off: a replica's failover that completes meanwhile is invisible to
# the caller; a longer one fails the call as backend.unavailable, well within the
# bound a dead backend must fail in.
_CLUSTER_RETRIES = 6
_CLUSTER_BACKOFF = (0.05, 0.5)  # base, cap (s)


@dataclass(frozen=True)
class RedisTarget:
    """A parsed coordinator URL: key prefix, buffer bound, the URL as shown (no
    password, no options), whether it names a cluster, and ``connect()`` that builds
    the redis-py client (no network traffic for one server; the cluster's slot map
    is fetched there)."""

    prefix: str
    max_events: int
    public_url: str
    cluster: bool
    connect: Callable[[], Any]


def parse_redis_url(url: str, **options: Any) -> RedisTarget:
    """Parse a ``redis://``, ``rediss://``, ``unix://`` or ``redis+cluster://`` URL.

    Raises ``config.invalid`` for a malformed URL, a bad ``max_events``, a cluster
    URL with a database number, or a cluster prefix holding ``{`` or ``}`` (a hash
    tag in the prefix would move every key into one slot, or split a stream's keys).
    ``options`` override the connection defaults."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    prefix = query.pop("prefix", None) or DEFAULT_PREFIX
    try:
        max_events = int(query.pop("max_events", DEFAULT_MAX_EVENTS))
    except ValueError as exc:
        raise ConfigInvalid("max_events must be an integer", url=redact(url)) from exc
    merged = {**_OPTIONS, **options}
    public = redact(urlunsplit(parts._replace(query=urlencode({"prefix": prefix}))))
    if parts.scheme in CLUSTER_SCHEMES:
        if "{" in prefix or "}" in prefix:
            raise ConfigInvalid("a Redis Cluster prefix must not contain '{' or '}'", url=public)
        connect = _cluster(url, parts.scheme, query, merged)
        return RedisTarget(prefix, max_events, public, True, connect)
    redis_url = urlunsplit(parts._replace(query=urlencode(query)))
    try:
        client = redis.Redis.from_url(redis_url, **merged)  # connects on first use
    except ValueError as exc:
        raise ConfigInvalid(f"bad Redis URL: {exc}", url=redact(url)) from exc
    return RedisTarget(prefix, max_events, public, False, lambda: client)


def _cluster(url: str, scheme: str, query: dict[str, str], options: dict[str, Any]) -> Callable[[], Any]:
    """Validate a cluster URL now; return the factory of its ``RedisCluster``."""
    from redis.cluster import ClusterNode, RedisCluster

    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if parts.path not in ("", "/", "/0"):
        raise ConfigInvalid("a Redis Cluster URL takes no database number (a cluster has db 0 only)",
                            url=redact(url))
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon:
            host, port = item.strip(), "6379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigInvalid(f"bad Redis Cluster node {item!r} (host:port expected)", url=redact(url))
        nodes.append((host, int(port)))
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    # The first node as a plain URL lets redis-py read the remaining query options as it
    # does for one server; the others are given as startup nodes.
    first_host, first_port = nodes[0]
    plain = urlunsplit((scheme.removesuffix("+cluster"), f"{first_host}:{first_port}", "", urlencode(query), ""))
    kwargs = dict(options)
    if username is not None:
        kwargs["username"] = username
    if password is not None:
        kwargs["password"] = password
    retry = Retry(ExponentialWithJitterBackoff(base=_CLUSTER_BACKOFF[0], cap=_CLUSTER_BACKOFF[1]), _CLUSTER_RETRIES)

    def connect() -> Any:
        return RedisCluster(
            url=plain,
            startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]],
            retry=retry,
            # serve the slots whose masters answer while another master is being replaced
            require_full_coverage=False,
            **kwargs,
        )

    return connect


def redact(url: str) -> str:
    """The URL without its password, for messages and ``.url``."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))
