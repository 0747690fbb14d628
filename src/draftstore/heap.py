"""The garbage collector in draftstore's own processes: start-up heap frozen, young
generation collected less often.

A full (generation 2) collection visits every tracked object of the process. Once
a store is open that is several hundred thousand objects (botocore's service
models, SQLAlchemy's and FastAPI's machinery), 100-160 ms of a single core on
the machines measured here; and one walk of a 10,000-file tree leaves enough
new objects behind (decoded directory entries) to set a full collection off in
the middle of a ``materialize`` or a first search. Those start-up objects live
as long as the process, so they are moved out of the collector's sight
(``gc.freeze``): later full collections visit only what came after (measured:
15 ms instead of 118-164 ms).

Requests that build many objects which all survive until the answer is sent (a
search returning 10,000 matches, a 10,000-file walk) set off a young collection
every 700 allocations by default, and every tenth of those scans all the
survivors again: 4 ms of a 17 ms search in a process holding a service's caches.
A young generation of 50,000 objects makes that a few collections per request.
Garbage that only the collector frees (reference cycles) waits longer, a few
megabytes at most.

The processes draftstore owns -- the service (each worker), the CLI, the MCP
stdio server -- do both once their store is open (``tune_collector``). The
library itself never does: it is a process-wide choice that belongs to the
process's owner. An application embedding draftstore in a long-running process
can call ``tune_collector()`` at the end of its own start-up for the same effect.
"""

from __future__ import annotations

import gc

__all__ = ["tune_collector", "THRESHOLDS"]

THRESHOLDS = (50_000, 20, 10)  # young generation size, then how many collections before each older one

_tuned = False


def tune_collector(collect: bool = True) -> None:
    """Collect what start-up left as garbage (unless ``collect`` is false: a
    short-lived command does not pay ~30 ms for it, and keeps that garbage until
    it exits), exempt every object alive now from later collections, and set
    ``THRESHOLDS``. Once per process: later calls do nothing (what a process
    allocates after its start-up is collected as usual). Frozen objects are
    still freed when their last reference goes; only cycles among them stay."""
    global _tuned
    if _tuned:
        return
    _tuned = True
    if collect:
        gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
