"""How a request ends early: the client hangs up or the deadline passes.

Every dialect answers through these, streamed or whole, so an early end always aborts the
request's engine work within one engine step and frees what it holds (`serving.py` frees the
model's lease in `HeldStream`'s `on_close` and after `unless_gone`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from ferrum.api.openai.dialect import OPENAI
from ferrum.errors import ClientGone, RequestTimeout

T = TypeVar("T")
_DISCONNECT_POLL_S = 0.25


class HeldStream(StreamingResponse):
    """A streamed response that runs `on_close` however it ends: sent, cut by a hang-up or
    never started. (A generator's `finally` runs only if the generator was started.)"""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def guard_stream(
    events: AsyncIterator[str],
    deadline: float | None,
    abort_all: Callable[[], None],
    on_timeout: Callable[[RequestTimeout], list[str]] | None = None,
) -> AsyncIterator[str]:
    """The stream, cut at the deadline with what `on_timeout` makes of the timeout error (by
    default SSE's: an error event and [DONE]); aborts on any exit. Each dialect streams
    through it with its own ending (Ollama's: an `{"error"}` line).

    The deadline covers only the waits for the engine, never a `yield`: while the generator is
    suspended there, Starlette is sending, and a timeout firing then would cancel the send and
    end the stream without its ending (the error event and [DONE]). Starlette cancels this
    generator when the client disconnects, which lands in `finally`.
    """
    loop = asyncio.get_running_loop()
    end = None if deadline is None else loop.time() + deadline
    try:
        while True:
            try:
                if end is not None and loop.time() >= end:
                    raise TimeoutError
                async with asyncio.timeout_at(end):
                    event = await anext(events)
            except StopAsyncIteration:
                return
            except TimeoutError:
                err = RequestTimeout(f"the request took longer than {deadline:g} s")
                done = [OPENAI.stream_error(err), "data: [DONE]\n\n"]
                ending = on_timeout(err) if on_timeout else done
                for line in ending:
                    yield line
                return
            yield event
    finally:
        abort_all()


async def unless_gone(http: Request, work: Awaitable[T], deadline: float | None) -> T:
    """Awaits `work`, cancelling it if the client hangs up or the deadline passes."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    end = None if deadline is None else loop.time() + deadline
    try:
        while True:
            wait = _DISCONNECT_POLL_S if end is None else min(_DISCONNECT_POLL_S, end - loop.time())
            done, _ = await asyncio.wait({task}, timeout=max(wait, 0))
            if done:
                return task.result()
            if end is not None and loop.time() >= end:
                raise RequestTimeout(f"the request took longer than {deadline:g} s")
            if await http.is_disconnected():
                raise ClientGone("the client closed the connection")
    finally:
        task.cancel()
