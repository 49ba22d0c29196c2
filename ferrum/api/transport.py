"""What one HTTP connection may cost the server before a route sees its request: the body's
size as it arrives, and how long its request head may take.

- Body: a declared `Content-Length` is checked before routing (`app.check_gate`); the HTTP
  server then frames the body by it, so no more can arrive. A body without one (chunked, or
  HTTP/2 without the header) is counted as it arrives (`BodyCap`): past the limit the route
  stops reading (so the rest is never buffered) and the request is answered as one that
  declared too large a body, with `Connection: close`, so the client stops sending.
- Head: uvicorn closes a connection idle between requests (`timeout_keep_alive`) but has no
  limit on a request head sent one byte at a time, nor on a connection that never sends one
  (slowloris). `header_deadline_protocol` gives each request's head `header_timeout` seconds
  from its first byte (from the connection's opening, for the first request); a head not
  complete by then closes the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import Request
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from ferrum.errors import RequestTooLarge

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

__all__ = ["BodyCap", "header_deadline_protocol", "needs_cap", "read_body", "too_large"]


def too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"request bodies are limited to {limit} bytes")


def needs_cap(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a body can outgrow what its head declared: it has no Content-Length, or it is
    chunked (a Transfer-Encoding wins over a Content-Length)."""
    names = {name.lower() for name, _ in headers}
    return b"content-length" not in names or b"transfer-encoding" in names


class BodyCap:
    """One request's `receive` and `send`, the body counted as it arrives.

    Past `limit` bytes `receive` raises `RequestTooLarge` (and keeps raising: nothing of the
    request is read any more), and whatever the app answers to that is dropped: the gate that
    made the cap answers instead (`over`), in the route's own error shape. Disconnects pass
    through untouched: a handler waiting for its client to leave still sees it leave.
    """

    def __init__(self, receive: Receive, send: Send, limit: int):
        self._receive, self._send, self.limit = receive, send, limit
        self.received = 0
        self.over = False  # the body passed the limit before any answer began
        self.started = False  # the app began its answer

    async def receive(self) -> Message:
        if self.over:
            raise too_large(self.limit)
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit and not self.started:
                self.over = True
                raise too_large(self.limit)
        return message

    async def send(self, message: Message) -> None:
        if self.over:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (`RequestTooLarge`) as soon as more than `limit` bytes have
    arrived, whatever the head declared: for a server (a cluster's ingress) that reads bodies
    itself."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)


# uvicorn's own choice of HTTP/1.1 parser (httptools when installed, else h11). Both keep
# `transport`, `loop` and `cycle` (the latest request's, made when its head is complete) and
# call `data_received`; that is all the deadline relies on. Typed Any: the base is chosen at
# import time.
_Base: Any = AutoHTTPProtocol


class HeaderDeadline(_Base):  # type: ignore[misc]
    """uvicorn's HTTP protocol with a deadline on every request head (module docstring)."""

    header_timeout = 10.0  # set per server by `header_deadline_protocol`

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._head_cycle: Any = None  # the request whose head completed last
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._head_cycle:  # a head completed: its request runs
            self._head_cycle = self.cycle
            self._disarm()
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            # Bytes with no request running: the start of the next head. The deadline counts
            # from here, not from the latest byte, so trickling bytes do not extend it.
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expire(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def header_deadline_protocol(header_timeout: float) -> type[asyncio.Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`, with this server's deadline."""
    cls: type[asyncio.Protocol] = type(
        "HeaderDeadline", (HeaderDeadline,), {"header_timeout": header_timeout}
    )
    return cls
