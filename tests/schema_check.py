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
