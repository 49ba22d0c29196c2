"""/v1/messages answered as Anthropic's message object, whole or as its server-sent events.

A stream is:

    message_start                    the message, content [], stop_reason null, input usage
    ping
    content_block_start   index 0    thinking "" (only with thinking enabled)
    content_block_delta   index 0    thinking_delta ... then one signature_delta
    content_block_stop    index 0
    content_block_start   index 1    text ""
    content_block_delta   index 1    text_delta ...
    content_block_stop    index 1
    content_block_start   index 2    tool_use {id, name, input {}}
    content_block_delta   index 2    input_json_delta: the whole input as partial_json
    content_block_stop    index 2
    message_delta                    stop_reason, stop_sequence, usage
    message_stop

Blocks open in the order the model writes them (thinking and text may alternate); a tool
call is parsed whole (`prompting/tool_calls.py`), so its input comes in one delta.
message_start waits for the engine's first output, which says how much of the prompt was
cached. A failure or the deadline ends the stream with an `error` event in the same shape as
an error response.

Rules:
- stop_reason: tool_use when the model made calls, max_tokens when it ran out, stop_sequence
  (naming it) when one of the request's stop_sequences ended it, end_turn otherwise.
- Every field the published schema requires is written (`tests/schemas/anthropic-messages.json`),
  null where it allows and ferrum has nothing to say: a message's container and stop_details,
  a text block's citations; a tool_use block's caller is the model itself (direct).
- usage: input_tokens are the prompt tokens not read from the cache
  (cache_read_input_tokens); ferrum writes no cache a client pays for, so
  cache_creation_input_tokens and both of cache_creation's figures are 0; thinking_tokens
  are the output tokens spent inside `<think>` (shown or not); no server tools, one tier
  (standard). message_delta's usage has the fields of the schema's MessageDeltaUsage.
- Signatures are empty: ferrum signs no thinking, and accepts the thinking blocks it gets back
  without checking theirs.
- A tool call whose arguments are not a JSON object has the input {}.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response

from ferrum.api.anthropic.dialect import ANTHROPIC
from ferrum.api.generation import Delta, Event, Finish, gathered
from ferrum.api.prompting.tool_calls import ToolCall
from ferrum.api.serving import Prepared
from ferrum.engine.outputs import RequestOutput
from ferrum.errors import FerrumError, RequestTimeout

__all__ = ["MessageAnswer"]


def _event(kind: str, data: dict[str, Any]) -> str:
    body = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {body}\n\n"


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": call.name,
        "input": _input(call.arguments),
        "caller": {"type": "direct"},
    }


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text, "citations": None}


def _delta_usage(out: RequestOutput | None, output_tokens: int, thinking: int) -> dict[str, Any]:
    """The schema's MessageDeltaUsage (message_delta's), and the core of a message's Usage."""
    prompt, cached = (out.prompt_tokens, out.cached_tokens) if out is not None else (0, 0)
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
        "output_tokens_details": {"thinking_tokens": min(thinking, output_tokens)},
        "server_tool_use": None,
    }


def _usage(out: RequestOutput | None, output_tokens: int, thinking: int) -> dict[str, Any]:
    """The schema's Usage, a message's."""
    return {
        **_delta_usage(out, output_tokens, thinking),
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "inference_geo": None,
        "service_tier": "standard",
    }


@dataclass
class _Thinking:
    """Output tokens spent thinking: each delta's tokens by the reasoning's share of its text
    (outputs can arrive merged into one delta)."""

    tokens: int = 0

    def feed(self, delta: Delta) -> None:
        if delta.reasoning:
            share = len(delta.reasoning) / (len(delta.reasoning) + len(delta.content))
            self.tokens += round(delta.tokens * share)

    async def counted(self, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        async for event in events:
            if isinstance(event, Delta):
                self.feed(event)
            yield event


class _Blocks:
    """The content blocks of a streamed message: the open one and its index."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def write(self, kind: str, text: str) -> list[str]:
        """`text` added to a block of `kind` (thinking or text), opened if need be."""
        block = _text("") if kind == "text" else {kind: ""}
        lines = [] if self.open == kind else [*self.close(), *self._start(block, kind)]
        delta = {"type": f"{kind}_delta", kind: text}
        return [*lines, self._delta(delta)]

    def call(self, call: ToolCall) -> list[str]:
        """One whole tool_use block."""
        block = _tool_use(call)
        partial = json.dumps(block["input"], ensure_ascii=False)
        return [
            *self.close(),
            *self._start({**block, "input": {}}, "tool_use"),
            self._delta({"type": "input_json_delta", "partial_json": partial}),
            *self.close(),
        ]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        lines = []
        if self.open == "thinking":
            lines.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return [*lines, _event("content_block_stop", {"index": self.index})]

    def _start(self, block: dict[str, Any], kind: str) -> list[str]:
        self.index += 1
        self.open = kind
        if kind == "thinking":
            block = {**block, "signature": ""}
        content = {"type": kind, **block}
        return [_event("content_block_start", {"index": self.index, "content_block": content})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})


@dataclass
class MessageAnswer:
    """How one /v1/messages request is answered (a `generation.Answer`)."""

    model: str
    stream: bool
    thinking: bool  # thinking blocks shown (thinking enabled) or dropped
    stop_sequences: tuple[str, ...]
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex[:24]}")
    media_type: str = "text/event-stream"
    first: RequestOutput | None = None

    def on_output(self, out: RequestOutput) -> None:
        self.first = self.first or out

    def begin(self, prepared: Prepared) -> None:
        pass

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "container": None,
            "stop_reason": None,
            "stop_sequence": None,
            "stop_details": None,
        }

    def _stop(self, finish: Finish) -> dict[str, Any]:
        """The message's stop_reason, stop_sequence and (null) stop_details."""
        stop, sequence = finish.output.stop_string, None
        if finish.called:
            reason = "tool_use"
        elif finish.reason == "length":
            reason = "max_tokens"
        elif stop is not None and stop in self.stop_sequences:
            reason, sequence = "stop_sequence", stop
        else:
            reason = "end_turn"
        return {"stop_reason": reason, "stop_sequence": sequence, "stop_details": None}

    def _start(self) -> list[str]:
        start = {"message": {**self._message([]), "usage": _usage(self.first, 0, 0)}}
        return [_event("message_start", start), _event("ping", {})]

    def _end(self, blocks: _Blocks, finish: Finish, thinking: int) -> list[str]:
        out = finish.output
        delta = {
            "delta": {"container": None, **self._stop(finish)},
            "usage": _delta_usage(out, out.completion_tokens, thinking),
        }
        return [*blocks.close(), _event("message_delta", delta), _event("message_stop", {})]

    async def lines(self, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        blocks = _Blocks()
        thinking = _Thinking()
        started = False
        try:
            async for event in thinking.counted(events):
                lines = [] if started else self._start()
                started = True
                if isinstance(event, Finish):
                    lines += self._end(blocks, event, thinking.tokens)
                else:
                    if self.thinking and event.reasoning:
                        lines += blocks.write("thinking", event.reasoning)
                    if event.content:
                        lines += blocks.write("text", event.content)
                    for call in event.calls:
                        lines += blocks.call(call)
                for line in lines:
                    yield line
        except FerrumError as exc:
            yield ANTHROPIC.stream_error(exc)

    async def whole(self, events: AsyncIterator[Event]) -> Response:
        thinking = _Thinking()
        total, finish = await gathered(thinking.counted(events))
        out = finish.output
        message = self._message(self._content(total))
        usage = _usage(out, out.completion_tokens, thinking.tokens)
        message.update(self._stop(finish), usage=usage)
        return JSONResponse(message)

    def _content(self, total: Delta) -> list[dict[str, Any]]:
        content: list[dict[str, Any]] = []
        if self.thinking and total.reasoning:
            content.append({"type": "thinking", "thinking": total.reasoning, "signature": ""})
        if total.content:
            content.append(_text(total.content))
        return content + [_tool_use(c) for c in total.calls]

    def timeout_lines(self, err: RequestTimeout) -> list[str]:
        return [ANTHROPIC.stream_error(err)]
