"""The published API schemas that ferrum's answers are checked against, kept as test data
(each document's source and version in README.md; the tests fetch nothing at run time).

`validate("openai:Response", obj)` checks `obj` against one component schema of one document
(`<document>:<component>`, the document being `tests/schemas/<document>.json`): what a client
generated from that document, or a gateway validating answers, would accept. A stream
event is checked against the event schema its `type` names (`validate_event`), which says
which field is wrong where a union of fifty events would only say "none matched".

The documents are OpenAPI 3.1 (JSON Schema 2020-12); a 3.0 document's `nullable: true` is
converted on load, so that a schema update stays one file dropped in here.
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
    doc: dict[str, Any] = json.loads((_HERE / f"{name}.json").read_text())
    if str(doc.get("openapi", "")).startswith("3.0"):
        doc = _nullable_to_31(doc)
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


# The Responses API is checked against both of its published schemas.
RESPONSES_DOCUMENTS = ("openai", "openresponses")
_RESPONSE_COMPONENT = {"openai": "Response", "openresponses": "ResponseResource"}


def validate_response(obj: Any) -> None:
    """A Responses API response object, against OpenAI's schema and Open Responses'."""
    for name in RESPONSES_DOCUMENTS:
        validate(f"{name}:{_RESPONSE_COMPONENT[name]}", obj)


def validate_response_event(event: dict[str, Any]) -> None:
    """A Responses API stream event, against OpenAI's schema and Open Responses'."""
    for name in RESPONSES_DOCUMENTS:
        validate_event(name, event)


def validate_error(obj: Any) -> None:
    """An OpenAI-shaped error body ({"error": {message, type, param, code}})."""
    validate("openai:ErrorResponse", obj)
