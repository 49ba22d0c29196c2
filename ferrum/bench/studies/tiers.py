"""The prefix cache's RAM and disk tiers, side by side: ferrum with tiers (the default), ferrum
without (`--cache-ram 0 --cache-disk 0`: an evicted prefix is computed again) and llama.cpp's
server with its host-RAM prompt cache (`--cache-ram`, on by default), on the default chat
model, one server at a time, same GGUF, threads and KV size (4,096 cells, 2 sequences).

Arms: `ferrum tiers` (the reference), `ferrum no tiers`, `llama-server cache-ram`; a `--tree`
arm runs with tiers unless its name holds "no tiers".

Workloads, through /v1/completions (prompts already templated, so every server sees the same
tokens), greedy, one client:
- multiturn: 8 conversations × 3 turns (`--set turns=`; `--quick`: 2), taken round-robin.
  Each starts with a document of its own (~900 tokens); each turn adds the answer (24
  tokens) and a new question. The KV pool holds about four of them (ferrum: two parked
  beside `--parallel 2`), so every later turn finds its history evicted. Metrics: turn-1 and
  later-turn TTFT (median over the requests), prompt tokens the server says it had cached
  on later turns.
- unique (ferrum arms): 6 prompts (`--quick`: 2) of ~750 tokens that share nothing (no reuse
  possible; evictions still save states): seconds for all of them (the cost of saving).
- restart (ferrum arms with tiers): a 4,000-token prompt on a server with an empty cache
  folder (cold prefill), the server stopped, started again on the same folder, and the same
  prompt: TTFT after the restart, the cold one, and their ratio.

    ferrum bench --study tiers [--rounds 4] [--arms "ferrum tiers,ferrum no tiers"]
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from pathlib import Path
from statistics import median

import httpx

from ferrum.bench.client import Sample, http_client, stream_body
from ferrum.bench.process import ServerProcess
from ferrum.bench.rounds import Metric
from ferrum.bench.studies import Study, StudyRun
from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

CONVERSATIONS = 8
ANSWER_TOKENS = 24
CTX, PARALLEL = "4096", "2"  # --ctx-size, --parallel (llama-server: -c, -np)
NO_TIERS = ["--cache-ram", "0", "--cache-disk", "0"]
WORDS = ["stone", "water", "bridge", "river", "mill", "harbour", "lantern", "orchard", "meadow",
         "valley", "tower", "market", "winter", "summer", "engine", "ledger", "archive",
         "garden", "weaver", "potter", "signal", "compass"]  # fmt: skip


def document(seed: int, words: int) -> str:
    """About `words` words of seeded sentences (a notes document no other seed shares)."""
    rng = random.Random(seed)
    sentences = []
    while words > 0:
        n = rng.randint(8, 16)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
        words -= n
    return " ".join(sentences)


def turn(history: str, question: str) -> str:
    """`history` with one more user turn and the assistant's answer begun (ChatML)."""
    return f"{history}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def has_tiers(arm: str) -> bool:
    return "no tiers" not in arm


def _server(run: StudyRun, arm: str, cache_dir: Path) -> ServerProcess:
    model = run.model or builtin_path(DEFAULT_CHAT_MODEL)
    if run.is_ferrum(arm):
        return run.ferrum(arm, "--models-dir", str(run.out / "m"), "--model", f"bench={model}",
                          "--parallel", PARALLEL, "--ctx-size", CTX, "--cache-dir",
                          str(cache_dir), *([] if has_tiers(arm) else NO_TIERS))  # fmt: skip
    return run.llama_server(arm, model, "-np", PARALLEL, "-c", CTX)


async def ask(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> Sample:
    """One streamed greedy completion of `prompt`, its usage asked for."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "repetition_penalty": 1.0, "repeat_penalty": 1.0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    return await stream_body(http, "/v1/completions", body)


async def _multiturn(url: str, turns: int) -> dict[str, float]:
    histories = [
        f"<|im_start|>system\nYou answer questions about notes.<|im_end|>\n<|im_start|>user\n"
        f"Notes {c}: {document(c, 650)}<|im_end|>\n<|im_start|>assistant\nNoted.<|im_end|>\n"
        for c in range(CONVERSATIONS)
    ]
    first_turn: list[float] = []
    later: list[float] = []
    cached = 0
    async with http_client(url) as http:
        for t in range(turns):
            for c in range(CONVERSATIONS):
                prompt = turn(histories[c], f"Question {t}: what about the {WORDS[t]}?")
                sample = await ask(http, prompt, ANSWER_TOKENS)
                ttft, text, hit = sample.ttft_s or 0.0, sample.text, sample.cached_tokens or 0
                (first_turn if t == 0 else later).append(ttft)
                if t:
                    cached += hit
                histories[c] = f"{prompt}{text}<|im_end|>\n"
    return {"turn1_ttft": median(first_turn), "later_ttft": median(later),
            "later_cached_tokens": cached}  # fmt: skip


async def _unique(url: str, seed: int, count: int) -> float:
    async with http_client(url) as http:
        start = time.perf_counter()
        for i in range(count):
            doc = document(10_000 + seed * count + i, 550)
            await ask(http, turn("", f"Summarise: {doc}"), 16)
        return time.perf_counter() - start


async def _one(url: str, prompt: str) -> float:
    async with http_client(url) as http:
        return (await ask(http, prompt, 8)).ttft_s or 0.0


def _restart(run: StudyRun, arm: str, cache_dir: Path, seed: int) -> dict[str, float]:
    """The same long prompt on a fresh server over an empty cache folder, then again on a
    server started anew over the folder the first one left."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    prompt = turn("", f"Summarise: {document(20_000 + seed, 2900)}")
    times = []
    for _ in range(2):
        server = _server(run, arm, cache_dir)
        try:
            times.append(asyncio.run(_one(server.url, prompt)))
        finally:
            server.stop()
    return {"restart_cold_ttft": times[0], "restart_ttft": times[1],
            "restart_vs_cold": times[1] / times[0]}  # fmt: skip


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    cache_dir = run.out / "kv" / arm.replace(" ", "-")
    shutil.rmtree(cache_dir, ignore_errors=True)
    server = _server(run, arm, cache_dir)
    try:
        asyncio.run(_one(server.url, turn("", "Say hello.")))  # weights paged in
        metrics = asyncio.run(_multiturn(server.url, run.option("turns", 2 if run.quick else 3)))
        if run.is_ferrum(arm):
            count = run.option("unique", 2 if run.quick else 6)
            metrics["unique_s"] = asyncio.run(_unique(server.url, round_no, count))
    finally:
        server.stop()
    if run.is_ferrum(arm) and has_tiers(arm):
        metrics.update(_restart(run, arm, cache_dir, round_no))
    shutil.rmtree(cache_dir, ignore_errors=True)
    return metrics


STUDY = Study(
    name="tiers",
    title="The prefix cache's RAM and disk tiers: later-turn TTFT, the cost of saving, restarts",
    arms=("ferrum tiers", "ferrum no tiers", "llama-server cache-ram"),
    metrics=(
        Metric("turn1_ttft", "s", higher_is_better=False),
        Metric("later_ttft", "s", higher_is_better=False),
        Metric("later_cached_tokens", "", higher_is_better=True, digits=0),
        Metric("unique_s", "s", higher_is_better=False),
        Metric("restart_ttft", "s", higher_is_better=False),
        Metric("restart_cold_ttft", "s", higher_is_better=False),
        Metric("restart_vs_cold", "x", higher_is_better=False),
    ),
    measure=measure,
)
