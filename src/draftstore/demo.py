"""The lifecycle demo behind ``draftstore demo``.

start turn -> tool calls -> writes -> interrupt -> continue -> publish -> rollback,
printing each step and checking the store agrees with what it printed.
"""

from __future__ import annotations

from collections.abc import Callable

from . import errors as E
from .store import Store


def run_demo(store: Store, say: Callable[[str], None] = print) -> str:
    """Run the demo on ``store``; returns the project id. Raises if any step misbehaves."""
    project = store.create_project(
        "demo-adventure",
        files={"game/main.py": b"print('welcome')\n", "README.md": b"# Adventure\n"},
        characters={"hero": {"name": "Ada", "hp": 10}},
        world_settings={"era": "bronze"},
    )
    v1 = project.current_version_id
    say(f"1. created project {project.id}: version 1 = {v1} with 2 files")

    turn = store.start_turn(project.id, "Add a dragon and a greeting")
    say(f"2. started turn {turn.number} ({turn.id}); a draft was derived from version 1")

    call = store.tool_started(turn.id, "view_file", {"path": "game/main.py"})
    content = store.view(project.id).read_text("game/main.py")
    store.tool_completed(turn.id, call.seq, {"content": content})
    call = store.tool_started(turn.id, "write_file", {"path": "game/dragon.py"})
    store.write_file(turn.id, "game/dragon.py", b"DRAGON = 'Smaug'\n")
    store.tool_completed(turn.id, call.seq, {"ok": True})
    store.patch_characters(turn.id, [{"op": "add", "path": "/dragon", "value": {"name": "Smaug", "hp": 99}}])
    say(f"3. recorded 2 tool calls, wrote game/dragon.py and added a character; "
        f"the agent's view now resolves to the {store.view(project.id).kind}")

    store.interrupt_turn(turn.id, partial_response={"text": "I added the dra"})
    say(f"4. interrupted turn {turn.number}; its writes stay in the draft")
    try:
        store.write_file(turn.id, "game/late.py", b"too late")
        raise AssertionError("a late write from an interrupted turn was accepted")
    except E.TurnNotRunning as exc:
        say(f"   a late write from the old worker is refused: {exc.code}")

    turn2 = store.continue_turn(project.id, "Now make the hero greet the dragon")
    store.write_file(turn2.id, "game/main.py", b"print('welcome')\nprint('Hello, Smaug!')\n")
    store.complete_turn(turn2.id, "The hero now greets Smaug.")
    history = store.get_turn(turn.id)
    say(f"5. continued with turn {turn2.number} on the same draft and completed it; "
        f"turn {turn.number} still shows {len(history.tool_calls)} tool calls ({history.status})")

    v2 = store.publish(project.id, "dragon and greeting", actor="demo-admin")
    view = store.view(project.id)
    say(f"6. published version {v2.number} ({v2.id}): files {view.list_files()}, "
        f"characters {sorted(view.characters)}")

    store.rollback_to(project.id, v1, actor="demo-admin")
    view = store.view(project.id)
    assert view.version_id == v1 and not view.exists("game/dragon.py")
    say(f"7. rolled head back to version 1: files {view.list_files()}; "
        f"{len(store.list_versions(project.id))} versions kept")
    for move in store.head_moves(project.id):
        say(f"   head move: {move.reason:<8} {(move.from_version_id or '-')[:8]:>8} -> {move.to_version_id[:8]} "
            f"by {move.actor or '-'}")
    say(f"done: project {project.id}")
    return project.id
