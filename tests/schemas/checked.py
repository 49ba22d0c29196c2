"""OpenAI clients whose every answer is validated against the published schemas as it
arrives: an httpx transport under the `openai` SDK checks each whole answer, each streamed
event or chunk (as the SDK reads it) and each error body of the Responses, chat completions
and completions routes. An e2e test that uses such a client checks conformance without a
line of its own; `Checked.answers` counts what was checked, so a fixture can prove it ran."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx  # the HTTP client the `openai` SDK and Starlette run on
import openai

from tests import schemas

Check = Callable[[Any], None]

_RESPONSE_ID = re.compile(r"/v1/responses/[^/]+")


def _checks(method: str, path: str) -> tuple[Check, Check] | None:
    """(whole answer, one stream event) checks for a route, None for a route not checked."""
    if method == "POST" and path.endswith("/v1/responses"):
        return schemas.validate_response, schemas.validate_response_event
    if method == "GET" and _RESPONSE_ID.search(path):
        return schemas.validate_response, schemas.validate_response_event
    if method == "POST" and path.endswith("/v1/chat/completions"):
        return schemas.validate_chat, lambda c: _chunk(c, schemas.validate_chat)
    if method == "POST" and path.endswith("/v1/completions"):
        return schemas.validate_completion, lambda c: _chunk(c, schemas.validate_completion)
    if method == "POST" and path.endswith("/v1/embeddings"):
        return schemas.validate_embeddings, schemas.validate_embeddings  # never streamed
    return None


def _chunk(chunk: Any, check: Callable[..., None]) -> None:
    # A chat or completion stream ends in an OpenAI error object when it fails midway.
    if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk:
        schemas.validate_error(chunk)
    else:
        check(chunk, chunk=True)


@dataclass
class Checked:
    """What a client's transport checked, counted."""

    answers: int = 0
    events: int = 0


class _SSE:
    """Server-sent events cut from the bytes as they stream, each checked once whole."""

    def __init__(self, check: Check, seen: Checked):
        self._check, self._seen, self._buffer = check, seen, b""

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        *blocks, self._buffer = self._buffer.split(b"\n\n")
        for block in blocks:
            data = [line[5:].strip() for line in block.split(b"\n") if line.startswith(b"data:")]
            if data and data != [b"[DONE]"]:
                self._check(json.loads(b"\n".join(data)))
                self._seen.events += 1

    def end(self) -> None:
        pass


class _Whole:
    """A JSON answer gathered as it streams, checked when it has all arrived: an answer, or
    an error body for a status of 400 and up."""

    def __init__(self, check: Check, status: int):
        self._check = schemas.validate_error if status >= 400 else check
        self._body = b""

    def feed(self, chunk: bytes) -> None:
        self._body += chunk

    def end(self) -> None:
        self._check(json.loads(self._body))


class _SyncTee(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, reader: _SSE | _Whole):
        self._inner, self._reader = inner, reader

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._reader.feed(chunk)
            yield chunk
        self._reader.end()

    def close(self) -> None:
        self._inner.close()


class _AsyncTee(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, reader: _SSE | _Whole):
        self._inner, self._reader = inner, reader

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._reader.feed(chunk)
            yield chunk
        self._reader.end()

    async def aclose(self) -> None:
        await self._inner.aclose()


def _reader(request: httpx.Request, response: httpx.Response, seen: Checked
            ) -> _SSE | _Whole | None:  # fmt: skip
    """How to check this answer as it streams, None for a route not checked."""
    checks = _checks(request.method, request.url.path)
    if checks is None:
        return None
    if response.headers.get("content-encoding", "identity") != "identity":
        raise ValueError("the checks read raw bodies: ask for no content-encoding")
    seen.answers += 1
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return _SSE(checks[1], seen)
    return _Whole(checks[0], response.status_code)


class CheckingTransport(httpx.BaseTransport):
    """`inner` (the network by default), with every answer of the checked routes checked."""

    def __init__(self, seen: Checked, inner: httpx.BaseTransport | None = None):
        self.seen, self._inner = seen, inner or httpx.HTTPTransport()

    def close(self) -> None:
        self._inner.close()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        reader = _reader(request, response, self.seen)
        if reader is not None and response.is_stream_consumed:  # a body given whole (mocks)
            reader.feed(response.content)
            reader.end()
        elif reader is not None:
            response.stream = _SyncTee(response.stream, reader)  # type: ignore[arg-type]
        return response


class AsyncCheckingTransport(httpx.AsyncBaseTransport):
    """The same, async."""

    def __init__(self, seen: Checked, inner: httpx.AsyncBaseTransport | None = None):
        self.seen, self._inner = seen, inner or httpx.AsyncHTTPTransport()

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        reader = _reader(request, response, self.seen)
        if reader is not None and response.is_stream_consumed:  # a body given whole (mocks)
            reader.feed(response.content)
            reader.end()
        elif reader is not None:
            response.stream = _AsyncTee(response.stream, reader)  # type: ignore[arg-type]
        return response


def client(base_url: str, seen: Checked | None = None) -> openai.OpenAI:
    """An `openai.OpenAI` client on `base_url` (…/v1) whose answers are all checked."""
    transport = CheckingTransport(seen if seen is not None else Checked())
    http = httpx.Client(transport=transport, timeout=600)
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)


def async_client(base_url: str, seen: Checked | None = None) -> openai.AsyncOpenAI:
    """The same, async."""
    transport = AsyncCheckingTransport(seen if seen is not None else Checked())
    http = httpx.AsyncClient(transport=transport, timeout=600)
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                              http_client=http)  # fmt: skip
