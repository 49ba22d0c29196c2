"""OpenAI's dialect, every path that no other dialect owns: errors as
`{"error": {message, type, param, code}}` (`FerrumError.to_dict`), a stream that has begun
ends with the same body as an SSE event (then `[DONE]`, which the stream adds)."""

from __future__ import annotations

from typing import Any

from ferrum.api.dialect import Dialect, compact_json
from ferrum.api.openai.bodies import ChatCompletionRequest, CompletionRequest
from ferrum.errors import FerrumError

__all__ = ["OPENAI", "OpenAI"]


class OpenAI(Dialect):
    name = "openai"
    generations = {
        "/v1/chat/completions": ChatCompletionRequest.model_validate,
        "/v1/completions": CompletionRequest.model_validate,
    }

    def error_body(self, exc: FerrumError) -> dict[str, Any]:
        return exc.to_dict()

    def stream_error(self, exc: FerrumError) -> str:
        return f"data: {compact_json(self.error_body(exc))}\n\n"


OPENAI = OpenAI()
