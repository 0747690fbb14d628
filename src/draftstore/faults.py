"""Named points where a crash test can stop a process and kill it for real.

A point does nothing unless it is armed: by ``DRAFTSTORE_PAUSE_AT`` (comma-
separated names, read at import) or by ``arm(name)`` (from a test's worker
script, once it has done what must not pause). Then the process that reaches it writes
``draftstore: paused at <name>`` to stderr and waits, so a test that started
it as a subprocess can ``kill -9`` it at exactly that moment and then check
what another process sees. Production never sets the variable; a disabled
point costs one set lookup.

Points, in the order an operation reaches them:

- a write: ``write.before_upload``, ``write.before_commit`` (rows written, upload
  running, not committed), ``write.after_commit``;
- a turn's end: ``seal.before_swap`` (tree objects stored, root not moved;
  inside the ending transaction), ``turn.end.before_commit``, ``turn.end.after_commit``;
- a publish: ``seal.before_swap`` (if anything is unsealed), ``publish.before_commit``,
  ``publish.after_commit``;
- a snapshot: ``snapshot.after_upload`` (bundle stored, row not ready);
- packing: ``pack.after_upload`` (pack stored, rows not written);
- garbage collection: ``gc.before_sweep`` (marked, nothing deleted yet).
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
