"""Which replica a request goes to: the routing policies, pure (no Ray), so they can be
tested alone and simulated with any number of replicas (`ferrum bench --study router`).

- `PrefixAffinity`, ferrum's: each replica publishes the chained hashes of the prefix blocks
  its engine holds (`ferrum.engine.kv.prefix.ResidentPrefixes`); the ingress hashes the request's
  prompt tokens the same way (`RouteKey.hashes`). The request goes to the replica holding the
  longest run of its blocks, unless that replica has `imbalance` or more requests in flight
  beyond the least loaded's, then to the less loaded of two drawn at random (power of two choices).
  Summaries arrive every stats period, so what the router itself sent in the last
  `recent_s` counts as held too: a conversation's next turn, sent right after the last one
  ended, goes where it went before.
- `TextPrefixAffinity`: Ray Serve LLM's `PrefixCacheAffinityRouter` as documented, written
  again here because `ray.serve.llm` refuses to import without vLLM or SGLang. The router
  keeps a tree of the prompt texts it sent to each replica (never what replicas evicted); a
  request goes to the replicas with the longest text match when at least 10% of its text
  matches, else to those whose tree holds the fewest characters; queues differing by more
  than `imbalanced_threshold` (infinite by default, as in Ray) mean power of two instead.
  Texts are matched in 16-character chunks, so a match is known to within 16 characters.
- Power of two choices is Ray Serve's default router, used as it is.

A policy returns replicas in ranks, most preferred first, as Ray's routers do: Ray then
sends to the least loaded replica of the first rank that accepts.
"""

from __future__ import annotations

import random
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

# Both sides encode hashes as signed 64-bit ints; Python's hash of a tuple fits one.
_HASH_TYPE = "q"
_TEXT_CHUNK = 16


@dataclass(frozen=True)
class RouteKey:
    """What the ingress computed for one request: which model, the chained hashes of its
    prompt's full blocks (empty: not known, e.g. a dialect the ingress cannot render), and
    its text for text-prefix routing; `pin`, a replica the request must go to while it lives
    (a Responses API continuation: its stored history is there)."""

    model: str = ""
    hashes: tuple[int, ...] = ()
    text: str = ""
    pin: str = ""


@dataclass(frozen=True)
class Candidate:
    replica: str
    in_flight: int  # requests sent and not finished, as the router last knew it


def encode_hashes(hashes: Iterable[int]) -> bytes:
    return array(_HASH_TYPE, hashes).tobytes()


def decode_hashes(data: bytes) -> frozenset[int]:
    values = array(_HASH_TYPE)
    values.frombytes(data)
    return frozenset(values)


def power_of_two(candidates: Sequence[Candidate], rng: random.Random) -> list[list[str]]:
    """Two replicas drawn at random, the less loaded first (one rank: Ray takes the least
    loaded that accepts)."""
    if not candidates:
        return []
    drawn = rng.sample(list(candidates), min(2, len(candidates)))
    drawn.sort(key=lambda c: c.in_flight)
    return [[c.replica for c in drawn]]


def pinned(key: RouteKey, candidates: Sequence[Candidate]) -> list[list[str]] | None:
    if key.pin and any(c.replica == key.pin for c in candidates):
        return [[key.pin]]
    return None


def _imbalanced(candidates: Sequence[Candidate], threshold: float) -> bool:
    loads = [c.in_flight for c in candidates]
    return max(loads) - min(loads) > threshold


