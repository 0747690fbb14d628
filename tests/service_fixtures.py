"""The HTTP service, run for real: uvicorn in a subprocess on a free loopback port.

- ``service_factory(workers=1, env=None)`` starts a service on the ``stack``
  (both flavours; the embedded one is the default a user gets) and returns a
  ``Service``; every service it started is stopped after the test.
- ``service`` — one service on the stack, with an admin token, so tests
  exercise the authenticated path (open mode has tests of its own).
- ``shared_service`` — one such service on ``module_stack``, started once per
  module and flavour (per xdist worker) for the tests that ask for it. A test
  module whose tests each make their own projects and tokens and look only at
  those makes its ``service`` this one (``shared_service_per_test``): a service's
  start-up is ~1-2 s of CPU, most of what such a test costs.

A ``Service`` has ``url``, ``client(token=...)`` (an httpx client), ``store``
(a Store on the same stack, for setting up and checking state directly),
``token(role, project_id=None)`` (a new token's secret) and ``stop()``.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from draftstore import Settings, Store

__all__ = ["Service", "service", "service_factory", "shared_service", "shared_service_per_test", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stack_env(stack: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTSTORE_")}
    env.update({f"DRAFTSTORE_{k.upper()}": v for k, v in stack.items()})
    return env


@dataclass
class Service:
    url: str
    proc: subprocess.Popen[bytes]
    store: Store
    admin: str | None = None
    clients: list[httpx.Client] = field(default_factory=list)

    def client(self, token: str | None = "admin", **kwargs: Any) -> httpx.Client:
        """An HTTP client; ``token="admin"`` uses the service's admin token, None sends none."""
        secret = self.admin if token == "admin" else token
        headers = {"authorization": f"Bearer {secret}"} if secret else {}
        c = httpx.Client(base_url=self.url, headers=headers, timeout=60, **kwargs)
        self.clients.append(c)
        return c

    def token(self, role: str, project_id: str | None = None) -> str:
        return self.store.tokens.create(role, project_id=project_id)[1]

    def close_clients(self) -> None:
        for c in self.clients:
            c.close()
        self.clients.clear()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.close_clients()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            pytest.fail(f"the service exited ({proc.returncode}) before it was ready:\n{out}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"the service at {url} was not ready within {timeout}s")


def _start(stack: dict[str, str], workers: int = 1, env: dict[str, str] | None = None,
           with_admin: bool = True) -> Service:
    """A service on ``stack`` that answers ``/healthz``, with its own ``Store`` (the caller stops
    the one and closes the other; a service that never became ready leaves neither behind)."""
    port = free_port()
    store = Store.open(**stack, settings=Settings(), migrate=True)
    admin = store.tokens.create("admin", name="tests")[1] if with_admin else None
    cmd = [sys.executable, "-m", "uvicorn", "draftstore.service.app:create_app", "--factory",
           "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers), "--log-level", "warning",
           "--no-access-log"]
    proc = subprocess.Popen(cmd, env={**stack_env(stack), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    svc = Service(f"http://127.0.0.1:{port}", proc, store, admin)
    try:
        _wait_ready(svc.url, proc)
    except BaseException:
        svc.stop()
        store.close()
        raise
    return svc


def _stop_all(services: list[Service]) -> None:
    """Stop every service, newest first, then close their stores."""
    for svc in reversed(services):
        svc.stop()
    for svc in services:
        svc.store.close()


@pytest.fixture
def service_factory(stack: dict[str, str]) -> Iterator[Callable[..., Service]]:
    started: list[Service] = []

    def start(workers: int = 1, env: dict[str, str] | None = None, with_admin: bool = True) -> Service:
        svc = _start(stack, workers, env, with_admin)
        started.append(svc)
        return svc

    yield start
    _stop_all(started)


@pytest.fixture
def service(service_factory: Callable[..., Service]) -> Service:
    return service_factory()


@pytest.fixture(scope="module")
def shared_service(module_stack: dict[str, str]) -> Iterator[Service]:
    svc = _start(module_stack)
    yield svc
    _stop_all([svc])


@pytest.fixture
def shared_service_per_test(shared_service: Service) -> Iterator[Service]:
    """``shared_service`` for one test: the clients the test opened are closed after it, and a
    service that a test left dead fails that test, not the next one."""
    yield shared_service
    shared_service.close_clients()
    if shared_service.proc.poll() is not None:
        pytest.fail(f"the shared service exited ({shared_service.proc.returncode}) during this test")


# -- a service's output, a request left hanging, a kill -9 (the fault tests) ---------------------------------
class Output:
    """A service's merged stdout and stderr, read on a thread."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.q: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [self.q.put(b.decode(errors="replace")) for b in proc.stdout],  # type: ignore
                         daemon=True).start()

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.seen):
            try:
                self.seen.append(self.q.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail(f"the service never printed {text!r}:\n{''.join(self.seen[-40:])}")


def in_background(call: Callable[[], httpx.Response]) -> tuple[threading.Thread, dict[str, Any]]:
    """A request sent on a thread (it hangs where the service pauses); ``out`` gets its response or error."""
    out: dict[str, Any] = {}

    def send() -> None:
        try:
            out["response"] = call()
        except httpx.HTTPError as exc:
            out["error"] = exc

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, out


def kill_service(proc: subprocess.Popen[bytes]) -> float:
    os.kill(proc.pid, signal.SIGKILL)
    at = time.time()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    return at
