"""Patching a JSON document (characters, world settings) with bounded work.

A JSON Patch ``copy`` duplicates a part of the document: thirty copies of
``/z`` into ``/z/-`` double it thirty times (a 1.3 KB patch asks for 2^30
elements). Checking the size of the result after applying comes too late, so
``apply`` keeps a running size while it applies the operations one by one and
refuses the patch as soon as the document would pass its limit. Every byte it
measures or copies is counted against a work budget (a few times the limit),
and the number of operations is bounded: the cost of one patch is bounded by
the limits whatever it asks for.

A Merge Patch (RFC 7386) cannot amplify: its result is at most the document
plus the patch, both already bounded.

The library (``jsonpatch``) applies each operation; this module only measures
before each one.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import jsonpointer

from . import errors as E

__all__ = ["MAX_PATCH_OPS", "WORK_FACTOR", "apply", "merge_patch"]

MAX_PATCH_OPS = 10_000  # operations in one JSON Patch
WORK_FACTOR = 4  # bytes a patch may copy, replace or remove: this many times the document limit

_JSON_PATCH_ERRORS = (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError, KeyError,
                      ValueError, AttributeError, IndexError, RecursionError)  # Recursion: copies nesting


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON Merge Patch (``target`` is not modified)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _size(value: Any) -> int:
    """The serialised size of ``value`` in characters (the stored size up to multi-byte characters)."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _at(doc: Any, pointer: Any) -> tuple[bool, Any]:
    """(True, the value) at ``pointer`` in ``doc``, or (False, None) where there is none."""
    try:
        return True, jsonpointer.resolve_pointer(doc, pointer)
    except (jsonpointer.JsonPointerException, TypeError, KeyError, IndexError, AttributeError):
        return False, None


def _replaced(doc: Any, pointer: Any) -> tuple[bool, Any]:
    """What an ``add`` at ``pointer`` overwrites: an object's member (an array insert overwrites nothing)."""
    try:
        parent, key = jsonpointer.JsonPointer(pointer).to_last(doc)
    except (jsonpointer.JsonPointerException, TypeError, KeyError, IndexError, AttributeError):
        return False, None
    if isinstance(parent, dict) and key in parent:
        return True, parent[key]
    return False, None


def _change(doc: Any, op: Any) -> tuple[int, int]:
    """(bytes the operation adds, bytes it removes), measured before it runs. An
    operation this cannot read is left to ``jsonpatch``, which refuses it."""
    if not isinstance(op, dict):
        return 0, 0
    kind, path = op.get("op"), op.get("path")
    added = removed = 0
    if kind in ("add", "replace") and "value" in op:
        added = _size(op["value"])
    elif kind == "copy":
        found, value = _at(doc, op.get("from"))
        added = _size(value) if found else 0
    if kind == "add" or kind == "copy":
        found, old = _replaced(doc, path)
        removed = _size(old) if found else 0
    elif kind in ("remove", "replace"):
        found, old = _at(doc, path)
        removed = _size(old) if found else 0
    return added, removed


def apply(document: Any, patch: list[Any], field: str, max_bytes: int) -> Any:
    """The result of the JSON Patch (RFC 6902) ``patch`` on ``document`` (which is
    not modified). The document never grows past ``max_bytes`` while the patch
    runs, and the patch may copy, replace or remove at most ``WORK_FACTOR`` times
    ``max_bytes``, in at most ``MAX_PATCH_OPS`` operations. Raises
    ``patch.invalid`` (not applicable, too many operations or too much work) or
    ``payload.too_large`` (the document would pass ``max_bytes``)."""
    if len(patch) > MAX_PATCH_OPS:
        raise E.PatchInvalid(f"a JSON Patch holds at most {MAX_PATCH_OPS} operations", field=field,
                             limit=MAX_PATCH_OPS)
    budget = WORK_FACTOR * max_bytes
    try:
        size = _size(document)
        doc = copy.deepcopy(document)
        work = size
        for op in patch:
            added, removed = _change(doc, op)
            size += added - removed
            work += added + removed
            if size > max_bytes:
                raise E.PayloadTooLarge(f"the patched {field} would be larger than {max_bytes} bytes",
                                        field=field, limit=max_bytes)
            if work > budget:
                raise E.PatchInvalid(f"the JSON Patch copies, replaces or removes more than {budget} bytes "
                                     f"of {field}", field=field, limit=budget)
            doc = jsonpatch.apply_patch(doc, [op], in_place=True)
    except _JSON_PATCH_ERRORS as exc:
        raise E.PatchInvalid(f"JSON Patch not applicable to {field}: {exc}", field=field) from exc
    return doc
