"""One completion request from HTTP to engine and back: model, n choices, deadline, hang-ups.

A request holds a lease on its model (`ferrum.models.registry`) from before its preparation
until its answer is sent, so the model cannot unload under it. Every way a request can end
early frees its engine requests and its lease: a client that hangs up (stream or not) and a
deadline that passes both abort them within one engine step (`hangups.py`). Each API
dialect (its package: `openai/`, `responses/`, `ollama/`, `anthropic/`) translates into
`prepare_*` and `submit`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request

from ferrum.api.auth import Caller, Keys, cache_scope, caller_of
from ferrum.api.hangups import HeldStream, guard_stream, unless_gone
from ferrum.api.loaded import Loaded, ServedModel
from ferrum.api.openai.answers import CompletionKind
from ferrum.api.openai.bodies import ChatCompletionRequest, CompletionRequest
from ferrum.api.prompting.chat_prompt import chat_messages, chat_prompt, parting_points
from ferrum.api.prompting.images import image_parts, prompt_with_images
from ferrum.api.prompting.preparation import light_body
from ferrum.api.prompting.tool_request import ToolRequest
from ferrum.engine.async_engine import AsyncEngine, RequestStream
from ferrum.engine.contracts import Vocabulary
from ferrum.engine.request import AdapterSet, ImageSpan, SamplingParams
from ferrum.errors import ContextLengthExceeded, InvalidRequest, RequestTimeout
from ferrum.models.adapters import LoraAdapter, adapter_set, files_scope
from ferrum.models.pull_workers import PullWorkers
from ferrum.models.registry import Lease, Registry
from ferrum.models.store import ModelStore
from ferrum.models.units import parse_duration
from ferrum.server_metrics import ServerMetrics

B = TypeVar("B", ChatCompletionRequest, CompletionRequest)
PrepareFn = Callable[[ServedModel, B, str], "Prepared"]  # (model, body, its cache scope)


@dataclass
class ServerState:
    """What every route shares: the registry of models and the server's settings."""

    models: Registry[Loaded]
    metrics: ServerMetrics
    store: ModelStore | None = None  # None: pulls and deletes through the API are refused
    pulls: PullWorkers = field(default_factory=PullWorkers)  # the threads pulls run on
    keys: Keys = field(default_factory=Keys)
    public_metrics: bool = False
    webui: bool = True  # the chat page at / and the dashboard (not --no-webui)
    share_prefix_cache: bool = False  # --share-prefix-cache: one cache scope for every key
    max_keep_alive: float = 3600.0  # --max-keep-alive: the most a user key may ask for
    split_think: bool = True
    request_timeout: float = 0.0  # --request-timeout; 0: none
    responses_store_bytes: int = 64 * 1024 * 1024  # --responses-store; 0: responses not kept
    lora_dirs: tuple[str, ...] = ()  # --lora-dir: where an admin may load adapters from
    created: int = 0


@dataclass(frozen=True)
class Prepared:
    """A request made ready for the engine: its prompt tokens, response kind and grammar."""

    prompt: list[int]
    kind: CompletionKind
    grammar: str | None = None
    images: tuple[ImageSpan, ...] = ()  # image rows at their prompt positions
    checkpoints: tuple[int, ...] = ()  # where later prompts may part from it (`parting_points`)


def prepare_chat(model: ServedModel, body: ChatCompletionRequest, scope: str) -> Prepared:
    """The prompt (tools carried by the template, images encoded as `scope`'s), the response
    kind and the grammar, if any. Rendering, tokenizing, encoding and grammar building take
    CPU time: call it in a worker thread (`prepare`), never on the event loop.

    A forced tool choice and a JSON response_format would each need their own grammar over
    the same output, so they are refused together."""
    body.reject_unsupported()
    text_bytes = sum(utf8_length(m.text()) for m in body.messages)
    refuse_unfit_text(model.vocab, text_bytes, model.info.request_ctx, "messages")
    tools = ToolRequest.from_body(body.tools, body.tool_choice, body.parallel_tool_calls)
    if template_tools := tools.template_tools():  # the prompt holds them too, as JSON or text
        text_bytes += utf8_length(json.dumps(template_tools, ensure_ascii=False))
        refuse_unfit_text(model.vocab, text_bytes, model.info.request_ctx, "tools")
    spans: tuple[ImageSpan, ...] = ()
    marks: tuple[int, ...] = ()
    if parts := image_parts(body.messages):
        encoder = None if model.images is None else model.images.scoped(scope)
        prompt, spans = prompt_with_images(
            model.name, encoder, parts, model.vocab.tokenize,
            lambda marked: chat_prompt(model.formatter, model.vocab, model.system, body, tools,
                                       marked),
        )  # fmt: skip
    else:
        messages = chat_messages(model.system, body)
        prompt, starts = model.formatter.tokenize_parts(
            messages, model.vocab.tokenize, template_tools
        )
        marks = parting_points(starts)
    fmt = model.formatter.tool_format
    grammar = model.grammars.for_tools(tools, fmt)
    if grammar is None:
        grammar = model.grammars.for_request(body.response_format, body)
    elif model.grammars.for_request(body.response_format, body) is not None:
        raise InvalidRequest(
            "response_format cannot be combined with a tool_choice that forces a call",
            param="response_format",
        )
    kind = CompletionKind(
        chat=True,
        token_bytes=model.vocab.token_bytes,
        tool_format=fmt if tools.active else None,
    )
    return Prepared(prompt, kind, grammar, spans, marks)


