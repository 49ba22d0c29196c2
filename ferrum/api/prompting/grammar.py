"""What the sampler enforces (structured output), from every request field that asks for it,
as llguidance grammars (`ferrum/engine/constraint.py`):

    response_format text             → no grammar
    response_format json_object      → any JSON object
    response_format json_schema      → the schema (Ollama's `format`, Anthropic's
    (and llama-server's json_schema,   output_config.format and Responses' text.format arrive
    vLLM's guided_json / structured_    here as response_format)
    outputs.json)
    guided_regex / structured_outputs.regex     → the regex
    guided_choice / structured_outputs.choice   → one of the strings
    grammar (llama-server's GBNF), guided_grammar / structured_outputs.grammar
                                                → GBNF or Lark, converted to llguidance's Lark
    tool_choice required / a named function     → the format's markers around one call's JSON
                                                  (or several), arguments per `parameters`

Any failure is a 400 naming the parameter and what failed. A JSON schema is checked first for
what it may cost (schema_limits.py) and against the draft 2020-12 metaschema; keywords that
only annotate (unknown ones included, as JSON Schema says) are ignored; those llguidance does
not implement are rewritten into ones it does where the meaning is kept whole
(schema_rewrites.py: `not` of types, `uniqueItems` that cannot matter), `uniqueItems` over
free strings or a fixed set of values becomes rules the engine enforces as the JSON is written
(schema_unique.py; in response formats, not yet in tool calls), and any other keyword it
cannot honour (`contains`, `uniqueItems` over objects, …) is refused by name and place rather
than accepted and not enforced: a client that sends it would otherwise get output that breaks
its schema.

Agents send the same schemas again and again: `GrammarBuilder` keeps the grammar text of each
request field it built (bounded by count and by bytes, least recently used out), and the
vocabulary keeps it compiled, so a repeated schema costs one dictionary lookup. Callers run it
in a worker thread, never on the event loop.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any, Protocol

import jsonschema_rs

from ferrum.api.openai.bodies import ResponseFormat, StructuredRequest
from ferrum.api.prompting.schema_limits import check_counts, check_size
from ferrum.api.prompting.schema_recursion import unbounded_ref
from ferrum.api.prompting.schema_rewrites import keyword_path, rewritten
from ferrum.api.prompting.schema_unique import unique_rules
from ferrum.api.prompting.tool_calls import ToolFormat
from ferrum.api.prompting.tool_request import Function, ToolRequest
from ferrum.engine.constraint import (
    Unenforceable,
    lark_json,
    refusal_reason,
    rules_of,
    to_grammar,
    with_unique,
)
from ferrum.engine.contracts import Vocabulary
from ferrum.engine.lru import SizedLRU
from ferrum.errors import InvalidRequest

# Grammars kept: by count, and by bytes (key and grammar text, one byte a character for the
# ASCII that schemas and grammars are), so that large grammars cannot hold memory that a count
# does not see: 256 typical grammars (5-20 KB) fit both; 16 MiB holds 64 of the largest
# schemas admitted (schema_limits.MAX_SCHEMA_BYTES).
_KEPT = 256
_KEPT_BYTES = 16 * 1024 * 1024


class GrammarRefused(InvalidRequest):
    """A constraint refused before any decode, with the reason the metrics count it under
    (conflict, invalid_json, invalid_schema, too_large, schema_limits, unbounded_recursion,
    unsupported_keyword, compile_limits, compile_error)."""

    def __init__(self, message: str, *, param: str, reason: str):
        super().__init__(message, param=param)
        self.reason = reason


class ConstraintCounter(Protocol):
    """Where the builder counts what it built and refused (`StructuredMetrics`)."""

    def on_constraint(self, kind: str) -> None: ...
    def on_refusal(self, reason: str) -> None: ...


class _Uncounted:
    def on_constraint(self, kind: str) -> None:
        pass

    def on_refusal(self, reason: str) -> None:
        pass


class GrammarBuilder:
    """Builds (and keeps) the grammar of a request; thread-safe."""

    def __init__(
        self,
        vocab: Vocabulary,
        counter: ConstraintCounter | None = None,
        kept: int = _KEPT,
        kept_bytes: int = _KEPT_BYTES,
    ):
        self._vocab = vocab
        self._counter = counter or _Uncounted()
        self._built: SizedLRU[str, str] = SizedLRU(kept, kept_bytes)
        self._lock = threading.Lock()

    def for_request(self, fmt: ResponseFormat | None, body: StructuredRequest) -> str | None:
        """The grammar a request's fields ask for (response_format or one of the extension
        fields; two of them at once are refused), or None for free text."""
        try:
            grammar, kind = self._for_request(fmt, body)
        except GrammarRefused as exc:
            self._counter.on_refusal(exc.reason)
            raise
        if grammar is not None:
            self._counter.on_constraint(kind)
        return grammar

    def _for_request(
        self, fmt: ResponseFormat | None, body: StructuredRequest
    ) -> tuple[str | None, str]:
        asked = body.constraint_fields()
        if fmt is not None and fmt.type != "text":
            asked.insert(0, ("response_format", "", fmt))
        if len(asked) > 1:
            names = ", ".join(param for param, _, _ in asked)
            raise GrammarRefused(
                f"only one structured output may be asked at once; got {names}",
                param=asked[1][0],
                reason="conflict",
            )
        if not asked:
            return None, ""
        param, kind, source = asked[0]
        if isinstance(source, ResponseFormat):
            return self.for_response_format(source), "json_schema"
        if kind == "json_schema":
            return self.for_schema(source, param), kind

        def build() -> str:
            return to_grammar(kind, source)

        return self._kept_or_built(_key(kind, source), build, param), kind

    def for_response_format(self, fmt: ResponseFormat | None) -> str | None:
        """The grammar for a response_format, or None for free text."""
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return self.for_schema({"type": "object"}, "response_format")
        if fmt.json_schema is None:
            raise GrammarRefused(
                "json_schema is required",
                param="response_format.json_schema",
                reason="invalid_schema",
            )
        return self.for_schema(fmt.json_schema.json_schema, "response_format.json_schema.schema")

    def for_schema(self, schema: Any, param: str) -> str:
        """The grammar of a JSON schema (a string is parsed as JSON first)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarRefused(
                    f"{param} is not valid JSON: {exc}", param=param, reason="invalid_json"
                ) from exc

        def build() -> str:
            check_schema(schema, param)
            plain, rules = unique_rules(rewritten(schema))
            return with_unique(to_grammar("json_schema", plain), rules)

        return self._kept_or_built(_key("schema", schema), build, param, schema)

    def for_tools(self, tools: ToolRequest, fmt: ToolFormat) -> str | None:
        """A grammar that admits only calls in `fmt`: one or more (`required`; one when not
        parallel) or exactly one of the forced function; None when the model may answer
        freely."""
        try:
            grammar = self._for_tools(tools, fmt)
        except GrammarRefused as exc:
            self._counter.on_refusal(exc.reason)
            raise
        if grammar is not None:
            self._counter.on_constraint("tool_call")
        return grammar

    def _for_tools(self, tools: ToolRequest, fmt: ToolFormat) -> str | None:
        chosen = tools.chosen()
        if not chosen:
            return None
        many = tools.mode == "required" and tools.parallel

        def build() -> str:
            for i, f in enumerate(tools.functions):
                if f in chosen:
                    # Each schema alone first, so that a refusal names its function.
                    param = f"tools[{i}].function.parameters"
                    if rules_of(self.for_schema(f.parameters, param)):
                        raise GrammarRefused(
                            f"{param}: uniqueItems is enforced in response formats, not yet "
                            "inside tool calls, so the schema is refused rather than the "
                            "keyword ignored",
                            param=param,
                            reason="unsupported_keyword",
                        )
            schema = _calls_schema(chosen, fmt.args_key)
            return to_grammar("grammar", _calls_lark(lark_json(schema), fmt, many))

        key = _key(
            "tools", [f.name for f in chosen], [f.parameters for f in chosen], fmt.name, many
        )
        return self._kept_or_built(key, build, "tools")

    def _kept_or_built(
        self, key: str, build: Callable[[], str], param: str, schema: Any = None
    ) -> str:
        """The grammar kept under `key`, else built; checked against the vocabulary either
        way. A refusal names `param`, and within `schema` the place of a keyword llguidance
        cannot enforce."""
        with self._lock:
            grammar = self._built.get(key)
        try:
            if grammar is None:
                grammar = build()
            # Also for a kept grammar: the vocabulary keeps fewer compiled ones, and one it let
            # go is compiled again here, in the worker thread, not on the engine thread.
            self._vocab.check_grammar(grammar)
        except (ValueError, RecursionError) as exc:
            reason = refusal_reason(exc)
            where = exc.where if isinstance(exc, Unenforceable) else (
                None if schema is None else keyword_path(schema, str(exc))
            )  # fmt: skip
            message = f"{param}: {exc}" if where is None else (
                f"{param}{where}: {exc}: the constraint engine cannot enforce it, so the "
                "schema is refused rather than the keyword ignored"
            )  # fmt: skip
            raise GrammarRefused(message, param=param, reason=reason) from exc
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
    """GrammarRefused naming the first problem: a schema too costly to compile (before any
    other work, see schema_limits.py), an invalid schema, or one no finite JSON satisfies
    (schema_recursion.py). Keywords are llguidance's to judge (it refuses those it cannot
    honour, by name)."""
    if not isinstance(schema, dict):
        raise GrammarRefused(f"{param} must be a JSON object", param=param, reason="invalid_schema")
    for check, reason in ((check_size, "too_large"), (check_counts, "schema_limits")):
        try:
            check(schema, param)
        except InvalidRequest as exc:
            raise GrammarRefused(exc.message, param=param, reason=reason) from exc
    _check_against_metaschema(schema, param)
    cycle = unbounded_ref(schema, param)
    if cycle is not None:
        raise GrammarRefused(
            f"{param} has no finite instance: {cycle} recurses with no base case (each step "
            "is required: a required property, minItems of 1 or more, or no alternative "
            "without it), so no output could ever end",
            param=param,
            reason="unbounded_recursion",
        )


def _check_against_metaschema(schema: dict[str, Any], param: str) -> None:
    try:
        # jsonschema-rs: the draft 2020-12 metaschema check in ~0.05 ms where the pure-Python
        # jsonschema takes ~20 ms of held GIL (stalling the engine thread) on a 60-property
        # schema.
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.instance_path)
        raise GrammarRefused(
            f"{param}{where} is not a valid JSON schema: {exc.message}",
            param=param,
            reason="invalid_schema",
        ) from exc
    except jsonschema_rs.ReferencingError as exc:
        raise GrammarRefused(
            f"{param} is not a valid JSON schema: {exc}", param=param, reason="invalid_schema"
        ) from exc


def _calls_lark(call_json: str, fmt: ToolFormat, many: bool) -> str:
    """Lark: the format's markers around one call (or several), each call's JSON embedded."""
    more = f"({_seq(_literal(fmt.call_sep), 'call')})*" if many else ""
    start = _seq(_literal(fmt.list_open), "call", more, _literal(fmt.list_close))
    call = _seq(_literal(fmt.call_open), "call_json", _literal(fmt.call_close))
    return f"start: {start}\ncall: {call}\ncall_json: {call_json}\n"


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
    return json.dumps(text) if text else ""


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)
