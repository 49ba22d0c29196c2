"""Structured output: `response_format` → a llama.cpp grammar the sampler enforces.

    text         → no grammar
    json_object  → JSON_OBJECT_GRAMMAR (any JSON object)
    json_schema  → the schema is checked (valid draft 2020-12, and only keywords the
                   converter enforces), converted to GBNF by the runner, parsed once by
                   llama.cpp; any failure is a 400 naming the parameter

A keyword the converter would silently ignore (say `minimum`) is refused rather than accepted
and not enforced: a client that sends it would otherwise get output that breaks its schema.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from ferrum.api.protocol import ResponseFormat
from ferrum.errors import InvalidRequest

# Written from the JSON grammar (RFC 8259). Whitespace between tokens is bounded so that a
# model cannot run away in it.
JSON_OBJECT_GRAMMAR = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}" ws
array  ::= "[" ws ( value ( "," ws value )* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\"" ws
number ::= "-"? ( "0" | [1-9] [0-9]{0,15} ) ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,4} )? ws
ws     ::= ( " " | "\n" [ \t]{0,20} )?
"""

# Keywords the JSON-schema-to-grammar converter turns into grammar rules.
_ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "pattern",
    "minLength", "maxLength", "format", "$defs", "definitions",
}  # fmt: skip
# Keywords that only describe; they change nothing a grammar could enforce.
_ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly", "nullable", "strict",
}  # fmt: skip
_FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
# Keywords whose values are maps of name → schema, and those whose values are schemas.
_SCHEMA_MAPS = {"properties", "$defs", "definitions"}
_SCHEMA_VALUES = {"items", "additionalProperties"}
_SCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}


class GrammarRunner(Protocol):
    def json_schema_grammar(self, schema: dict[str, Any]) -> str: ...

    def check_grammar(self, grammar: str) -> None: ...


def response_grammar(fmt: ResponseFormat | None, runner: GrammarRunner) -> str | None:
    """The grammar for a response_format, or None for free text; InvalidRequest when unusable."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JSON_OBJECT_GRAMMAR
    assert fmt.json_schema is not None  # the protocol model guarantees it
    schema = fmt.json_schema.json_schema
    return schema_grammar(schema, runner, "response_format.json_schema.schema")


def schema_grammar(schema: dict[str, Any], runner: GrammarRunner, param: str) -> str:
    """GBNF enforcing a JSON schema (also used for tool arguments)."""
    check_schema(schema, param)
    return compile_grammar(lambda: runner.json_schema_grammar(schema), runner, param)


def compile_grammar(make: Callable[[], str], runner: GrammarRunner, param: str) -> str:
    try:
        grammar = make()
        runner.check_grammar(grammar)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"{param}: {exc}", param=param) from exc
    return grammar


def check_schema(schema: Any, param: str) -> None:
    """InvalidRequest naming the first problem: an invalid schema or an unenforced keyword."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param} must be a JSON object", param=param)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequest(
            f"{param} is not a valid JSON schema: {exc.message}", param=param
        ) from exc
    for path, node in _walk(schema, param):
        for key, value in node.items():
            if key not in _ENFORCED and key not in _ANNOTATIONS:
                raise InvalidRequest(
                    f"{path}: the JSON schema keyword {key!r} is not supported "
                    "(structured output could not enforce it)",
                    param=param,
                )
            if key == "format" and value not in _FORMATS:
                raise InvalidRequest(
                    f"{path}: format {value!r} is not supported (supported: "
                    f"{', '.join(sorted(_FORMATS))})",
                    param=param,
                )
            if key == "$ref" and not str(value).startswith("#"):
                raise InvalidRequest(f"{path}: only local $refs (#/...) are supported", param=param)


def _walk(node: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every subschema with its path (boolean schemas have no keywords to check)."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from _walk(sub, f"{path}.{key}.{name}")
        elif key in _SCHEMA_VALUES:
            yield from _walk(value, f"{path}.{key}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _walk(sub, f"{path}.{key}[{i}]")
