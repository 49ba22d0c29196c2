"""The connection's limits on a real uvicorn server (the fake model behind it): a body with no
declared length counted as it arrives, and a deadline on request heads (slowloris)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from starlette.requests import Request

from ferrum.api.app import MAX_BODY_BYTES
from ferrum.api.transport import read_body
from ferrum.cli import uvicorn_config
from ferrum.config import ServerConfig
from ferrum.errors import RequestTooLarge
from tests.factories import FakeRunner, fake_app

MIB = 1 << 20


@contextmanager
def serving(app, header_timeout: float = 10.0, keep_alive: int = 5) -> Iterator[tuple[str, int]]:
    """The app on a free port, run as `ferrum serve` runs it (`cli.uvicorn_config`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ServerConfig(port=port, log_level="warning", header_timeout=header_timeout)
    config = uvicorn_config(app, cfg)
    config.timeout_keep_alive = keep_alive
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        thread.join(10)


class Body:
    """A chunked request body made lazily, 1 MiB a chunk: how much of it the client got to
    send shows how much the server read (a few MB of socket buffers aside)."""

    def __init__(self, mib: int, text: bytes = b"x"):
        self.mib, self.text, self.sent = mib, text, 0

    def __iter__(self) -> Iterator[bytes]:
        for _ in range(self.mib):
            self.sent += 1
            yield self.text * (MIB // len(self.text))


# -- the body ------------------------------------------------------------------------------


# Anthropic's own type is request_too_large, not one of its published schema's error types.
ANTHROPIC_413 = {"invalid_request_error": "request_too_large"}


@pytest.mark.parametrize(
    ("path", "status", "error_of"),
    [
        ("/v1/chat/completions", 400, lambda b: b["error"]["code"]),
        ("/api/chat", 400, lambda b: "request_too_large" if isinstance(b["error"], str) else ""),
        ("/v1/messages", 413, lambda b: ANTHROPIC_413.get(b["error"]["type"])),
    ],
)
def test_a_chunked_body_past_the_limit_is_refused_before_it_is_all_read(path, status, error_of):
    """256 MiB sent chunked (no Content-Length): refused in the route's own shape, as a body
    that declared its size would be, and the server stops reading near the limit."""
    body = Body(256)
    with serving(fake_app()) as (host, port):
        r = httpx.post(
            f"http://{host}:{port}{path}", content=iter(body),
            headers={"content-type": "application/json"}, timeout=60,
        )  # fmt: skip
    assert r.status_code == status
    assert error_of(r.json()) == "request_too_large"
    assert r.headers["connection"] == "close"
    assert body.sent < 64, f"the server read {body.sent} MiB of a body over {MAX_BODY_BYTES}"


def test_a_chunked_body_within_the_limit_is_served():
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with serving(fake_app()) as (host, port):
        r = httpx.post(
            f"http://{host}:{port}/v1/chat/completions",
            content=iter([json.dumps(chat).encode()]),
            headers={"content-type": "application/json"},
        )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_the_ingress_reads_a_chunked_body_only_up_to_the_limit():
    """A cluster's ingress reads bodies itself (`read_body`): it stops at the limit too."""
    asked = 0

    async def receive():
        nonlocal asked
        asked += 1
        return {"type": "http.request", "body": b"x" * MIB, "more_body": asked < 256}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    with pytest.raises(RequestTooLarge):
        asyncio.run(read_body(Request(scope, receive), MAX_BODY_BYTES))
    assert asked == MAX_BODY_BYTES // MIB + 1


# -- the head ------------------------------------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed the connection (None: still open after `seconds`)."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def test_a_request_head_that_never_ends_is_closed_at_the_deadline():
    with serving(fake_app(), header_timeout=1.0) as addr, socket.create_connection(addr) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        took = _closed_within(sock, 4.0)
    assert took is not None and took < 2.5


def test_a_head_trickled_byte_by_byte_does_not_extend_the_deadline():
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 200
    with serving(fake_app(), header_timeout=1.0) as addr, socket.create_connection(addr) as sock:
        start = time.monotonic()
        try:
            for byte in head:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        took = time.monotonic() - start
        closed = _closed_within(sock, 3.0)
    assert closed is not None and took < 4.0


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline():
    with serving(fake_app(), header_timeout=1.0) as addr, socket.create_connection(addr) as sock:
        took = _closed_within(sock, 4.0)
    assert took is not None and took < 2.5


def test_keep_alive_still_closes_idle_connections_and_the_next_head_has_its_deadline():
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with serving(fake_app(), header_timeout=1.0, keep_alive=2) as addr:
        with socket.create_connection(addr) as sock:  # idle after an answer: keep-alive's
            sock.sendall(request)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            took = _closed_within(sock, 5.0)
            assert took is not None and 1.5 < took < 3.5
        with socket.create_connection(addr) as sock:  # a second head begun, then stalled
            sock.sendall(request)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /health HTTP/1.1\r\n")  # cancels keep-alive's timer
            took = _closed_within(sock, 5.0)
            assert took is not None and took < 1.8


def test_a_slow_answer_is_not_cut_by_the_head_deadline():
    """The deadline covers the head alone: a request running longer keeps its connection."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    with (
        serving(fake_app(FakeRunner(step_delay_s=0.1)), header_timeout=0.5) as (host, port),
        httpx.Client(base_url=f"http://{host}:{port}") as client,
    ):
        start = time.monotonic()
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and time.monotonic() - start > 1.0
        assert client.get("/health").status_code == 200  # the same connection, kept


def test_the_default_header_timeout_is_ten_seconds():
    assert ServerConfig().header_timeout == 10.0
