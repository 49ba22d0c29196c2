"""Long unrelated prompts on the engine alone: what do the streams decoding beside the prefill
cost, and which engine settings change it? (issue #39: on `longctx` ferrum's whole workload
takes longer than llama-server's while its prefill alone is level.)

No HTTP, no event loop: a child process (this module run with ``python -m``) builds
`LlamaRunner` and `LLMEngine` as `ferrum serve` does (prefix cache and RAM tier on), adds
`clients` requests of `prompt_tokens` random token ids at one instant (nothing shared but
the BOS) and steps until all are done, `tokens` output tokens each (end of generation
ignored). Arms are engine settings, alternated one child at a time:

  ferrum           the defaults
  prefill-only     the defaults, one output token each: the prefill with no stream beside it
  swa-windows      `--swa-windows`: window layers sized to their windows
  decode-every-3   `--decode-every 3`: streams decode in every third step of a prefill
  batch-1024       `--batch-size 1024`: longer prefill chunks, fewer steps beside them
  split-0          `--split-prefill 0`: decodes in the prefill's llama_decode
  kv-streams       `--kv-streams`: a cell stream per sequence, as llama-server's slots

Metrics: when the last prompt got its first token (all prefills done), the median first
token, the whole run, and the mean step once every prompt is done (pure decoding).
Defaults: Gemma 3 270M, 8 clients x 1,677 tokens, 64 tokens, a 20,480-cell context.

    ferrum bench --study prefill [--arms ferrum,prefill-only,swa-windows] [--set clients=8]
        [--set prompt_tokens=1677] [--set tokens=64] [--set ctx=20480] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from ferrum.bench.rounds import Metric
from ferrum.bench.studies import Study, StudyRun
from ferrum.models.builtin import BENCH_MODEL, builtin_path

# arm -> (EngineConfig fields over the defaults, output tokens: None is the run's `tokens`)
ARMS: dict[str, tuple[dict[str, Any], int | None]] = {
    "ferrum": ({}, None),
    "prefill-only": ({}, 1),
    "swa-windows": ({"swa_windows": True}, None),
    "decode-every-3": ({"decode_every": 3}, None),
    "batch-1024": ({"batch_size": 1024}, None),
    "split-0": ({"split_prefill": 0}, None),
    "kv-streams": ({"kv_streams": True}, None),
}


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    fields, tokens = ARMS[arm]
    job = {
        "model": run.model or str(builtin_path(BENCH_MODEL)),
        "threads": run.threads,
        "ctx": run.option("ctx", 20480),
        "clients": run.option("clients", 8),
        "prompt_tokens": run.option("prompt_tokens", 1677),
        "tokens": tokens or run.option("tokens", 64),
        "fields": fields,
        "seed": round_no,
    }
    cmd = [sys.executable, "-m", "ferrum.bench.studies.prefill", json.dumps(job)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the engine child failed: {done.stderr.strip()[-500:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _engine_run(job: dict[str, Any]) -> dict[str, float]:
    from ferrum.config import EngineConfig
    from ferrum.engine.engine import LLMEngine
    from ferrum.engine.kv.tiers import TierConfig
    from ferrum.engine.llama.runner import LlamaRunner
    from ferrum.engine.request import SamplingParams
    from ferrum.engine.speculation.speculator import SpecConfig

    clients = job["clients"]
    cfg = EngineConfig(ctx_size=job["ctx"], parallel=clients, threads=job["threads"],
                       **job["fields"])  # fmt: skip
    runner = LlamaRunner(cfg, job["model"])
    try:
        # The server's RAM tier (`--cache-ram`), no disk tier: nothing outlives the child.
        tiers = TierConfig(int(cfg.cache_ram * 2**20), 0, None, "prefill-study", io_thread=False)
        engine = LLMEngine(
            runner, block_size=cfg.block_size, max_running=clients, tiers=tiers,
            speculation=SpecConfig.from_engine_config(cfg), prefill_cap=cfg.prefill_cap,
            decode_every=cfg.decode_every,
        )  # fmt: skip
        rng = random.Random(job["seed"])
        n_vocab, bos = runner.info.n_vocab, runner.vocab.bos
        params = SamplingParams(max_tokens=job["tokens"], temperature=0.0, ignore_eos=True)
        for i in range(clients):
            ids = [rng.randrange(n_vocab // 8, n_vocab) for _ in range(job["prompt_tokens"])]
            engine.add_request(f"p{i}", [bos, *ids], params)
        return _step_until_done(engine, clients)
    finally:
        runner.close()


def _step_until_done(engine: Any, clients: int) -> dict[str, float]:
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    decode_steps: list[float] = []
    while engine.has_work:
        t = time.perf_counter()
        outs = engine.step()
        if len(first) == clients:
            decode_steps.append(time.perf_counter() - t)
        for out in outs:
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
    total = time.perf_counter() - t0
    if len(first) < clients:
        raise RuntimeError("a request got no token")
    got = {
        "last_first_token": max(first.values()),
        "first_token_p50": statistics.median(first.values()),
        "total": total,
    }
    if decode_steps:  # none where each request ends at its first token: "n/a" in the table
        got["decode_step_ms"] = 1000 * statistics.fmean(decode_steps)
    return got


STUDY = Study(
    name="prefill",
    title="Long unrelated prompts on the engine alone: prefill with and without streams",
    arms=("ferrum", "prefill-only", "swa-windows"),
    metrics=(
        Metric("last_first_token", "s", higher_is_better=False),
        Metric("first_token_p50", "s", higher_is_better=False),
        Metric("total", "s", higher_is_better=False),
        Metric("decode_step_ms", "ms", higher_is_better=False),
    ),
    measure=measure,
)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one arm of the prefill study (its child)")
    parser.add_argument("job", help="the job as JSON (`measure` writes it)")
    print(json.dumps(_engine_run(json.loads(parser.parse_args().job))))