class PrefixAffinity:
    """Kept as an inverted index (block hash → replicas holding it), so a decision walks the
    prompt's blocks once, whatever the number of replicas, and a new summary costs only
    its difference from the one before."""

    def __init__(
        self,
        imbalance: int = 4,
        recent_s: float = 10.0,
        max_recent: int = 200_000,
        rng: random.Random | None = None,
    ):
        self.imbalance = imbalance
        self.recent_s = recent_s
        self.max_recent = max_recent
        self._rng = rng or random.Random()
        self._resident: dict[str, dict[str, frozenset[int]]] = {}  # replica → model → hashes
        self._holders: dict[tuple[str, int], set[str]] = {}  # (model, hash) → replicas
        # (model, hash) → replica → when this router sent a prompt with that block there
        self._recent: OrderedDict[tuple[str, int], dict[str, float]] = OrderedDict()

    def observe(self, replica: str, summaries: Mapping[str, frozenset[int]]) -> None:
        """A replica's latest summary, per model: it replaces the one before."""
        before = self._resident.get(replica, {})
        for model in set(before) | set(summaries):
            old, new = before.get(model, frozenset()), summaries.get(model, frozenset())
            for h in old - new:
                self._drop_holder((model, h), replica)
            for h in new - old:
                self._holders.setdefault((model, h), set()).add(replica)
        self._resident[replica] = dict(summaries)

    def _drop_holder(self, k: tuple[str, int], replica: str) -> None:
        holders = self._holders.get(k)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[k]

    def forget(self, replica: str) -> None:
        """A replica gone (dead, or scaled down): nothing of it is routed to any more."""
        for model, hashes in self._resident.pop(replica, {}).items():
            for h in hashes:
                self._drop_holder((model, h), replica)
        for sent in self._recent.values():
            sent.pop(replica, None)

    def _holding(self, model: str, h: int, now: float) -> set[str]:
        held = set(self._holders.get((model, h), ()))
        for replica, at in self._recent.get((model, h), {}).items():
            if now - at <= self.recent_s:
                held.add(replica)
        return held

    def longest(self, key: RouteKey, among: set[str], now: float) -> tuple[int, set[str]]:
        """How many leading blocks of the prompt the best replicas hold, and which they are."""
        depth, best = 0, set[str]()
        for h in key.hashes:
            holding = self._holding(key.model, h, now) & (best or among)
            if not holding:
                break
            depth, best = depth + 1, holding
        return depth, best

    def matched_blocks(self, replica: str, key: RouteKey, now: float) -> int:
        return self.longest(key, {replica}, now)[0]

    def choose(
        self, key: RouteKey, candidates: Sequence[Candidate], now: float | None = None
    ) -> list[list[str]]:
        if not candidates:
            return []
        now = time.monotonic() if now is None else now
        if key.hashes:
            depth, best = self.longest(key, {c.replica for c in candidates}, now)
            if depth > 0:
                least = min(c.in_flight for c in candidates)
                holder = min(
                    (c for c in candidates if c.replica in best), key=lambda c: c.in_flight
                )
                if holder.in_flight - least < self.imbalance:
                    rest = sorted(
                        (c for c in candidates if c is not holder), key=lambda c: c.in_flight
                    )
                    return [[holder.replica], [c.replica for c in rest]]
        return power_of_two(candidates, self._rng)

    def routed(self, replica: str, key: RouteKey, now: float | None = None) -> None:
        """The request went to `replica`: its blocks will be there before any summary says so."""
        now = time.monotonic() if now is None else now
        for h in key.hashes:
            k = (key.model, h)
            self._recent.setdefault(k, {})[replica] = now
            self._recent.move_to_end(k)
        while len(self._recent) > self.max_recent:
            self._recent.popitem(last=False)


def _text_chunks(text: str) -> Iterator[int]:
    h = 0
    for i in range(0, len(text) - _TEXT_CHUNK + 1, _TEXT_CHUNK):
        h = hash((h, text[i : i + _TEXT_CHUNK]))
        yield h


class TextPrefixAffinity:
    """One tree for all replicas, as Ray's: chained 16-character chunk hashes, each with the
    replicas it was sent to, and each replica's character count."""

    def __init__(
        self,
        imbalanced_threshold: float = float("inf"),
        match_rate_threshold: float = 0.1,
        rng: random.Random | None = None,
    ):
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self._rng = rng or random.Random()
        self._tenants: dict[int, set[str]] = {}  # chunk hash → replicas sent that text
        self._chars: dict[str, int] = {}  # replica → characters of its texts

    def forget(self, replica: str) -> None:
        self._chars.pop(replica, None)
        for h in [h for h, t in self._tenants.items() if replica in t]:
            self._tenants[h].discard(replica)
            if not self._tenants[h]:
                del self._tenants[h]

    def choose(self, key: RouteKey, candidates: Sequence[Candidate]) -> list[list[str]]:
        if not candidates:
            return []
        if not key.text or _imbalanced(candidates, self.imbalanced_threshold):
            return power_of_two(candidates, self._rng)
        names = {c.replica for c in candidates}
        matched, best = 0, set[str]()
        for h in _text_chunks(key.text):
            holding = self._tenants.get(h, set()) & (best or names)
            if not holding:
                break
            matched, best = matched + _TEXT_CHUNK, holding
        if best and matched / len(key.text) >= self.match_rate_threshold:
            return [[c.replica for c in candidates if c.replica in best]]
        fewest = min(self._chars.get(c.replica, 0) for c in candidates)
        return [[c.replica for c in candidates if self._chars.get(c.replica, 0) == fewest]]

    def routed(self, replica: str, key: RouteKey) -> None:
        for h in _text_chunks(key.text):
            tenants = self._tenants.setdefault(h, set())
            if replica not in tenants:
                tenants.add(replica)
                self._chars[replica] = self._chars.get(replica, 0) + _TEXT_CHUNK
