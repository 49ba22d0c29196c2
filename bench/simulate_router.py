"""The routing policies at scale, simulated: 1,000 replicas (by default), synthetic traffic
shaped like a chat service's, no model. Each replica holds KV for a bounded number of
prefix blocks (least recently used out) and serves a request in time proportional to the
tokens it must prefill plus those it generates; the router sees each replica's resident
blocks only as of its last summary (every `--period` seconds, at most `--summary` hashes)
plus what it sent itself, as in `ferrum cluster`.

Traffic: conversations arrive as a Poisson process; each has a system prompt drawn from a
Zipf-distributed set (a few prompts are very hot, as a popular app's are) and several turns
a think-time apart, each turn's prompt the whole history so far.

Reported per policy: share of prompt tokens served from cache, the busiest replica's load
against the mean (1.0 = perfectly even), the 99th percentile of queueing delay, the router's
time per decision, and the bytes of summaries per period.

    .venv/bin/python bench/simulate_router.py [--replicas 1000] [--seconds 120]
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

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


def _traffic(
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


def _tokens(conv: int, turn: int, system: int) -> list[int]:
    rng = random.Random(system)
    out = [rng.randrange(50_000) for _ in range(rng.randint(200, 1500))]
    for t in range(turn + 1):
        r = random.Random(conv * 1000 + t)
        out += [r.randrange(50_000) for _ in range(r.randint(20, 80))]  # question
        if t < turn:
            out += [r.randrange(50_000) for _ in range(ANSWER)]
    return out


def simulate(policy: str, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(1)
    replicas = [Replica(f"r{i}", args.kv_blocks) for i in range(args.replicas)]
    by_name = {r.name: r for r in replicas}
    prefix = PrefixAffinity(imbalance=args.imbalance, recent_s=2 * args.period, rng=rng)
    text = TextPrefixAffinity(rng=rng)
    events = _traffic(args.seconds, args.rate, args.prompts, seed=7)
    next_summary, prompt_tokens, cached_tokens, delays, decide = 0.0, 0, 0, [], 0.0
    summary_bytes = 0
    for now, conv, turn, system in events:
        if policy == "prefix" and now >= next_summary:
            for r in replicas:
                held = list(reversed(r.blocks))[: args.summary]  # most recent first
                prefix.observe(r.name, {"m": frozenset(held)})
                summary_bytes = max(summary_bytes, 8 * len(held))
            next_summary = now + args.period
        tokens = _tokens(conv, turn, system)
        hashes = list(block_hashes(tokens, BLOCK, ""))
        candidates = [Candidate(r.name, r.in_flight(now)) for r in replicas]
        t0 = time.perf_counter()
        if policy == "prefix":
            key = RouteKey("m", tuple(hashes))
            ranks = prefix.choose(key, candidates, now=now)
        elif policy == "text-prefix":
            key = RouteKey(text=" ".join(map(str, tokens)))
            ranks = text.choose(key, candidates)
        else:
            ranks = power_of_two(candidates, rng)
        load = {c.replica: c.in_flight for c in candidates}
        chosen = min(ranks[0], key=lambda name: load[name])
        decide += time.perf_counter() - t0
        if policy == "prefix":
            prefix.routed(chosen, key, now=now)
        elif policy == "text-prefix":
            text.routed(chosen, key)
        cached, delay = by_name[chosen].serve(hashes, len(tokens), now)
        prompt_tokens += len(tokens)
        cached_tokens += cached
        delays.append(delay)
    served = [r.served for r in replicas]
    delays.sort()
    return {
        "requests": len(events),
        "cache_share": cached_tokens / prompt_tokens,
        "busiest_vs_mean": max(served) / (sum(served) / len(served)),
        "p99_queue_s": delays[int(0.99 * (len(delays) - 1))],
        "decision_us": 1e6 * decide / len(events),
        "summary_bytes_per_replica": summary_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--rate", type=float, default=150.0, help="new conversations per second")
    parser.add_argument("--prompts", type=int, default=2000, help="distinct system prompts")
    parser.add_argument("--kv-blocks", type=int, default=4096, help="KV blocks per replica")
    parser.add_argument("--summary", type=int, default=8192, help="hashes per summary")
    parser.add_argument("--period", type=float, default=1.0)
    parser.add_argument("--imbalance", type=int, default=4)
    parser.add_argument("--policies", default="prefix,text-prefix,pow2")
    args = parser.parse_args()
    for policy in args.policies.split(","):
        result = simulate(policy, args)
        print(policy, {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()},
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
