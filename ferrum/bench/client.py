"""The benchmark's HTTP client: one streamed `/v1/completions` request, timed chunk by chunk.

Times are taken on receipt of each SSE event (`time.perf_counter`), so they include the
server's HTTP and JSON work, as a real client would see it. Token counts come from the
server's `usage` when it sends one; otherwise they are filled in afterwards (`count_prompt`),
never during a measurement, so counting cannot slow what is measured.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


def http_client(url: str, timeout: float = 600) -> httpx.AsyncClient:
    """A client on `url` that opens a connection per request: llama-server's HTTP library
    closes a kept-alive connection after a few requests, which a client sending the next one
    at once sees as a disconnect ("Server disconnected without sending a response")."""
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits)


@dataclass(frozen=True)
class Dialect:
    """How to ask one server for what every arm must do alike.

    `ignore_eos`: "native" (the `ignore_eos` field), "logit_bias" (end-of-generation tokens
    biased to -1e9: llama-cpp-python has no such field) or "none" (the server may stop early;
    the samples then record fewer completion tokens)."""

    ignore_eos: str = "native"
    eog_token_ids: tuple[int, ...] = ()
    usage_in_stream: bool = True


@dataclass
class Sample:
    """One request as the client saw it. Times are perf_counter seconds."""

    prompt: str
    max_tokens: int
    t_start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks with text
    chunk_chars: list[int] = field(default_factory=list)  # each such chunk's characters
    t_end: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    counts_from: str = "usage"  # "usage", or how the counts were filled in afterwards
    choices_seen: set[int] = field(default_factory=set)  # indexes of choices that sent text

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.t_start if self.chunk_times else None

    @property
    def gaps(self) -> list[float]:
        """Inter-token latencies: gaps between successive text chunks of this stream."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def tokens_within(self, start: float, end: float) -> float:
        """Tokens that arrived after `start` up to `end`. A chunk may carry several tokens
        (ferrum streams a step's kept guesses in one chunk), so the stream's tokens (its
        usage) are shared among its chunks by their characters; without usage, one token a
        chunk."""
        inside = [k for k, t in enumerate(self.chunk_times) if start < t <= end]
        total = sum(self.chunk_chars)
        counted = len(self.chunk_chars) == len(self.chunk_times)
        if not (self.completion_tokens and total and counted):
            return float(len(inside))
        return self.completion_tokens * sum(self.chunk_chars[k] for k in inside) / total

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["choices_seen"] = sorted(self.choices_seen)
        d["ttft_s"] = self.ttft_s
        return d


