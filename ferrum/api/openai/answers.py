"""OpenAI response shapes for chat and text completions, streamed and whole.

`CompletionKind` captures the few differences between the two endpoints so that one pair of
functions (stream, collect) serves both.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ferrum.api.openai.dialect import OPENAI
from ferrum.api.prompting.tool_calls import ToolCall, ToolFormat
from ferrum.engine.async_engine import RequestStream
from ferrum.engine.outputs import LogprobEntry, RequestOutput
from ferrum.engine.request import FinishReason
from ferrum.errors import EngineError

Logprobs = list[LogprobEntry] | None


@dataclass(frozen=True)
class CompletionKind:
    chat: bool
    # Bytes of a token id: the text of logprob alternatives (not needed without logprobs).
    token_bytes: Callable[[int], bytes] | None = None
    # Set when the request has tools: calls in this format are parsed out of the content.
    tool_format: ToolFormat | None = None

    @property
    def object_whole(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def object_chunk(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def delta_choice(
        self,
        index: int,
        content: str,
        reasoning: str,
        first: bool = False,
        logprobs: Logprobs = None,
        offset: int = 0,
        calls: Sequence[ToolCall] = (),
    ) -> dict[str, Any]:
        lp = self.logprobs(logprobs, offset)
        if not self.chat:
            return {"index": index, "text": content, "logprobs": lp, "finish_reason": None}
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if content or first:
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        if calls:
            delta["tool_calls"] = [{"index": c.index, **_call(c)} for c in calls]
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}

    def whole_choice(
        self,
        index: int,
        content: str,
        reasoning: str,
        finish_reason: str,
        logprobs: Logprobs = None,
    ) -> dict[str, Any]:
        lp = self.logprobs(logprobs, 0)
        if not self.chat:
            return {"index": index, "text": content, "logprobs": lp, "finish_reason": finish_reason}
        calls: list[ToolCall] = []
        if self.tool_format is not None:
            content, calls = self.tool_format.parse(content)
        # refusal is required (nullable) and annotations expected by conformance clients: a
        # local model never refuses through the API, nor annotates.
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content or None,
            "refusal": None,
            "annotations": [],
        }
        if calls:
            message["tool_calls"] = [_call(c) for c in calls]
            finish_reason = "tool_calls"
        elif not content:
            message["content"] = ""
        if reasoning:
            message["reasoning_content"] = reasoning
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish_reason}

    def logprobs(self, entries: Logprobs, offset: int) -> dict[str, Any] | None:
        """Chat: {"content": [...]}; completions: the legacy parallel lists."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e.text)
        return {
            "tokens": [e.text for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _chat_entry(self, e: LogprobEntry) -> dict[str, Any]:
        # The token's share of the text, so that tokens concatenate exactly to the content.
        return {
            "token": e.text,
            "logprob": e.logprob,
            "bytes": list(e.text.encode("utf-8")),
            "top_logprobs": [
                {"token": self._text(t), "logprob": lp, "bytes": list(self._bytes(t))}
                for t, lp in e.top
            ],
        }

    def _bytes(self, token: int) -> bytes:
        return self.token_bytes(token) if self.token_bytes is not None else b""

    def _text(self, token: int) -> str:
        return self._bytes(token).decode("utf-8", "replace")


def _call(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


class _ToolStreams:
    """Per choice, the streamed content with tool calls parsed out (a no-op without tools)."""

    def __init__(self, fmt: ToolFormat | None, n: int):
        self._parsers = [fmt.stream_parser() if fmt else None for _ in range(n)]
        self.called = [False] * n

    def feed(self, i: int, out: RequestOutput) -> tuple[str, list[ToolCall]]:
        parser = self._parsers[i]
        if parser is None:
            return out.content, []
        delta = parser.feed(out.content)
        content, calls = delta.content, delta.calls
        if out.finished:
            tail = parser.finish()
            content, calls = content + tail.content, calls + tail.calls
        self.called[i] = self.called[i] or bool(calls)
        return content, calls


def usage(finals: list[RequestOutput]) -> dict[str, Any]:
    """One prompt, n completions: the prompt counts once, completions add up."""
    prompt = finals[0].prompt_tokens
    completion = sum(f.completion_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": max(f.cached_tokens for f in finals)},
    }


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def failure(out: RequestOutput) -> EngineError | None:
    """Why a request ended without a result: an engine error, or an abort it did not ask for
    (a client's own abort closes its stream first, so it never reads one)."""
    if out.finish_reason is FinishReason.ERROR:
        return out.error or EngineError("the engine failed the request")
    if out.finish_reason is FinishReason.ABORT:
        return EngineError("the request was aborted")
    return None


def _reason(out: RequestOutput) -> str:
    """OpenAI's finish_reason of a finished output (stop or length; failures raise before)."""
    if out.finish_reason is None:
        raise EngineError("a finished output without a finish reason")
    return out.finish_reason.value


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from all streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for out in stream:
            queue.put_nowait((i, out))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    unfinished = len(streams)
    try:
        while unfinished:
            i, out = await queue.get()
            unfinished -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def collect(
    streams: list[RequestStream], kind: CompletionKind, request_id: str, model: str
) -> dict[str, Any]:
    content: list[list[str]] = [[] for _ in streams]
    reasoning: list[list[str]] = [[] for _ in streams]
    logprobs: list[Logprobs] = [None] * len(streams)
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in _merged(streams):
        content[i].append(out.content)
        reasoning[i].append(out.reasoning)
        if out.logprobs is not None:
            logprobs[i] = (logprobs[i] or []) + out.logprobs
        if out.finished:
            if (err := failure(out)) is not None:
                raise err
            finals[i] = out
    if any(f is None for f in finals):  # each stream ends with a finished output: guard it
        raise EngineError("the engine closed a request without a result")
    done = [f for f in finals if f is not None]
    choices = [
        kind.whole_choice(i, "".join(content[i]), "".join(reasoning[i]), _reason(f), logprobs[i])
        for i, f in enumerate(done)
    ]
    return {
        "id": request_id,
        "object": kind.object_whole,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(done),
    }


async def stream_sse(
    streams: list[RequestStream],
    kind: CompletionKind,
    request_id: str,
    model: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE events: role chunks, deltas, finish chunks (the last with usage), usage, [DONE]."""
    base = {
        "id": request_id,
        "object": kind.object_chunk,
        "created": int(time.time()),
        "model": model,
    }
    if kind.chat:
        for i in range(len(streams)):
            yield _sse({**base, "choices": [kind.delta_choice(i, "", "", first=True)]})
    finals: list[RequestOutput] = []
    offsets = [0] * len(streams)  # characters sent per choice: logprobs' text_offset
    tools = _ToolStreams(kind.tool_format, len(streams))
    async for i, out in _merged(streams):
        if out.finished and (err := failure(out)) is not None:
            yield OPENAI.stream_error(err)
            break
        content, calls = tools.feed(i, out)
        if content or out.reasoning or out.logprobs or calls:
            choice = kind.delta_choice(
                i, content, out.reasoning, logprobs=out.logprobs, offset=offsets[i], calls=calls
            )
            offsets[i] += len(content)
            yield _sse({**base, "choices": [choice]})
        if out.finished:
            finals.append(out)
            choice = kind.delta_choice(i, "", "")
            if kind.chat:
                choice["delta"] = {}
            choice["finish_reason"] = "tool_calls" if tools.called[i] else _reason(out)
            chunk: dict[str, Any] = {**base, "choices": [choice]}
            if len(finals) == len(streams):
                chunk["usage"] = usage(finals)
            yield _sse(chunk)
    if include_usage and len(finals) == len(streams):
        yield _sse({**base, "choices": [], "usage": usage(finals)})
    yield "data: [DONE]\n\n"
