"""The messages of an Anthropic Messages body (`bodies.py`): their content blocks, and their
translation into the OpenAI chat body's messages.

Rules:
- Content is a string or blocks: `text`, `image`, `tool_use`, `tool_result`, `thinking` and
  `redacted_thinking`; `document` blocks are refused by name. System blocks and a user turn's
  adjacent text blocks are joined by a blank line, an assistant's by nothing (its own text,
  split around tool calls).
- A user turn's `image` blocks (`source` {base64, media_type, data}) become `image_url` parts
  (data URIs) in their place among its text, served as the OpenAI chat's images are
  (`prompting/images.py`); an error names the block (`bodies.image_params`). A `url` or `file`
  source is refused by name: ferrum fetches nothing. Images in an assistant turn or a
  tool_result are refused.
- Tool turns: an assistant's `tool_use` blocks become its `tool_calls`, its `thinking` its
  `reasoning_content` (`redacted_thinking` is dropped: nothing can read it). A user turn's
  `tool_result` blocks become `tool` messages, in order, before the turn's text; one with
  `is_error` says so in its content, which is all a chat template can carry. A result that
  answers no earlier `tool_use` is a 400 naming it.
- Tool ids: each `tool_use` id is given an OpenAI call id by its position in the conversation
  (`call00000`, ...): 9 alphanumeric characters, the only ids Mistral's templates accept, and
  the same on every turn of a growing conversation, so its prompt prefix stays reusable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ferrum.api.openai.bodies import MAX_CONTENT_PARTS
from ferrum.errors import InvalidRequest

__all__ = ["Body", "Message", "TextBlock", "chat_messages", "image_blocks"]


class Body(BaseModel):
    # As in openai/bodies.py: wrong JSON types are refused, unknown fields tolerated.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


# -- content blocks -------------------------------------------------------------------------


class TextBlock(Body):
    type: Literal["text"]
    text: str


class MediaBlock(Body):
    """A document: parsed only to be refused by name."""

    type: Literal["document"]


class ImageSource(Body):
    type: Literal["base64", "url", "file"]
    media_type: str = ""
    data: str = ""


class ImageBlock(Body):
    type: Literal["image"]
    source: ImageSource

    def data_uri(self, where: str) -> str:
        source = self.source
        if source.type != "base64":
            raise InvalidRequest(
                f"{where}.source: {source.type} image sources are not supported: ferrum fetches "
                "nothing; send the image as base64 (source type base64)",
                param=f"{where}.source.type",
            )
        if not source.media_type:
            raise InvalidRequest(
                f"{where}.source.media_type: a base64 image names its type (image/png or "
                "image/jpeg)", param=f"{where}.source.media_type",
            )  # fmt: skip
        return f"data:{source.media_type};base64,{source.data}"


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: str
    input: dict[str, Any]


_ResultPart = Annotated[TextBlock | ImageBlock | MediaBlock, Field(discriminator="type")]


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | Annotated[list[_ResultPart], Field(max_length=MAX_CONTENT_PARTS)] = ""
    is_error: bool = False


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: str = ""


Block = Annotated[
    TextBlock
    | ImageBlock
    | MediaBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(Body):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=MAX_CONTENT_PARTS)]


# -- into the OpenAI chat messages ----------------------------------------------------------


def image_blocks(messages: Sequence[Message]) -> list[str]:
    """Each image block's param, in prompt order (as `chat_messages` keeps them)."""
    return [
        f"messages[{i}].content[{j}]"
        for i, m in enumerate(messages) if not isinstance(m.content, str)
        for j, block in enumerate(m.content) if isinstance(block, ImageBlock)
    ]  # fmt: skip


def _system(system: str | list[TextBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n\n".join(b.text for b in system)


def chat_messages(
    system: str | list[TextBlock] | None, messages: Sequence[Message]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if text := _system(system):
        out.append({"role": "system", "content": text})
    calls = _Calls()
    for i, m in enumerate(messages):
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
            f"{where}: {block.type} blocks are not supported: ferrum reads text and images",
            param=f"{where}.type",
        )
    if isinstance(block, ImageBlock):
        return InvalidRequest(
            f"{where}: images are taken in a user message's content, not in a {role} block",
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
    """The turn's tool results as tool messages, then its text and images (if any) as a user
    message: its text alone when it has no images, parts in block order when it has."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, ToolResultBlock):
            results.append(calls.answer(where, block))
        elif isinstance(block, TextBlock):
            if parts and parts[-1]["type"] == "text":
                parts[-1]["text"] += "\n\n" + block.text
            else:
                parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": block.data_uri(where)}})
        else:
            raise _refused(where, block, "user")
    if parts or not results:
        texts = [p["text"] for p in parts if p["type"] == "text"]
        plain = len(texts) == len(parts)
        results.append({"role": "user", "content": "".join(texts) if plain else parts})
    return results
