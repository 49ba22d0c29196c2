"""Typed errors that carry their OpenAI error shape and HTTP status.

Every layer raises these; only the API turns them into responses, so no code ever maps an
error by reading its message.
"""

from __future__ import annotations

from typing import Any


class FerrumError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(FerrumError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class AuthenticationError(FerrumError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(FerrumError):
    """A valid key without the role the route needs (the model store's routes need an admin
    key)."""

    status = 403
    type = "permission_error"
    code = "permission_denied"


class RequestTooLarge(InvalidRequest):
    code = "request_too_large"


class TooManyRequests(FerrumError):
    """The waiting queue is full: come back later (the response carries Retry-After)."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class RequestTimeout(FerrumError):
    status = 408
    type = "timeout_error"
    code = "request_timeout"


class NotFound(FerrumError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ServiceUnavailable(FerrumError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class ClientGone(FerrumError):
    """The client closed the connection before its answer was ready: nobody reads this
    error, but the request still ends through the error path (one log line, no traceback)."""

    status = 499  # "client closed request", as nginx counts it
    type = "client_error"
    code = "client_closed_request"


class EngineError(FerrumError):
    """The engine failed a request (e.g. llama_decode error); other requests keep running."""

    status = 500
    type = "server_error"
    code = "engine_error"


class ModelLoadError(FerrumError):
    """A model could not be loaded (missing, corrupt or unsupported file, no memory for its
    context): the server refuses to start on its first model; for a model loaded on demand
    its requests get a 503 and the other models keep serving."""

    status = 503
    code = "model_load_failed"
