"""A burst of unrelated requests: how soon do they all get going? (issue #11's last done-when:
time to first token p50 at most 1.0× llama-server's.)

Arms, one server at a time, same GGUF (Gemma 3 270M) and threads: `ferrum serve --parallel 8`
and `llama-server -np 8 -c 8192`; `--tree NAME=PATH` adds ferrum from another code tree. Per
server: one warm-up burst, then `bursts` bursts of 8 requests sent at the same instant, each a
short prompt of its own (random words, no shared beginning, so nothing can be reused), 64
tokens streamed through /v1/completions. Per burst the p50 of the 8 times to first token (the
goal), their mean and longest, and the time until the burst's last request ended; per arm and
round the median over its bursts.

    ferrum bench --study burst [--rounds 4] [--threads 2] [--tree before=/tmp/wt] [--set bursts=6]
"""

from __future__ import annotations

import asyncio
import random
import statistics

from ferrum.bench.client import Dialect, http_client, stream_completion
from ferrum.bench.rounds import Metric
from ferrum.bench.studies import Study, StudyRun
from ferrum.models.builtin import BENCH_MODEL, builtin_path

CLIENTS, TOKENS = 8, 64
_TEXT = ("river stone lamp violin harbor meadow copper lantern orchard glacier falcon "
         "compass thimble quartz saddle ember willow canyon parcel ribbon tundra beacon "
         "marble pepper walnut cobalt velvet anchor")  # fmt: skip
WORDS = _TEXT.split()


def prompts(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = rng.sample(WORDS, CLIENTS)  # a different first word for every request
    return [f"{w} " + " ".join(rng.choice(WORDS) for _ in range(11)) + "." for w in words]


async def _burst(url: str, seed: int) -> dict[str, float]:
    async with http_client(url, timeout=300) as http:
        samples = await asyncio.gather(
            *(stream_completion(http, "bench", p, TOKENS, Dialect()) for p in prompts(seed))
        )
    ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
    if len(ttfts) < len(samples):
        raise RuntimeError("a request of the burst streamed no token")
    start = min(s.t_start for s in samples)
    return {"ttft_p50": statistics.median(ttfts), "ttft_mean": statistics.fmean(ttfts),
            "ttft_max": max(ttfts), "burst_end": max(s.t_end for s in samples) - start}  # fmt: skip


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    model = run.model or builtin_path(BENCH_MODEL)
    if run.is_ferrum(arm):
        server = run.ferrum(arm, "--models-dir", str(run.out / "m"), "--model",
                            f"bench={model}", "--parallel", str(CLIENTS))  # fmt: skip
    else:
        server = run.llama_server(arm, model, "-np", str(CLIENTS), "-c", "8192")
    try:
        asyncio.run(_burst(server.url, -round_no))  # warm-up
        bursts = [
            asyncio.run(_burst(server.url, round_no * 100 + b))
            for b in range(run.option("bursts", 2 if run.quick else 6))
        ]
    finally:
        server.stop()
    return {k: statistics.median(b[k] for b in bursts) for k in bursts[0]}


STUDY = Study(
    name="burst",
    title="A burst of 8 unrelated short prompts: time to first token",
    arms=("ferrum", "llama-server"),
    metrics=(
        Metric("ttft_p50", "s", higher_is_better=False),
        Metric("ttft_mean", "s", higher_is_better=False),
        Metric("ttft_max", "s", higher_is_better=False),
        Metric("burst_end", "s", higher_is_better=False),
    ),
    measure=measure,
)
