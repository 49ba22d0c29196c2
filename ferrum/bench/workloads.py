"""The HTTP workloads. Each takes a running server and returns (raw samples, round metrics).

Metric keys are workload-local ("c4.tps", "cold.ttft_p50"); `report.metric_specs` names them
and says which direction is better. Token counts missing from a server's stream are filled in
after the workload (`client.fill_counts`), outside every timed section.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import httpx

from ferrum.bench.client import Dialect, Sample, fill_counts, stream_completion
from ferrum.bench.prompts import PromptSource, end_model_turn
from ferrum.bench.settings import BenchSettings
from ferrum.bench.stats import percentile

Metrics = dict[str, float | None]


@dataclass
class Context:
    client: httpx.AsyncClient
    model: str
    dialect: Dialect
    settings: BenchSettings
    prompts: PromptSource

    async def stream(self, prompt: str, max_tokens: int, fixed: bool = True) -> Sample:
        return await stream_completion(
            self.client, self.model, prompt, max_tokens, self.dialect, fixed
        )

    async def gather(self, prompts: list[str], max_tokens: int) -> tuple[list[Sample], float]:
        t0 = time.perf_counter()
        samples = await asyncio.gather(*(self.stream(p, max_tokens) for p in prompts))
        return list(samples), time.perf_counter() - t0


def _ttfts(samples: list[Sample]) -> list[float]:
    return [s.ttft_s for s in samples if s.ttft_s is not None]


def _cached_sum(samples: list[Sample]) -> float | None:
    """Summed cached prompt tokens, or None when the server reports none for any sample."""
    values = [s.cached_tokens for s in samples if s.cached_tokens is not None]
    return float(sum(values)) if values else None


# ------------------------------------------------------------------ sweep


async def sweep(ctx: Context) -> tuple[dict, Metrics]:
    """Unique unrelated prompts at each concurrency level: waves of c requests at once until
    at least `sweep_min_requests` have run. tok/s = completion tokens / summed wave time."""
    s = ctx.settings
    raw: dict = {}
    for c in s.sweep_levels:
        waves = []
        for _ in range(-(-s.sweep_min_requests // c)):
            prompts = [ctx.prompts.unrelated() for _ in range(c)]
            samples, wall = await ctx.gather(prompts, s.sweep_tokens)
            waves.append({"wall_s": wall, "samples": samples})
        raw[f"c{c}"] = waves
    await fill_counts(ctx.client, ctx.model, [x for w in _all_waves(raw) for x in w["samples"]])
    metrics: Metrics = {}
    for c in s.sweep_levels:
        waves = raw[f"c{c}"]
        samples = [x for w in waves for x in w["samples"]]
        gaps = [g for x in samples for g in x.gaps]
        tokens = sum(x.completion_tokens or 0 for x in samples)
        metrics[f"c{c}.tps"] = tokens / sum(w["wall_s"] for w in waves)
        metrics[f"c{c}.ttft_p50"] = percentile(_ttfts(samples), 50)
        metrics[f"c{c}.ttft_p99"] = percentile(_ttfts(samples), 99)
        metrics[f"c{c}.itl_p50"] = percentile(gaps, 50)
        metrics[f"c{c}.itl_p99"] = percentile(gaps, 99)
    return raw, metrics


def _all_waves(raw: dict) -> list[dict]:
    return [w for waves in raw.values() for w in waves]


# ------------------------------------------------------------------ burst


async def burst(ctx: Context) -> tuple[dict, Metrics]:
    """N clients at once behind one shared prefix nobody has seen ("cold"), then N more
    behind the same prefix ("warm")."""
    s = ctx.settings
    prefix = ctx.prompts.handbook(s.burst_prefix_rules)
    raw: dict = {}
    for phase in ("cold", "warm"):
        samples, wall = await ctx.gather(
            ctx.prompts.burst(prefix, s.burst_clients, phase), s.burst_tokens
        )
        raw[phase] = {"wall_s": wall, "samples": samples}
    await fill_counts(ctx.client, ctx.model, raw["cold"]["samples"] + raw["warm"]["samples"])
    metrics: Metrics = {}
    for phase in ("cold", "warm"):
        samples = raw[phase]["samples"]
        metrics[f"{phase}.ttft_p50"] = percentile(_ttfts(samples), 50)
        metrics[f"{phase}.ttft_p90"] = percentile(_ttfts(samples), 90)
        metrics[f"{phase}.wall_s"] = raw[phase]["wall_s"]
        metrics[f"{phase}.cached_tokens"] = _cached_sum(samples)
    metrics["prompt_tokens"] = _median_prompt(raw["cold"]["samples"])
    return raw, metrics


def _median_prompt(samples: list[Sample]) -> float | None:
    counts = [x.prompt_tokens for x in samples if x.prompt_tokens is not None]
    return statistics.median(counts) if counts else None


# ------------------------------------------------------------------ multiturn


async def multiturn(ctx: Context) -> tuple[dict, Metrics]:
    """K conversations at once, T turns each; every turn sends the whole history so far,
    including the server's own earlier replies (not fixed-length: replies end naturally)."""
    s = ctx.settings
    k_n, t_n = s.multiturn_conversations, s.multiturn_turns
    # All text drawn before any request: concurrent conversations must not race for the
    # generator, or arms would see different questions.
    openings = [ctx.prompts.conversation_opening(k) for k in range(k_n)]
    questions = [[ctx.prompts.next_question(t + 1) for t in range(t_n)] for _ in range(k_n)]

    async def conversation(k: int) -> list[Sample]:
        history, turns = openings[k], []
        for t in range(t_n):
            history += questions[k][t]
            sample = await ctx.stream(history, s.multiturn_tokens, fixed=False)
            turns.append(sample)
            history += end_model_turn(sample.text)
        return turns

    convs = await asyncio.gather(*(conversation(k) for k in range(k_n)))
    await fill_counts(ctx.client, ctx.model, [x for c in convs for x in c])
    metrics: Metrics = {}
    for t in range(t_n):
        metrics[f"turn{t + 1}.ttft"] = statistics.median(
            ttft for c in convs if (ttft := c[t].ttft_s) is not None
        )
    later = [ttft for c in convs for t in range(1, t_n) if (ttft := c[t].ttft_s) is not None]
    metrics["later.ttft_mean"] = statistics.fmean(later) if later else None
    metrics["last.prompt_tokens"] = _median_prompt([c[-1] for c in convs])
    metrics["cached_tokens"] = _cached_sum([x for c in convs for x in c])
    return {"conversations": convs}, metrics


