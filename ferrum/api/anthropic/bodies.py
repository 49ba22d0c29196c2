"""Anthropic's Messages request bodies and their translation into the OpenAI chat body
(`openai/bodies.py`), which the shared serving path takes from there.

Rules:
- The bodies refuse wrong JSON types and tolerate unknown fields (`metadata`,
  `cache_control`, `service_tier`...), as `openai/bodies.py` does. `max_tokens` is required on
  /v1/messages, as Anthropic requires it; /v1/messages/count_tokens takes the same body
  without it.
- Content is a string or blocks: `text`, `tool_use`, `tool_result`, `thinking` and
  `redacted_thinking`. `image` and `document` blocks are refused by name: ferrum serves text
  models. System blocks and a user turn's text blocks are joined by a blank line, an
  assistant's by nothing (its own text, split around tool calls).
- Tool turns: an assistant's `tool_use` blocks become its `tool_calls`, its `thinking` its
  `reasoning_content` (`redacted_thinking` is dropped: nothing can read it). A user turn's
  `tool_result` blocks become `tool` messages, in order, before the turn's text; one with
  `is_error` says so in its content, which is all a chat template can carry. A result that
  answers no earlier `tool_use` is a 400 naming it.
- Tool ids: each `tool_use` id is given an OpenAI call id by its position in the conversation
  (`call00000`, ...): 9 alphanumeric characters, the only ids Mistral's templates accept, and
  the same on every turn of a growing conversation, so its prompt prefix stays reusable.
- `tools` are custom tools (`name`, `description`, `input_schema`); server tools (a `type`
  such as `web_search_20250305` or `bash_20250124`) are refused by name: nothing here runs
  them. `tool_choice` {auto, any, tool, none} is OpenAI's auto, required, the named function
  and none; `disable_parallel_tool_use` is `parallel_tool_calls: false`.
- `thinking` {enabled}, {adaptive} or {between_tools} returns the reasoning the engine splits
  out of `<think>` as thinking blocks; {disabled}, `display: omitted` or no `thinking` drops
  it (as Anthropic answers without thinking by default). `budget_tokens` is accepted and not
  enforced: the reasoning counts against `max_tokens`. ferrum cannot tell a template whether
  to think, so a model may think unseen.
- `output_config.format` {json_schema, schema} is structured output: a JSON Schema grammar,
  as `response_format` on the OpenAI routes; `output_config.effort` is accepted and ignored.
- A final assistant message (Anthropic's prefill) is rendered as a finished turn: the chat
  templates cannot continue it, so the model answers after it.
- An error in the translated body names its parameter as the Anthropic client wrote it
  (`stop_sequences`, `tools[0].input_schema`): `renamed`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ferrum.api.openai.bodies import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_TOOLS,
    ChatCompletionRequest,
)
from ferrum.errors import InvalidRequest

__all__ = ["CountTokensBody", "MessagesBody", "chat_request", "parse", "renamed"]

M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    # As in openai/bodies.py: wrong JSON types are refused, unknown fields tolerated.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


# -- content blocks -------------------------------------------------------------------------


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class MediaBlock(_Body):
    """An image or a document: parsed only to be refused by name."""

    type: Literal["image", "document"]


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: str
    input: dict[str, Any]


_ResultPart = Annotated[TextBlock | MediaBlock, Field(discriminator="type")]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | Annotated[list[_ResultPart], Field(max_length=MAX_CONTENT_PARTS)] = ""
    is_error: bool = False


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str = ""


Block = Annotated[
    TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=MAX_CONTENT_PARTS)]


# -- tools and settings ---------------------------------------------------------------------


class ToolDef(_Body):
    name: str
    type: str | None = None  # None or "custom"; anything else is a server tool
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Body):
    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    # "schema" would shadow a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None
    effort: str | None = None  # accepted, not honoured: the model thinks as its template says


class CountTokensBody(_Body):
    """What a conversation is: /v1/messages/count_tokens takes this much."""

    model: str = ""
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    @property
    def shows_thinking(self) -> bool:
        t = self.thinking
        return t is not None and t.type != "disabled" and t.display != "omitted"


class MessagesBody(CountTokensBody):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


async def parse(request: Request, model: type[M]) -> M:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise _invalid(exc.errors()) from None


def _invalid(errors: Sequence[Any]) -> InvalidRequest:
    """pydantic's errors as one 400 naming the parameter of the most specific one: a string
    or a list of blocks fails as both, and the deeper error says what is wrong."""
    if not errors:
        return InvalidRequest("invalid request")
    if errors[0].get("type") == "json_invalid":
        return InvalidRequest("the request body is not valid JSON")
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    param = _param(first.get("loc", ())) or None
    msg = first.get("msg", "invalid request")
    return InvalidRequest(f"{param}: {msg}" if param else msg, param=param)


def _param(loc: Sequence[int | str]) -> str:
    """`messages[0].content[1].input` out of pydantic's location, whose union members are
    named (`str`, `list[tagged-union[...]]`) and whose tagged members carry their tag after the
    list index (`..., 1, 'tool_use', 'input'`)."""
    param, tagged, tag_next = "", False, False
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
            tag_next, tagged = tagged, False
        elif tag_next:
            tag_next = False
        elif part.startswith("list[tagged-union["):
            tagged = True
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in ("str", "list", "none"):
            param += f".{part}" if param else part
    return param


# -- into the OpenAI chat body --------------------------------------------------------------

# OpenAI body parameters as an Anthropic client wrote them, for error messages.
_ANTHROPIC_PARAMS = [
    (re.compile(r"\btools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"\btools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^stop\b"), "stop_sequences"),
    (re.compile(r"^response_format(\.json_schema)?"), "output_config.format"),
]


def renamed(err: InvalidRequest) -> InvalidRequest:
    """The error with its parameter named as the Anthropic client wrote it."""
    old = new = err.param or ""
    for pattern, name in _ANTHROPIC_PARAMS:
        new = pattern.sub(name, new)
    if new == old:
        return err
    return InvalidRequest(err.message.replace(old, new, 1), param=new)


def chat_request(body: CountTokensBody) -> ChatCompletionRequest:
    """The OpenAI chat body of an Anthropic one: only the sampling fields the request gives,
    so that the model preset's defaults fill the rest (`serving.with_defaults`)."""
    fields: dict[str, Any] = {"model": body.model, "messages": _messages(body)}
    if isinstance(body, MessagesBody):
        fields["max_tokens"] = body.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if (value := getattr(body, name)) is not None:
                fields[name] = value
        if body.stop_sequences:
            fields["stop"] = body.stop_sequences
    if body.tools:
        fields["tools"] = [_function(i, t) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields.update(_tool_choice(body.tool_choice))
    if body.output_config is not None and body.output_config.format is not None:
        schema = body.output_config.format.json_schema
        fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise renamed(_invalid(exc.errors())) from None


def _function(i: int, tool: ToolDef) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise InvalidRequest(
            f"tools[{i}]: {tool.name!r} is a server tool ({tool.type}); ferrum runs only custom "
            "tools (name, description, input_schema), which the client executes",
            param=f"tools[{i}].type",
        )
    if tool.input_schema is None:
        raise InvalidRequest(
            f"tools[{i}].input_schema: a custom tool needs one", param=f"tools[{i}].input_schema"
        )
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest(
                "tool_choice.name: a choice of type 'tool' names the tool", param="tool_choice.name"
            )
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def _system(system: str | list[TextBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n\n".join(b.text for b in system)


def _messages(body: CountTokensBody) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system := _system(body.system):
        out.append({"role": "system", "content": system})
    calls = _Calls()
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant(i, m.content, calls))
        else:
            out += _user(i, m.content, calls)
    return out


class _Calls:
    """The conversation's tool_use ids so far, each with its OpenAI id and tool name."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[str, str]] = {}

    def add(self, where: str, block: ToolUseBlock) -> str:
        if block.id in self.seen:
            raise InvalidRequest(
                f"{where}.id: tool_use id {block.id!r} is used twice", param=f"{where}.id"
            )
        openai_id = f"call{len(self.seen):05d}"
        self.seen[block.id] = (openai_id, block.name)
        return openai_id

    def answer(self, where: str, block: ToolResultBlock) -> dict[str, Any]:
        found = self.seen.get(block.tool_use_id)
        if found is None:
            raise InvalidRequest(
                f"{where}.tool_use_id: {block.tool_use_id!r} answers no earlier tool_use block",
                param=f"{where}.tool_use_id",
            )
        content = _result_text(where, block)
        if block.is_error:
            content = f"Error: {content}"
        return {"role": "tool", "tool_call_id": found[0], "name": found[1], "content": content}


def _refused(where: str, block: Any, role: str) -> InvalidRequest:
    if isinstance(block, MediaBlock):
        return InvalidRequest(
            f"{where}: {block.type} blocks are not supported: ferrum serves text models",
            param=f"{where}.type",
        )
    return InvalidRequest(
        f"{where}: a {block.type} block cannot be in a {role} message", param=f"{where}.type"
    )


def _result_text(where: str, block: ToolResultBlock) -> str:
    if isinstance(block.content, str):
        return block.content
    texts = []
    for k, part in enumerate(block.content):
        if not isinstance(part, TextBlock):
            raise _refused(f"{where}.content[{k}]", part, "tool_result")
        texts.append(part.text)
    return "\n".join(texts)


def _assistant(i: int, blocks: list[Any], calls: _Calls) -> dict[str, Any]:
    text, reasoning, tool_calls = [], [], []
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            openai_id = calls.add(where, block)
            function = {"name": block.name, "arguments": block.input}
            tool_calls.append({"id": openai_id, "type": "function", "function": function})
        elif not isinstance(block, RedactedThinkingBlock):
            raise _refused(where, block, "assistant")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def _user(i: int, blocks: list[Any], calls: _Calls) -> list[dict[str, Any]]:
    """The turn's tool results as tool messages, then its text (if any) as a user message."""
    results, text = [], []
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, ToolResultBlock):
            results.append(calls.answer(where, block))
        elif isinstance(block, TextBlock):
            text.append(block.text)
        else:
            raise _refused(where, block, "user")
    if text or not results:
        results.append({"role": "user", "content": "\n\n".join(text)})
    return results
