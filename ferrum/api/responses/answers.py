"""A generation answered as a Responses API response: output items built from the deltas
(reasoning, message, function calls), streamed as the Responses event sequence or sent
whole, and stored for continuations.

One `_Items` builder makes the items for both ways of answering, so a streamed response and
a whole one hold the same output. Stream order: `response.created`, `response.in_progress`,
then per item `output_item.added`, its content part or arguments events, `output_item.done`,
and last `response.completed` (or `response.incomplete` when max_output_tokens cut it, or
`response.failed`, which is also how a deadline or an engine failure ends a stream that has
begun). Every event carries a `sequence_number`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response

from ferrum.api.generation import Delta, Event, Finish
from ferrum.api.prompting.tool_calls import ToolCall
from ferrum.api.responses.bodies import Messages
from ferrum.api.responses.store import ResponseStore
from ferrum.api.serving import Prepared
from ferrum.engine.outputs import RequestOutput
from ferrum.errors import EngineError, FerrumError, RequestTimeout

SSE = "text/event-stream"
StreamEvent = tuple[str, dict[str, Any]]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


@dataclass
class _Open:
    """The item being written: a message's text or a reasoning item's."""

    item: dict[str, Any]
    index: int
    text: str = ""

    @property
    def reasoning(self) -> bool:
        return bool(self.item["type"] == "reasoning")


@dataclass
class _Items:
    """Output items from a generation's deltas, and the stream events that build them."""

    items: list[dict[str, Any]] = field(default_factory=list)
    reasoning_tokens: int = 0
    _open: _Open | None = None

    def feed(self, delta: Delta) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if delta.reasoning:
            # The delta's tokens by their share of its text: outputs can arrive merged.
            share = len(delta.reasoning) / (len(delta.reasoning) + len(delta.content))
            self.reasoning_tokens += round(delta.tokens * share)
            events += self._write(delta.reasoning, reasoning=True)
        if delta.content:
            events += self._write(delta.content, reasoning=False)
        for call in delta.calls:
            events += self._close("completed") + self._call(call)
        return events

    def finish(self, status: str) -> list[StreamEvent]:
        return self._close(status)

    def _write(self, text: str, reasoning: bool) -> list[StreamEvent]:
        events = []
        if self._open is None or self._open.reasoning != reasoning:
            events += self._close("completed") + self._start(reasoning)
        assert self._open is not None
        self._open.text += text
        kind = "response.reasoning_text.delta" if reasoning else "response.output_text.delta"
        delta: dict[str, Any] = {**self._where(), "delta": text}
        if not reasoning:
            delta["logprobs"] = []
        return events + [(kind, delta)]

    def _start(self, reasoning: bool) -> list[StreamEvent]:
        if reasoning:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}  # fmt: skip
            part = _reasoning_part("")
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}  # fmt: skip
            part = _text_part("")
        self._open = _Open(item, len(self.items))
        self.items.append(item)
        return [
            ("response.output_item.added", {"output_index": self._open.index, "item": dict(item)}),
            ("response.content_part.added", {**self._where(), "part": part}),
        ]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.item["id"], "output_index": self._open.index,
                "content_index": 0}  # fmt: skip

    def _close(self, status: str) -> list[StreamEvent]:
        if self._open is None:
            return []
        opened, where = self._open, self._where()
        self._open = None
        item = opened.item
        item["status"] = status
        if opened.reasoning:
            part = _reasoning_part(opened.text)
            done: StreamEvent = ("response.reasoning_text.done", {**where, "text": opened.text})
        else:
            part = _text_part(opened.text)
            done = ("response.output_text.done", {**where, "text": opened.text, "logprobs": []})
        item["content"] = [part]
        return [
            done,
            ("response.content_part.done", {**where, "part": part}),
            ("response.output_item.done", {"output_index": opened.index, "item": item}),
        ]

    def _call(self, call: ToolCall) -> list[StreamEvent]:
        index = len(self.items)
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call.id,
                "name": call.name, "arguments": call.arguments, "status": "completed"}  # fmt: skip
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": index}
        added = {**item, "arguments": "", "status": "in_progress"}
        return [
            ("response.output_item.added", {"output_index": index, "item": added}),
            ("response.function_call_arguments.delta", {**where, "delta": call.arguments}),
            ("response.function_call_arguments.done",
             {**where, "name": call.name, "arguments": call.arguments}),
            ("response.output_item.done", {"output_index": index, "item": item}),
        ]  # fmt: skip

    def as_message(self) -> dict[str, Any]:
        """The output as the assistant's chat message, for the stored conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        reasoning = []
        for item in self.items:
            if item["type"] == "message":
                message["content"] += item["content"][0]["text"] if item["content"] else ""
            elif item["type"] == "reasoning":
                reasoning.append(item["content"][0]["text"] if item["content"] else "")
            else:
                message.setdefault("tool_calls", []).append({
                    "id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                })  # fmt: skip
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        return message


def _usage(out: RequestOutput, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": out.prompt_tokens,
        # Every token prefilled stays in the prefix cache (parked with the sequence): what
        # was not read from it was written to it.
        "input_tokens_details": {
            "cached_tokens": out.cached_tokens,
            "cache_write_tokens": out.prompt_tokens - out.cached_tokens,
        },
        "output_tokens": out.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, out.completion_tokens)},
        "total_tokens": out.prompt_tokens + out.completion_tokens,
    }


def _failure_code(err: FerrumError) -> str:
    """The published schemas' code for a response that failed once its stream had begun:
    a closed list, where a deadline or an engine failure is a server error."""
    if err.status == 429:
        return "rate_limit_exceeded"
    if err.status == 400:
        return "invalid_prompt"
    return "server_error"


@dataclass
class ResponsesAnswer:
    """How one request is answered (a `generation.Answer`): `shell` is the response object
    without its outcome (id, model, the request's settings echoed); a finished response is
    stored with `turn` (this request's input as chat messages), as `owner`'s, unless store
    is false."""

    shell: dict[str, Any]
    stream: bool
    store: ResponseStore
    turn: Messages
    owner: str
    media_type: str = SSE
    _sequence: int = 0

    def on_output(self, out: RequestOutput) -> None:
        pass

    def begin(self, prepared: Prepared) -> None:
        pass

    def _event(self, kind: str, payload: dict[str, Any]) -> str:
        body = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"

    def _response(self, status: str, items: _Items | None = None, **outcome: Any) -> dict[str, Any]:
        return {**self.shell, "status": status, "output": items.items if items else [], **outcome}

    def _finished(self, items: _Items, finish: Finish) -> dict[str, Any]:
        """The final response object (stored unless store is false)."""
        incomplete = finish.reason == "length"
        response = self._response(
            "incomplete" if incomplete else "completed",
            items,
            completed_at=int(time.time()),
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage=_usage(finish.output, items.reasoning_tokens),
        )
        if self.shell["store"]:
            turn = [*self.turn, items.as_message()]
            self.store.put(response, turn, self.shell["previous_response_id"], self.owner)
        return response

    def _failed(self, err: FerrumError) -> str:
        failed = self._response("failed", error={"code": _failure_code(err),
                                                 "message": err.message})  # fmt: skip
        return self._event("response.failed", {"response": failed})

    async def lines(self, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        yield self._event("response.created", {"response": self._response("in_progress")})
        yield self._event("response.in_progress", {"response": self._response("in_progress")})
        items = _Items()
        try:
            async for event in events:
                if isinstance(event, Finish):
                    status = "incomplete" if event.reason == "length" else "completed"
                    for kind, payload in items.finish(status):
                        yield self._event(kind, payload)
                    response = self._finished(items, event)
                    yield self._event(f"response.{response['status']}", {"response": response})
                    return
                for kind, payload in items.feed(event):
                    yield self._event(kind, payload)
        except FerrumError as exc:
            yield self._failed(exc)

    async def whole(self, events: AsyncIterator[Event]) -> Response:
        items = _Items()
        async for event in events:
            if isinstance(event, Finish):
                items.finish("incomplete" if event.reason == "length" else "completed")
                return JSONResponse(self._finished(items, event))
            items.feed(event)
        raise EngineError("the engine closed a request without a result")

    def timeout_lines(self, err: RequestTimeout) -> list[str]:
        return [self._failed(err)]
