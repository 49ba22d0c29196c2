"""Anthropic's dialect, the Messages paths (`/v1/messages*`, `/messages*`): errors as
`{"type": "error", "error": {"type": T, "message": M}, "request_id": null}`, with T named
after the HTTP status as Anthropic names it, always one of the published schema's error types
(its ErrorResponse: Anthropic's 413 `request_too_large` is not one, so an oversized body is
an `invalid_request_error` with the status 413); a stream that has begun ends with the same
body as an `error` event. The app answers every error on these paths so, the gate's included
(API key, body size)."""

from __future__ import annotations

from typing import Any

from ferrum.api.anthropic.bodies import MessagesBody, chat_request
from ferrum.api.dialect import Dialect, compact_json
from ferrum.errors import FerrumError, RequestTooLarge

__all__ = ["ANTHROPIC", "Anthropic", "error_type"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


class Anthropic(Dialect):
    name = "anthropic"
    roots = ("/v1/messages", "/messages")
    generations = {"/v1/messages": lambda raw: chat_request(MessagesBody.model_validate(raw))}

    def status(self, exc: FerrumError) -> int:
        # ferrum answers an oversized body with a 400 (OpenAI's way); Anthropic's is a 413.
        return 413 if isinstance(exc, RequestTooLarge) else exc.status

    def error_body(self, exc: FerrumError) -> dict[str, Any]:
        kind = error_type(self.status(exc))
        # request_id is required and may be null: ferrum gives requests no id of Anthropic's.
        error = {"type": kind, "message": exc.message}
        return {"type": "error", "error": error, "request_id": None}

    def stream_error(self, exc: FerrumError) -> str:
        return f"event: error\ndata: {compact_json(self.error_body(exc))}\n\n"


ANTHROPIC = Anthropic()
