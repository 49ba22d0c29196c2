"""Prefix-reuse benchmark: ferrum vs ferrum --no-prefix-cache vs llama.cpp's llama-server.

Workloads, all through `/v1/completions` with raw Gemma-formatted text so every server sees
the same tokens (prompt token counts are read from each response's usage):

  burst      8 clients at once, each a ~750-token shared prefix + a unique question, 16 output
             tokens; the first burst on a fresh server is "cold", a second one "warm".
             Reported: TTFT p50 of the cold and warm bursts.
  multiturn  4 concurrent conversations x 5 turns, each turn the previous text + the real
             reply + a new question (32 output tokens). Reported: mean TTFT of turns 2-5.
  unrelated  8 clients at once with unique prompts (no reuse possible), 64 output tokens with
             ignore_eos. Reported: aggregate output tok/s.

Discipline as in bench_core.py: one server at a time, arms alternated per round, round 1
discarded, median and [min, max] over the kept rounds; a comparison is a win or loss only when
the ranges are disjoint. llama-server gets `-np 8 --kv-unified` and the same total context.

Run:  .venv/bin/python bench/bench_prefix.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import (  # noqa: E402
    FERRUM_BIN,
    RESULTS,
    default_llama_server,
    default_model,
    spread,
    start_server,
    stop_server,
    stream_completion,
    verdict,
    wait_healthy,
    wait_quiet,
)

ARMS = ("ferrum", "ferrum-nocache", "llama-server")
TOPICS = (
    "deliveries",
    "opening hours",
    "refunds",
    "gift cards",
    "allergens",
    "catering",
    "parking",
    "loyalty points",
    "recipes",
    "bulk orders",
    "holidays",
    "payment methods",
)


def shared_prefix(rng: random.Random) -> str:
    """~750 tokens of a made-up shop handbook, different for every round."""
    shop = (
        rng.choice(["Harbor", "Meadow", "Comet", "Falcon", "Orchard"]) + f" {rng.randint(1, 999)}"
    )
    lines = [f"You are the assistant of the {shop} bakery. Follow this handbook."]
    for i in range(36):
        topic = TOPICS[i % len(TOPICS)]
        lines.append(
            f"Rule {i + 1} about {topic}: staff answer questions on {topic} politely, quote "
            f"the price list for item {rng.randint(100, 999)}, and never promise more than "
            f"{rng.randint(2, 9)} days."
        )
    return "\n".join(lines)


def gemma_turn(user: str) -> str:
    return f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"


def server_cmd(arm: str, args: argparse.Namespace) -> list[str]:
    port, t, c = str(args.port), str(args.threads), str(args.ctx_size)
    if arm.startswith("ferrum"):
        cmd = [str(FERRUM_BIN), "serve", "--model", args.model, "--port", port, "--threads", t]
        cmd += ["--parallel", "8", "--ctx-size", c, "--log-level", "warning"]
        return cmd + (["--no-prefix-cache"] if arm == "ferrum-nocache" else [])
    cmd = [args.llama_server, "-m", args.model, "--port", port, "-t", t, "-tb", t]
    return cmd + ["-np", "8", "-c", c, "--kv-unified", "--no-webui", "--log-verbosity", "2"]


async def burst(client: httpx.AsyncClient, model: str, prefix: str, tag: str) -> list[dict]:
    prompts = [
        gemma_turn(f"{prefix}\n\nQuestion {tag}-{i}: what about item {i}?") for i in range(8)
    ]
    return await asyncio.gather(*(stream_completion(client, model, p, 16) for p in prompts))


async def multiturn_ttft(client: httpx.AsyncClient, model: str, rng: random.Random) -> list:
    """TTFT per turn: each turn streamed; the reply text comes from the stream itself."""

    async def one(k: int) -> list[dict]:
        text = f"Conversation {rng.getrandbits(32):08x} with customer {k}.\n"
        out = []
        for turn in range(5):
            text += gemma_turn(f"Turn {turn}: tell me about {rng.choice(TOPICS)}.")
            s = await stream_completion_text(client, model, text, 32)
            out.append(
                {"turn": turn + 1, "ttft_s": s["ttft_s"], "prompt_tokens": s["prompt_tokens"]}
            )
            text += s["text"] + "<end_of_turn>\n"
        return out

    return [x for conv in await asyncio.gather(*(one(k) for k in range(4))) for x in conv]


async def stream_completion_text(
    client: httpx.AsyncClient, model: str, prompt: str, n: int
) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0, first, text, usage = time.perf_counter(), None, [], {}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    first = first or time.perf_counter()
                    text.append(choice["text"])
    return {
        "ttft_s": (first or time.perf_counter()) - t0,
        "text": "".join(text),
        "prompt_tokens": usage.get("prompt_tokens"),
    }


async def measure(base: str, rng: random.Random, workloads: set[str]) -> dict:
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=0)
    out: dict = {"raw": {}}
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        if "burst" in workloads:
            prefix = shared_prefix(rng)
            cold = out["raw"]["cold"] = await burst(client, model, prefix, "cold")
            warm = out["raw"]["warm"] = await burst(client, model, prefix, "warm")
            out["burst_cold_ttft_p50"] = statistics.median(s["ttft_s"] for s in cold)
            out["burst_warm_ttft_p50"] = statistics.median(s["ttft_s"] for s in warm)
            out["burst_prompt_tokens"] = cold[0]["prompt_tokens"]
        if "multiturn" in workloads:
            turns = out["raw"]["turns"] = await multiturn_ttft(client, model, rng)
            later = [t["ttft_s"] for t in turns if t["turn"] > 1]
            out["multiturn_ttft_mean_2_5"] = statistics.fmean(later)
        if "unrelated" in workloads:
            tags = [f"[{rng.getrandbits(32):08x}] Write a story about {w}:" for w in range(8)]
            t0 = time.perf_counter()
            runs = await asyncio.gather(*(stream_completion(client, model, p, 64) for p in tags))
            wall = time.perf_counter() - t0
            out["raw"]["unrelated"] = runs
            out["unrelated_tps"] = sum(s["completion_tokens"] for s in runs) / wall
    return out


def run_arm(arm: str, round_no: int, args: argparse.Namespace) -> dict:
    quiet = wait_quiet(0.15, 60)
    log = RESULTS / "logs" / f"prefix-{arm}-r{round_no}.log"
    proc = start_server(server_cmd(arm, args), log)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{args.port}", 180, log)
        rng = random.Random(f"{args.seed}-{round_no}")  # same text for every arm in a round
        data = asyncio.run(measure(f"http://127.0.0.1:{args.port}", rng, args.workloads))
    finally:
        stop_server(proc, args.port)
    data.update(arm=arm, round=round_no, machine_quiet=quiet)
    return data


METRICS = (
    ("burst_cold_ttft_p50", "burst: cold TTFT p50 (s)", False),
    ("burst_warm_ttft_p50", "burst: warm TTFT p50 (s)", False),
    ("multiturn_ttft_mean_2_5", "multi-turn: mean TTFT turns 2-5 (s)", False),
    ("unrelated_tps", "unrelated: aggregate tok/s", True),
)


def summarize(records: list[dict], arms: list[str]) -> str:
    kept = [r for r in records if r["round"] > 1]
    rows = [
        "| metric | " + " | ".join(arms) + " | ferrum / other (paired) |",
        "|---" * (len(arms) + 2) + "|",
    ]
    for key, label, higher_better in METRICS:
        per = {a: {r["round"]: r[key] for r in kept if r["arm"] == a and key in r} for a in arms}
        if not any(per.values()):
            continue
        cells = [_fmt(spread(list(v.values()))) if v else "n/a" for v in per.values()]
        ratios = []
        for other in arms[1:]:
            paired = [per["ferrum"][k] / per[other][k] for k in per["ferrum"] if k in per[other]]
            if paired:
                s = spread(paired)
                a, b = spread(list(per["ferrum"].values())), spread(list(per[other].values()))
                v = verdict(a, b) if higher_better else verdict(b, a)
                ratios.append(f"{other}: {_fmt(s, 2)} ({v})")
        rows.append(f"| {label} | " + " | ".join(cells) + " | " + "; ".join(ratios) + " |")
    return "\n".join(rows)


def _fmt(s: dict, digits: int = 3) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--rounds", type=int, default=4, help="rounds incl. the discarded warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx-size", type=int, default=16384)
    p.add_argument("--port", type=int, default=18190)
    p.add_argument("--seed", default="prefix")
    p.add_argument("--model", default=None)
    p.add_argument("--llama-server", default=default_llama_server())
    p.add_argument("--out", default=str(RESULTS / "prefix.json"))
    p.add_argument(
        "--workloads",
        default="burst,multiturn,unrelated",
        help="any of burst, multiturn, "
        "unrelated; run in that order on each server (later ones see what earlier ones left)",
    )
    args = p.parse_args()
    args.model = args.model or default_model()
    args.workloads = {w.strip() for w in args.workloads.split(",") if w.strip()}
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if arms[0] != "ferrum" or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms: ferrum first, then any of {ARMS}")
    records = []
    for round_no in range(1, args.rounds + 1):
        order = arms if round_no % 2 else list(reversed(arms))
        for arm in order:
            rec = run_arm(arm, round_no, args)
            records.append(rec)
            done = ", ".join(f"{k}={rec[k]:.3f}" for k, _, _ in METRICS if k in rec)
            print(f"round {round_no} {arm}: {done}", file=sys.stderr, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {"args": {**vars(args), "workloads": sorted(args.workloads)}, "records": records},
            indent=1,
        )
    )
    print(summarize(records, arms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
