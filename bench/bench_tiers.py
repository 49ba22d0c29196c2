"""The prefix cache's RAM and disk tiers, side by side: ferrum with tiers (the default),
ferrum without (`--cache-ram 0 --cache-disk 0`: an evicted prefix is computed again) and
llama.cpp's server with its host-RAM prompt cache (`--cache-ram`, on by default), on the
default chat model, one server at a time, same GGUF, threads and KV size.

Workloads, through /v1/completions (prompts already templated, so every server sees the same
tokens), greedy, one client:
- multiturn: CONVERSATIONS conversations × TURNS turns, taken round-robin (turn 1 of each,
  then turn 2 of each, ...). Each starts with a document of its own (~900 tokens); each
  turn adds the answer (24 tokens) and a new question. A KV pool of 4,096 cells holds about
  four of them (ferrum: two parked beside `--parallel 2`), so every later turn finds its
  history evicted. Metric: later-turn TTFT
  (turns ≥ 2), median per round.
- unique: UNIQUE prompts of ~750 tokens that share nothing (no reuse possible; evictions
  still save states): seconds for all of them, tiers against no tiers (the cost of saving).
- restart (ferrum with tiers only): a 4,000-token prompt on a server with an empty cache
  folder (cold prefill), the server stopped, started again on the same folder, and the same
  prompt: TTFT after the restart against the cold one.

Rounds alternate the arm order; round 1 is a warm-up and is dropped; medians [min, max] over
the rest and per-round ratios.

    .venv/bin/python bench/bench_tiers.py [--rounds 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import time
from pathlib import Path
from statistics import median

import httpx

from ferrum.bench.arms import llama_cpp_build_dir
from ferrum.bench.process import ServerProcess, ferrum_command, free_port
from ferrum.bench.stats import Spread
from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

CONVERSATIONS = 8
TURNS = 3
ANSWER_TOKENS = 24
UNIQUE = 6
KV = ("4096", "2")  # --ctx-size, --parallel (llama-server: -c, -np)
ARMS = {
    "ferrum tiers": ("ferrum", []),
    "ferrum no tiers": ("ferrum", ["--cache-ram", "0", "--cache-disk", "0"]),
    "llama-server cache-ram": ("llama-server", []),
}
WORDS = ["stone", "water", "bridge", "river", "mill", "harbour", "lantern", "orchard", "meadow",
         "valley", "tower", "market", "winter", "summer", "engine", "ledger", "archive",
         "garden", "weaver", "potter", "signal", "compass"]  # fmt: skip


def _document(seed: int, words: int) -> str:
    rng = random.Random(seed)
    sentences = []
    while words > 0:
        n = rng.randint(8, 16)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
        words -= n
    return " ".join(sentences)


def _turn(history: str, question: str) -> str:
    return f"{history}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def _server(arm: str, threads: int, out: Path, cache_dir: Path) -> ServerProcess:
    kind, extra = ARMS[arm]
    port = free_port()
    model = builtin_path(DEFAULT_CHAT_MODEL)
    ctx, parallel = KV
    if kind == "ferrum":
        cmd = ferrum_command(port, "--threads", str(threads), "--models-dir", str(out / "m"),
                             "--model", f"bench={model}", "--parallel", parallel, "--ctx-size",
                             ctx, "--cache-dir", str(cache_dir), *extra)  # fmt: skip
    else:
        cmd = [str(llama_cpp_build_dir() / "llama-server"), "-m", model, "-np", parallel,
               "-c", ctx, "-t", str(threads), "--port", str(port), *extra]  # fmt: skip
    server = ServerProcess(cmd, out / f"{arm.replace(' ', '-')}.log", port)
    server.wait_ready(server.url, "/health", timeout=300)
    return server


def _client(url: str) -> httpx.AsyncClient:
    """A connection per request: llama-server's HTTP library closes a kept-alive connection
    after a few requests, which a client sending the next one at once sees as a disconnect."""
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=url, timeout=600, limits=limits)


async def _ask(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[float, str, int]:
    """(TTFT, text, cached prompt tokens where the server says) of one streamed request."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "repetition_penalty": 1.0, "repeat_penalty": 1.0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start, first, text, cached = time.perf_counter(), 0.0, [], 0
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    first = first or time.perf_counter() - start
                    text.append(choice["text"])
    return first, "".join(text), cached


