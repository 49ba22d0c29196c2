"""Do running streams stall while other requests are being prepared? Code trees side by side.

Four streams decode (ignore_eos) on a `ferrum serve --parallel 4 --max-queue 0`. While they
run, eight requests arrive at once, three bursts one after the other (to give the window
enough gaps), for each kind:
  schemas   chat requests whose response_format is a 60-property JSON schema, each schema
            distinct (no grammar kept from before: the first preparation, the costly one)
  prompts   chat requests of ~3,000 tokens each
  refused   the schema requests with max_tokens -5: refused (400) while their bodies are
            checked, before any preparation: what 8 requests cost the streams anyway (HTTP,
            body parsing, the answers), the floor the other two are read against
With `--max-queue 0` every schema and prompt request is refused with a 429 after it was
prepared (the four streams fill the server), so what they cost the streams is their
preparation alone: template rendering, tokenizing, schema checks and grammar building.

Metrics per kind: the p99 inter-token gap of the four streams in the 1.5 s before the bursts
(baseline) and from the bursts until their last answer, their ratio, and the bursts' length.
Arms are code trees (`--tree NAME=PATH`, e.g. a worktree of an older commit), or "ferrum"
(this package).

    ferrum bench --study stalls --tree before=/tmp/wt --tree after=. [--rounds 4] [--set bursts=3]
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from ferrum.bench.client import http_client
from ferrum.bench.rounds import Metric
from ferrum.bench.stats import p99_rank
from ferrum.bench.studies import Study, StudyRun
from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

BURST = 8  # requests at once
BURSTS = 3  # bursts one after the other, so the window holds enough gaps
KINDS = ("schemas", "prompts", "refused")
STREAMS = 4
STREAM_TOKENS = 2000  # more than the run needs; cancelled at the end


def _model() -> tuple[Path, str]:
    # Every tree serves the default chat model's file, named by the file (trees from before
    # issue #12 take a bare path and any model name, later ones name a bare path by its stem).
    path = Path(builtin_path(DEFAULT_CHAT_MODEL))
    return path, path.stem


def schema(tag: int) -> dict[str, Any]:
    """A 60-property object schema of its own for every tag: no grammar can be reused."""
    props = {
        f"field_{tag}_{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(60)
    }
    return {"type": "object", "properties": props, "required": list(props)[:30]}


def burst_bodies(kind: str, burst_no: int, model: str) -> list[dict[str, Any]]:
    """The BURST chat bodies of one burst of `kind`."""
    bodies = []
    for i in range(BURST):
        tag = burst_no * 100 + i
        body: dict[str, Any] = {"model": model, "max_tokens": -5 if kind == "refused" else 1}
        if kind in ("schemas", "refused"):
            body["messages"] = [{"role": "user", "content": f"Fill record {tag}."}]
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": f"r{tag}", "schema": schema(tag)},
            }
        else:
            words = " ".join(f"word{(tag * 7 + j) % 997}" for j in range(1500))
            body["messages"] = [{"role": "user", "content": f"Summarise ({tag}): {words}"}]
        bodies.append(body)
    return bodies


def p99_gap_ms(streams: list[list[float]], start: float, end: float) -> float:
    """p99 of the gaps between successive tokens of every stream that end inside the window."""
    gaps = [b - a for s in streams for a, b in zip(s, s[1:], strict=False) if start <= b <= end]
    if len(gaps) < 5:
        raise RuntimeError(f"only {len(gaps)} gaps in a {end - start:.2f} s window: streams "
                           "ended too early or decode too slowly")  # fmt: skip
    return 1000 * (p99_rank(gaps) or 0.0)


async def _stream(client: httpx.AsyncClient, model: str, stamps: list[float], tag: int) -> None:
    body = {"model": model, "prompt": f"Story {tag}: once upon a time",
            "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())


async def _kind(
    client: httpx.AsyncClient, streams: list[list[float]], kind: str, first: int, bursts: int,
    model: str,
) -> dict[str, float]:  # fmt: skip
    t0 = time.perf_counter()
    await asyncio.sleep(1.5)
    t1 = time.perf_counter()
    for b in range(bursts):
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=body)
              for body in burst_bodies(kind, first + b, model))
        )  # fmt: skip
        codes = sorted({a.status_code for a in answers})
        expected = [400] if kind == "refused" else [429]
        if codes != expected:
            raise RuntimeError(f"{kind}: expected {expected}, got {codes}")
    t2 = time.perf_counter()
    await asyncio.sleep(0.3)  # a gap the bursts stretched ends after them
    baseline, burst = p99_gap_ms(streams, t0, t1), p99_gap_ms(streams, t1, t2 + 0.3)
    return {
        f"{kind}.baseline_p99_ms": baseline,
        f"{kind}.burst_p99_ms": burst,
        f"{kind}.burst_over_baseline": burst / baseline,
        f"{kind}.burst_s": t2 - t1,
    }


async def _measure(url: str, round_no: int, bursts: int, model: str) -> dict[str, float]:
    out: dict[str, float] = {}
    async with http_client(url, timeout=120) as client:
        streams: list[list[float]] = [[] for _ in range(STREAMS)]
        tasks = [asyncio.create_task(_stream(client, model, s, round_no * 10 + i))
                 for i, s in enumerate(streams)]  # fmt: skip
        try:
            await asyncio.sleep(3.0)  # all four decoding
            for kind in KINDS:
                out |= await _kind(client, streams, kind, round_no * bursts, bursts, model)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return out


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    if not run.is_ferrum(arm):
        raise ValueError(f"stalls compares ferrum trees; {arm!r} is none (--tree NAME=PATH)")
    path, model = _model()
    # No speculation (trees from before issue #14 have none; FERRUM_* variables older trees
    # do not know are ignored), so the streams cost the same on every tree.
    server = run.ferrum(arm, "--parallel", str(STREAMS), "--max-queue", "0", "--model",
                        str(path), env={"FERRUM_SPEC_TYPE": "none"})  # fmt: skip
    try:
        bursts = run.option("bursts", BURSTS)  # fewer leave the window too few gaps
        return asyncio.run(_measure(server.url, round_no, bursts, model))
    finally:
        server.stop()


def _metrics() -> tuple[Metric, ...]:
    out: list[Metric] = []
    for kind in KINDS:
        out += [Metric(f"{kind}.burst_p99_ms", "ms", False, 1),
                Metric(f"{kind}.baseline_p99_ms", "ms", False, 1),
                Metric(f"{kind}.burst_over_baseline", "x", False, 2),
                Metric(f"{kind}.burst_s", "s", False)]  # fmt: skip
    return tuple(out)


STUDY = Study(
    name="stalls",
    title="Stream stalls while 8 requests are prepared: p99 inter-token gap, code trees",
    metrics=_metrics(),
    measure=measure,
)
