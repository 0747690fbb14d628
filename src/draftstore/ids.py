"""Identifiers of projects, versions, drafts, turns and snapshots: 32 lowercase hex digits."""

from __future__ import annotations

import uuid

__all__ = ["new_id"]


def new_id() -> str:
    """A fresh random id (uuid4 as hex)."""
    return uuid.uuid4().hex
