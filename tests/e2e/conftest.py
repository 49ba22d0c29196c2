"""Starts one real `ferrum serve` on the default model for the end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str, log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "ferrum.cli", "serve", "--port", str(port), *args]
    log = open(log_path, "w")  # noqa: SIM115 - owned by the process for its lifetime
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"ferrum exited with {proc.returncode}: {pathlib.Path(log_path).read_text()}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"ferrum did not start: {pathlib.Path(log_path).read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def running_server(tmp_path_factory, name: str, *extra: str) -> Iterator[str]:
    """`ferrum serve` on the default model with the suite's settings plus `extra` flags."""
    log_path = str(tmp_path_factory.mktemp("server") / f"{name}.log")
    args = ("--threads", "2", "--parallel", "8", "--ctx-size", "4096", *extra)
    proc, url = start_server(*args, log_path=log_path)
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[str]:
    with running_server(tmp_path_factory, "ferrum") as url:
        yield url


@pytest.fixture(scope="session")
def server_no_cache(tmp_path_factory) -> Iterator[str]:
    """The same server with prefix reuse off: the oracle for reuse == fresh prefill."""
    with running_server(tmp_path_factory, "ferrum-no-cache", "--no-prefix-cache") as url:
        yield url
