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
  (`hangups.guard_stream` keeps the deadline); the model's lease is released when the answer
  is sent or the request fails, however that happens.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ferrum.api.auth import require_admin
from ferrum.api.generation import Delta, Event, Finish, gathered, serve
from ferrum.api.loaded import ServedModel
from ferrum.api.ollama.bodies import (
    ChatBody,
    GenerateBody,
    Generation,
    chat_request,
    generate_request,
    image_params,
    parse,
    renamed,
)
from ferrum.api.ollama.dialect import OLLAMA
from ferrum.api.openai.bodies import ChatCompletionRequest, CompletionRequest
from ferrum.api.serving import (
    Prepared,
    PrepareFn,
    ServerState,
    acquire,
    acquire_chat,
    keep_alive_seconds,
    prepare_chat,
    prepare_completion,
)
from ferrum.engine.outputs import RequestOutput
from ferrum.errors import FerrumError, InvalidRequest, RequestTimeout
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


def rfc3339(unix: float) -> str:
    at = datetime.datetime.fromtimestamp(unix, datetime.UTC)
    return at.isoformat(timespec="microseconds").replace("+00:00", "Z")


def ndjson_line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def _arguments(text: str) -> dict[str, Any]:
    # Ollama's arguments are an object; a model that wrote them as anything else sends none.
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class _Done:
    reason: str
    stats: dict[str, int]


@dataclass(frozen=True)
class _Shape:
    """Ollama's chunks: /api/chat's carry a `message`, /api/generate's a `response`."""

    model: str
    chat: bool

    def chunk(self, delta: Delta, done: _Done | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": rfc3339(time.time())}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": delta.content}
            if delta.reasoning:
                message["thinking"] = delta.reasoning
            if delta.calls:
                message["tool_calls"] = [
                    {"function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                    for c in delta.calls
                ]
            out["message"] = message
        else:
            out["response"] = delta.content
            if delta.reasoning:
                out["thinking"] = delta.reasoning
        out["done"] = done is not None
        if done is not None:
            out["done_reason"] = done.reason
            out.update(done.stats)
        return out


@dataclass
class _Answer:
    """How one request is answered (a `generation.Answer`): chunks of this shape, streamed
    as NDJSON or sent whole, with or without the thinking, timed by its clock."""

    shape: _Shape
    stream: bool
    think: bool
    clock: _Clock
    media_type: str = NDJSON

    def on_output(self, out: RequestOutput) -> None:
        self.clock.first = self.clock.first or time.perf_counter_ns()

    def begin(self, prepared: Prepared) -> None:
        self.clock.submitted = time.perf_counter_ns()

    def _done(self, finish: Finish) -> _Done:
        return _Done(finish.reason, self.clock.stats(finish.output))

    def _seen(self, delta: Delta) -> Delta:
        return delta if self.think else Delta(delta.content, "", delta.calls)

    async def lines(self, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        """One JSON line per event; a failure ends the lines with an error line."""
        try:
            async for event in events:
                if isinstance(event, Finish):
                    yield ndjson_line(self.shape.chunk(Delta(), self._done(event)))
                elif (delta := self._seen(event)).content or delta.reasoning or delta.calls:
                    yield ndjson_line(self.shape.chunk(delta))
        except FerrumError as exc:
            yield OLLAMA.stream_error(exc)

    async def whole(self, events: AsyncIterator[Event]) -> Response:
        total, finish = await gathered(events)
        return JSONResponse(self.shape.chunk(self._seen(total), self._done(finish)))

    def timeout_lines(self, err: RequestTimeout) -> list[str]:
        return [OLLAMA.stream_error(err)]


async def _serve(
    state: ServerState,
    http: Request,
    lease: Lease[ServedModel],
    body: B,
    prepare_fn: PrepareFn[B],
    answer: _Answer,
    images: dict[str, str],
) -> Response:
    """`generation.serve`, with errors in a translated body named as the client wrote them
    (`images`: its image parts' names, `image_params`)."""
    try:
        return await serve(state, http, lease, body, prepare_fn, answer)
    except InvalidRequest as exc:
        raise renamed(exc, images) from None


async def _load_or_unload(
    state: ServerState, http: Request, name: str, keep_alive: str | float | None, chat: bool
) -> Response:
    """Ollama's idioms: a request with nothing to answer loads its model, or unloads it with
    keep_alive 0 (an admin's call: it ends the model for everyone). A model busy with requests
    is not unloaded under them (409)."""
    seconds = keep_alive_seconds(keep_alive)
    spec = state.models.resolve(name)
    if seconds == 0:
        require_admin(http, "unloading a model")
        if not await state.models.unload(spec.name):
            raise ModelBusy(f"model {spec.name!r} has requests in flight; it stays loaded")
        reason = "unload"
    else:
        (await acquire(state, http, spec.name, keep_alive)).release()
        reason = "load"
    return JSONResponse(_Shape(spec.name, chat).chunk(Delta(), _Done(reason, {})))


async def _leased(
    state: ServerState, http: Request, body: Generation, clock: _Clock, chat: bool
) -> tuple[Lease[ServedModel], _Answer]:
    """The body's model, loaded if need be, and how to answer on it."""
    lease = await acquire_chat(state, http, body.model, body.keep_alive)
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
            return await _load_or_unload(state, request, body.model, body.keep_alive, chat=True)
        openai = chat_request(body)
        images = image_params(body, openai)
        lease, answer = await _leased(state, request, body, clock, chat=True)
        return await _serve(state, request, lease, openai, prepare_chat, answer, images)

    @route("POST", "/api/generate")
    async def generate(request: Request) -> Response:
        clock = _Clock()
        body = await parse(request, GenerateBody)
        body.check()
        if not body.prompt:
            return await _load_or_unload(state, request, body.model, body.keep_alive, chat=False)
        openai = generate_request(body)
        images = image_params(body, openai)
        lease, answer = await _leased(state, request, body, clock, chat=False)
        if isinstance(openai, CompletionRequest):
            return await _serve(state, request, lease, openai, prepare_completion, answer, images)
        return await _serve(state, request, lease, openai, prepare_chat, answer, images)
