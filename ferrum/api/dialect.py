"""What makes a dialect of the API one: which paths it owns, how its errors look (as a
response and as the last line of a stream that has begun), and how its generation bodies
translate into the OpenAI body that is served (and that a cluster's ingress routes on).

Each dialect's package defines its own (`openai.dialect.OPENAI`, `ollama.dialect.OLLAMA`,
`anthropic.dialect.ANTHROPIC`); `dialects.dialect_for(path)` names the one a path speaks,
for the app's error handlers, its gate and a cluster's ingress alike, so that `ferrum
serve` and `ferrum cluster` answer every error on a path in the same shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from fastapi.responses import JSONResponse

from ferrum.errors import FerrumError, RequestTooLarge, TooManyRequests

__all__ = ["Dialect", "Translate", "compact_json"]

# A generation body as the client wrote it (parsed JSON), as the OpenAI body that serves it
# (`protocol.ChatCompletionRequest` or `CompletionRequest`); raises on a body that is not valid.
Translate = Callable[[dict[str, Any]], Any]


def compact_json(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class Dialect:
    """One dialect's paths, errors and translations. A subclass says how its errors look
    (`error_body`, `stream_error`, and `status` where it differs from the error's own);
    the response around them is the same for all."""

    name = ""
    # Path prefixes it owns, each with and without /v1 where the routes are so registered;
    # empty: the dialect of every path no other owns (OpenAI's).
    roots: tuple[str, ...] = ()
    # Its generation paths (in their /v1 form where they have one) → the body's translation.
    generations: Mapping[str, Translate] = {}

    def owns(self, path: str) -> bool:
        return any(path == root or path.startswith(root + "/") for root in self.roots)

    def status(self, exc: FerrumError) -> int:
        return exc.status

    def error_body(self, exc: FerrumError) -> dict[str, Any]:
        raise NotImplementedError

    def stream_error(self, exc: FerrumError) -> str:
        """How a stream that has already begun ends with `exc` (its status is already sent)."""
        raise NotImplementedError

    def error_response(self, exc: FerrumError) -> JSONResponse:
        headers = {"Retry-After": "1"} if isinstance(exc, TooManyRequests) else {}
        if isinstance(exc, RequestTooLarge):
            # The body's unread rest is still coming: closing the connection stops it, where
            # keep-alive would make the server read it all to find the next request.
            headers["connection"] = "close"
        return JSONResponse(self.error_body(exc), status_code=self.status(exc), headers=headers)

    def translation(self, path: str) -> Translate | None:
        """The translation of a generation path's body (the path with or without /v1)."""
        return self.generations.get(path) or self.generations.get("/v1" + path)
