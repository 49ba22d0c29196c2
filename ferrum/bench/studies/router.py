"""The routing policies at scale, simulated: 1,000 replicas (by default), synthetic traffic
shaped like a chat service's, no model and no server. Each replica holds KV for a bounded
number of prefix blocks (least recently used out) and serves a request in time proportional to
the tokens it must prefill plus those it generates; the router sees each replica's resident
blocks only as of its last summary (every `period` seconds, at most `summary` hashes) plus
what it sent itself, as in `ferrum cluster`.

Traffic: conversations arrive as a Poisson process; each has a system prompt drawn from a
Zipf-distributed set (a few prompts are very hot, as a popular app's are) and several turns
a think-time apart, each turn's prompt the whole history so far.

Reported per policy (`--set policies=prefix,text-prefix,pow2`): share of prompt tokens served
from cache, the busiest replica's load against the mean (1.0 = perfectly even), the 99th
percentile of queueing delay, the router's time per decision, and the bytes of summaries per
period. Knobs (`--set KEY=VALUE`): replicas 1000, seconds 120, rate 150 (new conversations
per second), prompts 2000 (distinct system prompts), kv-blocks 4096 (per replica), summary
8192 (hashes per summary), period 1.0, imbalance 4; `--quick`: 100 replicas, 20 s, rate 15.
The simulation is seeded, so only decision_us varies between runs: no rounds.

    ferrum bench --study router [--set replicas=1000 --set seconds=20 --set rate=100]
"""

from __future__ import annotations

import heapq
import json
import random
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from ferrum.bench.studies import Study, StudyRun
from ferrum.cluster.policy import (
    Candidate,
    PrefixAffinity,
    RouteKey,
    TextPrefixAffinity,
    power_of_two,
)
from ferrum.engine.kv.prefix import block_hashes

BLOCK = 16
PREFILL_TOK_S = 4000.0  # one replica's prefill speed (a GPU-class replica)
DECODE_TOK_S = 60.0  # per request
ANSWER = 120
SLOTS = 16  # requests a replica runs at once
POLICIES = ("prefix", "text-prefix", "pow2")


@dataclass(frozen=True)
class Settings:
    replicas: int = 1000
    seconds: float = 120.0
    rate: float = 150.0  # new conversations per second
    prompts: int = 2000  # distinct system prompts
    kv_blocks: int = 4096  # KV blocks per replica
    summary: int = 8192  # hashes per summary
    period: float = 1.0
    imbalance: int = 4

    @classmethod
    def of(cls, run: StudyRun) -> Settings:
        base = cls(replicas=100, seconds=20.0, rate=15.0) if run.quick else cls()
        return cls(**{name: run.option(name.replace("_", "-"), value)
                      for name, value in asdict(base).items()})  # fmt: skip


@dataclass
class Replica:
    name: str
    capacity: int  # blocks of KV
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)
    busy_until: list[float] = field(default_factory=list)  # a heap of running requests' ends
    served: int = 0

    def in_flight(self, now: float) -> int:
        while self.busy_until and self.busy_until[0] <= now:
            heapq.heappop(self.busy_until)
        return len(self.busy_until)

    def serve(self, hashes: list[int], tokens: int, now: float) -> tuple[int, float]:
        """(cached tokens, queueing delay) of one request."""
        hit = 0
        for h in hashes:
            if h not in self.blocks:
                break
            hit += 1
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        cached = hit * BLOCK
        start = now
        if self.in_flight(now) >= SLOTS:  # waits for the first slot to free
            start = self.busy_until[0]
        duration = (tokens - cached) / PREFILL_TOK_S + ANSWER / DECODE_TOK_S
        heapq.heappush(self.busy_until, start + duration)
        self.served += 1
        return cached, start - now


def traffic(
    seconds: float, rate: float, prompts: int, seed: int
) -> list[tuple[float, int, int, int]]:
    """(time, conversation, turn, system prompt) of every request, in time order."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) for k in range(prompts)]  # Zipf, s = 1
    events, t, conv = [], 0.0, 0
    while t < seconds:
        t += rng.expovariate(rate)
        system = rng.choices(range(prompts), weights)[0]
        turns = rng.randint(1, 6)
        at = t
        for turn in range(turns):
            events.append((at, conv, turn, system))
            at += rng.uniform(5, 30)  # the user reads and types
        conv += 1
    return sorted(events)


def tokens(conv: int, turn: int, system: int) -> list[int]:
    """A turn's prompt: its system prompt, then every earlier question and answer and its own."""
    rng = random.Random(system)
    out = [rng.randrange(50_000) for _ in range(rng.randint(200, 1500))]
    for t in range(turn + 1):
        r = random.Random(conv * 1000 + t)
        out += [r.randrange(50_000) for _ in range(r.randint(20, 80))]  # question
        if t < turn:
            out += [r.randrange(50_000) for _ in range(ANSWER)]
    return out