def request_body(
    model: str, prompt: str, max_tokens: int, dialect: Dialect, fixed: bool, n: int = 1
) -> dict:
    """`fixed`: exactly `max_tokens` output tokens wanted (the end-of-generation token ignored);
    `n`: choices (one request, one user, as many sequences)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if n > 1:
        body["n"] = n
    if dialect.usage_in_stream:
        body["stream_options"] = {"include_usage": True}
    if fixed and dialect.ignore_eos == "native":
        body["ignore_eos"] = True
    elif fixed and dialect.ignore_eos == "logit_bias" and dialect.eog_token_ids:
        body["logit_bias"] = {str(t): -1e9 for t in dialect.eog_token_ids}
    return body


async def stream_completion(
    client: httpx.AsyncClient,
    model: str,
    prompt: str,
    max_tokens: int,
    dialect: Dialect,
    fixed: bool = True,
    sample: Sample | None = None,
    n: int = 1,
    extra: dict[str, Any] | None = None,
) -> Sample:
    """`sample`: filled in as the stream arrives, for callers that watch its progress (with
    `n` choices, their chunks all count); `extra`: more fields of the body (a server's own,
    such as llama-server's `lora`)."""
    sample = sample or Sample(prompt=prompt, max_tokens=max_tokens)
    body = request_body(model, prompt, max_tokens, dialect, fixed, n) | (extra or {})
    await _stream(client, "/v1/completions", body, sample, _text)
    if not sample.chunk_times:
        raise RuntimeError(f"stream without text (finish_reason {sample.finish_reason})")
    return sample


def _read_usage(sample: Sample, usage: dict) -> None:
    sample.prompt_tokens = usage.get("prompt_tokens")
    sample.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        sample.cached_tokens = details["cached_tokens"]


async def served_model_id(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def count_prompt(client: httpx.AsyncClient, model: str, text: str) -> int | None:
    """The server's own token count for `text` as a completion prompt (BOS included), from
    `/tokenize` (ferrum, llama-server) or `/extras/tokenize` (llama-cpp-python)."""
    resp = await client.post(
        "/tokenize", json={"content": text, "add_special": True, "parse_special": True}
    )
    if resp.status_code == 200:
        return len(resp.json()["tokens"])
    resp = await client.post("/extras/tokenize", json={"input": text, "model": model})
    if resp.status_code == 200:
        return len(resp.json()["tokens"])
    return None


async def fill_counts(client: httpx.AsyncClient, model: str, samples: list[Sample]) -> None:
    """After a measurement: counts for samples whose server sent no usage. A reply cut at
    `max_tokens` has exactly that many tokens; otherwise the chunks are counted (one token a
    chunk for the servers here, an estimate in general)."""
    cache: dict[str, int | None] = {}
    for s in samples:
        if s.prompt_tokens is None:
            if s.prompt not in cache:
                cache[s.prompt] = await count_prompt(client, model, s.prompt)
            s.prompt_tokens = cache[s.prompt]
            s.counts_from = "tokenize"
        if s.completion_tokens is None:
            length = s.finish_reason == "length"
            s.completion_tokens = s.max_tokens if length else len(s.chunk_times)
            s.counts_from += "+max_tokens" if length else "+chunks"


async def probe_ignore_eos(client: httpx.AsyncClient, model: str) -> bool:
    """Whether an unknown server accepts the `ignore_eos` field (some reject unknown fields)."""
    body = {"model": model, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
    resp = await client.post("/v1/completions", json=body)
    return resp.status_code == 200


async def stream_body(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], sample: Sample | None = None
) -> Sample:
    """One streamed request of `body` as given (`stream` set) to `path`, /v1/completions or
    /v1/chat/completions, timed per chunk with text like `stream_completion`; its usage read
    when the server sends one. A stream without text is no error here. `sample`: filled in
    as the stream arrives, for callers that watch its progress."""
    chat = path.endswith("/chat/completions")
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]
    sample = sample or Sample(prompt=str(prompt), max_tokens=int(body.get("max_tokens") or 0))
    await _stream(client, path, body | {"stream": True}, sample, _content if chat else _text)
    return sample


def _text(choice: dict[str, Any]) -> str | None:
    return choice.get("text")


def _content(choice: dict[str, Any]) -> str | None:
    return (choice.get("delta") or {}).get("content")


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], sample: Sample,
    piece: Callable[[dict[str, Any]], str | None],
) -> None:  # fmt: skip
    """POST a streamed request and fill `sample` as its events arrive: a chunk time for every
    choice whose `piece` (its text or its delta's content) is not empty, finish reason, usage."""
    text: list[str] = []
    sample.t_start = time.perf_counter()
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {resp.status_code}: {detail[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            now = time.perf_counter()
            event = json.loads(line[5:])
            if event.get("usage"):
                _read_usage(sample, event["usage"])
            for choice in event.get("choices") or ():
                sample.finish_reason = choice.get("finish_reason") or sample.finish_reason
                if words := piece(choice):
                    sample.chunk_times.append(now)
                    sample.chunk_chars.append(len(words))
                    sample.choices_seen.add(choice.get("index", 0))
                    text.append(words)
    sample.t_end = time.perf_counter()
    sample.text = "".join(text)
