"""Configuration, read from ``DRAFTSTORE_*`` environment variables.

With no variable set, everything runs on the embedded defaults under
``./.draftstore/``: a SQLite file, a directory of blobs and an in-process
coordinator.
"""

from __future__ import annotations

from pathlib import Path

from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import ConfigInvalid

__all__ = ["Settings", "Limits", "DEFAULT_HOME"]

DEFAULT_HOME = Path(".draftstore")
MAX_RETAIN_DAYS = 36_500  # a hundred years: a retention past it is "for ever" (none)


class Limits(BaseSettings):
    """Input limits. Each is an environment variable ``DRAFTSTORE_<NAME>``.

    Exceeding one raises ``payload.too_large`` or ``limit.exceeded`` and
    changes nothing.
    """

    model_config = SettingsConfigDict(env_prefix="DRAFTSTORE_", extra="ignore")

    max_file_bytes: int = Field(16 * 1024 * 1024, gt=0, description="largest single file")
    max_files_per_draft: int = Field(250_000, gt=0, description="files in one project state")
    max_batch_files: int = Field(10_000, gt=0, description="paths in one apply_changes batch")
    max_json_state_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="characters or world settings, serialised"
    )
    max_message_bytes: int = Field(1024 * 1024, gt=0, description="one user/assistant message")
    inline_payload_bytes: int = Field(
        8 * 1024,
        ge=0, description="tool args/results up to this size stay in the row; larger go to the blob store",
    )
    max_payload_bytes: int = Field(64 * 1024 * 1024, gt=0, description="one tool args or result")
    payload_preview_chars: int = Field(512, ge=0, description="inline preview of an offloaded payload")
    max_path_bytes: int = Field(1024, gt=0, description="one path, UTF-8 encoded")
    max_path_depth: int = Field(64, gt=0, description="segments in one path")
    max_segment_bytes: int = Field(255, gt=0, description="one path segment, UTF-8 encoded")


class Settings(BaseSettings):
    """Where the three stores live, plus tuning knobs."""

    model_config = SettingsConfigDict(env_prefix="DRAFTSTORE_", extra="ignore")

    database_url: str | None = Field(
        None, description="SQLAlchemy URL; default sqlite:///.draftstore/draftstore.db"
    )
    blob_url: str | None = Field(
        None, description="file:///path or s3://bucket?endpoint_url=..&region=..; default .draftstore/blobs"
    )
    coord_url: str | None = Field(
        None,
        description="redis://host:port/db, redis+cluster://host:port,host:port, sqlite:///path or memory://; "
        "default: a SQLite file beside a "
        "SQLite database (shared by every process on that data), else memory://",
    )
    home: Path = Field(DEFAULT_HOME, description="root of the embedded defaults")
    cache_bytes: int = Field(
        64 * 1024 * 1024, ge=0, description="in-process cache of immutable objects, in bytes"
    )
    pack_cache_bytes: int = Field(
        256 * 1024 * 1024, ge=0, description="in-process cache of decoded packs, in bytes"
    )
    snapshot_on_publish: bool = Field(
        False, description="publish schedules a sandbox snapshot of the new version (built off the publish path)"
    )
    background_interval_s: float = Field(
        5.0, ge=0, allow_inf_nan=False,
        description="the service packs new versions and open drafts' trees and builds scheduled snapshots this often "
        "(0: never)"
    )
    gc_grace_s: float = Field(
        3600.0, ge=0, allow_inf_nan=False,
        description="garbage collection never deletes an object younger than this (in-flight writes)"
    )
    retain_turns_days: float | None = Field(
        None, ge=0, le=MAX_RETAIN_DAYS, allow_inf_nan=False,
        description="ended turns' boundary states and offloaded payloads are kept this long (none: for ever)"
    )
    retain_discarded_days: float | None = Field(
        30.0, ge=0, le=MAX_RETAIN_DAYS, allow_inf_nan=False,
        description="a discarded draft's tree is kept this long (none: for ever)"
    )
    heartbeat_ttl_s: float = Field(
        60.0, gt=0, allow_inf_nan=False,
        description="a running turn whose heartbeat is older is reaped as interrupted"
    )
    sandbox_heartbeat_ttl_s: float = Field(
        300.0, gt=0, allow_inf_nan=False,
        description="an open sandbox session not seen (no heartbeat) for longer is marked lost by the recovery sweep"
    )
    publishing_stuck_s: float = Field(
        300.0, gt=0, allow_inf_nan=False,
        description="a draft publishing for longer is released by the recovery sweep"
    )
    event_ttl_s: float = Field(
        3600.0, gt=0, allow_inf_nan=False,
        description="a turn's event buffer is dropped this long after the turn ends"
    )
    sse_keepalive_s: float = Field(
        15.0, gt=0, le=3600, allow_inf_nan=False,
        description="an idle SSE stream gets a keep-alive comment this often"
    )
    turn_threads: int = Field(
        16, ge=1, le=256,
        description="threads per service process for the agent's turn calls (tool-call records go first)"
    )
    upload_threads: int = Field(
        16, ge=1, le=256,
        description="threads per store for the uploads a write, a turn's end or a publish runs beside its "
                    "transaction (one per call that may wait on one, so a write's upload does not queue "
                    "behind other calls' uploads)"
    )
    group_commit: bool = Field(
        True,
        description="on PostgreSQL, tool-call records that arrive while others are committing share one "
                    "transaction and one commit (a record alone runs at once)"
    )
    resume_max_turns: int = Field(
        20, ge=1, le=1000,
        description="turns in one page of a resume context (the cursor fetches the next)"
    )
    resume_max_bytes: int = Field(
        1024 * 1024, ge=1024,
        description="one page of a resume context ends once its turns reach this size as JSON (one turn at least)"
    )
    limits: Limits = Field(default_factory=Limits)

    @field_validator("retain_turns_days", "retain_discarded_days", mode="before")
    @classmethod
    def _for_ever(cls, value: Any) -> Any:
        """``none`` (any case) spells "for ever" for a retention setting."""
        return None if isinstance(value, str) and value.strip().lower() == "none" else value

    @classmethod
    def load(cls, **values: Any) -> "Settings":
        """Settings from the environment (and ``values``); a malformed variable
        raises ``config.invalid`` naming it, never a validation traceback."""
        try:
            return cls(**values)
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                name = "DRAFTSTORE_" + "_".join(str(p) for p in err["loc"] if p != "limits").upper()
                value = err.get("input")
                shown = f"={value!r}" if isinstance(value, (str, int, float)) else ""
                problems.append(f"{name}{shown}: {err['msg']}")
            raise ConfigInvalid("invalid setting " + "; ".join(problems),
                                settings=[p.split(":", 1)[0] for p in problems]) from exc

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'draftstore.db'}"

    def resolved_blob_url(self) -> str:
        return self.blob_url or f"file://{(self.home / 'blobs').absolute()}"

    def resolved_coord_url(self) -> str:
        """The coordinator: as configured; else, for a SQLite database, a SQLite
        file beside it (``<db>.coord``), so every process and every store on the
        same embedded data shares heartbeats, locks and events; else in-process."""
        if self.coord_url:
            return self.coord_url
        db = self.resolved_database_url()
        if db.startswith("sqlite:///") and ":memory:" not in db and "mode=memory" not in db:
            path = db[len("sqlite:///"):].split("?", 1)[0]
            return f"sqlite:///{path}.coord"
        return "memory://"
