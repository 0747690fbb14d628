"""Store fixtures, built on the ``stack`` fixture of conftest.py (both flavours).

- ``store``          — ``Store.open(**stack, migrate=True)``, closed after the test.
- ``store_factory``  — opens more, independent ``Store`` instances on the same
  stack (each with its own engine, blob cache and coordinator client): "another
  process" without leaving this one. ``store_factory(settings=...)`` passes
  tuning knobs; every store it opened is closed after the test.
- ``shared_store``   — one ``Store`` on ``module_stack``, opened once per module and
  flavour, for a module whose tests each make their own projects and look only
  at those (it makes its ``store`` this one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from draftstore import Settings, Store

__all__ = ["store", "store_factory", "shared_store"]


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


@pytest.fixture(scope="module")
def shared_store(module_stack: dict[str, str]) -> Iterator[Store]:
    s = Store.open(**module_stack, settings=Settings(), migrate=True)
    yield s
    s.close()
