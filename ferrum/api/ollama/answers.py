"""/api/chat and /api/generate: a translated request (`bodies.py`) served by the shared path
(`serving.py`) and answered as Ollama's chunks, streamed as NDJSON or sent whole.

Rules:
- `think`: reasoning the engine splits out of `<think>` (unless `--reasoning-inline`) comes
  back as `thinking` unless think is false, which drops it: ferrum cannot tell a template not
  to think, so the model may still spend tokens on it (they count in eval_count).
- Tool calls come back as `message.tool_calls` whose `function.arguments` is an object.
- A chat with no messages or a generate with no prompt loads the model (done_reason "load"),
  or with keep_alive 0 unloads it ("unload"): Ollama's idioms. A model with requests in
  flight is not unloaded under them (409).
- Timings are nanoseconds: load_duration is the wait for the model, prompt_eval_duration runs
  to the first output, eval_duration from there to the last. prompt_eval_count counts the
  whole prompt, cached tokens included; eval_count the tokens generated.
- A stream that has begun reports a failure or its deadline as a last `{"error"}` line
  (`serving.guard_stream` keeps the deadline); the model's lease is released when the answer
  is sent or the request fails, however that happens.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ferrum.api.loaded import ServedModel
from ferrum.api.ollama.bodies import (
    ChatBody,
    GenerateBody,
    Generation,
    chat_request,
    generate_request,
    parse,
    renamed,
)
from ferrum.api.protocol import ChatCompletionRequest, CompletionRequest
from ferrum.api.serving import (
    HeldStream,
    Prepared,
    ServerState,
    acquire_chat,
    deadline,
    guard_stream,
    keep_alive_seconds,
    prepare,
    prepare_chat,
    prepare_completion,
    submit,
    unless_gone,
    with_defaults,
)
from ferrum.api.tool_calls import StreamDelta, ToolCall
from ferrum.engine.async_engine import RequestStream
from ferrum.engine.outputs import RequestOutput
from ferrum.engine.request import FinishReason
from ferrum.errors import EngineError, FerrumError, InvalidRequest
from ferrum.models.errors import ModelBusy
from ferrum.models.registry import Lease

if TYPE_CHECKING:
    from ferrum.api.ollama import Route

B = TypeVar("B", ChatCompletionRequest, CompletionRequest)

NDJSON = "application/x-ndjson"


@dataclass
class _Clock:
    """perf_counter_ns marks of one request, for Ollama's timings."""

    start: int = field(default_factory=time.perf_counter_ns)
    loaded: int = 0
    submitted: int = 0
    first: int = 0

    def stats(self, final: RequestOutput) -> dict[str, int]:
        now = time.perf_counter_ns()
        first = self.first or now
        return {
            "total_duration": now - self.start,
            "load_duration": self.loaded - self.start,
            "prompt_eval_count": final.prompt_tokens,
            "prompt_eval_duration": first - self.submitted,
            "eval_count": final.completion_tokens,
            "eval_duration": now - first,
        }


@dataclass
class _Delta:
    content: str = ""
    thinking: str = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class _Done:
    reason: str
    stats: dict[str, int]


def rfc3339(unix: float) -> str:
    at = datetime.datetime.fromtimestamp(unix, datetime.UTC)
    return at.isoformat(timespec="microseconds").replace("+00:00", "Z")


def ndjson_line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def _error_line(err: FerrumError) -> str:
    return ndjson_line({"error": err.message})


