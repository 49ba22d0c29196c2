"""The HTTP API's assembly: the gate (API key, body size), the error handlers, and the routes
of each dialect (`openai/`, `responses/`, `ollama/`, `anthropic/`) and the server's own
(`server_routes.py`).

Every /v1 route also answers without its `/v1` prefix. Every error, including FastAPI's own
validation and routing errors, leaves as an OpenAI-shaped body with a 4xx status, except on
the Anthropic Messages paths, where it takes Anthropic's shape, and on Ollama's /api paths,
where it takes Ollama's (`dialects.dialect_for` decides, for the gate's errors too).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ferrum.api.anthropic import add_anthropic_routes
from ferrum.api.auth import Keys, remember
from ferrum.api.body_text import SurrogateCheck
from ferrum.api.dialects import error_response
from ferrum.api.lora_routes import add_lora_routes
from ferrum.api.ollama import add_ollama_routes
from ferrum.api.ollama import running as ollama_running
from ferrum.api.openai.bodies import invalid_request
from ferrum.api.openai.routes import add_openai_routes, route
from ferrum.api.responses import add_responses_routes
from ferrum.api.server_routes import add_server_routes
from ferrum.api.serving import ServerState
from ferrum.api.slots import add_slots_routes
from ferrum.api.transport import BodyCap, needs_cap, too_large
from ferrum.errors import AuthenticationError, ClientGone, FerrumError, InvalidRequest, NotFound
from ferrum.web import add_pages, is_page

log = logging.getLogger("ferrum.api")

MAX_BODY_BYTES = 16 * 1024 * 1024

__all__ = ["ServerState", "create_app", "error_response"]


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
        path = request.url.path
        # A 405 says the path exists with another method; a path that only fits a route's
        # template (POST /v1/responses/compact against GET /v1/responses/{response_id}) is
        # no route at all, and a client reading 405 would think it called it wrongly.
        if exc.status_code == 404 or (exc.status_code == 405 and not _is_route(app, path)):
            return error_response(NotFound("no such route"), path)
        err = InvalidRequest(str(exc.detail))
        err.status = exc.status_code
        return error_response(err, request.url.path)


def _is_route(app: FastAPI, path: str) -> bool:
    """`path` is one of the app's routes as written, not through a path parameter."""
    return any(getattr(route, "path", None) == path for route in app.router.routes)


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


def _add_routes(app: FastAPI, state: ServerState) -> None:
    """Each dialect's routes, the server's own, and the browser pages."""
    if state.webui:  # first: its `/` answers browsers before the Ollama API's does
        add_pages(app, plain=ollama_running)
    add_openai_routes(app, state)
    add_server_routes(app, state)
    add_responses_routes(functools.partial(route, app), state)
    add_ollama_routes(app, state)
    add_anthropic_routes(app, state)
    add_slots_routes(app, state)
    add_lora_routes(app, state)
