"""Routing on 2 replicas, side by side: `ferrum cluster` with the prefix router (the blocks
replicas report holding), with the text-prefix router (Ray Serve LLM's
PrefixCacheAffinityRouter policy, re-implemented) and with power of two choices (Ray
Serve's default), against one `ferrum serve` with the same total KV. One server at a time,
the arm order alternated per round, a fresh server (cold cache) per run.

Replicas: --threads 1 --ctx-size 4096 --parallel 8 each; the single server: --threads 2
--ctx-size 8192 --parallel 16 (--parallel also bounds the parked sequences, so it is set
high enough that the KV cells, not the sequence ids, are what runs out). Prefix tiers off
everywhere (--cache-ram 0 --cache-disk 0): this measures what the KV holds, which routing
decides.

Workload, through /v1/chat/completions (streamed, greedy, 24 answer tokens, CLIENTS
requests in flight):
- conversations: CONVERSATIONS conversations, each with a system prompt of its own
  (~350 tokens), TURNS turns taken round-robin (turn 1 of each, then turn 2, ...). Their
  histories end near 4,800 tokens together: more than one replica's KV, less than two.
- bursts: BURSTS system prompts (~410 tokens each), BURST_SIZE requests behind each sent at
  once, between the turns.
Metrics per run: later-turn TTFT (turns >= 2, median), burst TTFT (median), share of prompt
tokens served from cache (usage.prompt_tokens_details.cached_tokens over prompt_tokens, all
requests), aggregate answer tokens/s over the whole run.

    .venv/bin/python bench/bench_cluster.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import httpx

from ferrum.bench.process import ServerProcess, ferrum_command, free_port
from ferrum.bench.stats import Spread, verdict
from ferrum.models.builtin import DEFAULT_CHAT_MODEL

CONVERSATIONS = 10
TURNS = 4
BURSTS = 3
BURST_SIZE = 6
CLIENTS = 4
ANSWER_TOKENS = 24
REPLICA = ["--threads", "1", "--ctx-size", "4096", "--parallel", "8"]
SINGLE = ["--threads", "2", "--ctx-size", "8192", "--parallel", "16"]
NO_TIERS = ["--cache-ram", "0", "--cache-disk", "0"]
ARMS = ["prefix", "text-prefix", "pow2", "single"]
WORDS = ["stone", "water", "bridge", "river", "mill", "harbour", "lantern", "orchard", "meadow",
         "valley", "tower", "market", "winter", "summer", "engine", "ledger", "archive",
         "garden", "weaver", "potter", "signal", "compass"]  # fmt: skip


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _start(arm: str, out: Path) -> ServerProcess:
    port = free_port()
    common = ["--model", DEFAULT_CHAT_MODEL, "--models-dir", str(out / "models"), *NO_TIERS]
    if arm == "single":
        cmd = ferrum_command(port, *SINGLE, *common)
    else:
        cmd = [sys.executable, "-m", "ferrum.cli", "cluster", "--port", str(port),
               "--replicas", "2", "--router", arm, *REPLICA, *common]  # fmt: skip
    server = ServerProcess(cmd, out / f"{arm}.log", port)
    server.wait_ready(server.url, "/health", timeout=300)
    if arm != "single":  # every replica posting
        while len(httpx.get(server.url + "/health", timeout=10).json()["replicas"]) < 2:
            time.sleep(0.5)
    return server


def _stop(server: ServerProcess, arm: str) -> None:
    server.stop()
    if arm != "single":  # whatever of the local Ray instance outlived its driver
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"],
                       capture_output=True, check=False)  # fmt: skip


class _Tally:
    def __init__(self) -> None:
        self.prompt = self.cached = self.answer = 0

    def add(self, usage: dict) -> None:
        self.prompt += usage["prompt_tokens"]
        self.cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        self.answer += usage["completion_tokens"]


async def _ask(http: httpx.AsyncClient, messages: list[dict], tally: _Tally) -> tuple[float, str]:
    body = {"model": DEFAULT_CHAT_MODEL, "messages": messages, "max_tokens": ANSWER_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start, first, text = time.perf_counter(), 0.0, []
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                tally.add(event["usage"])
            for choice in event.get("choices") or ():
                if choice["delta"].get("content"):
                    first = first or time.perf_counter() - start
                    text.append(choice["delta"]["content"])
    return first, "".join(text)


async def _run(url: str) -> dict[str, float]:
    tally, later, burst = _Tally(), [], []
    gate = asyncio.Semaphore(CLIENTS)
    chats = [[{"role": "system", "content": f"Notes {c}: {_text(c, 300)}"}]
             for c in range(CONVERSATIONS)]  # fmt: skip
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def turn(c: int, t: int) -> None:
            async with gate:
                chats[c].append({"role": "user", "content": f"Question {t}: the {WORDS[t]}?"})
                ttft, answer = await _ask(http, chats[c], tally)
                chats[c].append({"role": "assistant", "content": answer})
                if t:
                    later.append(ttft)

        async def one_burst(b: int, i: int) -> None:
            system = {"role": "system", "content": f"Rules {b}: {_text(1000 + b, 360)}"}
            user = {"role": "user", "content": f"Request {i}: name a {WORDS[i]}."}
            ttft, _ = await _ask(http, [system, user], tally)
            burst.append(ttft)

        for t in range(TURNS):
            await asyncio.gather(*(turn(c, t) for c in range(CONVERSATIONS)))
            if t < BURSTS:  # a burst between turns, as other users' traffic
                await asyncio.gather(*(one_burst(t, i) for i in range(BURST_SIZE)))
    wall = time.perf_counter() - start
    return {"later_ttft": median(later), "burst_ttft": median(burst),
            "cache_share": tally.cached / tally.prompt,
            "tokens_per_s": tally.answer / wall}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench-results/cluster")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        for arm in order:
            server = _start(arm, out / f"round{r}")
            try:
                result = asyncio.run(_run(server.url))
            finally:
                _stop(server, arm)
            runs[arm].append(result)
            print(f"round {r} {arm}: {json.dumps({k: round(v, 3) for k, v in result.items()})}",
                  flush=True)  # fmt: skip
    (out / "results.json").write_text(json.dumps(runs, indent=1))
    print("\n| metric | " + " | ".join(ARMS) + " |")
    print("| --- |" + " --- |" * len(ARMS))
    for metric in ("later_ttft", "burst_ttft", "cache_share", "tokens_per_s"):
        cells = []
        for arm in ARMS:
            s = Spread.of(run[metric] for run in runs[arm])
            cells.append(f"{s.median:.3f} [{s.lo:.3f}, {s.hi:.3f}]" if s else "n/a")
        print(f"| {metric} | " + " | ".join(cells) + " |")
    print()
    for metric, higher in (("later_ttft", False), ("burst_ttft", False),
                           ("cache_share", True), ("tokens_per_s", True)):  # fmt: skip
        for base in ("pow2", "text-prefix", "single"):
            pairs = zip(runs["prefix"], runs[base], strict=True)
            s = Spread.of(a[metric] / b[metric] for a, b in pairs)
            ours = Spread.of(run[metric] for run in runs["prefix"])
            theirs = Spread.of(run[metric] for run in runs[base])
            print(f"{metric} prefix/{base}: x{s.median:.3f} [{s.lo:.3f}, {s.hi:.3f}] "
                  f"({verdict(ours, theirs, higher)})")  # fmt: skip


if __name__ == "__main__":
    main()
