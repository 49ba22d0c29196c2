"""One completion request from HTTP to engine and back: n choices, deadline, disconnects.

Every way a request can end early frees its engine requests: a client that hangs up (stream
or not) and a deadline that passes both abort them within one engine step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from ferrum.api.chat_template import ChatFormatter
from ferrum.api.grammar import GrammarBuilder
from ferrum.api.protocol import ChatCompletionRequest, CompletionRequest
from ferrum.api.responses import CompletionKind, collect, error_event, stream_sse
from ferrum.api.tool_request import ToolRequest
from ferrum.engine.async_engine import AsyncEngine
from ferrum.engine.batch import ModelInfo, Vocabulary
from ferrum.engine.request import SamplingParams
from ferrum.errors import ClientGone, InvalidRequest, RequestTimeout
from ferrum.metrics import Metrics

T = TypeVar("T")
B = TypeVar("B", ChatCompletionRequest, CompletionRequest)
_DISCONNECT_POLL_S = 0.25


@dataclass
class ServerState:
    engine: AsyncEngine
    vocab: Vocabulary  # read-only: safe in the worker threads that prepare requests
    info: ModelInfo
    formatter: ChatFormatter
    metrics: Metrics
    alias: str
    api_keys: tuple[str, ...] = ()
    public_metrics: bool = False
    split_think: bool = True
    default_max_tokens: int = -1  # --n-predict: max_tokens when a request gives none
    request_timeout: float = 0.0  # --request-timeout; 0: none
    created: int = 0
    grammars: GrammarBuilder = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.grammars = GrammarBuilder(self.vocab)


@dataclass(frozen=True)
class Prepared:
    """A request made ready for the engine: its prompt tokens, response kind and grammar."""

    prompt: list[int]
    kind: CompletionKind
    grammar: str | None = None


def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> Prepared:
    """The prompt (tools carried by the template), the response kind and the grammar, if any.
    Template rendering, tokenizing and grammar building take CPU time: call it in a worker
    thread (`prepare`), never on the event loop.

    A forced tool choice and a JSON response_format would each need their own grammar over
    the same output, so they are refused together."""
    body.reject_unsupported()
    tools = ToolRequest.from_body(body.tools, body.tool_choice, body.parallel_tool_calls)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    prompt = state.formatter.tokenize(messages, state.vocab.tokenize, tools.template_tools())
    fmt = state.formatter.tool_format
    grammar = state.grammars.for_tools(tools, fmt)
    if grammar is None:
        grammar = state.grammars.for_response_format(body.response_format)
    elif body.response_format is not None and body.response_format.type != "text":
        raise InvalidRequest(
            "response_format cannot be combined with a tool_choice that forces a call",
            param="response_format",
        )
    kind = CompletionKind(
        chat=True,
        token_bytes=state.vocab.token_bytes,
        tool_format=fmt if tools.active else None,
    )
    return Prepared(prompt, kind, grammar)


def prepare_completion(state: ServerState, body: CompletionRequest) -> Prepared:
    """The prompt of a text completion: its text tokenized, or its token ids checked."""
    body.reject_unsupported()
    prompt_in = body.prompt_input()
    if isinstance(prompt_in, str):
        prompt = state.vocab.tokenize(prompt_in, True, True)
    else:
        prompt = check_token_ids(state, prompt_in, "prompt")
    return Prepared(prompt, CompletionKind(chat=False, token_bytes=state.vocab.token_bytes))


def check_token_ids(state: ServerState, tokens: list[int], param: str) -> list[int]:
    n_vocab = state.info.n_vocab
    if any(not 0 <= t < n_vocab for t in tokens):
        raise InvalidRequest(f"token ids must be in [0, {n_vocab})", param=param)
    return list(tokens)


async def prepare(
    prepare_fn: Callable[[ServerState, B], Prepared], state: ServerState, body: B
) -> Prepared:
    """Runs request preparation in a worker thread: a long prompt or a large schema must not
    stall the event loop, which every open stream is waiting on."""
    return await asyncio.to_thread(prepare_fn, state, body)


def _deadline(state: ServerState, body: ChatCompletionRequest | CompletionRequest) -> float | None:
    limits = [t for t in (state.request_timeout, body.timeout or 0.0) if t > 0]
    return min(limits) if limits else None


async def complete(
    state: ServerState,
    http: Request,
    body: ChatCompletionRequest | CompletionRequest,
    prepared: Prepared,
) -> Any:
    """Submits n engine requests for one prompt (they share its prefill) and answers."""
    engine = state.engine
    prompt, kind = prepared.prompt, prepared.kind
    engine.check_capacity(body.n)
    max_tokens = body.requested_max_tokens()
    if max_tokens is None and state.default_max_tokens > 0:
        max_tokens = state.default_max_tokens
    max_tokens = engine.clamp_max_tokens(len(prompt), max_tokens)
    params = body.sampling_params(max_tokens, state.info.n_vocab, prepared.grammar)
    request_id = ("chatcmpl-" if kind.chat else "cmpl-") + uuid.uuid4().hex
    split_think = state.split_think and kind.chat
    ids = [request_id] if body.n == 1 else [f"{request_id}-{i}" for i in range(body.n)]
    streams = [
        engine.submit(rid, prompt, _choice_params(params, i), split_think)
        for i, rid in enumerate(ids)
    ]

    def abort_all() -> None:  # a no-op for requests already finished
        for rid in ids:
            engine.abort(rid)

    deadline = _deadline(state, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = stream_sse(streams, kind, request_id, state.alias, include_usage)
        return StreamingResponse(
            _guard_stream(events, deadline, abort_all), media_type="text/event-stream"
        )
    try:
        return await _unless_gone(http, collect(streams, kind, request_id, state.alias), deadline)
    finally:
        abort_all()


async def _guard_stream(
    events: AsyncIterator[str], deadline: float | None, abort_all: Any
) -> AsyncIterator[str]:
    """The SSE stream, cut with an error event and [DONE] at the deadline; aborts on any exit.

    The deadline covers only the waits for the engine, never a `yield`: while the generator is
    suspended there, Starlette is sending, and a timeout firing then would cancel the send and
    end the stream with neither the error event nor [DONE]. Starlette cancels this generator
    when the client disconnects, which lands in `finally`.
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
                yield error_event(RequestTimeout(f"the request took longer than {deadline:g} s"))
                yield "data: [DONE]\n\n"
                return
            yield event
    finally:
        abort_all()


async def _unless_gone(http: Request, work: Awaitable[T], deadline: float | None) -> T:
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


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of n samples with seed + i, so a seeded request stays reproducible."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)
