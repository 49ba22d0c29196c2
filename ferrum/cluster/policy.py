"""Which replica a request goes to: the routing policies, pure (no Ray), so they can be
tested alone and simulated with any number of replicas (`bench/simulate_router.py`).

- `PrefixAffinity`, ferrum's: each replica publishes the chained hashes of the prefix blocks
  its engine holds (`ferrum.engine.prefix.ResidentPrefixes`); the ingress hashes the request's
  prompt tokens the same way (`RouteKey.hashes`). The request goes to the replica holding the
  longest run of its blocks, unless that replica has `imbalance` more requests in flight than
  the least loaded, then to the less loaded of two drawn at random (power of two choices).
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
from collections.abc import Iterable, Mapping, Sequence
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
        # replica → model → hashes it reported holding
        self._resident: dict[str, dict[str, frozenset[int]]] = {}
        # (replica, model, hash) → when this router sent a prompt with that block there
        self._recent: OrderedDict[tuple[str, str, int], float] = OrderedDict()

    def observe(self, replica: str, summaries: Mapping[str, frozenset[int]]) -> None:
        """A replica's latest summary, per model: it replaces the one before."""
        self._resident[replica] = dict(summaries)

    def forget(self, replica: str) -> None:
        """A replica gone (dead, or scaled down): nothing of it is routed to any more."""
        self._resident.pop(replica, None)
        for k in [k for k in self._recent if k[0] == replica]:
            del self._recent[k]

    def matched_blocks(self, replica: str, key: RouteKey, now: float) -> int:
        held = self._resident.get(replica, {}).get(key.model, frozenset())
        n = 0
        for h in key.hashes:
            if h not in held:
                sent = self._recent.get((replica, key.model, h))
                if sent is None or now - sent > self.recent_s:
                    break
            n += 1
        return n

    def choose(
        self, key: RouteKey, candidates: Sequence[Candidate], now: float | None = None
    ) -> list[list[str]]:
        if not candidates:
            return []
        now = time.monotonic() if now is None else now
        if key.hashes:
            matched = {c.replica: self.matched_blocks(c.replica, key, now) for c in candidates}
            best = max(matched.values())
            if best > 0:
                least = min(c.in_flight for c in candidates)
                holders = sorted(
                    (c for c in candidates if matched[c.replica] == best),
                    key=lambda c: c.in_flight,
                )
                if holders[0].in_flight - least <= self.imbalance:
                    rest = sorted(
                        (c for c in candidates if c is not holders[0]),
                        key=lambda c: (-matched[c.replica], c.in_flight),
                    )
                    return [[holders[0].replica], [c.replica for c in rest]]
        return power_of_two(candidates, self._rng)

    def routed(self, replica: str, key: RouteKey, now: float | None = None) -> None:
        """The request went to `replica`: its blocks will be there before any summary says so."""
        now = time.monotonic() if now is None else now
        for h in key.hashes:
            k = (replica, key.model, h)
            self._recent[k] = now
            self._recent.move_to_end(k)
        while len(self._recent) > self.max_recent:
            self._recent.popitem(last=False)


class _TextTree:
    """One replica's texts as chained hashes of 16-character chunks, with a character count."""

    def __init__(self) -> None:
        self.chunks: set[int] = set()
        self.chars = 0

    def insert(self, text: str) -> None:
        for h in _text_chunks(text):
            if h not in self.chunks:
                self.chunks.add(h)
                self.chars += _TEXT_CHUNK

    def match(self, text: str) -> int:
        n = 0
        for h in _text_chunks(text):
            if h not in self.chunks:
                break
            n += _TEXT_CHUNK
        return n


def _text_chunks(text: str) -> Iterable[int]:
    h = 0
    for i in range(0, len(text) - _TEXT_CHUNK + 1, _TEXT_CHUNK):
        h = hash((h, text[i : i + _TEXT_CHUNK]))
        yield h


class TextPrefixAffinity:
    def __init__(
        self,
        imbalanced_threshold: float = float("inf"),
        match_rate_threshold: float = 0.1,
        rng: random.Random | None = None,
    ):
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self._rng = rng or random.Random()
        self._trees: dict[str, _TextTree] = {}

    def add(self, replica: str) -> None:
        self._trees.setdefault(replica, _TextTree())

    def forget(self, replica: str) -> None:
        self._trees.pop(replica, None)

    def choose(self, key: RouteKey, candidates: Sequence[Candidate]) -> list[list[str]]:
        if not candidates:
            return []
        if not key.text or _imbalanced(candidates, self.imbalanced_threshold):
            return power_of_two(candidates, self._rng)
        for c in candidates:
            self.add(c.replica)
        matched = {c.replica: self._trees[c.replica].match(key.text) for c in candidates}
        best = max(matched.values())
        if best / len(key.text) >= self.match_rate_threshold:
            chosen = [c.replica for c in candidates if matched[c.replica] == best]
        else:
            fewest = min(self._trees[c.replica].chars for c in candidates)
            chosen = [c.replica for c in candidates if self._trees[c.replica].chars == fewest]
        return [chosen]

    def routed(self, replica: str, key: RouteKey) -> None:
        if key.text:
            self._trees.setdefault(replica, _TextTree()).insert(key.text)