# ------------------------------------------------------------------ noisy neighbour


async def noisy(ctx: Context) -> tuple[dict, Metrics]:
    """`noisy_streams` streams decode; once they have yielded `noisy_before_tokens` tokens
    each (in total), a long prompt arrives. Their inter-token gaps are split by arrival time:
    "before" it was sent, "during" its prefill (until its first token)."""
    s = ctx.settings
    stream_prompts = [ctx.prompts.unrelated() for _ in range(s.noisy_streams)]
    long_prompt = ctx.prompts.long_prompt(s.noisy_long_rules)
    # Samples made here, so their chunk arrivals can be watched while they stream.
    live = [Sample(prompt=p, max_tokens=s.noisy_stream_tokens) for p in stream_prompts]
    tasks = [
        asyncio.create_task(
            stream_completion(ctx.client, ctx.model, x.prompt, x.max_tokens, ctx.dialect, sample=x)
        )
        for x in live
    ]
    want = s.noisy_streams * s.noisy_before_tokens
    while sum(len(x.chunk_times) for x in live) < want and not all(t.done() for t in tasks):
        await asyncio.sleep(0.01)
    t_send = time.perf_counter()
    long = await ctx.stream(long_prompt, s.noisy_long_tokens)
    streams = list(await asyncio.gather(*tasks))
    await fill_counts(ctx.client, ctx.model, [*streams, long])
    t_first = long.chunk_times[0]
    before, during = [], []
    for x in streams:
        for end, gap in zip(x.chunk_times[1:], x.gaps, strict=True):
            if end < t_send:
                before.append(gap)
            elif end <= t_first:
                during.append(gap)
    metrics: Metrics = {
        "before.itl_p50": percentile(before, 50),
        "before.itl_p99": percentile(before, 99),
        "during.itl_p50": percentile(during, 50),
        "during.itl_p99": percentile(during, 99),
        "during.gaps": float(len(during)),
        "long.ttft": long.ttft_s,
        "long.prompt_tokens": float(long.prompt_tokens) if long.prompt_tokens else None,
    }
    return {"streams": streams, "long": long, "t_send": t_send}, metrics


