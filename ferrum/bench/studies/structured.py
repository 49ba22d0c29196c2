"""What structured output and logprobs cost: request kinds side by side on one ferrum server.

Arms (request kinds, all through /v1/chat/completions on the default model, greedy):
  free      unconstrained requests (the reference)
  schema    requests with a json_schema response_format
  logprobs  requests with logprobs and top_logprobs=5
Per arm and round: 8 concurrent whole requests (completion tokens / wall time of the batch),
then one streamed request alone (mean milliseconds per token after the first).

The schema is an object holding a list of strings, so a constrained answer is as long as a
free one: every request runs to max_tokens (ignore_eos for the free and logprobs kinds; the
schema kind only ends early by finishing its JSON, which is counted as it is). One server
serves the whole run (`main` starts it, then the arms alternate on it as in any study); the
ratio column is free ÷ kind, so the schema kind's cost shows as a ratio above 1 in tok/s.

    ferrum bench --study structured [--rounds 4] [--set tokens=64] [--set concurrency=8]
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from typing import Any

import httpx

from ferrum.bench.rounds import Metric
from ferrum.bench.studies import Study, StudyRun, run_study

SCHEMA = {
    "type": "object",
    "properties": {
        "animals": {"type": "array", "items": {"type": "string", "maxLength": 40}},
    },
    "required": ["animals"],
}
KINDS = ("free", "schema", "logprobs")


def body(kind: str, tokens: int, tag: int, stream: bool) -> dict[str, Any]:
    """One chat request of `kind`; `tag` keeps the prompts apart (no prefix reuse)."""
    if kind not in KINDS:
        raise ValueError(f"unknown request kind {kind!r}; the arms are {', '.join(KINDS)}")
    out: dict[str, Any] = {
        "model": "",  # the server's default model (an unknown name is a 404)
        "messages": [{"role": "user", "content": f"({tag}) List many animals as JSON."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": stream,
    }
    if kind == "schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    else:
        out["ignore_eos"] = True
    if kind == "logprobs":
        out.update(logprobs=True, top_logprobs=5)
    return out


async def _batch(client: httpx.AsyncClient, kind: str, n: int, tokens: int) -> float:
    """Aggregate completion tokens per second of n concurrent whole requests."""
    tags = [random.getrandbits(30) for _ in range(n)]
    t0 = time.perf_counter()
    replies = await asyncio.gather(
        *(client.post("/v1/chat/completions", json=body(kind, tokens, t, False)) for t in tags)
    )
    wall = time.perf_counter() - t0
    answers = [r.raise_for_status().json() for r in replies]
    for a in answers:
        choice = a["choices"][0]
        if kind == "schema" and choice["finish_reason"] == "stop":
            json.loads(choice["message"]["content"])  # a finished answer must be JSON
    return sum(a["usage"]["completion_tokens"] for a in answers) / wall


def ms_per_token(stamps: list[float]) -> float:
    """Mean milliseconds between streamed chunks after the first (the first waits on prefill)."""
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return 1000 * sum(gaps) / max(len(gaps), 1)


async def _per_token_ms(client: httpx.AsyncClient, kind: str, tokens: int) -> float:
    stamps = []
    request = body(kind, tokens, random.getrandbits(30), True)
    async with client.stream("POST", "/v1/chat/completions", json=request) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                stamps.append(time.perf_counter())
    return ms_per_token(stamps)


async def _measure(url: str, kind: str, concurrency: int, tokens: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        tok_s = await _batch(client, kind, concurrency, tokens)
        return {"tok_s": tok_s, "ms_per_token": await _per_token_ms(client, kind, tokens)}


def main(run: StudyRun) -> int:
    concurrency, tokens = run.option("concurrency", 8), run.option("tokens", 64)
    run.out.mkdir(parents=True, exist_ok=True)
    server = run.ferrum("ferrum", "--parallel", str(concurrency), "--ctx-size", "8192")
    try:

        def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
            return asyncio.run(_measure(server.url, arm, concurrency, tokens))

        return run_study(run, dataclasses.replace(STUDY, main=None, measure=measure))
    finally:
        server.stop()


STUDY = Study(
    name="structured",
    title="Structured output and logprobs: tok/s of 8 concurrent requests, ms/token alone",
    arms=KINDS,
    metrics=(
        Metric("tok_s", "tok/s", True, 1),
        Metric("ms_per_token", "ms", False, 2),
    ),
    main=main,
)
