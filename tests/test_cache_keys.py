"""Each object-cache key prefix is built by one module only (no I/O, no store).

The in-process object cache holds decoded forms next to raw bytes; a module
that wrote another module's key (its own size formula, its own value shape)
could put a value the owner then misreads. So each prefix is spelled, as a
string literal, in its owner module alone, and the cache's docstring names
that owner.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from draftstore.blobs import cache as cache_module

SRC = Path(__file__).resolve().parents[1] / "src" / "draftstore"

OWNERS = {
    "tree:": "trees.py",
    "covering:": "packing.py",
    "index:": "search/packed.py",
    "ixshard:": "search/packed.py",
    "summary:": "search/packed.py",
    "summary-of:": "search/packed.py",
    "summary-unusable:": "search/packed.py",
}


def _spelled_in(prefix: str) -> set[str]:
    literal = re.compile(r"""["']""" + re.escape(prefix))  # "tree:" + d, f"covering:{root}"
    return {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if literal.search(p.read_text(encoding="utf-8"))}


@pytest.mark.parametrize("prefix", sorted(OWNERS))
def test_a_cache_key_prefix_is_spelled_by_its_owner_alone(prefix: str) -> None:
    assert _spelled_in(prefix) == {OWNERS[prefix]}


def test_the_cache_names_the_owner_of_every_prefix() -> None:
    doc = cache_module.__doc__ or ""
    for prefix, owner in OWNERS.items():
        module = owner.removesuffix(".py").replace("/", ".")
        assert f"``{prefix}``" in doc, prefix
        assert re.search(re.escape(f"``{prefix}``") + r"[^;]*``" + re.escape(module) + "``", doc), (prefix, module)
