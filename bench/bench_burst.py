"""A burst of unrelated requests: how soon do they all get going? ferrum against llama.cpp's
server (issue #11's last done-when: time to first token p50 at most 1.0× llama-server's).

Arms, one server at a time, same GGUF (Gemma 3 270M, the benchmarks' model) and threads:
`ferrum serve --parallel 8` and `llama-server -np 8 -c 8192` (cmake-default build from
bench/build_llama_server.sh). Per server: one warm-up burst, then BURSTS bursts of 8
requests sent at the same instant, each a short prompt of its own (random words, no shared
beginning, so nothing can be reused), 64 tokens streamed through /v1/completions. Per burst
the p50 of the 8 times to first token (the goal), their mean and their longest, and the time
until the burst's last request ended; per server the median over its bursts. Rounds
alternate the arm order; round 1 is a warm-up and is dropped; median [min, max] of the
rest, and the ratio ferrum / llama-server per round. `--before PATH` adds an arm
`ferrum-before`: ferrum from another code tree (e.g. a worktree of an older commit), started
with PYTHONPATH=PATH.

    .venv/bin/python bench/bench_burst.py [--rounds 4] [--threads 2] [--before /tmp/wt]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
from pathlib import Path

import httpx

from ferrum.bench.arms import llama_cpp_build_dir
from ferrum.bench.client import Dialect, stream_completion
from ferrum.bench.process import ServerProcess, ferrum_command, free_port
from ferrum.bench.stats import Spread
from ferrum.models.builtin import builtin_path

CLIENTS, TOKENS, BURSTS = 8, 64, 6
METRICS = ("ttft_p50", "ttft_mean", "ttft_max", "burst_end")
MODEL = "gemma3-270m"
_TEXT = ("river stone lamp violin harbor meadow copper lantern orchard glacier falcon "
         "compass thimble quartz saddle ember willow canyon parcel ribbon tundra beacon "
         "marble pepper walnut cobalt velvet anchor")  # fmt: skip
WORDS = _TEXT.split()


def _prompts(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = rng.sample(WORDS, CLIENTS)  # a different first word for every request
    return [f"{w} " + " ".join(rng.choice(WORDS) for _ in range(11)) + "." for w in words]


def _server(arm: str, threads: int, folder: Path, before: str) -> ServerProcess:
    port = free_port()
    model = builtin_path(MODEL)
    env = {**os.environ, "PYTHONPATH": before} if arm == "ferrum-before" else None
    if arm.startswith("ferrum"):
        cmd = ferrum_command(port, "--threads", str(threads), "--models-dir", str(folder / "m"),
                             "--model", f"bench={model}", "--parallel", "8")  # fmt: skip
    else:
        cmd = [str(llama_cpp_build_dir() / "llama-server"), "-m", model, "-np", "8",
               "-c", "8192", "-t", str(threads), "--port", str(port)]  # fmt: skip
    server = ServerProcess(cmd, folder / f"{arm}.log", port, env=env)
    server.wait_ready(server.url, "/health", timeout=300)
    return server


async def _burst(url: str, seed: int) -> dict[str, float]:
    """One burst of CLIENTS requests sent together: its TTFT p50 (the goal's metric), mean and
    longest, and the time until its last request ended."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        samples = await asyncio.gather(
            *(stream_completion(http, "bench", p, TOKENS, Dialect()) for p in _prompts(seed))
        )
    ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
    if len(ttfts) < len(samples):
        raise RuntimeError("a request of the burst streamed no token")
    start = min(s.t_start for s in samples)
    return {"ttft_p50": statistics.median(ttfts), "ttft_mean": statistics.fmean(ttfts),
            "ttft_max": max(ttfts), "burst_end": max(s.t_end for s in samples) - start}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/burst")
    ap.add_argument("--before", default="", help="code tree of a ferrum-before arm")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = ["ferrum", "llama-server"] + (["ferrum-before"] if args.before else [])
    rounds = []
    for r in range(args.rounds):
        row: dict[str, float] = {}
        for arm in arms if r % 2 == 0 else arms[::-1]:
            server = _server(arm, args.threads, out, str(Path(args.before).resolve()))
            try:
                asyncio.run(_burst(server.url, -1 - r))  # warm-up
                bursts = [asyncio.run(_burst(server.url, r * 100 + b)) for b in range(BURSTS)]
                for metric in METRICS:
                    row[f"{arm} {metric}"] = statistics.median(b[metric] for b in bursts)
            finally:
                server.stop()
        rounds.append(row)
        print(f"round {r + 1}: {json.dumps({k: round(v, 4) for k, v in row.items()})}", flush=True)
    (out / "rounds.json").write_text(json.dumps(rounds, indent=1))
    kept = rounds[1:] if len(rounds) > 1 else rounds
    for metric in METRICS:
        for arm in arms:
            key = f"{arm} {metric}"
            s = Spread.of(row[key] for row in kept)
            line = f"{key}: {s.median:.3f} s [{s.lo:.3f}, {s.hi:.3f}]" if s else f"{key}: n/a"
            ratio = Spread.of(row[key] / row[f"llama-server {metric}"] for row in kept)
            if arm.startswith("ferrum") and ratio:
                line += f"  ×{ratio.median:.2f} [{ratio.lo:.2f}, {ratio.hi:.2f}] of llama-server"
            print(line)


if __name__ == "__main__":
    main()
