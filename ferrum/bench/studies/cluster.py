"""Routing on 2 replicas, side by side: `ferrum cluster` with the prefix router (the blocks
replicas report holding), with the text-prefix router (Ray Serve LLM's
PrefixCacheAffinityRouter policy, re-implemented) and with power of two choices (Ray Serve's
default), against one `ferrum serve` with the same total KV. One server at a time, a fresh
one (cold cache) per run.

Arms: `prefix` (the reference), `text-prefix`, `pow2` (each `ferrum cluster --router ARM`,
needs Ray: the `cluster` extra) and `single`. Replicas: --threads 1 --ctx-size 4096
--parallel 8 each; the single server: --threads 2 --ctx-size 8192 --parallel 16 (--parallel
also bounds the parked sequences, so it is set high enough that the KV cells, not the sequence
ids, are what runs out). Prefix tiers off everywhere (--cache-ram 0 --cache-disk 0): this
measures what the KV holds, which routing decides.

Workload, through /v1/chat/completions (streamed, greedy, 24 answer tokens, 4 requests in
flight):
- conversations: 10 conversations, each with a system prompt of its own (~350 tokens), 4
  turns (`--quick`: 2) taken round-robin. Their histories end near 4,800 tokens together:
  more than one replica's KV, less than two.
- bursts: 3 system prompts (~410 tokens each), 6 requests behind each sent at once, between
  the turns.
Metrics per run: later-turn TTFT (turns >= 2, median), burst TTFT (median), share of prompt
tokens served from cache (cached_tokens over prompt_tokens, all requests), answer tokens/s
over the whole run. After each cluster arm, `ray stop --force` (as bench_cluster.py did)
stops what of Ray outlived its driver, and with it every local Ray instance: run this study on
a machine of its own.

    ferrum bench --study cluster [--rounds 4] [--arms prefix,pow2]
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import httpx

from ferrum.bench.client import Sample, stream_body
from ferrum.bench.process import ServerProcess, ferrum_command, free_port
from ferrum.bench.rounds import Metric
from ferrum.bench.studies import Study, StudyRun
from ferrum.models.builtin import DEFAULT_CHAT_MODEL

CONVERSATIONS = 10
BURSTS = 3
BURST_SIZE = 6
CLIENTS = 4
ANSWER_TOKENS = 24
REPLICA = ["--threads", "1", "--ctx-size", "4096", "--parallel", "8"]
SINGLE = ["--threads", "2", "--ctx-size", "8192", "--parallel", "16"]
NO_TIERS = ["--cache-ram", "0", "--cache-disk", "0"]
ROUTERS = ("prefix", "text-prefix", "pow2")
WORDS = ["stone", "water", "bridge", "river", "mill", "harbour", "lantern", "orchard", "meadow",
         "valley", "tower", "market", "winter", "summer", "engine", "ledger", "archive",
         "garden", "weaver", "potter", "signal", "compass"]  # fmt: skip


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def command(arm: str, port: int, models_dir: Path) -> list[str]:
    """The command line of an arm: `ferrum serve` (single) or `ferrum cluster --router ARM`."""
    common = ["--model", DEFAULT_CHAT_MODEL, "--models-dir", str(models_dir), *NO_TIERS]
    if arm == "single":
        return ferrum_command(port, *SINGLE, *common)
    if arm not in ROUTERS:
        raise ValueError(f"arm {arm!r}: choose single or a router: {', '.join(ROUTERS)}")
    return [sys.executable, "-P", "-m", "ferrum.cli", "cluster", "--port", str(port),
            "--replicas", "2", "--router", arm, *REPLICA, *common]  # fmt: skip


def _start(run: StudyRun, arm: str) -> ServerProcess:
    port = free_port()
    server = ServerProcess(command(arm, port, run.out / "models"), run.out / f"{arm}.log", port)
    try:
        server.wait_ready(server.url, "/health", timeout=300)
        if arm != "single":  # every replica posting
            deadline = time.monotonic() + 300
            while len(httpx.get(server.url + "/health", timeout=10).json()["replicas"]) < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("fewer than 2 replicas after 300 s")
                time.sleep(0.5)
    except BaseException:
        _stop(server, arm)
        raise
    return server


def _stop(server: ServerProcess, arm: str) -> None:
    server.stop()
    if arm != "single":  # whatever of the local Ray instance outlived its driver
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"],
                       capture_output=True, check=False)  # fmt: skip


class Tally:
    """Prompt, cached and answer tokens over a run's requests (their usage)."""

    def __init__(self) -> None:
        self.prompt = self.cached = self.answer = 0

    def add(self, sample: Sample) -> None:
        if sample.prompt_tokens is None or sample.completion_tokens is None:
            raise RuntimeError("a reply without usage")
        self.prompt += sample.prompt_tokens
        self.cached += sample.cached_tokens or 0
        self.answer += sample.completion_tokens


async def _ask(http: httpx.AsyncClient, messages: list[dict], tally: Tally) -> tuple[float, str]:
    body = {"model": DEFAULT_CHAT_MODEL, "messages": messages, "max_tokens": ANSWER_TOKENS,
            "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    sample = await stream_body(http, "/v1/chat/completions", body)
    tally.add(sample)
    return sample.ttft_s or 0.0, sample.text


async def _traffic(url: str, turns: int) -> dict[str, float]:
    tally, later, burst = Tally(), [], []
    gate = asyncio.Semaphore(CLIENTS)
    chats = [[{"role": "system", "content": f"Notes {c}: {text(c, 300)}"}]
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
            system = {"role": "system", "content": f"Rules {b}: {text(1000 + b, 360)}"}
            user = {"role": "user", "content": f"Request {i}: name a {WORDS[i]}."}
            ttft, _ = await _ask(http, [system, user], tally)
            burst.append(ttft)

        for t in range(turns):
            await asyncio.gather(*(turn(c, t) for c in range(CONVERSATIONS)))
            if t < BURSTS:  # a burst between turns, as other users' traffic
                await asyncio.gather(*(one_burst(t, i) for i in range(BURST_SIZE)))
    wall = time.perf_counter() - start
    return {"later_ttft": median(later), "burst_ttft": median(burst),
            "cache_share": tally.cached / tally.prompt,
            "tokens_per_s": tally.answer / wall}  # fmt: skip


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    server = _start(run, arm)
    try:
        return asyncio.run(_traffic(server.url, run.option("turns", 2 if run.quick else 4)))
    finally:
        _stop(server, arm)


STUDY = Study(
    name="cluster",
    title="Routing on 2 replicas: prefix, text-prefix and power of two against one server",
    arms=(*ROUTERS, "single"),
    metrics=(
        Metric("later_ttft", "s", higher_is_better=False),
        Metric("burst_ttft", "s", higher_is_better=False),
        Metric("cache_share", "", higher_is_better=True),
        Metric("tokens_per_s", "tok/s", higher_is_better=True, digits=1),
    ),
    measure=measure,
)
