"""The real services the tests run against: PostgreSQL, Redis and SeaweedFS (S3).

No mocks: each helper talks to a real server. Where a server comes from:

- PostgreSQL: ``DRAFTSTORE_TEST_PG_URL`` (an admin URL that may CREATE
  DATABASE; default ``postgresql://postgres@127.0.0.1:5432/postgres``). Each
  test session gets a fresh ``draftstore_test_<random>`` database, dropped at
  the end.
- Redis: ``DRAFTSTORE_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``).
  Each session gets a random key prefix; its keys are deleted at the end
  (never FLUSHALL).
- PgBouncer: the binary at ``DRAFTSTORE_TEST_PGBOUNCER`` (default Debian's
  ``/usr/sbin/pgbouncer``), started per session in front of that PostgreSQL in
  transaction pooling, on a free loopback port, and stopped at the end.
- S3: ``DRAFTSTORE_TEST_S3_ENDPOINT`` plus the ``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY`` environment (what ``.ci/run`` sets); otherwise a
  private SeaweedFS is started with ``infra/seaweedfs.py`` in a temp dir and
  stopped at session end. Each session gets a fresh bucket.

A service that cannot be reached skips the tests that need it — unless
``DRAFTSTORE_REQUIRE_REAL=1`` (set by ``.ci/run``), where it is a hard failure;
and there ``pytest_runtest_makereport`` (a hook conftest.py installs) turns any
skip of a ``real`` test into a failure, on xdist workers too (the report is
rewritten where the test ran, before it is sent to the controlling process).
"""

from __future__ import annotations

import importlib.util
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import pytest

REPO = Path(__file__).resolve().parent.parent

ENV_PG = "DRAFTSTORE_TEST_PG_URL"
ENV_REDIS = "DRAFTSTORE_TEST_REDIS_URL"
ENV_S3 = "DRAFTSTORE_TEST_S3_ENDPOINT"
ENV_PGBOUNCER = "DRAFTSTORE_TEST_PGBOUNCER"
ENV_REQUIRE = "DRAFTSTORE_REQUIRE_REAL"

DEFAULT_PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PGBOUNCER = "/usr/sbin/pgbouncer"
S3_REGION = "us-east-1"


def require_real() -> bool:
    """True when a missing real service must fail the run instead of skipping."""
    return os.environ.get(ENV_REQUIRE, "").strip().lower() in {"1", "true", "yes"}


def unavailable(what: str, why: object) -> NoReturn:
    """Skip (developer machine) or fail (CI) because a real service is missing."""
    msg = f"real {what} unavailable: {why}"
    if require_real():
        pytest.fail(f"{msg} ({ENV_REQUIRE}=1 forbids skipping)", pytrace=False)
    pytest.skip(msg)


# -- CI must not turn a missing service into a green run --------------------------------
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and require_real()
        and item.get_closest_marker("real") is not None
        and not hasattr(report, "wasxfail")
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"real-service test skipped while DRAFTSTORE_REQUIRE_REAL=1: {reason}"


def token(n: int = 6) -> str:
    return secrets.token_hex(n)


# -- PostgreSQL ------------------------------------------------------------------------
def _libpq_url(url: str) -> str:
    """``postgresql+psycopg://`` (SQLAlchemy form) -> ``postgresql://`` (libpq form)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme="postgresql"))


def _with_database(url: str, db: str, scheme: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme=scheme, path="/" + db))


@dataclass
class PostgresDatabase:
    """A database created for this session; ``url`` is in SQLAlchemy form."""

    admin_url: str
    name: str

    @property
    def url(self) -> str:
        return _with_database(self.admin_url, self.name, "postgresql+psycopg")

    @property
    def libpq_url(self) -> str:
        return _with_database(self.admin_url, self.name, "postgresql")

    @classmethod
    def create(cls, template: str | None = None) -> "PostgresDatabase":
        """A fresh database (a copy of ``template``, a database no one is connected to, if given)."""
        import psycopg

        admin = _libpq_url(os.environ.get(ENV_PG) or DEFAULT_PG_ADMIN_URL)
        name = f"draftstore_test_{token()}"
        copy = f' TEMPLATE "{template}"' if template else ""
        try:
            with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'CREATE DATABASE "{name}"{copy}')
        except psycopg.Error as exc:
            unavailable(f"PostgreSQL ({_redact(admin)})", exc)
        return cls(admin, name)

    @classmethod
    def migrated_template(cls) -> "PostgresDatabase":
        """A database migrated to the newest schema, to copy a fresh database from per test
        (CREATE DATABASE ... TEMPLATE costs a fraction of migrating each one)."""
        from draftstore.db.engine import create_db_engine
        from draftstore.db.migrate import upgrade

        db = cls.create()
        engine = create_db_engine(db.url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()  # nobody may stay connected to a template
        return db

    def drop(self) -> None:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as conn:
            # FORCE (PostgreSQL 13+): a leaked pooled connection must not keep it alive.
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


# -- PgBouncer -----------------------------------------------------------------------------
def stop_process(proc: "subprocess.Popen[Any] | None", timeout: float = 10.0) -> None:
    """Stop a server a test started: SIGTERM, then SIGKILL if it is still running after
    ``timeout`` seconds; returns once it has exited. Nothing to do if it already has."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unprivileged_user() -> str:
    """The account PostgreSQL runs as, else ``nobody``: who PgBouncer switches to when started as root."""
    import pwd

    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name).pw_name
        except KeyError:
            continue
    return "nobody"


