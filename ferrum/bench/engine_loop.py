"""The `engine` workload: ferrum's decode loop without HTTP against llama.cpp's own.

Both sides run as child processes, one at a time, on the same model, threads and KV shape:

* ferrum: this module's `main` (``python -m ferrum.bench.engine_loop``) builds `LlamaRunner`
  and `LLMEngine` as `ferrum.server` does, adds B requests of `prompt_tokens` random token
  ids and steps until they are done; decode tok/s = tokens generated after the step in which
  the last request got its first token / time since that step.
* ceiling: `llama-batched-bench -npp P -ntg N -npl B...` (S_TG: B*N / time of the N decode
  calls), built from the same llama.cpp by bench/build_llama_server.sh, with ferrum's KV
  shape (one pool); the same with a cache per sequence (`llama-batched-bench streams`),
  which says what the pool itself costs; and one pool whose window layers keep only their
  windows (`llama-batched-bench windows`), which says what `swa_full` costs.

The ceiling decodes and computes logits but samples nothing and has no scheduler; ferrum's
loop adds greedy sampling, scheduling, KV accounting and text decoding. The ratio
ferrum / ceiling is what those cost. The prefix cache is off here: finished sequences leave
the KV as `llama_memory_clear` leaves llama-batched-bench's between batch sizes (parked ones
would widen the attended cell range of later batches).

Also: ``--eog`` prints the model's end-of-generation token ids (for llama-cpp-python, whose
server has no `ignore_eos`), so that the harness itself never imports llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BATCH_SIZE = 512  # n_batch = n_ubatch on both sides


def ferrum_decode_tps(
    model: str, threads: int, ctx: int, batches: list[int], prompt_tokens: int, tokens: int
) -> dict[int, float]:
    from ferrum.config import EngineConfig
    from ferrum.engine.engine import LLMEngine
    from ferrum.engine.llama.runner import LlamaRunner
    from ferrum.engine.request import SamplingParams

    cfg = EngineConfig(
        ctx_size=ctx,
        parallel=max(batches),
        threads=threads,
        batch_size=BATCH_SIZE,
        no_prefix_cache=True,
    )
    runner = LlamaRunner(cfg, model)
    try:
        engine = LLMEngine(
            runner, block_size=cfg.block_size, max_running=cfg.parallel, prefix_cache=False
        )
        rng = random.Random(0)
        n_vocab = runner.info.n_vocab
        _run_batch(engine, rng, n_vocab, 1, 16, 4, SamplingParams)  # warm-up, like the ceiling
        return {
            b: _run_batch(engine, rng, n_vocab, b, prompt_tokens, tokens, SamplingParams)
            for b in batches
        }
    finally:
        runner.close()


def _run_batch(
    engine: Any,
    rng: random.Random,
    n_vocab: int,
    b: int,
    prompt_tokens: int,
    tokens: int,
    params_cls: Any,
) -> float:
    # max_tokens = tokens + 1: the first token comes from the prefill step, then `tokens`
    # decode steps, as llama-batched-bench's -ntg counts them.
    params = params_cls(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    ids = [f"b{b}-{i}-{rng.getrandbits(32)}" for i in range(b)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(n_vocab) for _ in range(prompt_tokens)], params)
    started: set[str] = set()
    t0: float | None = None
    generated = 0
    while engine.has_work:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.error:
                raise RuntimeError(f"request {out.request_id}: {out.error}")
            if t0 is not None:
                generated += len(out.token_ids)
            elif out.token_ids:
                started.add(out.request_id)
        if t0 is None and len(started) == b:
            t0 = now
    if t0 is None or generated == 0:
        raise RuntimeError(f"batch {b}: no decode steps measured")
    return generated / (time.perf_counter() - t0)


# The ceilings' KV shapes, by side name: ferrum's (one pool for every sequence, the window
# cache as large as the pool); a cache per sequence, as llama.cpp keeps by default (what the
# pool costs); one pool with the window layers sized to their windows (what `swa_full`
# costs; issue #39).
CEILINGS = {
    "llama-batched-bench": ("-kvu", "--swa-full"),
    "llama-batched-bench streams": ("-no-kvu",),
    "llama-batched-bench windows": ("-kvu",),
}


def ceiling_command(
    binary: Path,
    model: str,
    threads: int,
    ctx: int,
    batches: list[int],
    pp: int,
    tg: int,
    side: str = "llama-batched-bench",
) -> list[str]:
    """llama-batched-bench with the KV shape that `side` names in CEILINGS."""
    t = str(threads)
    cmd = [str(binary), "-m", model, "-c", str(ctx), "-b", str(BATCH_SIZE)]
    cmd += ["-ub", str(BATCH_SIZE), "-t", t, "-tb", t, *CEILINGS[side]]
    cmd += ["-npp", str(pp), "-ntg", str(tg)]
    return [*cmd, "-npl", ",".join(map(str, batches)), "--output-format", "jsonl"]


def parse_ceiling(output: str) -> dict[int, float]:
    """S_TG (decode tok/s) per batch size from llama-batched-bench's jsonl lines."""
    result = {}
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            result[int(row["pl"])] = float(row["speed_tg"])
    return result


def run_ceiling(cmd: list[str], timeout: float) -> dict[int, float]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-10:])
        raise RuntimeError(f"llama-batched-bench exited with {proc.returncode}:\n{tail}")
    return parse_ceiling(proc.stdout + proc.stderr)


def ferrum_command(
    model: str, threads: int, ctx: int, batches: list[int], pp: int, tg: int
) -> list[str]:
    cmd = [sys.executable, "-m", "ferrum.bench.engine_loop", "--model", model]
    cmd += ["--threads", str(threads), "--ctx-size", str(ctx), "--prompt-tokens", str(pp)]
    return [*cmd, "--tokens", str(tg), "--batches", ",".join(map(str, batches))]


def run_ferrum(cmd: list[str], timeout: float) -> dict[int, float]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-10:])
        raise RuntimeError(f"ferrum engine loop exited with {proc.returncode}:\n{tail}")
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def eog_token_ids(model: str) -> tuple[int, ...]:
    """The model's end-of-generation token ids, from a child process (loads the model)."""
    cmd = [sys.executable, "-m", "ferrum.bench.engine_loop", "--model", model, "--eog"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"could not read the model's vocabulary:\n{proc.stderr[-500:]}")
    return tuple(json.loads(proc.stdout.strip().splitlines()[-1]))


def _print_eog(model: str) -> None:
    from ferrum.config import EngineConfig
    from ferrum.engine.llama.runner import LlamaRunner

    runner = LlamaRunner(EngineConfig(ctx_size=256, parallel=1, threads=1), model)
    try:
        print(json.dumps([t for t in range(runner.info.n_vocab) if runner.vocab.is_eog(t)]))
    finally:
        runner.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="ferrum's in-process decode loop (bench child)")
    p.add_argument("--model", required=True)
    p.add_argument("--eog", action="store_true", help="print end-of-generation token ids")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx-size", type=int, default=8192)
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.eog:
        _print_eog(args.model)
        return
    batches = [int(b) for b in args.batches.split(",")]
    tps = ferrum_decode_tps(
        args.model, args.threads, args.ctx_size, batches, args.prompt_tokens, args.tokens
    )
    print(json.dumps(tps))


if __name__ == "__main__":
    main()
