"""The Responses API's paths (`/v1/responses*`, `/responses*`) speak OpenAI's dialect; what
is their own is the translation of a first turn's body (a continuation's history lives on
one replica of a cluster, which is pinned rather than routed on its prompt)."""

from __future__ import annotations

from typing import Any

from ferrum.api.openai.dialect import OpenAI
from ferrum.api.responses.bodies import ResponsesRequest, chat_request, input_messages

__all__ = ["RESPONSES"]


def _first_turn(raw: dict[str, Any]) -> Any:
    body = ResponsesRequest.model_validate(raw)
    return chat_request(body, input_messages(body, []))


class Responses(OpenAI):
    name = "responses"
    roots = ("/v1/responses", "/responses")
    generations = {"/v1/responses": _first_turn}


RESPONSES = Responses()
