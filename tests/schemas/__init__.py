"""The published API schemas that ferrum's answers are checked against, kept as test data
(each document's source and version in README.md; the tests fetch nothing at run time).

`validate("openai:Response", obj)` checks `obj` against one component schema of one document
(`<document>:<component>`, the document being `tests/schemas/<document>.json`): what a client
generated from that document, or a gateway validating answers, would accept. A stream
event is checked against the event schema its `type` names (`validate_event`), which says
which field is wrong where a union of fifty events would only say "none matched".

The documents are OpenAPI 3.1 (JSON Schema 2020-12); OpenAPI 3.0's `nullable: true`, which
OpenAI's 3.1 document still writes in places, is converted on load, so that a schema update
stays one file dropped in here. The documents' own faults that the helper allows are listed
in README.md, each allowed in one function here.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

_HERE = Path(__file__).parent

# Where each document lists its stream events, by the union that names them all: a
# component (OpenAI's) or, where the document has none, every component named so.
_EVENT_UNIONS = {"openai": "ResponseStreamEvent", "openresponses": "*StreamingEvent"}


class SchemaViolation(AssertionError):
    """An answer that the published schema refuses."""


def _nullable_to_31(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true` as JSON Schema's `null` type (3.1 documents have none)."""
    if isinstance(node, list):
        return [_nullable_to_31(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable_to_31(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@cache
def _document(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = _nullable_to_31(json.loads((_HERE / f"{name}.json").read_text()))
    return doc


@cache
def _validator(kind: str) -> Draft202012Validator:
    name, _, component = kind.partition(":")
    doc = _document(name)
    if component not in doc["components"]["schemas"]:
        raise KeyError(f"{name}.json has no component {component!r}")
    uri = f"urn:ferrum-tests:{name}"
    resource = Resource.from_contents(doc, default_specification=DRAFT202012)
    registry: Registry[Any] = Registry().with_resource(uri, resource)
    ref = {"$ref": f"{uri}#/components/schemas/{component}"}
    return Draft202012Validator(ref, registry=registry)


def validate(kind: str, obj: Any) -> None:
    """Raise `SchemaViolation` unless `obj` validates against `kind` (`doc:Component`)."""
    error = best_match(_validator(kind).iter_errors(obj))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top)"
        raise SchemaViolation(f"{kind} at {where}: {error.message}\n{json.dumps(obj)[:2000]}")


@cache
def _events(name: str) -> dict[str, str]:
    """Each stream event type of a document → the component that defines it."""
    schemas = _document(name)["components"]["schemas"]
    union = _EVENT_UNIONS[name]
    if union.startswith("*"):
        names = [n for n in schemas if n.endswith(union[1:])]
    else:
        names = [b["$ref"].rsplit("/", 1)[1] for b in schemas[union]["anyOf"]]
    by_type = {}
    for component in names:
        for kind in schemas[component]["properties"]["type"].get("enum", ()):
            by_type[kind] = component
    return by_type


def validate_event(name: str, event: dict[str, Any]) -> None:
    """Check a stream event against the component its `type` names in document `name`."""
    component = _events(name).get(event.get("type", ""))
    if component is None:
        raise SchemaViolation(f"{name}.json defines no stream event {event.get('type')!r}")
    validate(f"{name}:{component}", event)


# The two documents name the reasoning text events differently; ferrum sends OpenAI's names
# (the SDKs parse those), checked against Open Responses' events of the same content.
_OPEN_RESPONSES_NAMES = {
    "response.reasoning_text.delta": "response.reasoning.delta",
    "response.reasoning_text.done": "response.reasoning.done",
}


def _open_responses_view(obj: Any) -> Any:
    """The object as Open Responses 2026-04-24 names it, with the one field it mistypes
    cleared: a json_schema format's `schema`, typed as null only (README.md)."""
    if not isinstance(obj, dict):
        return obj
    if obj.get("type") in _OPEN_RESPONSES_NAMES:
        return {**obj, "type": _OPEN_RESPONSES_NAMES[obj["type"]]}
    if isinstance(obj.get("response"), dict):  # a stream event carrying the response
        return {**obj, "response": _open_responses_view(obj["response"])}
    text = obj.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {**obj, "text": {**text, "format": {**fmt, "schema": None}}}
    return obj


def _openai_view(obj: Any) -> Any:
    """The object without a `usage: null`: OpenAI's document types `Response.usage` as an
    object, never null, yet its own examples of `response.created` and `response.failed`
    carry null there, as OpenAI's API sends, and Open Responses requires the key, null
    until the response has finished (README.md)."""
    if not isinstance(obj, dict):
        return obj
    if isinstance(obj.get("response"), dict):  # a stream event carrying the response
        return {**obj, "response": _openai_view(obj["response"])}
    if "usage" in obj and obj["usage"] is None:
        return {k: v for k, v in obj.items() if k != "usage"}
    return obj


def validate_response(obj: Any) -> None:
    """A Responses API response object, against OpenAI's schema and Open Responses'."""
    validate("openai:Response", _openai_view(obj))
    validate("openresponses:ResponseResource", _open_responses_view(obj))


def validate_response_event(event: dict[str, Any]) -> None:
    """A Responses API stream event, against OpenAI's schema and Open Responses'."""
    validate_event("openai", _openai_view(event))
    validate_event("openresponses", _open_responses_view(event))


def validate_chat(obj: Any, *, chunk: bool = False) -> None:
    """A chat completion, or one streamed chunk of it."""
    validate(f"openai:CreateChatCompletion{'Stream' if chunk else ''}Response", obj)


def validate_completion(obj: Any, *, chunk: bool = False) -> None:
    """A text completion, or one streamed chunk of it: OpenAI's document describes chunks
    with the whole answer's schema, whose `finish_reason` cannot be the null that every
    chunk before the last carries (README.md); that null alone is let through."""
    if chunk and isinstance(obj, dict) and isinstance(obj.get("choices"), list):
        choices = [
            {**c, "finish_reason": "stop"}
            if isinstance(c, dict) and c.get("finish_reason") is None and "finish_reason" in c
            else c
            for c in obj["choices"]
        ]
        obj = {**obj, "choices": choices}
    validate("openai:CreateCompletionResponse", obj)


def validate_embeddings(obj: Any) -> None:
    """An embeddings answer. OpenAI's document types `embedding` as an array of numbers only,
    while its API (and the SDK, which asks for it) sends base64 for `encoding_format:
    base64` (README.md): such a string is checked as the floats it encodes."""
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        data = [
            {**d, "embedding": _floats(d["embedding"])}
            if isinstance(d, dict) and isinstance(d.get("embedding"), str)
            else d
            for d in obj["data"]
        ]
        obj = {**obj, "data": data}
    validate("openai:CreateEmbeddingResponse", obj)


def _floats(b64: str) -> list[float]:
    import base64
    import struct

    raw = base64.b64decode(b64, validate=True)
    if len(raw) % 4:
        raise SchemaViolation("a base64 embedding that is not whole float32 values")
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def validate_error(obj: Any) -> None:
    """An OpenAI-shaped error body ({"error": {message, type, param, code}})."""
    validate("openai:ErrorResponse", obj)
