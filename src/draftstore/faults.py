"""Named points where a crash test can stop a process and kill it for real.

A point does nothing unless it is armed: by ``DRAFTSTORE_PAUSE_AT`` (comma-
separated names, read at import) or by ``arm(name)`` (from a test's worker
script, once it has done what must not pause). Then the process that reaches it writes
``draftstore: paused at <name>`` to stderr and waits, so a test that started
it as a subprocess can ``kill -9`` it at exactly that moment and then check
what another process sees. Production never sets the variable; a disabled
point costs one set lookup.

Points: ``turn.end.before_commit`` (inside the transaction that ends a turn
and seals its writes), ``write.before_commit`` (inside a write's transaction,
after its blob upload started), ``publish.before_commit`` (inside the publish
transaction).
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["point", "arm", "PAUSE_ENV"]

PAUSE_ENV = "DRAFTSTORE_PAUSE_AT"
_ARMED = {n.strip() for n in os.environ.get(PAUSE_ENV, "").split(",") if n.strip()}


def arm(*names: str) -> None:
    """Make the named points pause this process from now on."""
    _ARMED.update(names)


def point(name: str) -> None:
    """Pause forever here if ``name`` is armed (see the module docstring)."""
    if name in _ARMED:
        sys.stderr.write(f"draftstore: paused at {name}\n")
        sys.stderr.flush()
        while True:
            time.sleep(3600)