async def _multiturn(url: str) -> dict[str, float]:
    histories = [
        f"<|im_start|>system\nYou answer questions about notes.<|im_end|>\n<|im_start|>user\n"
        f"Notes {c}: {_document(c, 650)}<|im_end|>\n<|im_start|>assistant\nNoted.<|im_end|>\n"
        for c in range(CONVERSATIONS)
    ]
    first_turn: list[float] = []
    later: list[float] = []
    cached = 0
    async with _client(url) as http:
        for turn in range(TURNS):
            for c in range(CONVERSATIONS):
                prompt = _turn(histories[c], f"Question {turn}: what about the {WORDS[turn]}?")
                ttft, text, hit = await _ask(http, prompt, ANSWER_TOKENS)
                (first_turn if turn == 0 else later).append(ttft)
                if turn:
                    cached += hit
                histories[c] = f"{prompt}{text}<|im_end|>\n"
    return {"turn1_ttft": median(first_turn), "later_ttft": median(later),
            "later_cached_tokens": cached}  # fmt: skip


async def _unique(url: str, seed: int) -> float:
    async with _client(url) as http:
        start = time.perf_counter()
        for i in range(UNIQUE):
            doc = _document(10_000 + seed * UNIQUE + i, 550)
            await _ask(http, _turn("", f"Summarise: {doc}"), 16)
        return time.perf_counter() - start


def _restart(threads: int, out: Path, cache_dir: Path, seed: int) -> dict[str, float]:
    prompt = _turn("", f"Summarise: {_document(20_000 + seed, 2900)}")
    times = []
    for _ in range(2):
        server = _server("ferrum tiers", threads, out, cache_dir)
        try:
            times.append(asyncio.run(_one(server.url, prompt)))
        finally:
            server.stop()
    return {"restart_cold_ttft": times[0], "restart_ttft": times[1]}


async def _one(url: str, prompt: str) -> float:
    async with _client(url) as http:
        return (await _ask(http, prompt, 8))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default="bench/results/tiers")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = args.arms.split(",")
    rounds = []
    for r in range(args.rounds):
        row: dict[str, float] = {}
        for arm in arms if r % 2 == 0 else arms[::-1]:
            cache_dir = out / "kv" / arm.replace(" ", "-")
            shutil.rmtree(cache_dir, ignore_errors=True)
            server = _server(arm, args.threads, out, cache_dir)
            try:
                asyncio.run(_one(server.url, _turn("", "Say hello.")))  # weights paged in
                for key, value in asyncio.run(_multiturn(server.url)).items():
                    row[f"{key} {arm}"] = value
                if arm.startswith("ferrum"):
                    row[f"unique_s {arm}"] = asyncio.run(_unique(server.url, r))
            finally:
                server.stop()
            if arm == "ferrum tiers":
                shutil.rmtree(cache_dir, ignore_errors=True)
                for key, value in _restart(args.threads, out, cache_dir, r).items():
                    row[key] = value
        rounds.append(row)
        print(f"round {r + 1}: {json.dumps({k: round(v, 3) for k, v in row.items()})}", flush=True)
        (out / "rounds.json").write_text(json.dumps(rounds, indent=1))
    _report(rounds[1:] if len(rounds) > 1 else rounds, arms)


def _report(kept: list[dict[str, float]], arms: list[str]) -> None:
    def spread(f) -> str:  # type: ignore[no-untyped-def]
        s = Spread.of(f(row) for row in kept)
        return f"{s.median:.3f} [{s.lo:.3f}, {s.hi:.3f}]" if s else "n/a"

    for metric in ("turn1_ttft", "later_ttft", "later_cached_tokens"):
        for arm in arms:
            print(f"{metric} {arm}: {spread(lambda row, k=f'{metric} {arm}': row[k])}")
    base = "later_ttft ferrum no tiers"
    for arm in arms:
        key = f"later_ttft {arm}"
        if arm != "ferrum no tiers" and base in kept[0] and key in kept[0]:
            ratio = spread(lambda row, k=key: row[k] / row[base])
            print(f"later-turn TTFT {arm} / no tiers: ×{ratio}")
    if "unique_s ferrum tiers" in kept[0] and "unique_s ferrum no tiers" in kept[0]:
        ratio = spread(lambda row: row["unique_s ferrum no tiers"] / row["unique_s ferrum tiers"])
        print(f"unique prompts, speed with tiers / without: ×{ratio}")
    if "restart_ttft" in kept[0]:
        print(f"restart TTFT: {spread(lambda row: row['restart_ttft'])} s, cold "
              f"{spread(lambda row: row['restart_cold_ttft'])} s, "
              f"×{spread(lambda row: row['restart_ttft'] / row['restart_cold_ttft'])}")  # fmt: skip


if __name__ == "__main__":
    main()
