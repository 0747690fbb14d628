"""Three ``draftstore serve`` replicas behind a real HAProxy, for tests/test_replicas.py.

- ``haproxy_config(port, servers, stats_socket)``: the configuration docs/operations.md
  ("Behind a load balancer") describes: round robin, no stickiness, health checks on
  ``/readyz``, timeouts that let an SSE response stay open, nothing buffered.
- ``Replica``: one ``draftstore serve`` subprocess on a fixed port, which can be killed
  with SIGKILL and started again on the same port.
- ``Balancer``: Debian's ``/usr/sbin/haproxy`` on that configuration, and what its stats
  socket says of each server (``UP``, ``DOWN``, ...; sessions served).
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services import require_real, stop_process

__all__ = ["HAPROXY", "Balancer", "Replica", "haproxy_config", "haproxy_binary"]

HAPROXY = "/usr/sbin/haproxy"


def haproxy_binary() -> str:
    """Debian's haproxy; missing, the test skips, or fails under ``DRAFTSTORE_REQUIRE_REAL=1``."""
    found = HAPROXY if os.access(HAPROXY, os.X_OK) else shutil.which("haproxy")
    if found is None:
        message = f"{HAPROXY} is missing (apt-get install haproxy)"
        if require_real():
            pytest.fail(message)
        pytest.skip(message)
    return found


def haproxy_config(port: int, servers: dict[str, int], stats_socket: Path) -> str:
    lines = [
        "global",
        "    maxconn 4096",
        f"    stats socket {stats_socket} mode 600 level admin",
        "defaults",
        "    mode http",
        "    timeout connect 2s",
        "    timeout client 120s",          # an SSE reader sends nothing after its request
        "    timeout server 120s",          # > the stream's keep-alive comment interval
        "    timeout tunnel 1h",            # a long-lived response once it counts as a tunnel
        "    timeout http-request 10s",
        "    timeout http-keep-alive 10s",
        "    timeout queue 30s",
        "    option http-no-delay",         # forward each SSE event as it comes
        "    retries 2",                    # connection failures only (retry-on conn-failure, the default):
        "    option redispatch 1",          # the request was never sent, so another server may take it
        "frontend agents",
        f"    bind 127.0.0.1:{port}",
        "    default_backend replicas",
        "backend replicas",
        "    balance roundrobin",           # no stickiness: every replica serves every turn
        "    option httpchk GET /readyz",
        "    http-check expect status 200",
        # a loaded replica answers its probe late: a short check timeout takes healthy replicas
        # out (and, with on-marked-down shutdown-sessions, cut their requests): not used here
        "    timeout check 5s",
        "    default-server inter 1s fastinter 250ms downinter 500ms fall 3 rise 2",
    ]
    lines += [f"    server {name} 127.0.0.1:{p} check" for name, p in servers.items()]
    return "\n".join(lines) + "\n"


class Replica:
    """``draftstore serve --port PORT`` in its own process group, on the environment's store."""

    def __init__(self, name: str, port: int, env: dict[str, str], log: Path) -> None:
        self.name, self.port, self.env, self.log = name, port, env, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        out = open(self.log, "ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "draftstore.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            out.close()

    def wait_ready(self, timeout: float = 90) -> float:
        """Seconds until ``/readyz`` answers 200 (the database, blobs and coordinator reached)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(f"replica {self.name} exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        pytest.fail(f"replica {self.name} not ready within {timeout}s:\n{self.log.read_text()[-3000:]}")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        stop_process(self.proc, timeout=20)


class Balancer:
    """Debian's haproxy in the foreground on ``config`` (written to ``workdir``)."""

    def __init__(self, workdir: Path, port: int, servers: dict[str, int]) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.socket = workdir / "haproxy.sock"
        self.config = workdir / "haproxy.cfg"
        self.config.write_text(haproxy_config(port, servers, self.socket))
        self.log = workdir / "haproxy.log"
        self.binary = haproxy_binary()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20) -> None:
        check = subprocess.run([self.binary, "-c", "-f", str(self.config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        out = open(self.log, "ab")
        try:
            self.proc = subprocess.Popen([self.binary, "-db", "-f", str(self.config)], stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            out.close()
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                pytest.fail(f"haproxy exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            if self.socket.exists() and all(s == "UP" for s in self.status().values()):
                return
            time.sleep(0.05)
        pytest.fail(f"haproxy's servers were not all UP within {timeout}s: {self.status()}")

    def stats(self) -> dict[str, dict[str, str]]:
        """``show stat`` of the replicas backend's servers: server name -> its CSV row."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(self.socket))
            s.sendall(b"show stat\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        text = b"".join(chunks).decode().lstrip("# ")
        rows = csv.DictReader(text.splitlines())
        return {r["svname"]: r for r in rows if r["pxname"] == "replicas" and r["svname"] not in ("BACKEND",)}

    def status(self) -> dict[str, str]:
        """Server name -> ``UP``, ``DOWN``, ``UP 1/2`` (going down), ``DOWN 1/2`` (coming up), ..."""
        return {name: row["status"] for name, row in self.stats().items()}

    def stop(self) -> None:
        stop_process(self.proc)
