"""A server started as a child process: its own session (so its whole process group is
signalled and its CPU time counted at once), readiness by polling a health route, a clean
stop that waits until the port is free again. The benchmark, the end-to-end tests and the
soak script all start servers through it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ferrum_command(port: int, *flags: str) -> list[str]:
    """`ferrum serve` on `port` with this interpreter (the installed package, or the tree that
    PYTHONPATH names). `-P`: without it `-m` puts the working folder first on sys.path, and a
    bench run from a checkout would start that checkout's ferrum whatever PYTHONPATH says."""
    return [sys.executable, "-P", "-m", "ferrum.cli", "serve", "--port", str(port), *flags]


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_port_free(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not port_is_free(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {port} still busy after {timeout:.0f} s")
        time.sleep(0.2)


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """One started server, in its own session so that its whole process group can be
    signalled (and its CPU time counted) at once."""

    def __init__(
        self,
        cmd: list[str],
        log_path: Path,
        port: int,
        env: dict[str, str] | None = None,
        scratch: Path | None = None,
    ):
        """`scratch`: a folder of this server's own (its disk tier), removed when it stops."""
        self.cmd, self.log_path, self.port, self.scratch = cmd, log_path, port, scratch
        self.url = f"http://127.0.0.1:{port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, base: str, path: str, timeout: float = 300.0) -> float:
        """Polls `path` until 200 (llama-server answers 503 while loading); seconds waited."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                tail = log_tail(self.log_path)
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(base + path, timeout=2.0).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{path} not OK after {timeout:.0f} s:\n{log_tail(self.log_path)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
        wait_port_free(self.port)
