"""Store fixtures, built on the ``stack`` fixture of conftest.py (both flavours).

- ``store``          — ``Store.open(**stack, migrate=True)``, closed after the test.
- ``store_factory``  — opens more, independent ``Store`` instances on the same
  stack (each with its own engine, blob cache and coordinator client): "another
  process" without leaving this one. ``store_factory(settings=...)`` passes
  tuning knobs; every store it opened is closed after the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from draftstore import Settings, Store

__all__ = ["store", "store_factory"]


@pytest.fixture
def store_factory(stack: dict[str, str]) -> Iterator[Callable[..., Store]]:
    opened: list[Store] = []

    def open_store(*, settings: Settings | None = None) -> Store:
        s = Store.open(**stack, settings=settings, migrate=True)
        opened.append(s)
        return s

    yield open_store
    for s in reversed(opened):
        s.close()


@pytest.fixture
def store(store_factory: Callable[..., Store]) -> Store:
    return store_factory()

