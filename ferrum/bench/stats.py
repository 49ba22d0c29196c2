"""Pure statistics for the benchmark: percentiles, spreads over rounds, ratios and verdicts.

No I/O and no servers here, so the rules that decide a "win" are unit-tested on their own.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

INCONCLUSIVE = "inconclusive"


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None for no values.

    With few samples p99 is close to the maximum: that is what it is, not an estimate of a
    population tail, and the report says how many samples each number stands on."""
    data = sorted(values)
    if not data:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    rank = (len(data) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return data[lo] + (data[hi] - data[lo]) * (rank - lo)


def p99_rank(values: Iterable[float]) -> float | None:
    """The studies' p99: the sorted values' element at index int(0.99 n), the maximum below
    100 values (no interpolation, unlike `percentile`); None for no values."""
    data = sorted(values)
    return data[min(len(data) - 1, int(0.99 * len(data)))] if data else None


@dataclass(frozen=True)
class Spread:
    """Median and [min, max] of one metric over the kept rounds of one arm."""

    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Spread | None:
        data = [v for v in values if v is not None and not math.isnan(v)]
        if not data:
            return None
        return cls(statistics.median(data), min(data), max(data), len(data))

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": self.n}


def verdict(ours: Spread | None, theirs: Spread | None, higher_is_better: bool) -> str:
    """ "win" / "loss" for `ours` only when the two [min, max] ranges are disjoint.

    A one-sample range is a point, and any gap between two points would "decide": with fewer
    than two kept rounds on either side the answer is inconclusive."""
    if ours is None or theirs is None:
        return "n/a"
    if min(ours.n, theirs.n) < 2:
        return f"{INCONCLUSIVE} (n<2)"
    if ours.lo > theirs.hi:
        return "win" if higher_is_better else "loss"
    if ours.hi < theirs.lo:
        return "loss" if higher_is_better else "win"
    return INCONCLUSIVE


def paired_ratio(ours: Mapping[int, float], theirs: Mapping[int, float]) -> Spread | None:
    """Spread of ours[r] / theirs[r] over the rounds r both arms have (pairs share a round's
    machine state and prompts, so the ratio is steadier than a ratio of medians)."""
    return Spread.of(
        ours[r] / theirs[r] for r in sorted(ours) if r in theirs and theirs[r] not in (0, None)
    )


@dataclass(frozen=True)
class Answer:
    """One answered request of a closed-loop client: when it was sent, when its answer came
    and how many tokens it held."""

    sent: float
    answered: float
    tokens: int


def rate_while_all_busy(clients: Sequence[Sequence[Answer]]) -> float | None:
    """Output tokens per second while every client still had a request out: from the first
    request sent to the first client's last answer. A client sends its next request when
    its answer comes, so until then all of them are busy; after it, fewer are, and the
    batch the server decodes is narrower than the concurrency the cell is named for.

    How long that tail lasts depends on how evenly the clients' requests end (all of them
    at once when every request runs to max_tokens one token a step; at different steps
    when some requests gain more from speculation than others), so a rate over the whole
    run mixes concurrencies. A request's tokens are counted as spread evenly over its time
    (its prompt's share included), the part inside the window counting. None: no window."""
    if not clients or not all(clients):
        return None
    start = min(a.sent for answers in clients for a in answers)
    until = min(answers[-1].answered for answers in clients)
    if until <= start:
        return None
    tokens = 0.0
    for answers in clients:
        for a in answers:
            inside = min(a.answered, until) - max(a.sent, start)
            if inside > 0:
                tokens += a.tokens * inside / (a.answered - a.sent)
    return tokens / (until - start)
