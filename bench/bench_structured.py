"""What structured output and logprobs cost: request kinds side by side on one ferrum server.

Arms (request kinds, all through /v1/chat/completions on the default model, greedy):
  free      8 concurrent unconstrained requests
  schema    8 concurrent requests with a json_schema response_format
  logprobs  8 concurrent requests with logprobs and top_logprobs=5
and the same three at concurrency 1 (per-token cost, from the stream's token timings).

The schema is an object holding a list of strings, so a constrained answer is as long as a
free one: every request runs to max_tokens (ignore_eos for the free and logprobs kinds; the
schema kind only ends early by finishing its JSON, which is counted as it is). Metric:
completion tokens / wall time of the batch; at concurrency 1, the mean time per token after
the first.

One server for the whole run; kinds alternate within each round (rotated each round); round
1 is a warm-up and discarded; median and [min, max] of the other rounds; a ratio is a win or
a loss only when the ranges are disjoint.

    .venv/bin/python bench/bench_structured.py [--rounds 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from ferrum.bench.process import ServerProcess, ferrum_command
from ferrum.bench.stats import Spread, paired_ratio, verdict

SCHEMA = {
    "type": "object",
    "properties": {
        "animals": {"type": "array", "items": {"type": "string", "maxLength": 40}},
    },
    "required": ["animals"],
}
KINDS = ("free", "schema", "logprobs")


def _body(kind: str, tokens: int, tag: int, stream: bool) -> dict:
    body: dict = {
        "model": "m",
        "messages": [{"role": "user", "content": f"({tag}) List many animals as JSON."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": stream,
    }
    if kind == "schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    if kind == "logprobs":
        body.update(logprobs=True, top_logprobs=5)
    return body


async def _batch(client: httpx.AsyncClient, kind: str, n: int, tokens: int) -> float:
    """Aggregate completion tokens per second of n concurrent whole requests."""
    tags = [random.getrandbits(30) for _ in range(n)]
    t0 = time.perf_counter()
    replies = await asyncio.gather(
        *(client.post("/v1/chat/completions", json=_body(kind, tokens, t, False)) for t in tags)
    )
    wall = time.perf_counter() - t0
    bodies = [r.raise_for_status().json() for r in replies]
    for b in bodies:
        choice = b["choices"][0]
        if kind == "schema" and choice["finish_reason"] == "stop":
            json.loads(choice["message"]["content"])  # a finished answer must be JSON
    return sum(b["usage"]["completion_tokens"] for b in bodies) / wall


async def _per_token_ms(client: httpx.AsyncClient, kind: str, tokens: int) -> float:
    """Mean milliseconds between streamed chunks after the first, one request alone."""
    stamps = []
    body = _body(kind, tokens, random.getrandbits(30), True)
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return 1000 * sum(gaps) / max(len(gaps), 1)


def _start(port: int, threads: int) -> ServerProcess:
    cmd = ferrum_command(port, "--threads", str(threads), "--parallel", "8", "--ctx-size", "8192")
    server = ServerProcess(cmd, Path("/tmp/ferrum-bench-structured.log"), port)
    server.wait_ready(server.url, "/health")
    return server


async def _run(args: argparse.Namespace) -> dict:
    samples: dict[str, dict[int, float]] = {}
    async with httpx.AsyncClient(base_url=args.url, timeout=600) as client:
        for rnd in range(args.rounds):
            order = KINDS[rnd % 3 :] + KINDS[: rnd % 3]
            for kind in order:
                agg = await _batch(client, kind, args.concurrency, args.tokens)
                ms = await _per_token_ms(client, kind, args.tokens)
                samples.setdefault(f"{kind} c={args.concurrency} tok/s", {})[rnd] = agg
                samples.setdefault(f"{kind} c=1 ms/token", {})[rnd] = ms
                print(f"round {rnd + 1} {kind}: {agg:.1f} tok/s, {ms:.2f} ms/token", flush=True)
    return samples


def _report(samples: dict[str, dict[int, float]]) -> list[str]:
    kept = {k: {r: v for r, v in s.items() if r > 0} for k, s in samples.items()}
    c = next(k for k in kept if k.startswith("free c=") and "tok/s" in k).split()[1]
    lines = [
        "| metric | median [min, max] | vs free: ratio [min, max] | verdict |",
        "|---|---|---|---|",
    ]
    for kind in KINDS:
        for metric, higher in ((f"{c} tok/s", True), ("c=1 ms/token", False)):
            key, base = f"{kind} {metric}", f"free {metric}"
            s = Spread.of(kept[key].values())
            ratio = paired_ratio(kept[key], kept[base]) if kind != "free" else None
            v = verdict(s, Spread.of(kept[base].values()), higher) if kind != "free" else ""
            r = f"{ratio.median:.2f} [{ratio.lo:.2f}, {ratio.hi:.2f}]" if ratio else ""
            lines.append(f"| {key} | {s.median:.2f} [{s.lo:.2f}, {s.hi:.2f}] | {r} | {v} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=18171)
    parser.add_argument("--out", default="bench/results/structured.json")
    args = parser.parse_args()
    args.url = f"http://127.0.0.1:{args.port}"
    server = _start(args.port, args.threads)
    try:
        samples = asyncio.run(_run(args))
    finally:
        server.stop()
    Path(args.out).write_text(json.dumps({"args": vars(args), "samples": samples}, indent=1))
    print("\n".join(_report(samples)))


if __name__ == "__main__":
    main()
