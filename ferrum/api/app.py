"""The HTTP API: OpenAI-compatible routes over the AsyncEngine.

Every route also answers without its `/v1` prefix. Every error, including FastAPI's own
validation and routing errors, leaves as an OpenAI-shaped body with a 4xx status.
"""

from __future__ import annotations

import asyncio
import hmac
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

from ferrum.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    invalid_request,
)
from ferrum.api.serving import (
    ServerState,
    check_token_ids,
    complete,
    prepare,
    prepare_chat,
    prepare_completion,
)
from ferrum.errors import (
    AuthenticationError,
    ClientGone,
    FerrumError,
    InvalidRequest,
    NotFound,
    RequestTooLarge,
    TooManyRequests,
)
from ferrum.metrics import CONTENT_TYPE

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


def _error_response(exc: FerrumError) -> JSONResponse:
    headers = {"Retry-After": "1"} if isinstance(exc, TooManyRequests) else None
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(FerrumError)
    async def _ferrum(request: Request, exc: FerrumError) -> JSONResponse:
        if isinstance(exc, ClientGone):
            log.info("%s %s: %s", request.method, request.url.path, exc.message)
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(invalid_request(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error_response(NotFound("no such route"))
        err = InvalidRequest(str(exc.detail))
        err.status = exc.status_code
        return _error_response(err)


def _check_api_key(state: ServerState, request: Request) -> None:
    path = request.url.path
    if not state.api_keys or path == "/health" or (path == "/metrics" and state.public_metrics):
        return
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    # compare_digest against every key: the time taken does not say which key came close.
    ok = scheme.lower() == "bearer" and any(
        hmac.compare_digest(key.strip().encode(), k.encode()) for k in state.api_keys
    )
    if not ok:
        raise AuthenticationError("invalid or missing API key")


def _check_body_size(request: Request) -> None:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        raise RequestTooLarge(f"request bodies are limited to {MAX_BODY_BYTES} bytes")


class _Gate:
    """API key and body size, checked before routing.

    A plain ASGI middleware: FastAPI's `@app.middleware("http")` wraps `receive`, which hides
    client disconnects from handlers and adds a hop to every streamed chunk.
    """

    def __init__(self, app: Any, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            try:
                _check_api_key(self.state, request)
                _check_body_size(request)
            except FerrumError as exc:
                await _error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        yield
        await state.engine.stop()

    app = FastAPI(title="ferrum", lifespan=lifespan)
    app.state.ferrum = state
    state.created = int(time.time())
    _install_error_handlers(app)

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
    @_route(app, "POST", "/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        prepared = await prepare(prepare_chat, state, body)
        return await complete(state, request, body, prepared)

    @_route(app, "POST", "/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        prepared = await prepare(prepare_completion, state, body)
        return await complete(state, request, body, prepared)

    @_route(app, "GET", "/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @_route(app, "GET", "/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != state.alias:
            raise NotFound(f"model {model_id!r} is not served here (try {state.alias!r})")
        return _model_card(state)

    @_route(app, "GET", "/health")
    async def health() -> JSONResponse:
        ok = state.engine.alive
        body = {"status": "ok" if ok else "error", "model": state.alias, **state.metrics.snapshot()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @_route(app, "GET", "/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @_route(app, "POST", "/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        vocab = state.vocab
        tokens = await asyncio.to_thread(
            vocab.tokenize, body.content, body.add_special, body.parse_special
        )
        return {"tokens": tokens}

    @_route(app, "POST", "/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        tokens = check_token_ids(state, body.tokens, "tokens")
        data = b"".join(state.vocab.token_bytes(t) for t in tokens)
        return {"content": data.decode("utf-8", "replace")}


def _model_card(state: ServerState) -> dict[str, Any]:
    info = state.info
    return {
        "id": state.alias,
        "object": "model",
        "created": state.created,
        "owned_by": "ferrum",
        "meta": {
            "architecture": info.architecture,
            "description": info.description,
            "n_ctx": info.n_ctx,
            "n_ctx_train": info.n_ctx_train,
            "n_vocab": info.n_vocab,
        },
    }
