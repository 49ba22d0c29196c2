"""Errors in Anthropic's shape, `{"type": "error", "error": {"type": T, "message": M}}`, with
T named after the HTTP status as Anthropic names it. The app answers every error on the
Messages paths this way (`speaks_anthropic`), the gate's included (API key, body size), and a
stream that has begun ends with the same body as an `error` event."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from ferrum.errors import FerrumError, RequestTooLarge, TooManyRequests

__all__ = ["error_body", "error_response", "speaks_anthropic"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def speaks_anthropic(path: str) -> bool:
    """Whether a path is one of the Messages routes, whose errors take Anthropic's shape."""
    return any(
        path == root or path.startswith(root + "/") for root in ("/v1/messages", "/messages")
    )


def _status(exc: FerrumError) -> int:
    # ferrum answers an oversized body with a 400 (OpenAI's way); Anthropic's is a 413.
    return 413 if isinstance(exc, RequestTooLarge) else exc.status


def error_type(status: int) -> str:
    return _TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def error_body(exc: FerrumError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(_status(exc)), "message": exc.message}}


def error_response(exc: FerrumError) -> JSONResponse:
    headers = {"Retry-After": "1"} if isinstance(exc, TooManyRequests) else None
    return JSONResponse(error_body(exc), status_code=_status(exc), headers=headers)
