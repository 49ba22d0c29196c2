"""Starts real `ferrum serve` processes for the end-to-end tests: most on the built-in Gemma
3 270M alone (a base model, so greedy output is long and stable), each with an empty model
store of its own so nothing from the machine's store leaks in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from ferrum.bench.process import ServerProcess, ferrum_command, free_port


@contextlib.contextmanager
def running_server(
    tmp_path_factory, name: str, *extra: str, models: tuple[str, ...] = ("gemma3-270m",),
    env: dict[str, str] | None = None, handle: list | None = None,
) -> Iterator[str]:
    """`ferrum serve` on Gemma 3 270M alone with the suite's settings plus `extra` flags
    (`models`: the --model flags; none: every built-in and store model). `handle` receives
    the ServerProcess, for tests that watch the process itself."""
    folder = tmp_path_factory.mktemp("server")
    log_path = folder / f"{name}.log"
    port = free_port()
    if not any(flag.startswith("--models-dir") for flag in extra):
        extra = ("--models-dir", str(folder / "models"), *extra)
    if not any(flag.startswith("--cache-dir") for flag in extra):
        extra = ("--cache-dir", str(folder / "kv"), *extra)  # never the user's own
    model_flags = [f for m in models for f in ("--model", m)]
    flags = ("--threads", "2", "--parallel", "8", "--ctx-size", "4096", *model_flags, *extra)
    server = ServerProcess(ferrum_command(port, *flags), log_path, port, env=env)
    if handle is not None:
        handle.append(server)
    try:
        server.wait_ready(server.url, "/health", timeout=120)
        yield server.url
    finally:
        server.stop()


# The shared servers do not speculate: their tests ask for the same text from runs of other
# batch shapes (a seed twice, stream against whole, n forks against one, reuse against
# none), and a verification batch sums in another order than single decodes (about 0.1 nats
# on the top log-probabilities of SmolLM2 and Gemma 3 alike), so near ties go either way.
# Speculation's exactness is the state machines' (tiny models, token for token); its own
# server test is tests/e2e/test_speculation_e2e.py.
NO_SPECULATION = ("--spec-type", "none")


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[str]:
    with running_server(tmp_path_factory, "ferrum", *NO_SPECULATION) as url:
        yield url


@pytest.fixture(scope="session")
def server_no_cache(tmp_path_factory) -> Iterator[str]:
    """The same server with prefix reuse off: the oracle for reuse == fresh prefill."""
    flags = ("--no-prefix-cache", *NO_SPECULATION)
    with running_server(tmp_path_factory, "ferrum-no-cache", *flags) as url:
        yield url
