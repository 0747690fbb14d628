"""Content digests: the only way an object is named in the blob store."""

from __future__ import annotations

import hashlib
import re

from .errors import InvalidInput

__all__ = ["Digest", "digest_of", "EMPTY_TREE"]

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class Digest(str):
    """A SHA-256 digest in lowercase hex.

    A distinct type so a digest is never confused with a path or an id; the
    constructor validates the form, so an object key derived from a ``Digest``
    can never carry user-controlled text.
    """

    __slots__ = ()

    def __new__(cls, value: str) -> "Digest":
        if isinstance(value, Digest):
            return value
        if not isinstance(value, str) or not _HEX64.match(value):
            raise InvalidInput("not a SHA-256 hex digest", value=str(value)[:80])
        return super().__new__(cls, value)

    @property
    def short(self) -> str:
        return self[:12]

    @classmethod
    def __get_pydantic_core_schema__(cls, source: object, handler: object) -> object:
        # a Digest is a string on the wire (the HTTP service documents records holding one)
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(cls, core_schema.str_schema(pattern="^[0-9a-f]{64}$"))


def digest_of(data: bytes) -> Digest:
    """Digest of ``data`` (SHA-256)."""
    return str.__new__(Digest, hashlib.sha256(data).hexdigest())


# The empty directory: a tree object with no entries (see trees.encode_tree).
EMPTY_TREE: Digest = digest_of(b"tree 1\n")
