"""Answers checked against the published API schemas kept in `tests/schemas/` (their source
and version in its README): `conforms("anthropic-messages", "Message", body)` raises
`jsonschema.ValidationError` naming the first field that does not match.

The documents are OpenAPI files (or their trimmed components, as JSON); a component is
validated with the whole document as its root, so `#/components/schemas/...` references
resolve inside it. The tests fetch nothing: a schema update is one file."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

SCHEMAS = Path(__file__).parent / "schemas"


@cache
def _document(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SCHEMAS / f"{name}.json").read_text())
    return doc


@cache
def _validator(name: str, component: str) -> jsonschema.Draft202012Validator:
    doc = _document(name)
    if component not in doc["components"]["schemas"]:
        raise KeyError(f"{name}.json has no component {component!r}")
    # The document is the root, so its own references resolve; the $ref picks the component.
    schema = {**doc, "$ref": f"#/components/schemas/{component}"}
    return jsonschema.Draft202012Validator(schema)


def conforms(name: str, component: str, instance: Any) -> None:
    """Raises jsonschema.ValidationError unless `instance` is a valid `component` of the
    schema document `tests/schemas/{name}.json`."""
    error = jsonschema.exceptions.best_match(_validator(name, component).iter_errors(instance))
    if error is not None:
        raise error


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
        raise jsonschema.ValidationError(f"not an event type of the schema: {event!r}")
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