# ------------------------------------------------------------------ fairness


async def fairness(ctx: Context) -> tuple[dict, Metrics]:
    """Short chats one after another on the idle server; then requests with n choices each
    that take every slot (`parallel`), long outputs, and, once each choice streams, short chats
    one after another (new prompts) for as long as they run. Does one client's flood of choices
    make another wait?"""
    s = ctx.settings
    idle_prompts = [ctx.prompts.unrelated() for _ in range(s.fair_chats)]
    busy_prompts = [ctx.prompts.unrelated() for _ in range(s.fair_chats)]
    n = min(s.fair_flood_n, s.parallel)
    floods = [
        Sample(prompt=ctx.prompts.unrelated(), max_tokens=s.fair_flood_tokens)
        for _ in range(-(-s.parallel // n))
    ]
    idle = [await ctx.stream(p, s.fair_chat_tokens) for p in idle_prompts]
    tasks = [
        asyncio.create_task(
            stream_completion(
                ctx.client, ctx.model, f.prompt, f.max_tokens, ctx.dialect, sample=f, n=n
            )
        )
        for f in floods
    ]
    while sum(len(f.choices_seen) for f in floods) < s.parallel and not all(
        t.done() for t in tasks
    ):
        await asyncio.sleep(0.01)  # every choice decoding: every slot taken
    busy = []
    for p in busy_prompts:
        if all(t.done() for t in tasks):
            break
        busy.append(await ctx.stream(p, s.fair_chat_tokens))
    await asyncio.gather(*tasks)
    await fill_counts(ctx.client, ctx.model, [*idle, *busy])
    idle_p50, busy_p99 = percentile(_ttfts(idle), 50), percentile(_ttfts(busy), 99)
    metrics: Metrics = {
        "idle.ttft_p50": idle_p50,
        "idle.ttft_p99": percentile(_ttfts(idle), 99),
        "flood.ttft_p50": percentile(_ttfts(busy), 50),
        "flood.ttft_p99": busy_p99,
        "flood.p99_vs_idle": busy_p99 / idle_p50 if busy_p99 and idle_p50 else None,
        "flood.chats": float(len(busy)),
        "flood.wall_s": max(f.t_end for f in floods) - min(f.t_start for f in floods),
    }
    return {"idle": idle, "flood_chats": busy, "floods": floods}, metrics


# ------------------------------------------------------------------ longctx


async def longctx(ctx: Context) -> tuple[dict, Metrics]:
    """`longctx_clients` unrelated long prompts at one instant, `longctx_tokens` each: the
    whole workload's output tok/s and wall time, TTFT and inter-token gaps (prefill of the
    others' prompts interleaved with or ahead of the decodes shows in both)."""
    s = ctx.settings
    prompts = [ctx.prompts.long_prompt(s.longctx_rules) for _ in range(s.longctx_clients)]
    samples, wall = await ctx.gather(prompts, s.longctx_tokens)
    await fill_counts(ctx.client, ctx.model, samples)
    gaps = [g for x in samples for g in x.gaps]
    tokens = sum(x.completion_tokens or 0 for x in samples)
    metrics: Metrics = {
        "tps": tokens / wall,
        "wall_s": wall,
        "ttft_p50": percentile(_ttfts(samples), 50),
        "ttft_p99": percentile(_ttfts(samples), 99),
        "itl_p50": percentile(gaps, 50),
        "itl_p99": percentile(gaps, 99),
        "prompt_tokens": _median_prompt(samples),
    }
    return {"samples": samples}, metrics


WORKLOADS = {
    "sweep": sweep,
    "burst": burst,
    "multiturn": multiturn,
    "noisy": noisy,
    "fairness": fairness,
    "longctx": longctx,
}
