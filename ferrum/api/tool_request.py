"""What a chat request asks of tools: validated `tools`, `tool_choice` and
`parallel_tool_calls`, and the grammar that forces calls when the choice demands them.

The grammar is llama.cpp GBNF: the format's markers around one call's JSON, whose arguments
follow the function's `parameters` schema. Schemas are checked and converted the way
`response_format` schemas are (ferrum/api/structured.py, through the runner); only a forced
call needs that, so `auto` accepts any object schema.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ferrum.api.structured import GrammarRunner, check_schema, compile_grammar
from ferrum.api.tool_calls import ToolFormat
from ferrum.errors import InvalidRequest

# OpenAI allows letters, digits, "_" and "-"; dots are common in MCP tool names.
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI tool dict that chat templates receive in `tools`."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """mode: "none" (no tools in the prompt, output not parsed), "auto", "required" (at least
    one call) or "function" (exactly one call of `forced`)."""

    functions: tuple[Function, ...] = ()
    mode: str = "none"
    forced: str | None = None
    parallel: bool = True

    @classmethod
    def from_body(
        cls, tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None
    ) -> ToolRequest:
        functions = _parse_tools(tools)
        mode, forced = _parse_choice(tool_choice, functions)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise InvalidRequest(
                "parallel_tool_calls must be a boolean", param="parallel_tool_calls"
            )
        return cls(functions, mode, forced, parallel_tool_calls is not False)

    @property
    def active(self) -> bool:
        """Whether tools go into the prompt and calls are parsed out of the output."""
        return self.mode != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [f.as_tool() for f in self.functions] if self.active else None

    def grammar(self, fmt: ToolFormat, runner: GrammarRunner) -> str | None:
        """GBNF that admits only calls in `fmt`: one or more (`required`; one when not
        parallel) or exactly one of the forced function; None when the model may answer
        freely. InvalidRequest when a parameters schema cannot be enforced."""
        if self.mode not in ("required", "function"):
            return None
        chosen = [f for f in self.functions if self.mode == "required" or f.name == self.forced]
        for i, f in enumerate(self.functions):
            if f in chosen:
                check_schema(f.parameters, f"tools[{i}].function.parameters")
        schema = _calls_schema(chosen, fmt.args_key)
        many = self.mode == "required" and self.parallel
        return compile_grammar(
            lambda: _wrap(runner.json_schema_grammar(schema), fmt, many), runner, "tools"
        )


def _wrap(rules: str, fmt: ToolFormat, many: bool) -> str:
    """The converter's rules, its start rule renamed to one call's JSON, under a start rule
    that puts the format's markers around one call (or several)."""
    rules = re.sub(r"(?m)^root ::=", "ferrum-call-json ::=", rules)
    item = _seq(_literal(fmt.call_open), "ferrum-call-json", _literal(fmt.call_close))
    more = f"({_seq(_literal(fmt.call_sep), 'ferrum-call')})*" if many else ""
    root = _seq(_literal(fmt.list_open), "ferrum-call", more, _literal(fmt.list_close))
    return f"root ::= {root}\nferrum-call ::= {item}\n{rules}"


def _parse_tools(tools: Any) -> tuple[Function, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", param="tools")
    functions: list[Function] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidRequest(f"{where}: only function tools are supported", param=where)
        spec = tool.get("function")
        if not isinstance(spec, dict):
            raise InvalidRequest(f"{where}.function must be an object", param=f"{where}.function")
        functions.append(_parse_function(spec, f"{where}.function"))
        if functions[-1].name in (f.name for f in functions[:-1]):
            raise InvalidRequest(
                f"{where}: duplicate function name {functions[-1].name!r}",
                param=f"{where}.function.name",
            )
    return tuple(functions)


def _parse_function(spec: dict[str, Any], where: str) -> Function:
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(
            f"{where}.name must be 1 to 64 letters, digits, '_', '-' or '.'",
            param=f"{where}.name",
        )
    description = spec.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequest(f"{where}.description must be a string", param=f"{where}.description")
    parameters = spec.get("parameters")
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidRequest(
            f"{where}.parameters must be a JSON Schema of type object",
            param=f"{where}.parameters",
        )
    return Function(name, description, parameters)


def _parse_choice(choice: Any, functions: tuple[Function, ...]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if functions else "none"), None
    if choice in _MODES:
        if choice == "required" and not functions:
            raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")
        return ("none" if not functions else choice), None
    spec = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(spec, dict) and choice.get("type") == "function"):
        raise InvalidRequest(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    name = spec.get("name")
    if name not in {f.name for f in functions}:
        raise InvalidRequest(
            f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
        )
    return "function", name


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
