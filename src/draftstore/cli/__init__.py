"""The ``draftstore`` command line.

One module per area, each registering its commands on ``main``:

- ``database``    — ``db upgrade``, ``db current``, ``config``
- ``projects``    — ``projects``, ``log``, ``publish``, ``discard``, ``rollback``, ``fork``
- ``turns``       — ``turns``, ``turn``
- ``files``       — ``import``, ``export``, ``cat``, ``ls``, ``diff``, ``snapshot``, ``materialize``
- ``maintenance`` — ``sweep``, ``gc``, ``fsck``, ``retention``, ``prune-versions``
- ``service``     — ``serve``, ``token``, ``mcp``, ``demo``

Every command reads the store location from ``DRAFTSTORE_*`` variables
(embedded defaults under ./.draftstore/ when unset). Ids may be given as any
unique prefix of at least 6 characters. Read commands take ``--json``.
Failures print one line with the error's code; exit statuses are listed in
``failures``.
"""

from __future__ import annotations

from .root import main
from . import database, files, maintenance, projects, service, turns  # noqa: F401  (register commands)

__all__ = ["main"]
