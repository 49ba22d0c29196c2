"""The HTTP API: OpenAI-compatible routes over the AsyncEngine, beside the Ollama and
Anthropic dialects.

Every route also answers without its `/v1` prefix. Every error, including FastAPI's own
validation and routing errors, leaves as an OpenAI-shaped body with a 4xx status, except on
the Anthropic Messages paths, where it takes Anthropic's shape, and on Ollama's /api paths,
where it takes Ollama's (`error_response` decides, for the gate's errors too).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ferrum.api.anthropic import add_anthropic_routes, speaks_anthropic
from ferrum.api.anthropic import error_response as anthropic_error
from ferrum.api.auth import Keys, caller_of, remember
from ferrum.api.body_text import SurrogateCheck
from ferrum.api.embeddings import EmbeddingRequest, RerankRequest, embeddings, rerank
from ferrum.api.loaded import Loaded, ServedModel
from ferrum.api.ollama import add_ollama_routes, speaks_ollama
from ferrum.api.ollama import error_response as ollama_error
from ferrum.api.ollama import running as ollama_running
from ferrum.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    invalid_request,
)
from ferrum.api.responses_api import add_responses_routes
from ferrum.api.serving import (
    ServerState,
    acquire,
    acquire_chat,
    check_token_ids,
    complete,
    prepare_chat,
    prepare_completion,
    refuse_unfit_text,
    utf8_length,
)
from ferrum.api.slots import add_slots_routes
from ferrum.api.transport import BodyCap, needs_cap, too_large
from ferrum.errors import (
    AuthenticationError,
    ClientGone,
    ContextLengthExceeded,
    FerrumError,
    InvalidRequest,
    NotFound,
    RequestTooLarge,
    TooManyRequests,
)
from ferrum.metrics import CONTENT_TYPE
from ferrum.models.errors import ModelNotFound
from ferrum.models.registry import ModelSpec
from ferrum.web import add_pages, is_page

log = logging.getLogger("ferrum.api")

MAX_BODY_BYTES = 16 * 1024 * 1024

__all__ = ["ServerState", "create_app"]


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


def error_response(exc: FerrumError, path: str) -> JSONResponse:
    """An error in the shape of the API its path belongs to (Anthropic's, Ollama's or
    OpenAI's)."""
    if speaks_anthropic(path):
        response = anthropic_error(exc)
    elif speaks_ollama(path):
        response = ollama_error(exc)
    else:
        headers = {"Retry-After": "1"} if isinstance(exc, TooManyRequests) else None
        response = JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)
    if isinstance(exc, RequestTooLarge):
        # The body's unread rest is still coming: closing the connection stops it, where
        # keep-alive would make the server read it all to find the next request.
        response.headers["connection"] = "close"
    return response


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(FerrumError)
    async def _ferrum(request: Request, exc: FerrumError) -> JSONResponse:
        if isinstance(exc, ClientGone):
            log.info("%s %s: %s", request.method, request.url.path, exc.message)
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(invalid_request(exc.errors()), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(NotFound("no such route"), request.url.path)
        err = InvalidRequest(str(exc.detail))
        err.status = exc.status_code
        return error_response(err, request.url.path)


def check_gate(keys: Keys, public_metrics: bool, request: Request) -> None:
    """The API key and the body size, as every route checks them first (a cluster's ingress
    too, before it reads a body). The caller found is kept in the request's scope for the
    routes (`auth.caller_of`). /health answers without a key (liveness only, `health`), and
    so do the browser pages (`ferrum.web`); /slots never does."""
    path = request.url.path
    try:
        remember(request.scope, keys.caller(request.headers))
    except AuthenticationError:
        # The browser pages hold no data; the routes they call need a key.
        public = path == "/health" or is_page(path)
        if public or (path in ("/metrics", "/props") and public_metrics):
            pass
        else:
            client = request.client.host if request.client else "?"
            log.warning("refused %s %s from %s: invalid or missing API key",
                        request.method, path, client)  # fmt: skip
            raise
    _check_body_size(request)


def _check_body_size(request: Request) -> None:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        raise too_large(MAX_BODY_BYTES)


class _Gate:
    """API key and body size, checked before routing; a body of no declared length is
    counted as it arrives (`transport.BodyCap`).

    A plain ASGI middleware: FastAPI's `@app.middleware("http")` wraps `receive`, which hides
    client disconnects from handlers and adds a hop to every streamed chunk. A request with a
    declared length passes through untouched.
    """

    def __init__(self, app: Any, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            try:
                check_gate(self.state.keys, self.state.public_metrics, request)
            except FerrumError as exc:
                await error_response(exc, request.url.path)(scope, receive, send)
                return
            if needs_cap(scope["headers"]):
                await self._capped(scope, receive, send, request.url.path)
                return
        await self.app(scope, receive, send)

    async def _capped(self, scope: Any, receive: Any, send: Any, path: str) -> None:
        cap = BodyCap(receive, send, MAX_BODY_BYTES)
        try:
            await self.app(scope, cap.receive, cap.send)
        except Exception:
            if not cap.over:
                raise
        if cap.over:  # whatever the route made of the cut body was dropped: this answers
            log.info("refused %s %s: body over %d bytes", scope["method"], path, MAX_BODY_BYTES)
            await error_response(too_large(MAX_BODY_BYTES), path)(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.models.start()
        # The default model loads now: the first request should not wait for it, and a
        # model that cannot load stops the server at start-up, not at its first request.
        lease = await state.models.acquire(state.models.default)
        lease.release()
        yield
        state.pulls.close()
        await state.models.close()

    app = FastAPI(title="ferrum", lifespan=lifespan)
    app.state.ferrum = state
    state.created = int(time.time())
    _install_error_handlers(app)

    # Added first, so it runs inside the gate: a body is read only once the key passed.
    app.add_middleware(SurrogateCheck, respond=error_response)
    app.add_middleware(_Gate, state=state)

    _add_routes(app, state)
    return app


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def _route(app: FastAPI, method: str, path: str) -> Callable[[Handler], Handler]:
    """Registers a handler under `path` and, for /v1 routes, also without the prefix."""

    def register(fn: Handler) -> Handler:
        app.add_api_route(path, fn, methods=[method], responses=_ERROR_RESPONSES)
        if path.startswith("/v1/"):
            app.add_api_route(path[3:], fn, methods=[method], include_in_schema=False)
        return fn

    return register


def _add_routes(app: FastAPI, state: ServerState) -> None:
    if state.webui:  # first: its `/` answers browsers before the Ollama API's does
        add_pages(app, plain=ollama_running)
    _add_openai_routes(app, state)
    _add_server_routes(app, state)
    add_responses_routes(functools.partial(_route, app), state)
    add_ollama_routes(app, state)
    add_anthropic_routes(app, state)
    add_slots_routes(app, state)


def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    """OpenAI's generation, embedding and model-listing routes (and /v1/rerank beside them)."""

    @_route(app, "POST", "/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        lease = await acquire_chat(state, request, body.model, body.keep_alive)
        return await complete(state, request, body, prepare_chat, lease)

    @_route(app, "POST", "/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        lease = await acquire_chat(state, request, body.model, body.keep_alive)
        return await complete(state, request, body, prepare_completion, lease)

    @_route(app, "POST", "/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
        return await embeddings(state, request, body)

    @_route(app, "POST", "/v1/rerank")
    async def create_rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
        return await rerank(state, request, body)

    @_route(app, "GET", "/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state, s) for s in state.models.specs()]}

    @_route(app, "GET", "/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        spec = state.models.lookup(model_id)
        if spec is None:
            raise ModelNotFound(model_id, [s.name for s in state.models.specs()])
        return _model_card(state, spec)


def _add_server_routes(app: FastAPI, state: ServerState) -> None:
    """The server's own routes: health, metrics and the tokenizer."""

    @_route(app, "GET", "/health")
    async def health(request: Request) -> JSONResponse:
        loaded = state.models.loaded()
        ok = all(m.model.alive for m in loaded)
        if state.keys.required and not caller_of(request).tenant:
            # Liveness for anyone (a load balancer's probe); which models run, their load
            # and cache figures only for a key.
            return JSONResponse({"status": "ok" if ok else "error"}, 200 if ok else 503)
        per_model = {m.spec.name: state.metrics.snapshot(m.spec.name) for m in loaded}
        body = {
            "status": "ok" if ok else "error",
            "model": state.models.default,
            **_sum_snapshots(list(per_model.values())),
            "models": per_model,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @_route(app, "GET", "/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @_route(app, "POST", "/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        lease = await acquire(state, request, body.model)
        try:
            model = lease.model
            refuse_unfit_text(model.vocab, utf8_length(body.content), _n_ctx(model), "content")
            tokens = await asyncio.to_thread(
                lease.model.vocab.tokenize, body.content, body.add_special, body.parse_special
            )
        finally:
            lease.release()
        return {"tokens": tokens}

    @_route(app, "POST", "/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        lease = await acquire(state, request, body.model)
        try:
            model = lease.model
            if len(body.tokens) > _n_ctx(model):
                # No sequence of this model is longer; joining millions of ids takes seconds.
                raise ContextLengthExceeded(
                    f"{len(body.tokens)} tokens; this model's context holds {_n_ctx(model)}",
                    param="tokens",
                )
            tokens = check_token_ids(_n_vocab(model), body.tokens, "tokens")
            data = await asyncio.to_thread(b"".join, map(model.vocab.token_bytes, tokens))
        finally:
            lease.release()
        return {"content": data.decode("utf-8", "replace")}


def _sum_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Several models' /health figures as one: counts add up, the KV use ratio is the
    highest."""
    total: dict[str, Any] = {}
    for snap in snapshots:
        for key, value in snap.items():
            if isinstance(value, dict):
                total[key] = _sum_snapshots([total.get(key, {}), value])
            elif key.endswith("_ratio"):
                total[key] = max(total.get(key, 0), value)
            else:
                total[key] = total.get(key, 0) + value
    return total


def _n_vocab(model: Loaded) -> int:
    return model.info.n_vocab if isinstance(model, ServedModel) else model.embedder.info.n_vocab


def _n_ctx(model: Loaded) -> int:
    return model.info.n_ctx if isinstance(model, ServedModel) else model.embedder.info.max_tokens


def _model_card(state: ServerState, spec: ModelSpec) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": spec.name,
        "object": "model",
        "created": int(spec.created) or state.created,
        "owned_by": spec.source.partition(":")[0] or "ferrum",
        "loaded": False,
    }
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
                "n_ctx": info.n_ctx,
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
