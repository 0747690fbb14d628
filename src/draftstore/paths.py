"""The one path validator every user path crosses.

A valid path is relative, '/'-separated, non-empty UTF-8, with no empty, '.'
or '..' segment, not absolute, no NUL or control character, no backslash, no
Windows drive prefix, and within the length and depth limits. ``normalize_path``
returns the canonical form; every other module trusts only that form. Object
keys are never derived from paths.

One name has one spelling, so two different inputs never land on one file
and one name never makes two files:
- a path holding U+FFFD (the replacement character) is refused: it is what a
  lossy decoder leaves of bytes that were not UTF-8 (an HTTP server decodes
  ``%FF`` and ``%FE`` both to U+FFFD), so it cannot say which name was meant;
- a path that is not in Unicode normal form C is refused (the details give
  its NFC spelling): ``e`` + U+0301 and U+00E9 look alike and would otherwise
  be two files.
"""

from __future__ import annotations

import re
import unicodedata

from .errors import PathDenied
from .settings import Limits

__all__ = ["normalize_path", "parent_dirs", "normalize_dir"]

_DRIVE = re.compile(r"^[A-Za-z]:")
# the control characters an ASCII path can hold (category Cc: C0 and DEL); every other
# character that is refused (C1 controls, surrogates, U+2028/U+2029) is not ASCII
_ASCII_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DEFAULT_LIMITS = Limits.model_construct()  # the documented defaults; a store passes its own


def _deny(reason: str, path: object, **details: str) -> PathDenied:
    shown = repr(path)[:200]  # quoted in the message: control characters and spaces stay visible
    detail = path[:200] if isinstance(path, str) else shown
    return PathDenied(f"path {shown} denied: {reason}", path=detail, reason=reason, **details)


def normalize_path(path: object, limits: Limits | None = None) -> str:
    """Validate ``path`` and return its canonical form.

    The canonical form drops a single leading './' and repeated or trailing
    '/' separators are refused rather than repaired, so two spellings never
    name the same file silently; so are U+FFFD and a path not in NFC (the
    details' ``nfc`` is the spelling to use). Raises ``PathDenied`` (``path.denied``).
    """
    lim = limits or _DEFAULT_LIMITS
    if not isinstance(path, str):
        raise _deny("not a string", path)
    if path == "":
        raise _deny("empty", path)
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        raise _deny("not valid UTF-8", path) from None
    if len(encoded) > lim.max_path_bytes:
        raise _deny(f"longer than {lim.max_path_bytes} bytes", path)
    ascii_only = len(encoded) == len(path)
    if ascii_only:  # most paths: one regex scan instead of a category lookup per character
        if _ASCII_CONTROL.search(path):
            raise _deny("control character", path)
    else:
        for ch in path:
            if unicodedata.category(ch) in ("Cc", "Cs") or ch in "\u2028\u2029":
                raise _deny("control character", path)
        if "\ufffd" in path:
            raise _deny("replacement character U+FFFD (bytes that were not UTF-8)", path)
        if not unicodedata.is_normalized("NFC", path):
            raise _deny("not in Unicode normal form C", path, nfc=unicodedata.normalize("NFC", path)[:200])
    if "\\" in path:
        raise _deny("backslash", path)
    # drop the one optional './' first, so every later rule sees the canonical form
    if path.startswith("./"):
        path = path[2:]
    if path.startswith("/"):
        raise _deny("absolute", path)
    if _DRIVE.match(path):
        raise _deny("drive prefix", path)
    segments = path.split("/")
    if len(segments) > lim.max_path_depth:
        raise _deny(f"deeper than {lim.max_path_depth} segments", path)
    for seg in segments:
        if seg == "":
            raise _deny("empty segment", path)
        if seg in (".", ".."):
            raise _deny(f"'{seg}' segment", path)
        if (len(seg) if ascii_only else len(seg.encode("utf-8"))) > lim.max_segment_bytes:
            raise _deny(f"segment longer than {lim.max_segment_bytes} bytes", path)
    return path


def normalize_dir(path: object, limits: Limits | None = None) -> str:
    """Like ``normalize_path`` for a directory; '' (or '.', '/') is the root."""
    if path in ("", ".", "/", "./"):
        return ""
    if isinstance(path, str) and path.endswith("/"):
        path = path[:-1]
    return normalize_path(path, limits)


def parent_dirs(path: str) -> list[str]:
    """Proper ancestors of a canonical path, nearest last: 'a/b/c' -> ['a', 'a/b']."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]
