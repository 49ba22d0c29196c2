"""Two models in one server against each served alone: what a second model costs the first.

Arms, one server at a time (`ferrum serve`, --keep-alive -1 so nothing unloads mid-run):
  both    gemma3-270m and smollm2-135m-instruct in one server: 8 clients on gemma and 2 on
          smollm2 at the same time (the reference)
  switch  the same two-model server, 8 clients on gemma; halfway through the window one
          request asks for smollm2, which loads then (a user switching models mid-traffic)
  gemma   gemma3-270m alone, the same 8 clients
  smollm2 smollm2-135m-instruct alone, the same 2 clients
Each client streams /v1/completions (greedy, ignore_eos, 128 tokens) back to back for the
window. Metrics per model (`gemma_…`, `smollm2_…`): output tokens per second over the window
(all its clients) and the p99 inter-token gap, so the ratio column reads both ÷ alone; the
first request's time to first token, and the model's load seconds (from
ferrum_model_load_seconds; smollm2's in `both` and `switch` is a load under traffic). For
switch ÷ gemma alone: `--arms switch,gemma`.

    ferrum bench --study models [--rounds 4] [--threads 2] [--set window=30]
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx

from ferrum.bench.client import Dialect, Sample, stream_completion
from ferrum.bench.rounds import Metric
from ferrum.bench.stats import p99_rank
from ferrum.bench.studies import Study, StudyRun

BIG, SMALL = "gemma3-270m", "smollm2-135m-instruct"
SHORT = {BIG: "gemma", SMALL: "smollm2"}  # metric prefixes
CLIENTS = {BIG: 8, SMALL: 2}
TOKENS = 128
PROMPT = "Write a long story about a lighthouse keeper and the storm that changed her life."
ARMS = {"both": (BIG, SMALL), "switch": (BIG, SMALL), "gemma": (BIG,), "smollm2": (SMALL,)}


def per_model(samples: list[Sample], start: float, end: float) -> dict[str, float]:
    """Tokens that arrived after `start` up to `end` per second, and the streams' p99 gap."""
    tokens = sum(s.tokens_within(start, end) for s in samples)  # a chunk may hold several
    p99 = p99_rank(g for s in samples for g in s.gaps)
    return {"tok_s": tokens / (end - start), "p99_gap_s": float("nan") if p99 is None else p99}


def load_seconds(metrics_text: str) -> dict[str, float]:
    """Each model's load seconds from the server's /metrics."""
    pattern = r'ferrum_model_load_seconds_sum\{model="([^"]+)"\} (\S+)'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, metrics_text)}


async def _client(http: httpx.AsyncClient, model: str, until: float, out: list[Sample]) -> None:
    while time.perf_counter() < until:
        out.append(await stream_completion(http, model, PROMPT, TOKENS, Dialect()))


async def _first(http: httpx.AsyncClient, model: str, delay: float, cold: dict[str, float]) -> None:
    await asyncio.sleep(delay)
    s = await stream_completion(http, model, PROMPT, 4, Dialect())
    cold[model] = s.ttft_s or float("nan")


async def _measure(url: str, arm: str, window: float) -> dict[str, float]:
    busy = (BIG,) if arm == "switch" else ARMS[arm]
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        cold: dict[str, float] = {}
        for m in busy:  # the first request to each model (the second loads now)
            await _first(http, m, 0.0, cold)
        for m in busy:  # warm before the window
            await stream_completion(http, m, PROMPT, 8, Dialect())
        start = time.perf_counter()
        until = start + window
        samples: dict[str, list[Sample]] = {m: [] for m in busy}
        work = [_client(http, m, until, samples[m]) for m in busy for _ in range(CLIENTS[m])]
        if arm == "switch":
            work.append(_first(http, SMALL, window / 2, cold))
        await asyncio.gather(*work)
        end = time.perf_counter()
        loads = load_seconds((await http.get("/metrics")).text)
    out: dict[str, float] = {}
    for m in busy:
        out |= {
            f"{SHORT[m]}_{k}": v for k, v in per_model(samples[m], start, min(end, until)).items()
        }
    out |= {f"{SHORT[m]}_first_ttft_s": v for m, v in cold.items()}
    out |= {f"{SHORT[m]}_load_s": v for m, v in loads.items() if m in SHORT}
    return out


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; the arms are {', '.join(ARMS)}")
    flags = ["--keep-alive", "-1", "--models-dir", str(run.out / "models")]
    for m in ARMS[arm]:
        flags += ["--model", m]
    server = run.ferrum(arm, *flags)
    try:
        return asyncio.run(
            _measure(server.url, arm, run.option("window", 10.0 if run.quick else 30.0))
        )
    finally:
        server.stop()


def _metrics() -> tuple[Metric, ...]:
    out: list[Metric] = []
    for short in SHORT.values():
        out += [Metric(f"{short}_tok_s", "tok/s", True, 1),
                Metric(f"{short}_p99_gap_s", "s", False, 4)]  # fmt: skip
    for short in SHORT.values():
        out += [Metric(f"{short}_first_ttft_s", "s", False),
                Metric(f"{short}_load_s", "s", False)]  # fmt: skip
    return tuple(out)


STUDY = Study(
    name="models",
    title="Two models in one server against each alone: tok/s and p99 gap per model",
    arms=tuple(ARMS),
    metrics=_metrics(),
    measure=measure,
)
