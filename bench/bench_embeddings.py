"""Embeddings throughput against llama.cpp's own server, and what an embedding flood costs
running chat streams.

Part 1, arms one server at a time, same GGUF (all-MiniLM-L6-v2, converted by the tests'
converter) and threads: `ferrum serve --model minilm=GGUF` and `llama-server --embeddings
--pooling mean -np 8 -c 4096 -b 512 -ub 512` (cmake-default build from
bench/build_llama_server.sh). 1,000 short sentences, 8 concurrent clients, one sentence per
request (the server must batch across requests): inputs per second. Rounds alternate the arm
order; round 1 is a warm-up and is dropped; median [min, max].

Part 2, ferrum serving minilm and smollm2-135m-instruct: 4 chat streams (greedy, ignore_eos,
200 tokens) alone, then with the flood of part 1 running; p99 of the streams' inter-token
gaps, per round, and the flood's inputs per second beside the streams. Both with the engines
taking turns at the cores (`--engine-turns shared`, the default) and without (`off`: the chat
and embedding engines decode side by side).

    .venv/bin/python bench/bench_embeddings.py [--rounds 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from ferrum.bench.arms import llama_cpp_build_dir
from ferrum.bench.client import Dialect, Sample, stream_completion
from ferrum.bench.process import ServerProcess, ferrum_command, free_port
from ferrum.bench.stats import Spread

N_SENTENCES, CLIENTS, STREAMS = 1000, 8, 4
_TEXT = "the a man woman dog cat eats runs reads plays near under big small red blue old new"
WORDS = _TEXT.split()


def _sentences(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) + "." for _ in
            range(N_SENTENCES)]


async def _flood(url: str, model: str, sentences: list[str]) -> float:
    """Seconds for CLIENTS clients to embed every sentence, one per request."""
    todo = list(sentences)

    async def client(http: httpx.AsyncClient) -> None:
        while todo:
            text = todo.pop()
            r = await http.post("/v1/embeddings", json={"model": model, "input": text})
            r.raise_for_status()

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(CLIENTS)))
        return time.perf_counter() - start


ARMS = {"ferrum": "shared", "ferrum-turns-off": "off", "llama-server": ""}


def _server(arm: str, gguf: Path, threads: int, folder: Path) -> ServerProcess:
    port = free_port()
    if arm.startswith("ferrum"):
        flags = ["--threads", str(threads), "--models-dir", str(folder), "--model",
                 f"minilm={gguf}", "--model", "smollm2-135m-instruct", "--keep-alive", "-1",
                 "--engine-turns", ARMS[arm]]
        cmd = ferrum_command(port, *flags)
    else:
        cmd = [str(llama_cpp_build_dir() / "llama-server"), "-m", str(gguf), "--embeddings",
               "--pooling", "mean", "-np", "8", "-c", "4096", "-b", "512", "-ub", "512",
               "-t", str(threads), "--port", str(port)]
    server = ServerProcess(cmd, folder / f"{arm}.log", port)
    server.wait_ready(server.url, "/health", timeout=300)
    return server


async def _streams(url: str, flood: list[str] | None) -> tuple[float, float]:
    """p99 inter-token gap of STREAMS chat streams, with or without a flood beside them, and
    the flood's inputs per second (0 without one)."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        samples = [Sample(prompt="Tell me a story.", max_tokens=200) for _ in range(STREAMS)]
        work = [stream_completion(http, "smollm2-135m-instruct", s.prompt, s.max_tokens,
                                  Dialect(), sample=s) for s in samples]
        if flood is not None:
            work.append(_flood(url, "minilm", flood))
        done = await asyncio.gather(*work)
    gaps = sorted(g for s in samples for g in s.gaps)
    rate = len(flood) / done[-1] if flood is not None else 0.0
    return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/embeddings")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.embedding_model import write_minilm_gguf

    gguf = write_minilm_gguf(out / "minilm.gguf")
    rounds = []
    for r in range(args.rounds):
        row: dict[str, float] = {}
        arms = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
        for arm in arms:
            server = _server(arm, gguf, args.threads, out)
            try:
                model = "minilm"
                asyncio.run(_flood(server.url, model, _sentences(99)[:50]))  # warm
                seconds = asyncio.run(_flood(server.url, model, _sentences(r)))
                row[f"{arm} inputs/s"] = N_SENTENCES / seconds
                if arm != "llama-server":
                    row[f"{arm} streams p99 alone"] = asyncio.run(_streams(server.url, None))[0]
                    p99, rate = asyncio.run(_streams(server.url, _sentences(r)))
                    row[f"{arm} streams p99 flood"] = p99
                    row[f"{arm} inputs/s beside streams"] = rate
            finally:
                server.stop()
        rounds.append(row)
        print(f"round {r + 1}: {json.dumps(row)}", flush=True)
    (out / "rounds.json").write_text(json.dumps(rounds, indent=1))
    kept = rounds[1:] if len(rounds) > 1 else rounds
    for key in kept[0]:
        s = Spread.of([row[key] for row in kept])
        print(f"{key}: {s.median:.4g} [{s.lo:.4g}, {s.hi:.4g}]" if s else f"{key}: n/a")
    ratios = {
        f"{arm} inputs/s vs llama-server": Spread.of(
            [row[f"{arm} inputs/s"] / row["llama-server inputs/s"] for row in kept]
        )
        for arm in ARMS if arm != "llama-server"
    }
    for arm in ARMS:
        if arm != "llama-server":
            ratios[f"{arm} p99 flood/alone"] = Spread.of(
                [row[f"{arm} streams p99 flood"] / row[f"{arm} streams p99 alone"] for row in kept]
            )
    for name, s in ratios.items():
        print(f"{name}: {s.median:.3g} [{s.lo:.3g}, {s.hi:.3g}]" if s else f"{name}: n/a")


if __name__ == "__main__":
    main()
