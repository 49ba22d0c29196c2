"""Soak: minutes of mixed traffic against a ferrum server, then checks that it is whole. No
comparison of arms: one server, one verdict (`main`).

Traffic (random mix, bounded concurrency): streamed and whole chat completions, completions,
streams the client hangs up on, prompts longer than the context (must be 400
context_length_exceeded), and bursts of 8 requests behind one shared prefix. Afterwards the
server must be idle again: no active or queued request and no KV block held outside parked
prefixes.

With `--set inject_faults=RATE` the server it starts fakes llama.cpp's "no KV slot" for that
share of decodes of several sequences: the split retry must absorb every one (failures stay 0).

Prints a progress line a minute, then (and into soak.json) requests served, intended
rejections, failures (anything else, must be 0), cancels, faults injected and decode retries
(from /metrics), KV blocks before/after, the server's RSS growth after warm-up and the TTFT
drift (median of the last fifth of streamed requests over the first fifth). Exits 1 when any
bound is broken.

    ferrum bench --study soak --set minutes=10 --set inject_faults=0.05   # starts its server
    ferrum bench --study soak --set url=http://127.0.0.1:8080 --set pid=1234
Knobs (--set): minutes (10; --quick 0.5), workers (6), seed (1), max_rss_growth (0.05),
max_ttft_drift (2.0), inject_faults (0), url and pid (a running server instead of one started).
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ferrum.bench.process import ServerProcess
from ferrum.bench.studies import Study, StudyRun

SHARED = "You are the assistant of a bakery that sells bread, cakes and coffee. " * 12


@dataclass
class Tally:
    served: int = 0
    rejected: int = 0  # intended: over-long prompts
    cancels: int = 0
    failures: list[str] = field(default_factory=list)
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (time sent, ttft)


@dataclass(frozen=True)
class Bounds:
    max_rss_growth: float = 0.05
    max_ttft_drift: float = 2.0
    inject_faults: float = 0.0


def chat_body(rng: random.Random, stream: bool, prefix: str = "") -> dict[str, Any]:
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
        await _stream(client, chat_body(rng, True, rng.choice(["", SHARED])), t)
    elif kind == "chat":
        await _whole(client, "/v1/chat/completions", chat_body(rng, False), t)
    elif kind == "completion":
        body = {"prompt": f"Recipe {rng.getrandbits(20)}:", "max_tokens": rng.randint(4, 32)}
        await _whole(client, "/v1/completions", body, t)
    elif kind == "cancel":
        await _stream(client, {**chat_body(rng, True), "max_tokens": 200}, t, hang_up_after=3)
    elif kind == "long":
        await _too_long(client, n_ctx, t)
    else:
        prefix = SHARED + f"Batch {rng.getrandbits(16)}. "
        await asyncio.gather(*(_stream(client, chat_body(rng, True, prefix), t) for _ in range(8)))


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


def counters(metrics_text: str) -> dict[str, float]:
    """Prometheus counters by name (e.g. ferrum_faults_injected_total), summed over their
    labels (every model's, every reason's)."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        series, _, value = line.rpartition(" ")
        name = series.partition("{")[0]
        if name.endswith("_total") and not line.startswith("#"):
            out[name] = out.get(name, 0.0) + float(value)
    return out


async def _progress(t: Tally, start: float, every: float = 60.0) -> None:
    while True:
        await asyncio.sleep(every)
        print(
            f"[{(time.monotonic() - start) / 60:5.1f} min] served {t.served} cancels "
            f"{t.cancels} rejected {t.rejected} failures {len(t.failures)}",
            flush=True,
        )


def held_blocks(health: dict) -> int:
    """KV blocks held by anything but parked prefixes (0 when idle)."""
    held = round(health["kv_cache_usage_ratio"] * health["kv_blocks_total"])
    return int(held - health["prefix_cache"]["blocks"])


def _tier_bytes(health: dict) -> int:
    return int(health["prefix_cache"].get("tiers", {}).get("ram", {}).get("bytes", 0))