def _arguments(text: str) -> dict[str, Any]:
    # Ollama's arguments are an object; a model that wrote them as anything else sends none.
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class _Shape:
    """Ollama's chunks: /api/chat's carry a `message`, /api/generate's a `response`."""

    model: str
    chat: bool

    def event(self, event: _Delta | _Done) -> dict[str, Any]:
        return self.chunk(event) if isinstance(event, _Delta) else self.chunk(_Delta(), event)

    def chunk(self, delta: _Delta, done: _Done | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": rfc3339(time.time())}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": delta.content}
            if delta.thinking:
                message["thinking"] = delta.thinking
            if delta.calls:
                message["tool_calls"] = [
                    {"function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                    for c in delta.calls
                ]
            out["message"] = message
        else:
            out["response"] = delta.content
            if delta.thinking:
                out["thinking"] = delta.thinking
        out["done"] = done is not None
        if done is not None:
            out["done_reason"] = done.reason
            out.update(done.stats)
        return out


def _check(out: RequestOutput) -> str:
    """Ollama's done_reason of a finished output; a failed one raises."""
    if out.finish_reason is FinishReason.ERROR:
        raise out.error or EngineError("the engine failed the request")
    if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return out.finish_reason.value
    raise EngineError("the request was aborted")


@dataclass
class _Answer:
    """How one request is answered: chunks of this shape, streamed or whole, with or without
    the thinking, timed by its clock."""

    shape: _Shape
    stream: bool
    think: bool
    clock: _Clock


async def _events(
    stream: RequestStream, prepared: Prepared, answer: _Answer
) -> AsyncIterator[_Delta | _Done]:
    """Deltas with tool calls parsed out, then one _Done; raises if the engine fails."""
    fmt = prepared.kind.tool_format
    parser = fmt.stream_parser() if fmt is not None else None
    clock = answer.clock
    async for out in stream:
        clock.first = clock.first or time.perf_counter_ns()
        reason = _check(out) if out.finished else ""
        delta = _Delta(out.content, out.reasoning if answer.think else "")
        if parser is not None:
            parsed = parser.feed(out.content)
            tail = parser.finish() if out.finished else StreamDelta()
            delta.content, delta.calls = parsed.content + tail.content, parsed.calls + tail.calls
        if delta.content or delta.thinking or delta.calls:
            yield delta
        if out.finished:
            yield _Done(reason, clock.stats(out))
            return


async def _whole(events: AsyncIterator[_Delta | _Done], shape: _Shape) -> dict[str, Any]:
    total = _Delta()
    async for event in events:
        if isinstance(event, _Done):
            return shape.chunk(total, event)
        total.content += event.content
        total.thinking += event.thinking
        total.calls += event.calls
    raise EngineError("the engine closed a request without a result")


async def _lines(events: AsyncIterator[_Delta | _Done], shape: _Shape) -> AsyncIterator[str]:
    """One JSON line per event; a failure ends the lines with an error line."""
    try:
        async for event in events:
            yield ndjson_line(shape.event(event))
    except FerrumError as exc:
        yield _error_line(exc)


async def _serve(
    state: ServerState,
    http: Request,
    lease: Lease[ServedModel],
    body: B,
    prepare_fn: Callable[[ServedModel, B], Prepared],
    answer: _Answer,
) -> Response:
    """Prepares, submits and answers on the leased model; the lease is released when the
    answer is sent or the request fails, however that happens (see `serving.complete`)."""
    try:
        model = lease.model
        body = with_defaults(model, body)
        prepared = await prepare(prepare_fn, model, body)
        answer.clock.submitted = time.perf_counter_ns()
        sub = submit(state, model, body, prepared)
    except BaseException as exc:
        lease.release()
        if isinstance(exc, InvalidRequest):
            raise renamed(exc) from None
        raise
    events = _events(sub.streams[0], prepared, answer)
    limit = deadline(state, body)
    if answer.stream:

        def close() -> None:
            sub.abort_all()
            lease.release()

        lines = _lines(events, answer.shape)
        guarded = guard_stream(lines, limit, sub.abort_all, lambda err: [_error_line(err)])
        return HeldStream(guarded, close, media_type=NDJSON)
    try:
        return JSONResponse(await unless_gone(http, _whole(events, answer.shape), limit))
    finally:
        sub.abort_all()
        lease.release()


async def _load_or_unload(
    state: ServerState, name: str, keep_alive: str | float | None, chat: bool
) -> Response:
    """Ollama's idioms: a request with nothing to answer loads its model, or unloads it with
    keep_alive 0. A model busy with requests is not unloaded under them (409)."""
    seconds = keep_alive_seconds(keep_alive)
    spec = state.models.resolve(name)
    if seconds == 0:
        if not await state.models.unload(spec.name):
            raise ModelBusy(f"model {spec.name!r} has requests in flight; it stays loaded")
        reason = "unload"
    else:
        (await state.models.acquire(spec.name, seconds)).release()
        reason = "load"
    return JSONResponse(_Shape(spec.name, chat).chunk(_Delta(), _Done(reason, {})))


async def _leased(
    state: ServerState, body: Generation, clock: _Clock, chat: bool
) -> tuple[Lease[ServedModel], _Answer]:
    """The body's model, loaded if need be, and how to answer on it."""
    lease = await acquire_chat(state, body.model, body.keep_alive)
    clock.loaded = time.perf_counter_ns()
    answer = _Answer(_Shape(lease.name, chat), body.stream, body.think is not False, clock)
    return lease, answer


def add_generation_routes(route: Route, state: ServerState) -> None:
    @route("POST", "/api/chat")
    async def chat(request: Request) -> Response:
        clock = _Clock()
        body = await parse(request, ChatBody)
        body.check()
        if not body.messages:
            return await _load_or_unload(state, body.model, body.keep_alive, chat=True)
        openai = chat_request(body)
        lease, answer = await _leased(state, body, clock, chat=True)
        return await _serve(state, request, lease, openai, prepare_chat, answer)

    @route("POST", "/api/generate")
    async def generate(request: Request) -> Response:
        clock = _Clock()
        body = await parse(request, GenerateBody)
        body.check()
        if not body.prompt:
            return await _load_or_unload(state, body.model, body.keep_alive, chat=False)
        openai = generate_request(body)
        lease, answer = await _leased(state, body, clock, chat=False)
        if isinstance(openai, CompletionRequest):
            return await _serve(state, request, lease, openai, prepare_completion, answer)
        return await _serve(state, request, lease, openai, prepare_chat, answer)

