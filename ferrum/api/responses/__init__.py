"""OpenAI's Responses API (`/v1/responses`): a response body translated into a chat
completion (`bodies.py`), served by the shared path (`generation.py`) and answered as a
response object or its event stream (`answers.py`); finished responses are kept for
`previous_response_id` and `GET /v1/responses/{id}` (`store.py`, bounded by
`--responses-store`).

A continuation's prompt is the stored conversation plus the new input, rendered by the same
template, so its start is the previous turn's prompt and output token for token: the
engine's prefix index finds that KV still parked and prefills only the new input (reported
in `usage.input_tokens_details.cached_tokens`).

Errors are OpenAI's (the app's handlers), with parameters named as the Responses client
wrote them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ferrum.api.auth import caller_of
from ferrum.api.generation import serve
from ferrum.api.openai.bodies import ChatCompletionRequest
from ferrum.api.responses.answers import ResponsesAnswer, new_id
from ferrum.api.responses.bodies import (
    Reasoning,
    ResponsesRequest,
    chat_request,
    image_params,
    input_messages,
    renamed,
)
from ferrum.api.responses.store import ResponseStore
from ferrum.api.serving import ServerState, acquire_chat, prepare_chat, with_defaults
from ferrum.errors import InvalidRequest, NotFound

__all__ = ["add_responses_routes"]

Handler = Callable[..., Awaitable[Any]]
Route = Callable[[str, str], Callable[[Handler], Handler]]


def _tools(chat: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The tools as ferrum read them, in the Responses function-tool shape (every field the
    published schema requires, null where the client gave none)."""
    return [
        {"type": "function", "name": t.function.name, "description": t.function.description,
         "parameters": t.function.parameters, "strict": t.function.strict}
        for t in chat.tools or ()
    ]  # fmt: skip


def _shell(body: ResponsesRequest, used: ChatCompletionRequest, model: str, store: bool
           ) -> dict[str, Any]:  # fmt: skip
    """The response object without its outcome: ids and the request's settings echoed, the
    sampling ones as used (`used`: the chat body after the model preset's defaults)."""
    shell = {
        "id": new_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "completed_at": None,
        "model": model,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,  # no limit: the client runs the calls
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": (body.reasoning or Reasoning()).model_dump(include={"effort", "summary"}),
        "service_tier": "default",
        "store": store,
        "temperature": used.temperature,
        "top_p": used.top_p,
        "presence_penalty": used.presence_penalty,
        "frequency_penalty": used.frequency_penalty,
        "top_logprobs": 0,  # output_text logprobs are not offered
        "text": {"format": body.format_dict() or {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": _tools(used),
        "truncation": body.truncation or "disabled",
        "usage": None,
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
    }
    if body.user is not None:  # a string when present, in OpenAI's schema
        shell["user"] = body.user
    return shell


def add_responses_routes(route: Route, state: ServerState) -> None:
    store = ResponseStore(state.responses_store_bytes)

    @route("POST", "/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        body.check()
        owner = caller_of(request).tenant
        previous = body.previous_response_id
        history = store.conversation(previous, owner) if previous else []
        turn = input_messages(body, history)
        chat = chat_request(body, history + turn)
        images = image_params(body, chat)
        lease = await acquire_chat(state, request, body.model, body.keep_alive)
        chat = with_defaults(lease.model, chat)
        answer = ResponsesAnswer(_shell(body, chat, lease.name, body.store and store.enabled),
                                 body.stream, store, turn, owner)  # fmt: skip
        try:
            return await serve(state, request, lease, chat, prepare_chat, answer)
        except InvalidRequest as exc:
            raise renamed(exc, images) from None

    @route("GET", "/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        return store.get(response_id, caller_of(request).tenant).response

    @route("DELETE", "/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        if not store.delete(response_id, caller_of(request).tenant):
            raise NotFound(f"no stored response {response_id!r}", param="response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}