@dataclass
class PgBouncer:
    """A PgBouncer of our own in front of the test PostgreSQL, in transaction pooling.

    Every database of that server is reachable through it under its own name
    (``* =`` in ``[databases]``), as the same user, with ``auth_type = trust``
    (the user listed in an ``auth_file``, which trust still requires). At most
    ``pool_size`` server connections per database are shared by all clients, so
    consecutive transactions of one client land on different server connections; a client
    that waits ``query_wait_timeout`` (30 s) for one is disconnected with an error.
    PgBouncer refuses to run as root; as root it is started with ``-u`` and the
    account PostgreSQL runs as (it reads its config, in our private temp
    directory, before it switches).
    """

    port: int
    user: str
    proc: subprocess.Popen[bytes]
    tmpdir: tempfile.TemporaryDirectory[str]

    @classmethod
    def start(cls, *, pool_size: int = 20, timeout: float = 15) -> "PgBouncer":
        binary = os.environ.get(ENV_PGBOUNCER) or DEFAULT_PGBOUNCER
        if not os.access(binary, os.X_OK):
            unavailable("PgBouncer", f"no executable {binary} (Debian's package `pgbouncer`; or set {ENV_PGBOUNCER})")
        upstream = urlsplit(os.environ.get(ENV_PG) or DEFAULT_PG_ADMIN_URL)
        user = upstream.username or "postgres"
        tmpdir = tempfile.TemporaryDirectory(prefix="draftstore-pgbouncer-")
        root = Path(tmpdir.name)
        (root / "users.txt").write_text(f'"{user}" ""\n')
        port = _free_port()
        (root / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={upstream.hostname or '127.0.0.1'} port={upstream.port or 5432}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {root / 'users.txt'}\n"
            f"pool_mode = transaction\ndefault_pool_size = {pool_size}\nmax_client_conn = 2000\n"
            "server_login_retry = 1\nquery_wait_timeout = 30\n")
        cmd = [binary]
        if os.geteuid() == 0:
            cmd += ["-u", _unprivileged_user()]
        cmd.append(str(root / "pgbouncer.ini"))
        log = open(root / "pgbouncer.log", "wb")
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        bouncer = cls(port, user, proc, tmpdir)
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                why = f"exited with status {proc.returncode}: {bouncer.log_tail()}"
                tmpdir.cleanup()
                unavailable("PgBouncer", why)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return bouncer
            except OSError:
                if time.monotonic() > deadline:
                    bouncer.stop()
                    unavailable("PgBouncer", f"not accepting on port {port} after {timeout:.0f}s")
                time.sleep(0.05)

    def url(self, database: str) -> str:
        """A SQLAlchemy URL of ``database`` through this PgBouncer, declaring it (``?pooler=transaction``)."""
        return f"postgresql+psycopg://{quote(self.user)}@127.0.0.1:{self.port}/{database}?pooler=transaction"

    def undeclared_url(self, database: str) -> str:
        """The same URL without the declaration, as a user who has not read the docs writes it."""
        return self.url(database).split("?", 1)[0]

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = (Path(self.tmpdir.name) / "pgbouncer.log").read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Stop it (SIGTERM: at once, closing every client and server connection)."""
        stop_process(self.proc)
        self.tmpdir.cleanup()


class DatabaseDropper:
    """Drops per-test databases on a background thread, so a test's teardown does not wait for it.

    ``DROP DATABASE`` waits for every backend of the cluster to let go of the files and
    for them to be removed: a second or two on a loaded machine, a test's whole run time
    for the short ones. A test hands its database over (``drop_later``) and the next test
    starts at once. At most ``backlog`` databases wait (a test handing over one more waits
    for room), so the disk never fills with them; ``close()`` drops every one still waiting
    and raises if any drop failed.
    """

    def __init__(self, backlog: int = 8) -> None:
        self._queue: queue.Queue[PostgresDatabase | None] = queue.Queue(maxsize=backlog)
        self._errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="drop-databases", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (db := self._queue.get()) is not None:
            try:
                db.drop()
            except Exception as exc:  # reported by close(): a leaked database must not pass unseen
                self._errors.append(f"{db.name}: {exc!r}")

    def drop_later(self, db: PostgresDatabase) -> None:
        self._queue.put(db)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        assert not self._errors, f"test databases that could not be dropped: {self._errors}"


# -- Redis -------------------------------------------------------------------------------
@dataclass
class RedisServer:
    """A Redis server plus this session's key prefix."""

    base_url: str
    prefix: str

    @classmethod
    def connect(cls) -> "RedisServer":
        import redis

        base = os.environ.get(ENV_REDIS) or DEFAULT_REDIS_URL
        try:
            client = redis.Redis.from_url(base, socket_connect_timeout=3, socket_timeout=5)
            client.ping()
            client.close()
        except redis.RedisError as exc:
            unavailable(f"Redis ({_redact(base)})", exc)
        return cls(base, f"dstest-{token()}")

    def url(self, sub: str | None = None) -> str:
        """Coordinator URL whose keys live under this session's prefix (+ ``sub``)."""
        prefix = self.prefix if sub is None else f"{self.prefix}-{sub}"
        parts = urlsplit(self.base_url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        query["prefix"] = prefix
        return urlunsplit(parts._replace(query=urlencode(query)))

    def cleanup(self) -> None:
        """Delete every key this session created (and nothing else)."""
        import redis

        client = redis.Redis.from_url(self.base_url, socket_connect_timeout=3, socket_timeout=5)
        try:
            batch = []
            for key in client.scan_iter(match=f"{self.prefix}*", count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    client.delete(*batch)
                    batch.clear()
            if batch:
                client.delete(*batch)
        finally:
            client.close()


class PrivateRedis:
    """A redis-server of one test alone, without persistence, on a free port: flushing,
    killing (``kill -9``) and restarting it (on the same port, empty) touches nobody else."""

    def __init__(self, workdir: Path) -> None:
        import shutil

        binary = shutil.which("redis-server")
        if binary is None:
            unavailable("redis-server", "not on PATH")
        self.binary, self.dir, self.port = binary, workdir, _free_port()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def url(self, prefix: str) -> str:
        return f"redis://127.0.0.1:{self.port}/0?prefix={prefix}"

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=2, socket_timeout=5)

    def start(self) -> "PrivateRedis":
        """Start it (again, after ``kill``) and return once it answers PING."""
        import redis

        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while True:
            assert self.proc.poll() is None, f"redis-server exited ({self.proc.returncode})"
            try:
                with self.client() as r:
                    r.ping()
                self.starts += 1
                return self
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not answer within 15 s"
                time.sleep(0.02)

    def flushall(self) -> None:
        with self.client() as r:
            r.flushall()
            assert r.dbsize() == 0

    def kill(self) -> None:
        """``kill -9``: gone at once, with everything it held."""
        assert self.proc is not None and self.proc.poll() is None
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(timeout=10) == -signal.SIGKILL

    def stop(self) -> None:
        stop_process(self.proc)


# -- S3 (SeaweedFS) ------------------------------------------------------------------------
def load_seaweedfs_module() -> Any:
    """``infra/seaweedfs.py`` as a module (infra/ is scripts, not a package)."""
    name = "draftstore_infra_seaweedfs"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "infra" / "seaweedfs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class S3Service:
    """An S3 endpoint with working credentials and this session's bucket."""

    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    started: Any = None  # the SeaweedFS we started, if any
    tmpdir: Any = None
    _saved_env: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def start_or_connect(cls) -> "S3Service":
        endpoint = os.environ.get(ENV_S3)
        started = tmpdir = None
        saved: dict[str, str | None] = {}
        if endpoint:
            access = os.environ.get("AWS_ACCESS_KEY_ID", "")
            secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
            if not access or not secret:
                unavailable("S3", f"{ENV_S3} is set but AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY are not")
        else:
            seaweedfs = load_seaweedfs_module()
            tmpdir = tempfile.TemporaryDirectory(prefix="draftstore-seaweedfs-")
            try:
                started = seaweedfs.SeaweedFS(tmpdir.name).start()
            except seaweedfs.SeaweedFSError as exc:
                tmpdir.cleanup()
                unavailable("S3 (SeaweedFS)", exc)
            endpoint, access, secret = started.endpoint_url, started.access_key, started.secret_key
            # The code under test reads credentials from boto3's default chain,
            # exactly as in production: publish ours there for this session.
            for key, value in started.env().items():
                if key.startswith("AWS_"):
                    saved[key] = os.environ.get(key)
                    os.environ[key] = value
        svc = cls(endpoint, access, secret, f"dstest-{token()}", started, tmpdir, saved)
        try:
            svc.open_store(create=True).close()
        except BaseException:
            svc.stop()
            raise
        return svc

    def url(self, prefix: str = "", *, bucket: str | None = None, create: bool = False) -> str:
        path = f"/{prefix.strip('/')}" if prefix else ""
        query = {"endpoint_url": self.endpoint_url, "region": S3_REGION}
        if create:
            query["create"] = "1"
        return f"s3://{bucket or self.bucket}{path}?{urlencode(query)}"

    def open_store(self, prefix: str = "", *, create: bool = False, **kwargs: Any) -> Any:
        from draftstore.blobs.s3 import S3BlobStore
        from draftstore.errors import BackendError

        try:
            return S3BlobStore.from_url(self.url(prefix, create=create), **kwargs)
        except BackendError as exc:
            unavailable(f"S3 ({self.endpoint_url})", exc)

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session(
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key, region_name=S3_REGION
        ).client("s3", endpoint_url=self.endpoint_url, config=Config(s3={"addressing_style": "path"}))

    def purge_bucket(self) -> None:
        """Empty and delete this session's bucket (best effort: a shared endpoint stays tidy)."""
        client = self.client()
        try:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
                if keys:
                    client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
            client.delete_bucket(Bucket=self.bucket)
        finally:
            client.close()

    def stop(self) -> None:
        if self.started is None:
            try:
                self.purge_bucket()
            except Exception:  # cleanup must not mask the test results
                pass
        else:
            self.started.stop()
        if self.tmpdir is not None:
            self.tmpdir.cleanup()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{quote(parts.username or '')}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


# -- Redis Cluster -------------------------------------------------------------------------
class LocalRedisCluster:
    """A Redis Cluster of ``masters`` masters with one replica each, started here: Debian's
    ``redis-server --cluster-enabled yes`` on free loopback ports in a temp dir, joined with
    ``redis-cli --cluster create``, ready once every node reports ``cluster_state:ok``.
    No persistence. ``stop()`` ends every process it started (and only those).

    Faults: ``master_of(key)`` is the port of the master owning ``key``'s slot,
    ``replica_of(port)`` that master's replica, ``kill(port)`` a ``kill -9`` of one
    node, and ``wait_failover(replica)`` waits until that replica took its master's
    slots over and every live node reports ``cluster_state:ok``. A cluster that will
    not start is ``unavailable`` (a failure under ``DRAFTSTORE_REQUIRE_REAL=1``)."""

    NODE_TIMEOUT_MS = 2000  # how long a silent master goes before its replica takes over

    def __init__(self, masters: int = 3) -> None:
        import shutil

        self.server, self.cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if self.server is None or self.cli is None:
            unavailable("Redis Cluster", "redis-server / redis-cli not on PATH")
        self.tmpdir = tempfile.TemporaryDirectory(prefix="draftstore-redis-cluster-")
        self.dir = Path(self.tmpdir.name)
        self.size = masters * 2
        self.ports: list[int] = []
        self.procs: dict[int, Any] = {}
        self.killed: set[int] = set()

    # -- life cycle ---------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> "LocalRedisCluster":
        import subprocess

        try:
            self.ports = _free_ports(self.size)
            for port in self.ports:
                self._spawn(port)
            for port in self.ports:
                self._wait(lambda p=port: self._ping(p), timeout, f"redis-server :{port} to answer")
            create = subprocess.run(
                [self.cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                 "--cluster-replicas", "1", "--cluster-yes"],
                capture_output=True, text=True, timeout=timeout)
            if create.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {create.stdout[-2000:]}{create.stderr}")
            self._wait(self._all_ok, timeout, "cluster_state:ok on every node")
            # every replica attached to its master (a failover needs one to take over)
            self._wait(self._replicas_attached, timeout, "a replica attached to every master")
        except Exception as exc:
            self.stop()
            unavailable("Redis Cluster", exc)
        return self

    def _spawn(self, port: int) -> None:
        import subprocess

        node_dir = self.dir / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        log = open(node_dir / "redis.log", "ab")
        self.procs[port] = subprocess.Popen(
            [self.server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(node_dir / "nodes.conf"), "--cluster-node-timeout",
             str(self.NODE_TIMEOUT_MS), "--save", "", "--appendonly", "no", "--daemonize", "no",
             "--dir", str(node_dir)],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def stop(self) -> None:

        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()  # all at once: a cluster node waits for no other
        for proc in self.procs.values():
            stop_process(proc)
        self.procs.clear()
        self.tmpdir.cleanup()

    # -- addresses ------------------------------------------------------------------------
    def url(self, prefix: str, **query: str) -> str:
        """``redis+cluster://`` URL naming every node as a startup node, keys under ``prefix``."""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return f"redis+cluster://{hosts}?{urlencode({'prefix': prefix, **query})}"

    def client(self, port: int) -> Any:
        """A plain client of one node (``CLUSTER`` and ``INFO`` questions, never data)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=2, socket_timeout=5,
                           decode_responses=True)

    def _ping(self, port: int) -> bool:
        with self.client(port) as r:
            return bool(r.ping())

    def live_ports(self) -> list[int]:
        return [p for p in self.ports if p not in self.killed]

    def _role(self, port: int) -> list[Any]:
        with self.client(port) as r:
            return list(r.execute_command("ROLE"))

    def master_ports(self) -> list[int]:
        return [p for p in self.live_ports() if self._role(p)[0] == "master"]

    def replica_of(self, master: int) -> int:
        """The port of the live replica that replicates ``master``."""
        for port in self.live_ports():
            role = self._role(port)
            if role[0] == "slave" and int(role[2]) == master:
                return port
        raise AssertionError(f"no live replica of :{master}")

    def _replicas_attached(self) -> bool:
        """Every master has a replica whose link is up."""
        masters = set(self.master_ports())
        attached = set()
        for port in self.live_ports():
            role = self._role(port)
            if role[0] == "slave" and role[3] == "connected":
                attached.add(int(role[2]))
        return bool(masters) and masters <= attached

    def master_of(self, key: str) -> int:
        """The port of the master that owns ``key``'s slot now."""
        from redis.crc import key_slot

        slot = key_slot(key.encode())
        with self.client(self.live_ports()[0]) as r:
            for start, end, *nodes in r.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(nodes[0][1])
        raise AssertionError(f"no node owns slot {slot}")

    # -- faults -----------------------------------------------------------------------------
    def kill(self, port: int) -> None:
        """``kill -9`` of one node: gone at once, with everything it held."""
        import signal

        proc = self.procs[port]
        assert proc.poll() is None, f"redis-server :{port} was not running"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        self.killed.add(port)

    def wait_failover(self, replica: int, timeout: float = 60.0) -> None:
        """Wait until ``replica`` (of a master just killed) is a master, and every live
        node reports ``cluster_state:ok``."""
        self._wait(lambda: self._role(replica)[0] == "master", timeout, f":{replica} to take over as master")
        self._wait(self._all_ok, timeout, "cluster_state:ok on every live node")

    def _all_ok(self) -> bool:
        for port in self.live_ports():
            with self.client(port) as r:
                info = r.execute_command("CLUSTER", "INFO")
            state = info.get("cluster_state") if isinstance(info, dict) else \
                dict(line.split(":", 1) for line in str(info).split() if ":" in line).get("cluster_state")
            if state != "ok":
                return False
        return True

    @staticmethod
    def _wait(cond: Any, timeout: float, what: str) -> Any:
        import time

        import redis

        deadline = time.monotonic() + timeout
        while True:
            try:
                value = cond()
                if value:
                    return value
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.05)


def _free_ports(n: int) -> list[int]:
    """``n`` free loopback ports whose cluster bus ports (+10000) are below 65536 and free too."""
    import socket

    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports
