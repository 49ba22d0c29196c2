"""OpenAI response shapes for chat and text completions, streamed and whole.

`CompletionKind` captures the few differences between the two endpoints so that one pair of
functions (stream, collect) serves both.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ferrum.engine.async_engine import RequestStream
from ferrum.engine.outputs import RequestOutput
from ferrum.errors import EngineError


@dataclass(frozen=True)
class CompletionKind:
    chat: bool

    @property
    def object_whole(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def object_chunk(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def delta_choice(self, content: str, reasoning: str, first: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": content, "logprobs": None, "finish_reason": None}
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if content or first:
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}

    def whole_choice(self, content: str, reasoning: str, finish_reason: str) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}


def usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _raise_if_failed(out: RequestOutput) -> None:
    if out.finish_reason in ("error", "abort"):
        raise EngineError(out.error or f"request ended: {out.finish_reason}")


async def collect(
    stream: RequestStream, kind: CompletionKind, request_id: str, model: str
) -> dict[str, Any]:
    content: list[str] = []
    reasoning: list[str] = []
    last = None
    async for out in stream:
        content.append(out.content)
        reasoning.append(out.reasoning)
        last = out
    if last is None:  # a stream always ends with a finished output; guard the contract
        raise EngineError("the engine closed the request without a result")
    _raise_if_failed(last)
    return {
        "id": request_id,
        "object": kind.object_whole,
        "created": int(time.time()),
        "model": model,
        "choices": [kind.whole_choice("".join(content), "".join(reasoning), last.finish_reason)],
        "usage": usage(last),
    }


async def stream_sse(
    stream: RequestStream,
    kind: CompletionKind,
    request_id: str,
    model: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE events: role chunk, deltas, the finish chunk (with usage), usage chunk, [DONE]."""
    created = int(time.time())
    base = {"id": request_id, "object": kind.object_chunk, "created": created, "model": model}
    first = kind.chat
    if first:
        yield _sse({**base, "choices": [kind.delta_choice("", "", True)]})
        first = False
    async for out in stream:
        if out.finished and out.finish_reason in ("error", "abort"):
            err = EngineError(out.error or f"request ended: {out.finish_reason}")
            yield _sse(err.to_dict())
            break
        if out.content or out.reasoning:
            yield _sse({**base, "choices": [kind.delta_choice(out.content, out.reasoning, first)]})
        if out.finished:
            choice = kind.delta_choice("", "", False)
            if kind.chat:
                choice["delta"] = {}
            choice["finish_reason"] = out.finish_reason
            yield _sse({**base, "choices": [choice], "usage": usage(out)})
            if include_usage:
                yield _sse({**base, "choices": [], "usage": usage(out)})
    yield "data: [DONE]\n\n"
