"""/api/embed and the older /api/embeddings: Ollama's shapes over the same embedding path as
/v1/embeddings (`openai/embeddings.py`).

Rules: `/api/embed` truncates over-long inputs unless `truncate: false` (Ollama's default),
returns L2-normalised vectors in `embeddings`, and reports `prompt_eval_count` and its
durations in nanoseconds; `/api/embeddings` takes one `prompt` and returns one `embedding`.
`dimensions` follows /v1/embeddings' rule. A chat model that does not embed is a 400.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from ferrum.api.ollama.bodies import _Body, parse
from ferrum.api.openai.embeddings import deadline, embed_texts, embedder_of
from ferrum.api.serving import ServerState, acquire
from ferrum.errors import InvalidRequest

if TYPE_CHECKING:
    from ferrum.api.ollama import Route


class EmbedBody(_Body):
    model: str = ""
    input: str | Annotated[list[str], Field(min_length=1)]
    truncate: bool = True
    dimensions: Annotated[int, Field(ge=1)] | None = None
    keep_alive: str | float | None = None


class EmbeddingsBody(_Body):
    model: str = ""
    prompt: str
    keep_alive: str | float | None = None


def add_embed_routes(route: Route, state: ServerState) -> None:
    @route("POST", "/api/embed")
    async def embed(request: Request) -> Response:
        start = time.perf_counter_ns()
        body = await parse(request, EmbedBody)
        lease = await acquire(state, request, body.model, body.keep_alive)
        loaded = time.perf_counter_ns()
        try:
            n_embd = embedder_of(lease).info.n_embd
            if body.dimensions is not None and body.dimensions != n_embd:
                raise InvalidRequest(
                    f"model {lease.name!r} makes {n_embd}-dimensional vectors and was not "
                    "trained for shorter ones",
                    param="dimensions",
                )
            vectors, tokens = await embed_texts(
                lease, body.input, body.truncate, request, deadline(state)
            )
        finally:
            lease.release()
        end = time.perf_counter_ns()
        return JSONResponse(
            {
                "model": lease.name,
                "embeddings": [[float(x) for x in v] for v in vectors],
                "total_duration": end - start,
                "load_duration": loaded - start,
                "prompt_eval_count": tokens,
            }
        )

    @route("POST", "/api/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await parse(request, EmbeddingsBody)
        lease = await acquire(state, request, body.model, body.keep_alive)
        try:
            vectors, _ = await embed_texts(lease, body.prompt, True, request, deadline(state))
        finally:
            lease.release()
        return JSONResponse({"embedding": [float(x) for x in vectors[0]]})