class Router:
    """One policy over the replicas, as `ferrum cluster` drives it."""

    def __init__(self, policy: str, s: Settings, rng: random.Random) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.policy, self.settings, self.rng = policy, s, rng
        self.prefix = PrefixAffinity(imbalance=s.imbalance, recent_s=2 * s.period, rng=rng)
        self.text = TextPrefixAffinity(rng=rng)
        self.next_summary, self.summary_bytes, self.decide_s = 0.0, 0, 0.0

    def summarize(self, replicas: list[Replica], now: float) -> None:
        """Every replica's summary of its resident blocks, once a period (prefix only)."""
        if self.policy != "prefix" or now < self.next_summary:
            return
        for r in replicas:
            held = list(reversed(r.blocks))[: self.settings.summary]  # most recent first
            self.prefix.observe(r.name, {"m": frozenset(held)})
            self.summary_bytes = max(self.summary_bytes, 8 * len(held))
        self.next_summary = now + self.settings.period

    def choose(self, prompt: list[int], hashes: list[int], candidates: list[Candidate],
               now: float) -> str:  # fmt: skip
        t0 = time.perf_counter()
        key: RouteKey | None = None
        if self.policy == "prefix":
            key = RouteKey("m", tuple(hashes))
            ranks = self.prefix.choose(key, candidates, now=now)
        elif self.policy == "text-prefix":
            key = RouteKey(text=" ".join(map(str, prompt)))
            ranks = self.text.choose(key, candidates)
        else:
            ranks = power_of_two(candidates, self.rng)
        load = {c.replica: c.in_flight for c in candidates}
        chosen = min(ranks[0], key=lambda name: load[name])
        self.decide_s += time.perf_counter() - t0
        if self.policy == "prefix" and key is not None:
            self.prefix.routed(chosen, key, now=now)
        elif self.policy == "text-prefix" and key is not None:
            self.text.routed(chosen, key)
        return chosen


def simulate(policy: str, s: Settings) -> dict[str, float]:
    """One policy over the seeded traffic: the figures the docstring names."""
    replicas = [Replica(f"r{i}", s.kv_blocks) for i in range(s.replicas)]
    by_name = {r.name: r for r in replicas}
    router = Router(policy, s, random.Random(1))
    events = traffic(s.seconds, s.rate, s.prompts, seed=7)
    prompt_tokens, cached_tokens, delays = 0, 0, []
    for now, conv, turn, system in events:
        router.summarize(replicas, now)
        prompt = tokens(conv, turn, system)
        hashes = list(block_hashes(prompt, BLOCK, ""))
        candidates = [Candidate(r.name, r.in_flight(now)) for r in replicas]
        chosen = router.choose(prompt, hashes, candidates, now)
        cached, delay = by_name[chosen].serve(hashes, len(prompt), now)
        prompt_tokens += len(prompt)
        cached_tokens += cached
        delays.append(delay)
    served = [r.served for r in replicas]
    delays.sort()
    return {
        "requests": len(events),
        "cache_share": cached_tokens / prompt_tokens,
        "busiest_vs_mean": max(served) / (sum(served) / len(served)),
        "p99_queue_s": delays[int(0.99 * (len(delays) - 1))],
        "decision_us": 1e6 * router.decide_s / len(events),
        "summary_bytes_per_replica": router.summary_bytes,
    }


def table(results: dict[str, dict[str, float]]) -> str:
    """One row per policy, one column per figure."""
    keys = list(next(iter(results.values())))
    lines = ["| policy | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for policy, r in results.items():
        cells = (f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys)
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(run: StudyRun) -> int:
    s = Settings.of(run)
    results: dict[str, Any] = {}
    for policy in run.option("policies", ",".join(POLICIES)).split(","):
        results[policy] = simulate(policy, s)
        print(policy, json.dumps({k: round(v, 4) for k, v in results[policy].items()}),
              file=sys.stderr, flush=True)  # fmt: skip
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / "router.json").write_text(json.dumps({"settings": asdict(s), **results}, indent=1))
    text = f"# {STUDY.title}\n\n{asdict(s)}\n\n{table(results)}"
    (run.out / "results.md").write_text(text)
    print(text, end="")
    return 0


STUDY = Study(
    name="router",
    title="The routing policies at scale, simulated (no model)",
    main=main,
)
