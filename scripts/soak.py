"""Soak test: minutes of mixed traffic against a ferrum server, then checks that it is whole.

Traffic (random mix, bounded concurrency): streamed and whole chat completions, completions,
streams the client hangs up on, prompts longer than the context (must be 400
context_length_exceeded), and bursts of 8 requests behind one shared prefix. Afterwards the
server must be idle again: no active or queued request and no KV block held outside parked
prefixes.

With --inject-faults RATE the server it starts fakes llama.cpp's "no KV slot" for that share of
decodes of several sequences: the split retry must absorb every one (failures stay 0).

Prints a progress line a minute, then requests served, intended rejections, failures (anything
else, must be 0), cancels, faults injected and decode retries (from /metrics), KV blocks
before/after, the server's RSS growth after warm-up and the TTFT drift (median of the last fifth
of streamed requests over the first fifth). Exits 1 when any bound is broken.

    .venv/bin/python scripts/soak.py --minutes 10 --inject-faults 0.05   # starts its own server
    .venv/bin/python scripts/soak.py --url http://127.0.0.1:8080 --pid 1234
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ferrum.bench.process import ServerProcess, ferrum_command, free_port

SHARED = "You are the assistant of a bakery that sells bread, cakes and coffee. " * 12


@dataclass
class Tally:
    served: int = 0
    rejected: int = 0  # intended: over-long prompts
    cancels: int = 0
    failures: list[str] = field(default_factory=list)
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (time sent, ttft)


def _chat_body(rng: random.Random, stream: bool, prefix: str = "") -> dict:
    q = f"{prefix}Question {rng.getrandbits(24)}: name a {rng.choice(['bread', 'cake', 'drink'])}."
    return {
        "model": "",  # the server's default model
        "messages": [{"role": "user", "content": q}],
        "stream": stream,
        "max_tokens": rng.randint(4, 40),
        "temperature": rng.choice([0, 0.8]),
    }


async def _stream(client: httpx.AsyncClient, body: dict, t: Tally, hang_up_after: int = 0) -> None:
    sent = time.monotonic()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            t.failures.append(f"stream HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            return
        events, done = 0, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                t.failures.append(f"stream error event: {event['error']}")
                return
            events += 1
            if events == 2:
                t.ttfts.append((sent, time.monotonic() - sent))
            if hang_up_after and events >= hang_up_after:
                t.cancels += 1
                return  # leaving the block closes the connection mid-stream
    if done:
        t.served += 1
    else:
        t.failures.append("stream ended without [DONE]")


async def _whole(client: httpx.AsyncClient, path: str, body: dict, t: Tally) -> None:
    r = await client.post(path, json=body)
    if r.status_code == 200 and r.json().get("choices"):
        t.served += 1
    else:
        t.failures.append(f"{path} HTTP {r.status_code}: {r.text[:200]}")


async def _too_long(client: httpx.AsyncClient, n_ctx: int, t: Tally) -> None:
    r = await client.post("/v1/completions", json={"prompt": "bread " * (n_ctx + 10)})
    if r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded":
        t.rejected += 1
    else:
        t.failures.append(f"over-long prompt: HTTP {r.status_code}: {r.text[:200]}")


async def _one(client: httpx.AsyncClient, rng: random.Random, n_ctx: int, t: Tally) -> None:
    kind = rng.choices(
        ["stream", "chat", "completion", "cancel", "long", "burst"], weights=[30, 20, 15, 15, 5, 5]
    )[0]
    if kind == "stream":
        await _stream(client, _chat_body(rng, True, rng.choice(["", SHARED])), t)
    elif kind == "chat":
        await _whole(client, "/v1/chat/completions", _chat_body(rng, False), t)
    elif kind == "completion":
        body = {"prompt": f"Recipe {rng.getrandbits(20)}:", "max_tokens": rng.randint(4, 32)}
        await _whole(client, "/v1/completions", body, t)
    elif kind == "cancel":
        await _stream(client, {**_chat_body(rng, True), "max_tokens": 200}, t, hang_up_after=3)
    elif kind == "long":
        await _too_long(client, n_ctx, t)
    else:
        prefix = SHARED + f"Batch {rng.getrandbits(16)}. "
        await asyncio.gather(*(_stream(client, _chat_body(rng, True, prefix), t) for _ in range(8)))


async def _worker(base: str, rng: random.Random, end: float, n_ctx: int, t: Tally) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        while time.monotonic() < end:
            try:
                await _one(client, rng, n_ctx, t)
            except httpx.HTTPError as exc:
                t.failures.append(f"transport: {exc!r}")


async def _idle_health(base: str, timeout: float = 60) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        deadline = time.monotonic() + timeout
        while True:
            h = (await client.get("/health")).json()
            if (h["active_requests"] == 0 and h["queue_depth"] == 0) or time.monotonic() > deadline:
                return h
            await asyncio.sleep(0.2)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def _counters(base: str) -> dict[str, float]:
    """The server's Prometheus counters by name (e.g. ferrum_faults_injected_total), summed
    over their labels (every model's, every reason's)."""
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        text = (await client.get("/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        name = series.partition("{")[0]
        if name.endswith("_total") and not line.startswith("#"):
            out[name] = out.get(name, 0.0) + float(value)
    return out


async def _progress(t: Tally, start: float, every: float = 60.0) -> None:
    while True:
        await asyncio.sleep(every)
        print(
            f"[{(time.monotonic() - start) / 60:5.1f} min] served {t.served} "
            f"cancels {t.cancels} rejected {t.rejected} failures {len(t.failures)}",
            flush=True,
        )


def _held_blocks(h: dict) -> int:
    """KV blocks held by anything but parked prefixes (0 when idle)."""
    return round(h["kv_cache_usage_ratio"] * h["kv_blocks_total"]) - h["prefix_cache"]["blocks"]


def _tier_bytes(health: dict) -> int:
    return int(health["prefix_cache"].get("tiers", {}).get("ram", {}).get("bytes", 0))


async def _tier_ram_bytes(base: str) -> int:
    async with httpx.AsyncClient(base_url=base, timeout=30) as c:
        return _tier_bytes((await c.get("/health")).json())


def _start_server(inject_faults: float, log_path: Path) -> ServerProcess:
    port = free_port()
    flags = ("--threads", "2", "--parallel", "8", "--ctx-size", "4096", "--log-level", "warning")
    # Gemma 3 270M alone, in a store of its own: a base model's long answers load the engine,
    # and the machine's own store stays out.
    models = ("--model", "gemma3-270m", "--models-dir", str(log_path.parent / "ferrum-soak-models"))
    kv = log_path.parent / "ferrum-soak-kv"  # the disk tier, empty at every start
    shutil.rmtree(kv, ignore_errors=True)
    cmd = ferrum_command(port, *flags, *models, "--cache-dir", str(kv), "--inject-faults",
                         str(inject_faults))  # fmt: skip
    server = ServerProcess(cmd, log_path, port)
    server.wait_ready(server.url, "/health", timeout=120)
    return server


async def soak(base: str, pid: int, seconds: float, workers: int, seed: int) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=10) as c:
        n_ctx = (await c.get("/v1/models")).json()["data"][0]["meta"]["n_ctx"]
    before = await _idle_health(base)
    t, rng = Tally(), random.Random(seed)
    progress = asyncio.create_task(_progress(t, time.monotonic()))
    warm_end = time.monotonic() + min(30.0, seconds / 5)
    await asyncio.gather(
        *(_worker(base, random.Random(rng.random()), warm_end, n_ctx, t) for _ in range(workers))
    )
    rss_warm = _rss_kib(pid)
    tiers_warm = await _tier_ram_bytes(base)
    end = time.monotonic() + seconds
    await asyncio.gather(
        *(_worker(base, random.Random(rng.random()), end, n_ctx, t) for _ in range(workers))
    )
    progress.cancel()
    after = await _idle_health(base)
    counters = await _counters(base)
    rss_end = _rss_kib(pid)
    tier_growth = (_tier_bytes(after) - tiers_warm) // 1024
    ttfts = [x for _, x in sorted(t.ttfts)]
    fifth = max(1, len(ttfts) // 5)
    return {
        "served": t.served,
        "rejected_as_intended": t.rejected,
        "cancels": t.cancels,
        "failures": len(t.failures),
        "failure_samples": t.failures[:5],
        "faults_injected": int(counters.get("ferrum_faults_injected_total", 0)),
        "decode_retries": int(counters.get("ferrum_decode_retries_total", 0)),
        "decode_failures": int(counters.get("ferrum_decode_failures_total", 0)),
        "preemptions": int(counters.get("ferrum_preemptions_total", 0)),
        "kv_held_blocks_before": _held_blocks(before),
        "kv_held_blocks_after": _held_blocks(after),
        "active_after": after["active_requests"],
        "queue_after": after["queue_depth"],
        "rss_warm_kib": rss_warm,
        "rss_end_kib": rss_end,
        # The prefix cache's RAM tier is a cache with its own bound (--cache-ram), not a
        # leak: what it grew by is counted out.
        "tier_ram_growth_kib": tier_growth,
        "rss_growth": (rss_end - tier_growth) / rss_warm - 1 if rss_warm else 0.0,
        "ttft_drift": statistics.median(ttfts[-fifth:]) / statistics.median(ttfts[:fifth])
        if ttfts
        else 1.0,
        "prefix_cache": after["prefix_cache"],
    }


def check(
    report: dict, max_rss_growth: float, max_ttft_drift: float, inject_faults: float = 0.0
) -> list[str]:
    broken = []
    if report["failures"] or report["decode_failures"]:
        broken.append(f"{report['failures']} failures, {report['decode_failures']} in decode")
    if inject_faults > 0 and report["faults_injected"] == 0:
        broken.append("--inject-faults was given but no fault was injected")
    if report["kv_held_blocks_after"] != 0 or report["active_after"] or report["queue_after"]:
        broken.append("the server did not return to idle")
    if report["rss_growth"] > max_rss_growth:
        broken.append(f"RSS grew {report['rss_growth']:.1%}")
    if report["ttft_drift"] > max_ttft_drift:
        broken.append(f"TTFT drifted x{report['ttft_drift']:.2f}")
    if report["served"] == 0:
        broken.append("nothing was served")
    return broken


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--pid", type=int, help="the running server's pid, for RSS")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--max-ttft-drift", type=float, default=2.0)
    p.add_argument(
        "--inject-faults",
        type=float,
        default=0.0,
        metavar="RATE",
        help="the started server fakes 'no KV slot' for this share of shared decodes",
    )
    args = p.parse_args(argv)
    server = None
    if args.url is None:
        log_path = Path(tempfile.gettempdir()) / "ferrum-soak.log"
        server = _start_server(args.inject_faults, log_path)
        args.url, args.pid = server.url, server.pid
    if args.pid is None:
        raise SystemExit("--pid is needed with --url")
    if args.url and server is None and args.inject_faults:
        raise SystemExit("--inject-faults applies to a server this script starts, not to --url")
    try:
        report = asyncio.run(soak(args.url, args.pid, args.minutes * 60, args.workers, args.seed))
    finally:
        if server is not None:
            server.stop()
    broken = check(report, args.max_rss_growth, args.max_ttft_drift, args.inject_faults)
    print(json.dumps({**report, "broken": broken}, indent=1))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
