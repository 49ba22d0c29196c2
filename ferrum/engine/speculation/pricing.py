"""What a guessed token costs and how likely it is kept: the two sides `speculator.py`
weighs before a draft goes into a step.

`StepCosts` prices a decode by its number of positions, from the decodes timed so far;
`KeepRates` gives a guess's chance of being kept by the length of the n-gram match it
follows, learned per model from the verifications."""

from __future__ import annotations

from collections import deque
from itertools import pairwise
from statistics import median

# How often a guess is kept, per match length: a new length starts at _PRIOR_KEPT as if
# seen _PRIOR_TRIES times (hopeful, so a length is tried before it is judged); each new
# guess weighs its length's older evidence down by _KEPT_DECAY.
_PRIOR_KEPT = 0.8
_PRIOR_TRIES = 2.0
_KEPT_DECAY = 0.98


class StepCosts:
    """A decode's seconds by its number of positions: the median of each size's latest
    timings, made non-decreasing, between sizes a straight line, past the largest the
    cheapest slope between two of them. Not one line for all sizes: on 2 CPU cores two
    positions cost 1.9x one and four 3.1x, so a line fitted to all of them would price the
    first guess at two thirds of a token where it costs nine tenths."""

    KEEP = 9  # timings per size

    def __init__(self) -> None:
        self._timings: dict[int, deque[float]] = {}
        self._medians: dict[int, float] = {}
        # Seconds by positions up to the largest size timed (None below the smallest, or
        # everywhere while fewer than two sizes are timed); rebuilt after a timing.
        self._table: list[float | None] | None = None
        self._slope = 0.0  # seconds per position past the largest size timed

    def add(self, positions: int, seconds: float) -> None:
        timings = self._timings.get(positions)
        if timings is None:
            timings = self._timings[positions] = deque(maxlen=self.KEEP)
        timings.append(seconds)
        self._medians[positions] = median(timings)
        self._table = None

    def seconds(self, positions: int) -> float | None:
        """The expected seconds of a decode of `positions`; None until two sizes, one of
        them no larger, are timed."""
        table = self._by_positions()
        if positions < len(table):
            return table[positions]
        last = table[-1] if table else None
        return None if last is None else last + self._slope * (positions - len(table) + 1)

    def _by_positions(self) -> list[float | None]:
        if self._table is None:
            rising, top = [], 0.0
            for size in sorted(self._medians):
                top = max(top, self._medians[size])
                rising.append((size, top))
            table: list[float | None] = [None] * (rising[-1][0] + 1 if rising else 0)
            if len(rising) >= 2:
                for (n, a), (m, b) in pairwise(rising):
                    for p in range(n, m):
                        table[p] = a + (b - a) * (p - n) / (m - n)
                table[-1] = rising[-1][1]
                # Past the largest size timed, the cheapest position seen between two sizes:
                # a hopeful guess, so that a wider decode is tried, timed and then known.
                slopes = [(b - a) / (m - n) for (n, a), (m, b) in pairwise(rising) if b > a]
                self._slope = min(slopes) if slopes else 0.0
            self._table = table
        return self._table


class KeepRates:
    """How often a guess is kept, by the length of the n-gram match it follows: the stronger
    the evidence, the likelier the guess (on stories here, 47% after a 3-token match, 95%
    after a match of ngram_max). The j-th guess of a draft from an n-token match follows an
    (n + j - 1)-token match once the guesses before it held. Lengths of `longest` and more
    share one rate."""

    def __init__(self, longest: int) -> None:
        self._longest = longest
        self._kept = [0.0] * (longest + 1)
        self._tried = [0.0] * (longest + 1)
        self._likeliest: float | None = None

    def chance(self, match: int) -> float:
        """The chance that a guess following a `match`-token match is kept."""
        i = min(match, self._longest)
        return (self._kept[i] + _PRIOR_KEPT * _PRIOR_TRIES) / (self._tried[i] + _PRIOR_TRIES)

    def likeliest(self) -> float:
        """The highest chance of any match length."""
        if self._likeliest is None:
            self._likeliest = max(self.chance(n) for n in range(1, self._longest + 1))
        return self._likeliest

    def runs(self, match: int, k: int, odds: float = 1.0) -> list[float]:
        """For j = 1..k: the chance that the first j guesses of a draft are all kept, each
        guess's odds times `odds` (a request's own record against these rates)."""
        out, chance = [], 1.0
        for j in range(k):
            p = self.chance(match + j)
            p = p * odds / (1 - p + p * odds)
            chance *= p
            out.append(chance)
        return out

    def record(self, match: int, tried: int, accepted: int) -> float:
        """A draft from a `match`-token match whose first `tried` guesses were tried (each
        kept one and the first refused), each at its own length; returns how many of them
        these rates expected kept, as they stood before."""
        lengths = [min(match + j, self._longest) for j in range(tried)]
        expected = sum(self.chance(i) for i in lengths)
        for j, i in enumerate(lengths):
            self._kept[i] = self._kept[i] * _KEPT_DECAY + (j < accepted)
            self._tried[i] = self._tried[i] * _KEPT_DECAY + 1
        self._likeliest = None
        return expected
