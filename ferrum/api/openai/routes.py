"""OpenAI's routes: chat and text completions (`complete`: n choices answered as a
`Completion` through the serve path every dialect shares), embeddings and rerank
(`embeddings.py`), the model list; and `route`, which registers a route under `/v1` and
without it, its errors documented as they leave (OpenAI's shape, a bad body a 400)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel

from ferrum.api.loaded import ServedModel
from ferrum.api.openai.answers import collect, stream_sse
from ferrum.api.openai.bodies import ChatCompletionRequest, CompletionRequest
from ferrum.api.openai.dialect import OPENAI
from ferrum.api.openai.embeddings import EmbeddingRequest, RerankRequest, embeddings, rerank
from ferrum.api.serving import (
    Prepared,
    PrepareFn,
    ServerState,
    Submission,
    acquire_chat,
    prepare_chat,
    prepare_completion,
    serve_request,
)
from ferrum.errors import RequestTimeout
from ferrum.models.adapters import adapter_names
from ferrum.models.errors import ModelNotFound
from ferrum.models.projectors import capabilities
from ferrum.models.registry import Lease, ModelSpec

__all__ = ["Completion", "add_openai_routes", "complete", "route"]

B = TypeVar("B", ChatCompletionRequest, CompletionRequest)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error response (`FerrumError.to_dict()`), as the OpenAPI schema documents it."""

    error: ErrorDetail


# The schema documents errors as they really leave: OpenAI-shaped, a bad body is a 400. Without
# this FastAPI documents a 422 validation body that this API never sends.
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorBody, "description": "OpenAI-shaped client error"},
    "5XX": {"model": ErrorBody, "description": "OpenAI-shaped server error"},
}


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def route(app: FastAPI, method: str, path: str) -> Callable[[Handler], Handler]:
    """Registers a handler under `path` and, for /v1 routes, also without the prefix."""

    def register(fn: Handler) -> Handler:
        app.add_api_route(path, fn, methods=[method], responses=_ERROR_RESPONSES)
        if path.startswith("/v1/"):
            app.add_api_route(path[3:], fn, methods=[method], include_in_schema=False)
        return fn

    return register


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    """OpenAI's generation, embedding and model-listing routes (and /v1/rerank beside them)."""

    @route(app, "POST", "/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        lease = await acquire_chat(state, request, body.model, body.keep_alive)
        return await complete(state, request, body, prepare_chat, lease)

    @route(app, "POST", "/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        lease = await acquire_chat(state, request, body.model, body.keep_alive)
        return await complete(state, request, body, prepare_completion, lease)

    @route(app, "POST", "/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
        return await embeddings(state, request, body)

    @route(app, "POST", "/v1/rerank")
    async def create_rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
        return await rerank(state, request, body)

    @route(app, "GET", "/v1/models")
    async def models() -> dict[str, Any]:
        cards = [c for s in state.models.specs() for c in _cards(state, s)]
        return {"object": "list", "data": cards}

    @route(app, "GET", "/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        spec = state.models.lookup(model_id)
        if spec is None:
            raise ModelNotFound(model_id, [s.name for s in state.models.specs()])
        return _model_card(state, spec)


@dataclass(frozen=True)
class Completion:
    """OpenAI's answer to a chat or text completion: n choices, whole or as SSE chunks."""

    name: str
    stream: bool
    include_usage: bool
    media_type: str = "text/event-stream"

    def begin(self, prepared: Prepared) -> None:
        pass

    def lines(self, sub: Submission, prepared: Prepared) -> AsyncIterator[str]:
        return stream_sse(sub.streams, prepared.kind, sub.request_id, self.name, self.include_usage)

    def whole(self, sub: Submission, prepared: Prepared) -> Awaitable[dict[str, Any]]:
        return collect(sub.streams, prepared.kind, sub.request_id, self.name)

    def timeout_lines(self, err: RequestTimeout) -> list[str]:
        return [OPENAI.stream_error(err), "data: [DONE]\n\n"]


async def complete(
    state: ServerState,
    http: Request,
    body: B,
    prepare_fn: PrepareFn[B],
    lease: Lease[ServedModel],
) -> Any:
    """An OpenAI request served on the leased model (`serve_request`), n choices."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    reply = Completion(lease.name, body.stream, include_usage)
    return await serve_request(state, http, lease, body, prepare_fn, reply)


def _cards(state: ServerState, spec: ModelSpec) -> list[dict[str, Any]]:
    """A model's card, then one per LoRA adapter served on it (`BASE:NAME`, its `parent`
    the base, as vLLM lists adapters)."""
    card = _model_card(state, spec)
    adapters = [
        {**card, "id": name, "parent": spec.name, "meta": None} for name in adapter_names(spec)
    ]
    return [card, *adapters]


def _model_card(state: ServerState, spec: ModelSpec) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": spec.name,
        "object": "model",
        "created": int(spec.created) or state.created,
        "owned_by": spec.source.partition(":")[0] or "ferrum",
        "loaded": False,
    }
    if seen := capabilities(spec):
        card["capabilities"] = seen
    for m in state.models.loaded():
        if m.spec.name != spec.name:
            continue
        card["loaded"] = True
        model = m.model
        if isinstance(model, ServedModel):
            info = model.info
            card["meta"] = {
                "architecture": info.architecture,
                "description": info.description,
                "n_ctx": info.request_ctx,
                "n_ctx_train": info.n_ctx_train,
                "n_vocab": info.n_vocab,
            }
        else:
            facts = model.embedder.info
            card["meta"] = {
                "architecture": facts.architecture,
                "description": facts.description,
                "embedding": True,
                "n_embd": facts.n_embd,
                "pooling": facts.pooling,
                "max_input_tokens": facts.max_tokens,
                "n_vocab": facts.n_vocab,
            }
    return card
