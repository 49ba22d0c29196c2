"""Do running streams stall while other requests are being prepared? Two code trees side by side.

Four streams decode (ignore_eos) on a `ferrum serve --parallel 4 --max-queue 0`. While they
run, eight requests arrive at once, twice:
  schemas   chat requests whose response_format is a 60-property JSON schema, each schema
            distinct (no grammar kept from before: the first preparation, the costly one)
  prompts   chat requests of ~3,000 tokens each
  refused   the schema requests with max_tokens -5: refused (400) while their bodies are
            checked, before any preparation: what 8 requests cost the streams anyway (HTTP,
            body parsing, the answers), the floor the other two are read against
(three such bursts one after the other, to give the window enough gaps).
With `--max-queue 0` every one of them is refused with a 429 after it was prepared (the four
streams fill the server), so what they cost the streams is their preparation alone: template
rendering, tokenizing, schema checks and grammar building, with no prefill.

Metric: inter-token gaps of the four streams in the second before the burst (baseline) and
from the burst until its last answer; p99 of each window, per round. Arms are code trees
(`--tree NAME=PATH`, e.g. a worktree of an older commit), each started with PYTHONPATH=PATH;
one server at a time, arm order alternating per round, round 1 discarded as warm-up;
median [min, max] over the kept rounds.

    .venv/bin/python bench/bench_stalls.py --tree before=/tmp/wt --tree after=. [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import httpx

from ferrum.bench.process import ServerProcess, ferrum_command, free_port
from ferrum.bench.stats import Spread
from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

# Every tree serves the default chat model's file, named by the file (trees from before
# issue #12 take a bare path and any model name, later ones name a bare path by its stem),
# without speculation (trees from before issue #14 have none; FERRUM_* variables older trees
# do not know are ignored), so the streams cost the same on every tree.
MODEL_PATH = Path(builtin_path(DEFAULT_CHAT_MODEL))
MODEL = MODEL_PATH.stem

BURST = 8  # requests at once
BURSTS = 3  # bursts one after the other, so the window holds enough gaps
KINDS = ("schemas", "prompts", "refused")
STREAM_TOKENS = 2000  # more than the run needs; cancelled at the end


def _schema(tag: int) -> dict:
    props = {
        f"field_{tag}_{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(60)
    }
    return {"type": "object", "properties": props, "required": list(props)[:30]}


def _burst_bodies(kind: str, round_: int) -> list[dict]:
    bodies = []
    for i in range(BURST):
        tag = round_ * 100 + i
        body: dict = {"model": MODEL, "max_tokens": 1}
        if kind == "refused":
            body["max_tokens"] = -5
        if kind in ("schemas", "refused"):
            body["messages"] = [{"role": "user", "content": f"Fill record {tag}."}]
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": f"r{tag}", "schema": _schema(tag)},
            }
        else:
            words = " ".join(f"word{(tag * 7 + j) % 997}" for j in range(1500))
            body["messages"] = [{"role": "user", "content": f"Summarise ({tag}): {words}"}]
        bodies.append(body)
    return bodies


async def _stream(client: httpx.AsyncClient, stamps: list[float], tag: int) -> None:
    body = {
        "model": MODEL,
        "prompt": f"Story {tag}: once upon a time",
        "max_tokens": STREAM_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())


def _p99_gap(streams: list[list[float]], start: float, end: float) -> float:
    gaps = [b - a for s in streams for a, b in zip(s, s[1:], strict=False) if start <= b <= end]
    if len(gaps) < 5:
        raise RuntimeError(f"only {len(gaps)} gaps in the window: streams ended too early")
    gaps.sort()
    return 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]


async def _measure(url: str, round_: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        streams: list[list[float]] = [[] for _ in range(4)]
        tasks = [
            asyncio.create_task(_stream(client, s, round_ * 10 + i)) for i, s in enumerate(streams)
        ]
        await asyncio.sleep(3.0)  # all four decoding
        for kind in KINDS:
            t0 = time.perf_counter()
            await asyncio.sleep(1.5)
            t1 = time.perf_counter()
            for b in range(BURSTS):
                bodies = _burst_bodies(kind, round_ * BURSTS + b)
                answers = await asyncio.gather(
                    *(client.post("/v1/chat/completions", json=body) for body in bodies)
                )
                codes = sorted({a.status_code for a in answers})
                expected = [400] if kind == "refused" else [429]
                if codes != expected:
                    raise RuntimeError(f"{kind}: expected {expected}, got {codes}")
            t2 = time.perf_counter()
            await asyncio.sleep(0.3)  # a gap the bursts stretched ends after them
            out[f"{kind}.baseline_p99_ms"] = _p99_gap(streams, t0, t1)
            out[f"{kind}.burst_p99_ms"] = _p99_gap(streams, t1, t2 + 0.3)
            out[f"{kind}.burst_s"] = t2 - t1
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return out


def _run_arm(tree: Path, round_: int, threads: int) -> dict[str, float]:
    port = free_port()
    cmd = ferrum_command(port, "--threads", str(threads), "--parallel", "4", "--max-queue", "0",
                         "--model", str(MODEL_PATH))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "FERRUM_SPEC_TYPE": "none"}
    server = ServerProcess(cmd, Path(f"/tmp/ferrum-bench-stalls-{tree.name}.log"), port, env=env)
    try:
        server.wait_ready(server.url, "/health", timeout=120)
        return asyncio.run(_measure(server.url, round_))
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH of a ferrum tree")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/stalls.json")
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            m = _run_arm(Path(trees[name]), r, args.threads)
            print(f"round {r + 1} {name}: " + " ".join(f"{k}={v:.1f}" for k, v in m.items()))
            if r > 0:
                rows[name].append(m)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    keys = list(next(iter(rows.values()))[0])
    print("\n| metric | " + " | ".join(trees) + " |\n|---|" + "---|" * len(trees))
    for k in keys:
        cells = [Spread.of([m[k] for m in rows[name]]) for name in trees]
        shown = [f"{c.median:.1f} [{c.lo:.1f}, {c.hi:.1f}]" if c else "n/a" for c in cells]
        print(f"| {k} | " + " | ".join(shown) + " |")
    for name in trees:
        for kind in KINDS:
            ratios = [m[f"{kind}.burst_p99_ms"] / m[f"{kind}.baseline_p99_ms"] for m in rows[name]]
            spread = Spread.of(ratios)
            if spread:
                print(f"{name} {kind}: burst p99 / baseline p99 {spread.median:.2f} "
                      f"[{spread.lo:.2f}, {spread.hi:.2f}]")  # fmt: skip


if __name__ == "__main__":
    main()
