"""Answers checked against the published API schemas kept in `tests/schemas/` (their source
and version in its README): `conforms("anthropic-messages", "Message", body)` raises
`SchemaViolation` naming the first field that does not match.

Anthropic's and Ollama's answers by event type and by route, over the one validator of
`tests.schemas` (which OpenAI's and Open Responses' checks use too). The tests fetch nothing:
a schema update is one file."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx

from tests.schemas import SchemaViolation, validate

if TYPE_CHECKING:
    from fastapi.testclient import TestClient


def conforms(name: str, component: str, instance: Any) -> None:
    """Raises SchemaViolation unless `instance` is a valid `component` of the schema
    document `tests/schemas/{name}.json` (`tests.schemas.validate`, one validator for all)."""
    validate(f"{name}:{component}", instance)


_ANTHROPIC_EVENTS = {
    "message_start": "RawMessageStartEvent",
    "message_delta": "RawMessageDeltaEvent",
    "message_stop": "RawMessageStopEvent",
    "content_block_start": "RawContentBlockStartEvent",
    "content_block_delta": "RawContentBlockDeltaEvent",
    "content_block_stop": "RawContentBlockStopEvent",
    "ping": "PingEvent",
    "error": "ErrorResponse",
}


def anthropic_event(event: dict[str, Any]) -> None:
    """One streamed Anthropic event against its own component (named by its type, so a
    failure names the field rather than "none of the union's members")."""
    component = _ANTHROPIC_EVENTS.get(str(event.get("type")))
    if component is None:
        raise SchemaViolation(f"not an event type of the schema: {event!r}")
    conforms("anthropic-messages", component, event)


# Ollama's answers by route: (whole, each line of a stream).
_OLLAMA_ROUTES = {
    "/api/chat": ("ChatResponse", "ChatStreamEvent"),
    "/api/generate": ("GenerateResponse", "GenerateStreamEvent"),
    "/api/tags": ("ListResponse", None),
    "/api/ps": ("PsResponse", None),
    "/api/show": ("ShowResponse", None),
    "/api/embed": ("EmbedResponse", None),
    "/api/version": ("VersionResponse", None),
}


def ollama_answer(path: str, status: int, content_type: str, body: bytes) -> None:
    """One answer of Ollama's API against its published schema (`ollama-api.json`): an
    error's body, a whole answer, or each line of a stream (an error line as an error)."""
    if not path.startswith("/api/"):
        return
    if status >= 400:
        conforms("ollama-api", "ErrorResponse", json.loads(body))
        return
    whole, line = _OLLAMA_ROUTES.get(path, (None, None))
    if "ndjson" in content_type and line is not None:
        for raw in body.decode().splitlines():
            event = json.loads(raw)
            conforms("ollama-api", "ErrorResponse" if "error" in event else line, event)
    elif whole is not None and content_type.startswith("application/json"):
        conforms("ollama-api", whole, json.loads(body))


def ollama_typed(path: str, status: int, content_type: str, body: bytes) -> None:
    """One answer of Ollama's API read by the `ollama` client's own pydantic types in strict
    mode (no coercion: a number sent as a string, a missing required field fails), each line
    of a stream too: what a typed client generated from the API reads."""
    from ollama import _types as types

    kinds = {"/api/chat": types.ChatResponse, "/api/generate": types.GenerateResponse,
             "/api/tags": types.ListResponse, "/api/show": types.ShowResponse,
             "/api/ps": types.ProcessResponse, "/api/embed": types.EmbedResponse}  # fmt: skip
    kind = kinds.get(path)
    if kind is None or status >= 400:
        return
    lines = body.decode().splitlines() if "ndjson" in content_type else [body.decode()]
    for line in lines:
        if line.strip() and '"error"' not in line[:10]:
            kind.model_validate_json(line, strict=True)


class OllamaBridge(httpx.BaseTransport):
    """Hands Ollama's httpx requests to a TestClient, which speaks httpx2 (Starlette 1.x):
    the real app in process, answered whole (TestClient buffers streams anyway)."""

    def __init__(self, http: TestClient):
        self.http = http

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = self.http.request(
            request.method, request.url.path, headers=dict(request.headers), content=request.read()
        )
        # Every answer the client gets, as Ollama's published schema has it.
        ollama_answer(request.url.path, r.status_code, r.headers.get("content-type", ""), r.content)
        ollama_typed(request.url.path, r.status_code, r.headers.get("content-type", ""), r.content)
        return httpx.Response(r.status_code, headers=r.headers.multi_items(), content=r.content)
