"""The real stack a benchmark run owns: a scratch PostgreSQL database, an S3
bucket on SeaweedFS, a Redis key prefix, and the raw clients the baselines use.

Where each service comes from:

- PostgreSQL: ``DRAFTSTORE_BENCH_PG_URL`` (an admin URL allowed to CREATE
  DATABASE; default ``postgresql://postgres@127.0.0.1:5432/postgres``). The run
  creates ``draftstore_bench_<random>``, migrates it with
  ``Store.open(..., migrate=True)`` and drops it at the end.
- S3: ``DRAFTSTORE_BENCH_S3_ENDPOINT`` plus ``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY`` if set; otherwise a private SeaweedFS is started
  with ``infra/seaweedfs.py`` in a temp dir and stopped at the end. Either way
  the run creates a fresh bucket with boto3 (emptied and deleted at the end
  on an external endpoint).
- Redis: ``DRAFTSTORE_BENCH_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``)
  with a random key prefix; the prefix's keys are deleted at the end.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import boto3
import psycopg
import redis
from botocore.config import Config

from draftstore import Store

REPO = Path(__file__).resolve().parent.parent
REGION = "us-east-1"
DEFAULT_PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _with_db(url: str, db: str, scheme: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme=scheme, path="/" + db))


def _load_seaweedfs_module() -> Any:
    path = REPO / "infra" / "seaweedfs.py"
    spec = importlib.util.spec_from_file_location("draftstore_infra_seaweedfs", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses/typing look modules up by name
    spec.loader.exec_module(module)
    return module


class BenchEnv:
    """Owns every resource of one run; ``close()`` releases all of them."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(4)
        self._tmp = Path(tempfile.mkdtemp(prefix="draftstore-bench-"))
        self._seaweed: Any = None
        self._db_created = False
        self._bucket_created = False
        self._external_s3 = False
        self.stores: list[Store] = []
        self.pg: psycopg.Connection | None = None
        self.s3: Any = None
        self.redis: redis.Redis | None = None

    # -- set-up ------------------------------------------------------------------
    def open(self) -> "BenchEnv":
        t0 = time.perf_counter()
        self._open_postgres()
        self._open_s3()
        self._open_redis()
        progress(f"stack ready in {time.perf_counter() - t0:.1f}s: db {self.db_name}, bucket {self.bucket}, "
                 f"S3 {self.endpoint_url}, redis prefix {self.redis_prefix}")
        return self

    def _open_postgres(self) -> None:
        admin = os.environ.get("DRAFTSTORE_BENCH_PG_URL") or DEFAULT_PG_ADMIN_URL
        self.pg_admin_url = _with_db(admin, urlsplit(admin).path.lstrip("/") or "postgres", "postgresql")
        self.db_name = f"draftstore_bench_{self.token}"
        with psycopg.connect(self.pg_admin_url, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{self.db_name}"')
        self._db_created = True
        self.database_url = _with_db(self.pg_admin_url, self.db_name, "postgresql+psycopg")
        # the baselines' raw connection: psycopg 3, autocommit, scratch tables
        self.pg = psycopg.connect(_with_db(self.pg_admin_url, self.db_name, "postgresql"), autocommit=True)
        self.pg.execute("CREATE TABLE bench_scratch (id integer PRIMARY KEY, body jsonb NOT NULL)")
        self.pg.execute("INSERT INTO bench_scratch SELECT g, '{\"v\": 0}'::jsonb FROM generate_series(1, 1000) g")
        self.pg.execute(
            "CREATE TABLE bench_insert (id bigserial PRIMARY KEY, turn_id text NOT NULL, seq integer NOT NULL, "
            "tool_name text NOT NULL, status text NOT NULL, args_json text, started_at timestamptz NOT NULL)"
        )

    def _open_s3(self) -> None:
        endpoint = os.environ.get("DRAFTSTORE_BENCH_S3_ENDPOINT")
        if endpoint:
            self._external_s3 = True
            self.endpoint_url = endpoint.rstrip("/")
        else:
            mod = _load_seaweedfs_module()
            progress("starting a private SeaweedFS (infra/seaweedfs.py)")
            self._seaweed = mod.SeaweedFS(self._tmp / "seaweedfs").start()
            self.endpoint_url = self._seaweed.endpoint_url
            # the store's S3 backend takes credentials from boto3's default chain
            os.environ["AWS_ACCESS_KEY_ID"] = self._seaweed.access_key
            os.environ["AWS_SECRET_ACCESS_KEY"] = self._seaweed.secret_key
        os.environ.setdefault("AWS_DEFAULT_REGION", REGION)
        self.bucket = f"draftstore-bench-{self.token}"
        # the baselines' raw client: same endpoint, same addressing, default boto3 settings otherwise
        self.s3 = boto3.session.Session(region_name=REGION).client(
            "s3", endpoint_url=self.endpoint_url, config=Config(s3={"addressing_style": "path"})
        )
        self.s3.create_bucket(Bucket=self.bucket)
        self._bucket_created = True
        self.blob_url = f"s3://{self.bucket}?endpoint_url={self.endpoint_url}&region={REGION}"

    def _open_redis(self) -> None:
        self.redis_url = os.environ.get("DRAFTSTORE_BENCH_REDIS_URL") or DEFAULT_REDIS_URL
        self.redis = redis.Redis.from_url(self.redis_url, socket_connect_timeout=3)
        self.redis.ping()
        self.redis_prefix = f"dsbench-{self.token}"
        sep = "&" if "?" in self.redis_url else "?"
        self.coord_url = f"{self.redis_url}{sep}prefix={self.redis_prefix}"

    def open_store(self, migrate: bool = False) -> Store:
        store = Store.open(self.database_url, self.blob_url, self.coord_url, migrate=migrate)
        self.stores.append(store)
        return store

    def scratch_dir(self, name: str) -> Path:
        path = self._tmp / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    # -- tear-down -----------------------------------------------------------------
    def close(self) -> None:
        """Release everything, best effort: one failure never leaks the rest."""
        for store in self.stores:
            _quietly(store.close)
        self.stores.clear()
        if self.pg is not None:
            _quietly(self.pg.close)
        if self._db_created:
            def drop() -> None:
                with psycopg.connect(self.pg_admin_url, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
            _quietly(drop)
        if self.redis is not None:
            _quietly(self._clean_redis)
            _quietly(self.redis.close)
        if self._bucket_created and self._external_s3:
            _quietly(self._delete_bucket)
        if self.s3 is not None:
            _quietly(self.s3.close)
        if self._seaweed is not None:
            progress("stopping SeaweedFS")
            _quietly(self._seaweed.stop)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _clean_redis(self) -> None:
        assert self.redis is not None
        batch: list[bytes] = []
        for key in self.redis.scan_iter(match=f"{self.redis_prefix}:*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                self.redis.delete(*batch)
                batch.clear()
        if batch:
            self.redis.delete(*batch)

    def _delete_bucket(self) -> None:
        paginator = self.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
            if keys:
                self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
        self.s3.delete_bucket(Bucket=self.bucket)

    def __enter__(self) -> "BenchEnv":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _quietly(fn: Any) -> None:
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # clean-up must go on; say what was left behind
        progress(f"clean-up step {getattr(fn, '__name__', fn)!r} failed: {exc}")
    if time.perf_counter() - t0 > 1.0:
        progress(f"clean-up step {getattr(fn, '__name__', fn)!r} took {time.perf_counter() - t0:.1f}s")
