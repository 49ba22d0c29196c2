"""One generation answered in a dialect of its own: the engine's outputs as deltas with tool
calls parsed out, ending in one `Finish`, and the serving of one request (preset defaults,
preparation in a worker thread, submission, the deadline, a hang-up, the model's lease) that
the Ollama, Responses and Anthropic routes share. Chat completions, which answer n choices
and logprobs, are OpenAI's (`openai.routes.complete`); both go through
`serving.serve_request`.

A dialect is an `Answer`: how it streams the events (`lines`, which also ends a stream that
fails in its own shape), how it answers them whole, and what a stream says when the deadline
passes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from fastapi import Request
from fastapi.responses import Response

from ferrum.api.loaded import ServedModel
from ferrum.api.openai.answers import failure
from ferrum.api.openai.bodies import ChatCompletionRequest, CompletionRequest
from ferrum.api.prompting.tool_calls import StreamDelta, ToolCall, ToolFormat
from ferrum.api.serving import Prepared, PrepareFn, ServerState, Submission, serve_request
from ferrum.engine.async_engine import RequestStream
from ferrum.engine.outputs import RequestOutput
from ferrum.errors import EngineError, RequestTimeout
from ferrum.models.registry import Lease

B = TypeVar("B", ChatCompletionRequest, CompletionRequest)

__all__ = ["Answer", "Delta", "Event", "Finish", "deltas", "gathered", "serve"]


@dataclass
class Delta:
    """New text of one answer: content, reasoning (split out of `<think>`) and tool calls."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    tokens: int = 0  # tokens generated since the last delta (usage's reasoning tokens)


@dataclass(frozen=True)
class Finish:
    """How the answer ended: `reason` is "stop" or "length"; `output` is the last output
    (token counts, cached tokens, the stop string that ended it); `called`: it made calls."""

    reason: str
    output: RequestOutput
    called: bool


Event = Delta | Finish


async def deltas(
    stream: RequestStream,
    tool_format: ToolFormat | None,
    on_output: Callable[[RequestOutput], None] = lambda _: None,
) -> AsyncIterator[Event]:
    """The stream's non-empty deltas, with tool calls parsed out when the request has tools,
    then one Finish; a failed or aborted request raises its error instead."""
    parser = tool_format.stream_parser() if tool_format is not None else None
    called = False
    tokens = 0
    async for out in stream:
        on_output(out)
        if out.finished and (err := failure(out)) is not None:
            raise err
        tokens += len(out.token_ids)
        delta = Delta(out.content, out.reasoning, tokens=tokens)
        if parser is not None:
            parsed = parser.feed(out.content)
            tail = parser.finish() if out.finished else StreamDelta()
            delta.content, delta.calls = parsed.content + tail.content, parsed.calls + tail.calls
            called = called or bool(delta.calls)
        if delta.content or delta.reasoning or delta.calls:
            tokens = 0
            yield delta
        if out.finished:
            if out.finish_reason is None:
                raise EngineError("a finished output without a finish reason")
            yield Finish(out.finish_reason.value, out, called)
            return
    raise EngineError("the engine closed a request without a result")


async def gathered(events: AsyncIterator[Event]) -> tuple[Delta, Finish]:
    """Every delta joined into one, and the Finish: a whole answer's material."""
    total = Delta()
    async for event in events:
        if isinstance(event, Finish):
            return total, event
        total.content += event.content
        total.reasoning += event.reasoning
        total.calls += event.calls
        total.tokens += event.tokens
    raise EngineError("the engine closed a request without a result")


class Answer(Protocol):
    """How one request is answered in a dialect."""

    stream: bool
    media_type: str

    def on_output(self, out: RequestOutput) -> None:
        """Sees every engine output as it arrives (Ollama times the first)."""

    def begin(self, prepared: Prepared) -> None:
        """Called with the prepared prompt, just before it is submitted."""

    def lines(self, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        """The streamed answer; a failure (a FerrumError from `events`) ends it in the
        dialect's own error shape."""
        ...

    async def whole(self, events: AsyncIterator[Event]) -> Response: ...

    def timeout_lines(self, err: RequestTimeout) -> list[str]:
        """How a stream that has begun ends when its deadline passes."""
        ...


async def serve(
    state: ServerState,
    http: Request,
    lease: Lease[ServedModel],
    body: B,
    prepare_fn: PrepareFn[B],
    answer: Answer,
) -> Response:
    """Prepares, submits and answers one generation on the leased model (n is 1), through the
    serve path every dialect shares (`serving.serve_request`: the lease, the deadline, a
    hang-up); an error before submission is raised as it is, for the dialect to shape."""
    response: Response = await serve_request(
        state, http, lease, body, prepare_fn, _OneChoice(answer)
    )
    return response


@dataclass(frozen=True)
class _OneChoice:
    """An `Answer`, which reads one choice as deltas, as the serve path's `Reply`."""

    answer: Answer

    @property
    def stream(self) -> bool:
        return self.answer.stream

    @property
    def media_type(self) -> str:
        return self.answer.media_type

    def begin(self, prepared: Prepared) -> None:
        self.answer.begin(prepared)

    def lines(self, sub: Submission, prepared: Prepared) -> AsyncIterator[str]:
        return self.answer.lines(self._events(sub, prepared))

    def whole(self, sub: Submission, prepared: Prepared) -> Awaitable[Response]:
        return self.answer.whole(self._events(sub, prepared))

    def timeout_lines(self, err: RequestTimeout) -> list[str]:
        return self.answer.timeout_lines(err)

    def _events(self, sub: Submission, prepared: Prepared) -> AsyncIterator[Event]:
        return deltas(sub.streams[0], prepared.kind.tool_format, self.answer.on_output)
