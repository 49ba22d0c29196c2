"""Two models in one server against each served alone: what a second model costs the first.

Arms, one server at a time (`ferrum serve`, --keep-alive -1 so nothing unloads mid-run):
  both    gemma3-270m and smollm2-135m-instruct in one server: 8 clients on gemma and 2 on
          smollm2 at the same time
  switch  the same two-model server, 8 clients on gemma; halfway through the window one
          request asks for smollm2, which loads then (a user switching models mid-traffic)
  gemma   gemma3-270m alone, the same 8 clients
  smollm2 smollm2-135m-instruct alone, the same 2 clients
Each client streams /v1/completions (greedy, ignore_eos, 128 tokens) back to back for the
window. Metric per model: output tokens per second over the window (all its clients) and the
p99 inter-token gap; the ratio of `both` to the model's `alone` arm, per round. Rounds
alternate the arm order; round 1 is a warm-up and is dropped; median [min, max] of the kept
rounds. Also, in `both`: the load seconds of the second model (loaded on its first request,
from ferrum_model_load_seconds) and that first request's time to first token.

    .venv/bin/python bench/bench_models.py [--rounds 4] [--window 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from pathlib import Path

import httpx

from ferrum.bench.client import Dialect, Sample, stream_completion
from ferrum.bench.process import ServerProcess, ferrum_command, free_port
from ferrum.bench.stats import Spread

BIG, SMALL = "gemma3-270m", "smollm2-135m-instruct"
CLIENTS = {BIG: 8, SMALL: 2}
TOKENS = 128
PROMPT = "Write a long story about a lighthouse keeper and the storm that changed her life."
ARMS = {"both": (BIG, SMALL), "switch": (BIG, SMALL), "gemma": (BIG,), "smollm2": (SMALL,)}


async def _client(http: httpx.AsyncClient, model: str, until: float, out: list[Sample]) -> None:
    while time.perf_counter() < until:
        out.append(await stream_completion(http, model, PROMPT, TOKENS, Dialect()))


def _per_model(samples: list[Sample], start: float, end: float) -> dict[str, float]:
    """Tokens that arrived inside [start, end] per second, and the p99 gap among them."""
    times = sorted(t for s in samples for t in s.chunk_times if start <= t <= end)
    gaps = sorted(g for s in samples for g in s.gaps)
    p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else float("nan")
    return {"tok_s": len(times) / (end - start), "p99_gap_s": p99}


async def _switch(http: httpx.AsyncClient, delay: float, cold: dict[str, float]) -> None:
    await asyncio.sleep(delay)
    s = await stream_completion(http, SMALL, PROMPT, 4, Dialect())
    cold[SMALL] = s.ttft_s or float("nan")


async def _measure(url: str, arm: str, window: float) -> dict:
    models = ARMS[arm]
    busy = (BIG,) if arm == "switch" else models
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        cold: dict[str, float] = {}
        for m in busy:  # the first request to each model (the second loads now)
            s = await stream_completion(http, m, PROMPT, 4, Dialect())
            cold[m] = s.ttft_s or float("nan")
        for m in busy:  # warm before the window
            await stream_completion(http, m, PROMPT, 8, Dialect())
        start = time.perf_counter()
        until = start + window
        samples: dict[str, list[Sample]] = {m: [] for m in busy}
        work = [_client(http, m, until, samples[m]) for m in busy for _ in range(CLIENTS[m])]
        if arm == "switch":
            work.append(_switch(http, window / 2, cold))
        await asyncio.gather(*work)
        end = time.perf_counter()
        metrics = (await http.get("/metrics")).text
    loads = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'ferrum_model_load_seconds_sum\{model="([^"]+)"\} (\S+)', metrics)
    }
    return {
        "per_model": {m: _per_model(samples[m], start, min(end, until)) for m in busy},
        "first_ttft_s": cold,
        "load_s": loads,
    }


def _run_arm(arm: str, threads: int, window: float, folder: Path) -> dict:
    port = free_port()
    flags = ["--threads", str(threads), "--keep-alive", "-1", "--models-dir", str(folder)]
    for m in ARMS[arm]:
        flags += ["--model", m]
    server = ServerProcess(ferrum_command(port, *flags), folder / f"{arm}.log", port)
    try:
        server.wait_ready(server.url, "/health", timeout=300)
        return asyncio.run(_measure(server.url, arm, window))
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/models")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
        result = {arm: _run_arm(arm, args.threads, args.window, out) for arm in order}
        rounds.append(result)
        print(f"round {r + 1}: " + json.dumps(result), flush=True)
    (out / "rounds.json").write_text(json.dumps(rounds, indent=1))
    _report(rounds[1:] if len(rounds) > 1 else rounds)


def _fmt(values: list[float]) -> str:
    s = Spread.of(values)
    return "n/a" if s is None else f"{s.median:.3g} [{s.lo:.3g}, {s.hi:.3g}]"


def _report(rounds: list[dict]) -> None:
    pairs = ((BIG, "both", "gemma"), (SMALL, "both", "smollm2"), (BIG, "switch", "gemma"))
    for model, arm, alone in pairs:
        for key in ("tok_s", "p99_gap_s"):
            with_other = [r[arm]["per_model"][model][key] for r in rounds]
            solo = [r[alone]["per_model"][model][key] for r in rounds]
            ratio = [b / s for b, s in zip(with_other, solo, strict=True)]
            print(
                f"{model} {key}: {arm} {_fmt(with_other)}  alone {_fmt(solo)}  "
                f"{arm}/alone {_fmt(ratio)}"
            )
    for arm in ("both", "switch"):
        loads = [r[arm]["load_s"].get(SMALL, float("nan")) for r in rounds]
        cold = [r[arm]["first_ttft_s"][SMALL] for r in rounds]
        print(f"{arm}: {SMALL} load s {_fmt(loads)}; its first request's TTFT s {_fmt(cold)}")


if __name__ == "__main__":
    main()
