"""Anthropic's Messages request bodies and their translation into the OpenAI chat body
(`openai/bodies.py`), which the shared serving path takes from there.

Rules:
- The bodies refuse wrong JSON types and tolerate unknown fields (`metadata`,
  `cache_control`, `service_tier`...), as `openai/bodies.py` does. `max_tokens` is required on
  /v1/messages, as Anthropic requires it; /v1/messages/count_tokens takes the same body
  without it.
- The messages' content blocks and their translation (text, images, tool turns): see
  `conversation.py`.
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
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, Field, ValidationError

from ferrum.api.anthropic.conversation import Body as _Body
from ferrum.api.anthropic.conversation import Message, TextBlock, chat_messages, image_blocks
from ferrum.api.openai.bodies import MAX_MESSAGES, MAX_TOOLS, ChatCompletionRequest
from ferrum.api.prompting.images import image_names, renamed_image
from ferrum.errors import InvalidRequest

__all__ = ["CountTokensBody", "MessagesBody", "chat_request", "image_params", "parse", "renamed"]

M = TypeVar("M", bound=BaseModel)


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


def renamed(err: InvalidRequest, images: Mapping[str, str] | None = None) -> InvalidRequest:
    """The error with its parameter named as the Anthropic client wrote it; `images`: the
    request's image names (`image_params`)."""
    if images and (named := renamed_image(err, images)) is not None:
        return named
    old = new = err.param or ""
    for pattern, name in _ANTHROPIC_PARAMS:
        new = pattern.sub(name, new)
    if new == old:
        return err
    return InvalidRequest(err.message.replace(old, new, 1), param=new)


def image_params(body: CountTokensBody, served: ChatCompletionRequest) -> dict[str, str]:
    """The request's image names: those of `served` (its `chat_request`) → the client's."""
    return image_names(served.messages, image_blocks(body.messages))


def chat_request(body: CountTokensBody) -> ChatCompletionRequest:
    """The OpenAI chat body of an Anthropic one: only the sampling fields the request gives,
    so that the model preset's defaults fill the rest (`serving.with_defaults`)."""
    messages = chat_messages(body.system, body.messages)
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
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
