"""Ollama's dialect, the `/api` paths: errors as `{"error": message}` with the error's
status; a stream that has begun (NDJSON) ends with the same body as its last line."""

from __future__ import annotations

from typing import Any

from ferrum.api.dialect import Dialect, compact_json
from ferrum.api.ollama.bodies import ChatBody, GenerateBody, chat_request, generate_request
from ferrum.errors import FerrumError

__all__ = ["OLLAMA", "Ollama"]


class Ollama(Dialect):
    name = "ollama"
    roots = ("/api",)
    generations = {
        "/api/chat": lambda raw: chat_request(ChatBody.model_validate(raw)),
        "/api/generate": lambda raw: generate_request(GenerateBody.model_validate(raw)),
    }

    def error_body(self, exc: FerrumError) -> dict[str, Any]:
        return {"error": exc.message}

    def stream_error(self, exc: FerrumError) -> str:
        return compact_json(self.error_body(exc)) + "\n"


OLLAMA = Ollama()
