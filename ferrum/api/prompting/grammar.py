"""Grammars the sampler enforces: `response_format` and forced tool calls → llama.cpp GBNF.

    text                    → no grammar
    json_object             → JSON_OBJECT_GRAMMAR (any JSON object)
    json_schema             → the schema is checked (valid draft 2020-12, and only keywords
                              the converter enforces), converted to GBNF, parsed by llama.cpp
    tool_choice required /  → the format's markers around one call's JSON (or several), whose
    a named function          arguments follow each chosen function's `parameters` schema

Any failure is a 400 naming the parameter. A keyword the converter would silently ignore (say
`minimum`) is refused rather than accepted and not enforced: a client that sends it would
otherwise get output that breaks its schema. A schema that would compile to a costly grammar
(a million-item minItems, deep nesting, thousands of choices) is refused before conversion
(schema_limits.py); the vocabulary bounds the conversion itself.

Agents send the same schemas again and again, and checking plus converting a large one costs
tens of milliseconds of Python: `GrammarBuilder` keeps the grammar of each schema it built
(bounded by count and by bytes, least recently used out), and the vocabulary keeps it
parsed, so a repeated schema costs one dictionary lookup. Callers run it in a worker
thread, never on the event loop.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from typing import Any

import jsonschema_rs

from ferrum.api.openai.bodies import ResponseFormat
from ferrum.api.prompting.schema_limits import check_limits, walk
from ferrum.api.prompting.tool_calls import ToolFormat
from ferrum.api.prompting.tool_request import Function, ToolRequest
from ferrum.engine.contracts import Vocabulary
from ferrum.engine.lru import SizedLRU
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


# Grammars kept: by count, and by bytes (key and grammar text, one byte a character for the
# ASCII that schemas and GBNF are), so that large grammars cannot hold memory that a count
# does not see: 256 typical grammars (5-20 KB) fit both; 16 MiB holds 16 of the largest the
# vocabulary builds (MAX_GRAMMAR_BYTES).
_KEPT = 256
_KEPT_BYTES = 16 * 1024 * 1024


class GrammarBuilder:
    """Builds (and keeps) the grammar of a request; thread-safe."""

    def __init__(self, vocab: Vocabulary, kept: int = _KEPT, kept_bytes: int = _KEPT_BYTES):
        self._vocab = vocab
        self._built: SizedLRU[str, str] = SizedLRU(kept, kept_bytes)
        self._lock = threading.Lock()

    def for_response_format(self, fmt: ResponseFormat | None) -> str | None:
        """The grammar for a response_format, or None for free text."""
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return self._kept_or_built(
                "json_object", lambda: JSON_OBJECT_GRAMMAR, "response_format"
            )
        if fmt.json_schema is None:
            raise InvalidRequest("json_schema is required", param="response_format.json_schema")
        schema = fmt.json_schema.json_schema
        param = "response_format.json_schema.schema"

        def build() -> str:
            check_schema(schema, param)
            return self._vocab.json_schema_grammar(schema)

        return self._kept_or_built(_key("schema", schema), build, param)

    def for_tools(self, tools: ToolRequest, fmt: ToolFormat) -> str | None:
        """GBNF that admits only calls in `fmt`: one or more (`required`; one when not
        parallel) or exactly one of the forced function; None when the model may answer
        freely."""
        chosen = tools.chosen()
        if not chosen:
            return None
        many = tools.mode == "required" and tools.parallel

        def build() -> str:
            for i, f in enumerate(tools.functions):
                if f in chosen:
                    check_schema(f.parameters, f"tools[{i}].function.parameters")
            schema = _calls_schema(chosen, fmt.args_key)
            return _wrap(self._vocab.json_schema_grammar(schema), fmt, many)

        key = _key(
            "tools", [f.name for f in chosen], [f.parameters for f in chosen], fmt.name, many
        )
        return self._kept_or_built(key, build, "tools")

    def _kept_or_built(self, key: str, build: Callable[[], str], param: str) -> str:
        with self._lock:
            grammar = self._built.get(key)
        try:
            if grammar is None:
                grammar = build()
            # Also for a kept grammar: the vocabulary keeps fewer parsed ones, and one it let go
            # is parsed again here, in the worker thread, not on the engine thread.
            self._vocab.check_grammar(grammar)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequest(f"{param}: {exc}", param=param) from exc
        with self._lock:
            self._built.put(key, grammar, len(key) + len(grammar))
        return grammar

    @property
    def kept_bytes(self) -> int:
        """What the kept grammars hold (keys and texts)."""
        with self._lock:
            return self._built.total_bytes


def _key(*parts: Any) -> str:
    return json.dumps(parts, sort_keys=True, separators=(",", ":"))


def check_schema(schema: Any, param: str) -> None:
    """InvalidRequest naming the first problem: a schema too costly to compile (before any
    other work, see schema_limits.py), an invalid schema or an unenforced keyword."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param} must be a JSON object", param=param)
    check_limits(schema, param)
    try:
        # jsonschema-rs: the draft 2020-12 metaschema check in ~0.05 ms where the pure-Python
        # jsonschema takes ~20 ms of held GIL (stalling the engine thread) on a 60-property
        # schema.
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.instance_path)
        raise InvalidRequest(
            f"{param}{where} is not a valid JSON schema: {exc.message}", param=param
        ) from exc
    except jsonschema_rs.ReferencingError as exc:
        raise InvalidRequest(f"{param} is not a valid JSON schema: {exc}", param=param) from exc
    for path, node, _ in walk(schema, param):
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
            if key == "pattern":
                try:
                    re.compile(value)
                except re.error as exc:
                    raise InvalidRequest(
                        f"{path}: pattern {value!r} is not a regular expression: {exc}",
                        param=param,
                    ) from exc
            if key == "$ref" and not str(value).startswith("#"):
                raise InvalidRequest(f"{path}: only local $refs (#/...) are supported", param=param)


def _wrap(rules: str, fmt: ToolFormat, many: bool) -> str:
    """The converter's rules, its start rule renamed to one call's JSON, under a start rule
    that puts the format's markers around one call (or several)."""
    rules = re.sub(r"(?m)^root ::=", "ferrum-call-json ::=", rules)
    item = _seq(_literal(fmt.call_open), "ferrum-call-json", _literal(fmt.call_close))
    more = f"({_seq(_literal(fmt.call_sep), 'ferrum-call')})*" if many else ""
    root = _seq(_literal(fmt.list_open), "ferrum-call", more, _literal(fmt.list_close))
    return f"root ::= {root}\nferrum-call ::= {item}\n{rules}"


def _calls_schema(functions: list[Function], key: str) -> dict[str, Any]:
    """One call's JSON: {"name": <const>, key: <parameters>} for any of the functions.

    Each function's parameters move to `$defs/f<i>` with their local $refs rebased there, so
    refs written against the function's own schema still resolve (the converter follows
    pointers through objects only, not list indices)."""
    defs = {f"f{i}": _rebase_refs(f.parameters, f"#/$defs/f{i}") for i, f in enumerate(functions)}
    alternatives = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, key: {"$ref": f"#/$defs/f{i}"}},
            "required": ["name", key],
        }
        for i, f in enumerate(functions)
    ]
    return {"$defs": defs, "anyOf": alternatives}


def _rebase_refs(node: Any, base: str) -> Any:
    if isinstance(node, dict):
        out = {k: _rebase_refs(v, base) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def _literal(text: str) -> str:
    if not text:
        return ""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + escaped.replace("\r", "\\r").replace("\t", "\\t") + '"'


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)
