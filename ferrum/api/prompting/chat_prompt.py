"""A chat's prompt tokens from its messages, as a replica and a cluster's ingress compute them,
and where later prompts are likely to part from it."""

from __future__ import annotations

from typing import Any

from ferrum.api.openai.bodies import ChatCompletionRequest
from ferrum.api.prompting.chat_template import ChatFormatter, Tokenize
from ferrum.api.prompting.tool_request import ToolRequest
from ferrum.engine.contracts import Vocabulary


def chat_prompt(
    formatter: ChatFormatter,
    vocab: Vocabulary,
    system: str,
    body: ChatCompletionRequest,
    tools: ToolRequest,
    tokenize: Tokenize | None = None,
) -> list[int]:
    """A chat's prompt tokens: its messages (the preset's system prompt first when they bring
    none) and tools rendered by the template. A cluster's ingress computes the same tokens to
    route on (`ferrum.cluster.keys`)."""
    messages = chat_messages(system, body)
    return formatter.tokenize(messages, tokenize or vocab.tokenize, tools.template_tools())


def chat_messages(system: str, body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The body's messages as the template reads them, the preset's `system` prompt first
    when they bring none."""
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    if system and not any(m["role"] in ("system", "developer") for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def parting_points(starts: list[int]) -> tuple[int, ...]:
    """Where later prompts are likely to part from this one, for the engine's window
    checkpoints (`engine/kv/checkpoints.py`): the start of the second client string (a new
    conversation behind the same system prompt) and of the last (another last turn of the
    same conversation). Two at most: each is a state of the whole prefix, kept in RAM."""
    return tuple(sorted(set(starts[1:2] + starts[-1:])))
