"""What a chat request asks of tools: `tools`, `tool_choice` and `parallel_tool_calls`
(their shapes validated by the pydantic models in `openai/bodies.py`; here what relates them: unique
names, a choice that names a tool), and which functions a forcing choice must call
(`grammar.py` turns those into the grammar; only a forced call checks its schema, so
`auto` accepts any object schema)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ferrum.api.openai.bodies import NamedToolChoice, Tool, ToolChoice
from ferrum.errors import InvalidRequest

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


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
        cls,
        tools: Sequence[Tool] | None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> ToolRequest:
        functions = _functions(tools or ())
        mode, forced = _choice(tool_choice, functions)
        return cls(functions, mode, forced, parallel_tool_calls is not False)

    @property
    def active(self) -> bool:
        """Whether tools go into the prompt and calls are parsed out of the output."""
        return self.mode != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [f.as_tool() for f in self.functions] if self.active else None

    def chosen(self) -> list[Function]:
        """The functions a grammar must force calls of: all (`required`), the named one
        (`function`), or none when the model may answer freely."""
        if self.mode not in ("required", "function"):
            return []
        return [f for f in self.functions if self.mode == "required" or f.name == self.forced]


def _functions(tools: Sequence[Tool]) -> tuple[Function, ...]:
    functions: list[Function] = []
    for i, tool in enumerate(tools):
        spec = tool.function
        if spec.name in (f.name for f in functions):
            raise InvalidRequest(
                f"tools[{i}]: duplicate function name {spec.name!r}",
                param=f"tools[{i}].function.name",
            )
        parameters = spec.parameters if spec.parameters is not None else _EMPTY_PARAMETERS
        functions.append(Function(spec.name, spec.description or "", parameters))
    return tuple(functions)


def _choice(choice: ToolChoice | None, functions: tuple[Function, ...]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {f.name for f in functions}:
            raise InvalidRequest(
                f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
            )
        return "function", name
    if choice == "required" and not functions:
        raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")
    return ("none" if not functions else choice), None