def ttft_drift(ttfts: list[tuple[float, float]]) -> float:
    """Median TTFT of the last fifth of streamed requests (by time sent) over the first's."""
    ordered = [x for _, x in sorted(ttfts)]
    if not ordered:
        return 1.0
    fifth = max(1, len(ordered) // 5)
    return statistics.median(ordered[-fifth:]) / statistics.median(ordered[:fifth])


async def _traffic(base: str, seconds: float, workers: int, rng: random.Random, n_ctx: int,
                   t: Tally) -> None:  # fmt: skip
    end = time.monotonic() + seconds
    await asyncio.gather(
        *(_worker(base, random.Random(rng.random()), end, n_ctx, t) for _ in range(workers))
    )


async def soak(base: str, pid: int, seconds: float, workers: int, seed: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base, timeout=30) as c:
        n_ctx = (await c.get("/v1/models")).json()["data"][0]["meta"]["n_ctx"]
        before = await _idle_health(base)
        t, rng = Tally(), random.Random(seed)
        progress = asyncio.create_task(_progress(t, time.monotonic()))
        await _traffic(base, min(30.0, seconds / 5), workers, rng, n_ctx, t)  # warm-up
        rss_warm = _rss_kib(pid)
        tiers_warm = _tier_bytes((await c.get("/health")).json())
        await _traffic(base, seconds, workers, rng, n_ctx, t)
        progress.cancel()
        after = await _idle_health(base)
        seen = counters((await c.get("/metrics")).text)
    rss_end = _rss_kib(pid)
    tier_growth = (_tier_bytes(after) - tiers_warm) // 1024
    return {
        "served": t.served,
        "rejected_as_intended": t.rejected,
        "cancels": t.cancels,
        "failures": len(t.failures),
        "failure_samples": t.failures[:5],
        "faults_injected": int(seen.get("ferrum_faults_injected_total", 0)),
        "decode_retries": int(seen.get("ferrum_decode_retries_total", 0)),
        "decode_failures": int(seen.get("ferrum_decode_failures_total", 0)),
        "preemptions": int(seen.get("ferrum_preemptions_total", 0)),
        "kv_held_blocks_before": held_blocks(before),
        "kv_held_blocks_after": held_blocks(after),
        "active_after": after["active_requests"],
        "queue_after": after["queue_depth"],
        "rss_warm_kib": rss_warm,
        "rss_end_kib": rss_end,
        # The prefix cache's RAM tier is a cache with its own bound (--cache-ram), not a
        # leak: what it grew by is counted out.
        "tier_ram_growth_kib": tier_growth,
        "rss_growth": (rss_end - tier_growth) / rss_warm - 1 if rss_warm else 0.0,
        "ttft_drift": ttft_drift(t.ttfts),
        "prefix_cache": after["prefix_cache"],
    }


def check(report: dict[str, Any], bounds: Bounds) -> list[str]:
    """The bounds the report breaks, in words (none: the server came through whole)."""
    broken = []
    if report["failures"] or report["decode_failures"]:
        broken.append(f"{report['failures']} failures, {report['decode_failures']} in decode")
    if bounds.inject_faults > 0 and report["faults_injected"] == 0:
        broken.append("inject_faults was set but no fault was injected")
    if report["kv_held_blocks_after"] != 0 or report["active_after"] or report["queue_after"]:
        broken.append("the server did not return to idle")
    if report["rss_growth"] > bounds.max_rss_growth:
        broken.append(f"RSS grew {report['rss_growth']:.1%}")
    if report["ttft_drift"] > bounds.max_ttft_drift:
        broken.append(f"TTFT drifted x{report['ttft_drift']:.2f}")
    if report["served"] == 0:
        broken.append("nothing was served")
    return broken


def _start_server(run: StudyRun, inject_faults: float) -> ServerProcess:
    kv = run.out / "kv"  # the disk tier, empty at every start
    shutil.rmtree(kv, ignore_errors=True)
    # Gemma 3 270M alone, in a store of its own: a base model's long answers load the engine,
    # and the machine's own store stays out.
    return run.ferrum(
        "ferrum", "--parallel", "8", "--ctx-size", "4096", "--log-level", "warning",
        "--model", run.model or "gemma3-270m", "--models-dir", str(run.out / "models"),
        "--cache-dir", str(kv), "--inject-faults", str(inject_faults),
    )  # fmt: skip


def main(run: StudyRun) -> int:
    bounds = Bounds(run.option("max_rss_growth", 0.05), run.option("max_ttft_drift", 2.0),
                    run.option("inject_faults", 0.0))  # fmt: skip
    url, pid = run.option("url", ""), run.option("pid", 0)
    if url and bounds.inject_faults:
        raise ValueError("inject_faults applies to a server the soak starts, not to url")
    if url and not pid:
        raise ValueError("--set url=... needs --set pid=... (the server's, for its RSS)")
    run.out.mkdir(parents=True, exist_ok=True)
    server = None if url else _start_server(run, bounds.inject_faults)
    if server is not None:
        url, pid = server.url, server.pid
    seconds = 60 * run.option("minutes", 0.5 if run.quick else 10.0)
    try:
        report = asyncio.run(
            soak(url, pid, seconds, run.option("workers", 6), run.option("seed", 1))
        )
    finally:
        if server is not None:
            server.stop()
    report["broken"] = check(report, bounds)
    text = json.dumps(report, indent=1)
    (run.out / "soak.json").write_text(text)
    print(text)
    return 1 if report["broken"] else 0


STUDY = Study(name="soak", title="Minutes of mixed traffic: does the server come back whole?",
              main=main)  # fmt: skip