def prepare_completion(model: ServedModel, body: CompletionRequest, scope: str) -> Prepared:
    """The prompt of a text completion: its text tokenized, or its token ids checked."""
    body.reject_unsupported()
    prompt_in = body.prompt_input()
    if isinstance(prompt_in, str):
        refuse_unfit_text(model.vocab, utf8_length(prompt_in), model.info.request_ctx, "prompt")
        prompt = model.vocab.tokenize(prompt_in, True, True)
    else:
        prompt = check_token_ids(model.info.n_vocab, prompt_in, "prompt")
    grammar = model.grammars.for_request(None, body)
    kind = CompletionKind(chat=False, token_bytes=model.vocab.token_bytes)
    return Prepared(prompt, kind, grammar)


def utf8_length(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def refuse_unfit_text(vocab: Vocabulary, n_bytes: int, max_tokens: int, param: str) -> None:
    """Refuses, before any tokenizing, a text too long to be `max_tokens` tokens: tokenizing
    megabytes takes seconds of the thread that prepares every model's requests. A text
    within this bound may still not fit; the tokens decide that."""
    limit = max_tokens * vocab.max_token_bytes()
    if n_bytes > limit:
        raise ContextLengthExceeded(
            f"the {param} text is {n_bytes} bytes: more than {max_tokens} tokens of this "
            f"model can hold ({limit} bytes at most)",
            param=param,
        )


def check_token_ids(n_vocab: int, tokens: list[int], param: str) -> list[int]:
    if any(not 0 <= t < n_vocab for t in tokens):
        raise InvalidRequest(f"token ids must be in [0, {n_vocab})", param=param)
    return list(tokens)


async def prepare(
    state: ServerState, prepare_fn: PrepareFn[B], model: ServedModel, body: B, http: Request
) -> Prepared:
    """Runs request preparation off the event loop, which every open stream is waiting on, in
    turns with the decodes (`ferrum.api.prompting.preparation`); a short body's at once."""
    light = light_body(http.headers.get("content-length"))
    scope = cache_scope(caller_of(http), body.cache_salt, state.share_prefix_cache)  # submit's
    return await model.preparer.run(functools.partial(prepare_fn, model, body, scope), light)


def keep_alive_seconds(value: str | float | None, param: str = "keep_alive") -> float | None:
    """A request's keep_alive as seconds (None: the model's or server's default)."""
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise InvalidRequest(f"{param}: {exc}", param=param) from exc


async def acquire(
    state: ServerState, http: Any, name: str, keep_alive: str | float | None = None
) -> Lease[Loaded]:
    """The named model, loaded if need be; the caller must release the lease (or hand it to
    `complete`, which always does). A keep_alive from a caller who is not an admin is bounded
    (`Registry.acquire`): one user cannot pin a model for everyone, nor unload it under them."""
    seconds = keep_alive_seconds(keep_alive)
    free = caller_of(http).admin or state.max_keep_alive < 0
    bound = None if free else state.max_keep_alive
    return await state.models.acquire(name, seconds, bound)


async def acquire_chat(
    state: ServerState, http: Any, name: str, keep_alive: str | float | None = None
) -> Lease[ServedModel]:
    """`acquire` for the routes that generate: an embedding model is a 400 naming it."""
    lease = await acquire(state, http, name, keep_alive)
    model = lease.model
    if not isinstance(model, ServedModel):
        lease.release()
        raise InvalidRequest(
            f"model {lease.name!r} is an embedding model: it answers /v1/embeddings and "
            "/v1/rerank, not chats or completions",
            param="model",
        )
    return Lease(lease.name, model, lease.release)


@dataclass
class Submission:
    """n engine requests for one prompt (they share its prefill), and how to abort them."""

    request_id: str
    streams: list[RequestStream]
    ids: list[str]
    engine: AsyncEngine

    def abort_all(self) -> None:  # a no-op for requests already finished
        for rid in self.ids:
            self.engine.abort(rid)


def with_defaults(model: ServedModel, body: B) -> B:
    """The body with the model preset's sampling defaults in the fields it does not set."""
    defaults = {k: v for k, v in model.sampling.items() if k not in body.model_fields_set}
    return body.model_copy(update=defaults) if defaults else body


def submit(
    state: ServerState,
    caller: Caller,
    model: ServedModel,
    body: ChatCompletionRequest | CompletionRequest,
    prepared: Prepared,
    whole: bool,
) -> Submission:
    """The request's n choices on the engine; `whole`: the answer is not streamed, so each
    choice's stream holds one output, the finished one. The caller decides the request's
    cache scope and whom its decode slots count against (the key; per request on a server
    without keys)."""
    engine = model.engine
    prompt, kind = prepared.prompt, prepared.kind
    engine.check_capacity(body.n)
    max_tokens = body.requested_max_tokens()
    if max_tokens is None and model.default_max_tokens > 0:
        max_tokens = model.default_max_tokens
    try:
        max_tokens = engine.clamp_max_tokens(len(prompt), max_tokens)
        engine.check_images(prepared.images)
    except InvalidRequest as exc:  # the engine says "prompt": a chat's is its messages
        if not kind.chat:
            raise
        raise type(exc)(exc.message, param="messages") from None
    params = body.sampling_params(max_tokens, model.info.n_vocab, prepared.grammar)
    request_id = ("chatcmpl-" if kind.chat else "cmpl-") + uuid.uuid4().hex
    adapters = request_adapters(model, body)  # KV is scoped by their files too
    scope = cache_scope(caller, body.cache_salt, state.share_prefix_cache)  # as `prepare`'s
    scope += files_scope(model.adapters, adapters)
    params = dataclasses.replace(
        params, cache_scope=scope, tenant=caller.tenant or request_id, adapters=adapters
    )
    split_think = state.split_think and kind.chat
    ids = [request_id] if body.n == 1 else [f"{request_id}-{i}" for i in range(body.n)]
    streams = [
        engine.submit(
            rid, prompt, _choice_params(params, i), split_think, whole, prepared.images,
            prepared.checkpoints,
        )  # fmt: skip
        for i, rid in enumerate(ids)
    ]
    return Submission(request_id, streams, ids, engine)


def request_adapters(
    model: ServedModel, body: ChatCompletionRequest | CompletionRequest
) -> AdapterSet:
    """The LoRA set a request decodes with: the adapter its model name picks (`BASE:NAME`)
    and its `lora` entries; a 404 or 400 for an adapter or scale the model cannot serve."""
    return pick_adapters(model.name, model.adapters, body)


def pick_adapters(
    name: str, adapters: tuple[LoraAdapter, ...], body: ChatCompletionRequest | CompletionRequest
) -> AdapterSet:
    """`request_adapters` for model `name` serving `adapters` (a cluster's ingress computes
    the same set for its route key: `ferrum.cluster.keys`)."""
    listed = [(c.id, c.scale) for c in body.lora or ()]
    if not adapters:
        if listed:
            raise InvalidRequest(f"model {name!r} serves no LoRA adapters", param="lora")
        return ()
    # The registry resolved `BASE:NAME` (or a bare NAME) to this model, 404 for a NAME it
    # lacks: what is left is which of its adapters the name picks, if any.
    wanted = body.model.rpartition(":")[2]
    named = next((i for i, a in enumerate(adapters) if a.name == wanted and not a.removed), None)
    if named is None and body.lora is None:  # the scales POST /lora-adapters set (default 0)
        listed = [(i, a.default) for i, a in enumerate(adapters) if a.default and not a.removed]
    return adapter_set(adapters, named, listed)


def deadline(state: ServerState, body: ChatCompletionRequest | CompletionRequest) -> float | None:
    limits = [t for t in (state.request_timeout, body.timeout or 0.0) if t > 0]
    return min(limits) if limits else None


class Reply(Protocol):
    """How one request's submission is answered in a dialect: its n streams read as the
    dialect's answer, whole or streamed (`serve_request`)."""

    @property
    def stream(self) -> bool: ...

    @property
    def media_type(self) -> str: ...

    def begin(self, prepared: Prepared) -> None:
        """Called with the prepared prompt, just before it is submitted."""

    def lines(self, sub: Submission, prepared: Prepared) -> AsyncIterator[str]:
        """The streamed answer; a failure ends it in the dialect's own error shape."""
        ...

    def whole(self, sub: Submission, prepared: Prepared) -> Awaitable[Any]: ...

    def timeout_lines(self, err: RequestTimeout) -> list[str]:
        """How a stream that has begun ends when its deadline passes."""
        ...


async def serve_request(
    state: ServerState,
    http: Request,
    lease: Lease[ServedModel],
    body: B,
    prepare_fn: PrepareFn[B],
    reply: Reply,
) -> Any:
    """Prepares, submits and answers one request on the leased model, in every dialect: the
    lease is released when the answer is sent or the request fails, however that happens
    (a hang-up, the deadline); an error before submission is raised as it is, for the
    dialect to shape."""
    try:
        model = lease.model
        body = with_defaults(model, body)
        prepared = await prepare(state, prepare_fn, model, body, http)
        reply.begin(prepared)
        sub = submit(state, caller_of(http), model, body, prepared, whole=not reply.stream)
    except BaseException:
        lease.release()
        raise
    limit = deadline(state, body)
    if reply.stream:

        def close() -> None:
            sub.abort_all()
            lease.release()

        lines = guard_stream(reply.lines(sub, prepared), limit, sub.abort_all, reply.timeout_lines)
        return HeldStream(lines, close, media_type=reply.media_type)
    try:
        return await unless_gone(http, reply.whole(sub, prepared), limit)
    finally:
        sub.abort_all()
        lease.release()


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of n samples with seed + i, so a seeded request stays reproducible."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)
