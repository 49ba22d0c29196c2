"""The Ollama API (`/api/*`) on ferrum's port: Ollama's bodies are translated into the OpenAI
ones (`openai/bodies.py`), served by the same path (`serving.py`) and answered as Ollama's NDJSON.

The package:
- `bodies.py`: Ollama's request bodies and their translation into the OpenAI bodies.
- `answers.py`: /api/chat and /api/generate served and answered as Ollama's chunks.
- `models.py`: /api/tags, /api/show, /api/ps, and the store's /api/pull, /api/delete,
  /api/copy.
- `dialect.py`: Ollama's error shape and its bodies' translation (`ferrum.api.dialect`).
- here: the route registration that gives every error Ollama's shape, /api/version, `/` and
  the catch-all.

Every route is registered through `Route` (`_api`), so every error leaves as
`{"error": message}` with its `FerrumError`'s status; /api paths that ferrum does not serve
(create, push, blobs) are 404s. The routes are left out of the OpenAPI schema, which
documents the OpenAI dialect.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import re
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ferrum.api.ollama.answers import add_generation_routes
from ferrum.api.ollama.dialect import OLLAMA
from ferrum.api.ollama.embed import add_embed_routes
from ferrum.api.ollama.models import add_model_routes, add_store_routes
from ferrum.api.serving import ServerState
from ferrum.errors import ClientGone, FerrumError, NotFound

__all__ = ["Handler", "Route", "add_ollama_routes"]

log = logging.getLogger("ferrum.api")

Handler = Callable[[Request], Awaitable[Response]]
# Registers a handler as METHOD PATH: `route("POST", "/api/chat")(handler)`.
Route = Callable[[str, str], Callable[[Handler], Handler]]


def running() -> PlainTextResponse:
    """What `GET /` answers a client that is not a browser: Ollama's clients probe it."""
    return PlainTextResponse("ferrum is running (Ollama-compatible API on /api)")


def add_ollama_routes(app: FastAPI, state: ServerState) -> None:
    """The Ollama API's routes; any other /api path is a 404 in Ollama's shape."""
    route: Route = functools.partial(_api, app)
    add_generation_routes(route, state)
    add_embed_routes(route, state)
    add_model_routes(route, state)

    @route("GET", "/api/version")
    async def version(request: Request) -> Response:
        return JSONResponse({"version": _version()})

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> PlainTextResponse:
        return running()

    add_store_routes(route, state)

    @app.api_route(
        "/api/{path:path}",
        methods=["GET", "POST", "PUT", "DELETE", "HEAD"],
        include_in_schema=False,
    )
    async def unknown(request: Request) -> Response:
        return OLLAMA.error_response(NotFound(f"no such route: {request.url.path}"))


def _api(app: FastAPI, method: str, path: str) -> Callable[[Handler], Handler]:
    """Registers an Ollama route whose errors leave in Ollama's shape."""

    def register(fn: Handler) -> Handler:
        @functools.wraps(fn)
        async def handler(request: Request) -> Response:
            try:
                return await fn(request)
            except FerrumError as exc:
                if isinstance(exc, ClientGone):
                    log.info("%s %s: %s", method, path, exc.message)
                return OLLAMA.error_response(exc)

        app.add_api_route(path, handler, methods=[method], include_in_schema=False)
        return fn

    return register


def _version() -> str:
    """ferrum's version as MAJOR.MINOR.PATCH: clients compare Ollama versions as semver."""
    try:
        full = importlib.metadata.version("ferrum")
    except importlib.metadata.PackageNotFoundError:
        full = "0.0.0"
    m = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", full)
    return ".".join(p or "0" for p in m.groups()) if m else "0.0.0"
