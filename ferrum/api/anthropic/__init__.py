"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`, and both
without `/v1`) on ferrum's port: Anthropic's bodies are translated into the OpenAI chat body
(`openai/bodies.py`) and served by the same path (`generation.serve`: preset defaults, the chat
template, tool-call parsing, grammars, the deadline, the lease), then answered as
Anthropic's message object or its events.

The package:
- `bodies.py`: the request bodies and their translation into the OpenAI chat body.
- `answers.py`: the message object, whole or streamed as Anthropic's server-sent events.
- `dialect.py`: Anthropic's error shape, which the app gives every error on these paths (the
  API key and body-size gate's included), and the body's translation (`ferrum.api.dialect`).
- here: the routes.

The `anthropic-version` header is accepted and not required: one shape is served whatever
it says. The API key may come as `x-api-key` (Anthropic's clients) or as a bearer token. The
routes are left out of the OpenAPI schema, which documents the OpenAI dialect.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ferrum.api.anthropic.answers import MessageAnswer
from ferrum.api.anthropic.bodies import (
    CountTokensBody,
    MessagesBody,
    chat_request,
    image_params,
    parse,
    renamed,
)
from ferrum.api.generation import serve
from ferrum.api.serving import ServerState, acquire_chat, prepare, prepare_chat
from ferrum.errors import InvalidRequest

__all__ = ["add_anthropic_routes"]


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    async def messages(request: Request) -> Response:
        body = await parse(request, MessagesBody)
        openai = chat_request(body)
        images = image_params(body, openai)
        lease = await acquire_chat(state, request, body.model)
        stops = tuple(body.stop_sequences or ())
        answer = MessageAnswer(lease.name, body.stream, body.shows_thinking, stops)
        try:
            return await serve(state, request, lease, openai, prepare_chat, answer)
        except InvalidRequest as exc:
            raise renamed(exc, images) from None

    async def count_tokens(request: Request) -> Response:
        """The prompt's length as the chat template renders it, tools included."""
        body = await parse(request, CountTokensBody)
        openai = chat_request(body)
        images = image_params(body, openai)
        lease = await acquire_chat(state, request, body.model)
        try:
            prepared = await prepare(state, prepare_chat, lease.model, openai, request)
        except InvalidRequest as exc:
            raise renamed(exc, images) from None
        finally:
            lease.release()
        return JSONResponse({"input_tokens": len(prepared.prompt)})

    for root in ("/v1", ""):
        app.add_api_route(f"{root}/messages", messages, methods=["POST"], include_in_schema=False)
        app.add_api_route(
            f"{root}/messages/count_tokens",
            count_tokens,
            methods=["POST"],
            include_in_schema=False,
        )
