"""draftstore: the state store behind AI agents that edit a project over many turns.

Public surface::

    from draftstore import Store
    store = Store.from_env()            # embedded defaults under ./.draftstore/
    p = store.create_project("demo", files={"main.py": b"print(1)"})
    t = store.start_turn(p.id, "add a greeting")
    store.write_file(t.id, "hello.py", b"print('hi')")
    store.complete_turn(t.id, "done")
    store.publish(p.id, "greeting")
"""

from .digest import Digest
from .errors import *  # noqa: F401,F403  (the exception family is public)
from .errors import __all__ as _error_names
from .records import (ContinuedTurn, Draft, HeadMove, Project, ResumeContext, SandboxSession, Snapshot, ToolCall,
                      Turn, Version)
from .settings import Limits, Settings
from .store import Store
from .view import FileStat, View

__version__ = "0.1.0"

__all__ = [
    "Store",
    "View",
    "FileStat",
    "Project",
    "Version",
    "Draft",
    "Turn",
    "ContinuedTurn",
    "ResumeContext",
    "ToolCall",
    "HeadMove",
    "Snapshot",
    "SandboxSession",
    "Settings",
    "Limits",
    "Digest",
    *_error_names,
]
