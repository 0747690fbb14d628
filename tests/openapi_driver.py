"""A backend's whole story with draftstore, written against a client generated from
``/openapi.json`` (``draftstore_client``, built by ``tests/test_openapi_client.py``).

The test type-checks this file with ``mypy --strict`` before running it: every
answer is the documented model (``Project``, ``Turn`` or ``ContinuedTurn``, ``ToolCall``,
``Version``, ``Error``), not a ``str`` or an untyped dict, so a document that
described an answer wrongly fails here, either statically or when the
generated code parses what the service sent.
"""

from __future__ import annotations

from http import HTTPStatus
from io import BytesIO
from typing import TypeVar

from draftstore_client import AuthenticatedClient
from draftstore_client.api.projects import (projects_create, projects_get, projects_publish, projects_rollback,
                                            versions_list)
from draftstore_client.api.turns import (files_write, tool_calls_complete, tool_calls_start, turns_complete,
                                         turns_start)
from draftstore_client.api.view import view_read_file
from draftstore_client.models import (Complete, ContinuedTurn, CreateProject, Error, Project, ProjectDetail, Publish,
                                      Rollback, StartTurn, ToolCall, ToolCallStatus, ToolComplete, ToolStart,
                                      TurnStatus, Version, VersionPage)
from draftstore_client.types import File, Response

__all__ = ["drive"]

T = TypeVar("T")


def ok(answer: T | Error | None) -> T:
    """The documented success model; an ``Error`` (or an undocumented answer) fails the story."""
    assert answer is not None and not isinstance(answer, Error), answer
    return answer


def done(response: Response[T]) -> None:
    """A 204 answer."""
    assert response.status_code == HTTPStatus.NO_CONTENT, (response.status_code, response.content)


def one_turn(client: AuthenticatedClient, project: Project, path: str, content: bytes, summary: str) -> Version:
    """One turn that records a tool call, writes ``path``, completes and is published."""
    turn = ok(turns_start.sync(project.id, client=client, body=StartTurn(user_message=f"write {path}")))
    # a start answers the turn in the model a continue shares (a continue adds ``context``)
    assert isinstance(turn, ContinuedTurn) and turn.status == TurnStatus.RUNNING
    call = ok(tool_calls_start.sync(turn.id, client=client,
                                    body=ToolStart(tool_name="write_file", args={"path": path})))
    assert isinstance(call, ToolCall) and call.status == ToolCallStatus.STARTED
    done(files_write.sync_detailed(turn.id, path, client=client,
                                   body=File(payload=BytesIO(content), mime_type="application/octet-stream")))
    done(tool_calls_complete.sync_detailed(turn.id, call.seq, client=client, body=ToolComplete(result={"ok": True})))
    ended = ok(turns_complete.sync(turn.id, client=client, body=Complete(assistant_message=f"wrote {path}")))
    assert ended.status == TurnStatus.COMPLETED and ended.id == turn.id

    late = files_write.sync(turn.id, "late.md", client=client,
                            body=File(payload=BytesIO(b"too late"), mime_type="application/octet-stream"))
    assert isinstance(late, Error) and late.code == "turn.not_running" and not late.retryable, late

    version = ok(projects_publish.sync(project.id, client=client, body=Publish(summary=summary)))
    assert isinstance(version, Version) and version.summary == summary
    return version


def drive(base_url: str, token: str) -> None:
    """Create a project, publish two turns' work, list the versions, roll back to the first,
    read the file as head has it, and read a refused request as the typed ``Error``."""
    with AuthenticatedClient(base_url=base_url, token=token, raise_on_unexpected_status=True) as client:
        project = ok(projects_create.sync(client=client, body=CreateProject(name="dragons")))
        assert isinstance(project, Project) and project.current_version_id is None

        first = one_turn(client, project, "lore/dragon.md", b"A red dragon.\n", "the dragon")
        second = one_turn(client, project, "lore/dragon.md", b"A blue dragon.\n", "the dragon, blue")
        assert second.parent_version_id == first.id

        versions = ok(versions_list.sync(project.id, client=client))
        assert isinstance(versions, VersionPage)
        assert [v.id for v in versions.items][-2:] == [first.id, second.id]

        head = ok(projects_get.sync(project.id, client=client))
        assert isinstance(head, ProjectDetail) and head.current_version_id == second.id

        rolled = ok(projects_rollback.sync(project.id, client=client, body=Rollback(version_id=first.id)))
        assert isinstance(rolled, Project) and rolled.current_version_id == first.id
        read = ok(view_read_file.sync(project.id, "lore/dragon.md", client=client, at="head"))
        assert read.payload.read() == b"A red dragon.\n"

        missing = projects_get.sync("no-such-project", client=client)
        assert isinstance(missing, Error) and missing.code == "project.not_found", missing
        assert missing.details.additional_properties == {"project_id": "no-such-project"}
        assert not missing.additional_properties  # the body on the wire is exactly the documented Error
