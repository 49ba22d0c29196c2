"""Starts one real `ferrum serve` on the default model for the end-to-end tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from ferrum.bench.process import ServerProcess, ferrum_command, free_port


@contextlib.contextmanager
def running_server(tmp_path_factory, name: str, *extra: str) -> Iterator[str]:
    """`ferrum serve` on the default model with the suite's settings plus `extra` flags."""
    log_path = tmp_path_factory.mktemp("server") / f"{name}.log"
    port = free_port()
    flags = ("--threads", "2", "--parallel", "8", "--ctx-size", "4096", *extra)
    server = ServerProcess(ferrum_command(port, *flags), log_path, port)
    try:
        server.wait_ready(server.url, "/health", timeout=120)
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[str]:
    with running_server(tmp_path_factory, "ferrum") as url:
        yield url


@pytest.fixture(scope="session")
def server_no_cache(tmp_path_factory) -> Iterator[str]:
    """The same server with prefix reuse off: the oracle for reuse == fresh prefill."""
    with running_server(tmp_path_factory, "ferrum-no-cache", "--no-prefix-cache") as url:
        yield url
