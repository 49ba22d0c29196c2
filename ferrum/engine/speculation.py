"""N-gram speculation: guessing a request's next tokens from its own tokens, so one decode
can verify several of them.

Each decoding request may append a draft to its one token: `[last, d1 … dk]` go into the
same llama_decode, with logits at every position. The runner samples at each position in
order with the request's own sampler and stops at the first token that differs from the
draft: the tokens it returns are exactly the tokens decoding one at a time would have
sampled (greedy: the argmax; sampling: one draw per token from the same distribution and
RNG, so seeds stay reproducible; a grammar sees only tokens it accepted). The positions of
rejected draft tokens are removed from the sequence at once (`llama_memory_seq_rm`), and
only accepted tokens ever enter `all_token_ids`, so the prefix index never sees them.

    tokens      last  d1  d2  d3  d4          draft of 4
    sampled     t1    t2  t3                   t1 = d1, t2 = d2, t3 ≠ d3: 3 tokens
    KV kept     last  d1  d2 | d3 d4 removed   the next step decodes t3

The guess (`NgramDrafter`) is what followed the longest recent earlier occurrence (n from
`ngram_max` down to `ngram_min`) of the sequence's last n tokens, in its own tokens or in the
model's latest finished requests (`RecentSequences`: a regeneration or a retry repeats an
earlier answer), the longer match winning. How much of it goes in is priced, per step:

- How likely each token of a guess is to be kept depends most on how long the match it
  follows is: a one-token match in a story is right ~1 time in 5, a match of 24 tokens in
  code being copied 19 in 20 and for many tokens on. `KeptChances` learns, per class of
  match length, how often the j-th token of a guess held, from every guess made, drafted
  or not: each is checked against the tokens the request then wrote.
- What a decode of n positions costs is measured (`DecodeSizes`): on a CPU not a straight
  line (tiles make 3 positions cost nearly 4, and 7 nearly 8) and a first guess may cost
  half a token or three quarters of one, depending on the machine.
- Each step takes the guessed tokens most likely to be kept first, over all decoding
  requests, as many as make the step's expected tokens per second highest. One request
  decoding on a CPU drafts long runs when copying and nothing where its guesses fail; a
  wide batch, whose positions are already paid for, drafts only its likeliest guesses.

Off for recurrent and hybrid models (their state cannot drop the rejected positions) and
for sliding-window models (the window cache may recycle cells a rollback needs again).
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ferrum.config import EngineConfig
from ferrum.engine.ngram import NgramDrafter, RecentSequences
from ferrum.engine.request import Request
from ferrum.engine.turns import DecodeCost

# The classes of match length a guess's chances are learned for (the shortest of each):
# evidence is pooled within a class, so classes widen where matches are rarer.
_MATCH_CLASSES = (1, 2, 3, 4, 5, 8, 12, 24, 48)
_OTHER = len(_MATCH_CLASSES)  # guesses from a drafter that reports no match length
_DECAY = 0.98  # per checked guess of a class: how much older evidence still counts
_PRIOR_KEPT, _PRIOR_TRIED = 1.0, 2.0  # before any evidence, each token of a guess: even odds
_OWN_DECAY = 0.9  # the same, for a request's own record
_OWN_PRIOR = 4.0  # weight of the model's chance in a request's own (as guesses compared)
_SIZE_SAMPLES = 16  # latest timed decodes kept per size
_SIZE_MIN_SAMPLES = 3  # before that many, a size is priced by the line through all sizes
_REFIT_EVERY = 8  # timed decodes between two fits of that line
# Before any wider decode is timed, a position more is priced at this share of a one-position
# decode: low enough that wider sizes get tried, and so timed.
_UNTIMED_POSITION = 0.5


@dataclass(frozen=True)
class SpecConfig:
    """--spec-type and its bounds."""

    kind: str = "ngram"  # "ngram" or "none"
    draft_max: int = 8
    ngram_min: int = 1
    ngram_max: int = 12
    batch_max: int = 16  # draft tokens of all requests in one step
    recent: int = 8  # finished requests kept to guess from (RecentSequences)

    @property
    def enabled(self) -> bool:
        return self.kind != "none" and self.draft_max > 0

    @classmethod
    def from_engine_config(cls, cfg: EngineConfig) -> SpecConfig:
        return cls(cfg.spec_type, cfg.spec_draft_max, cfg.spec_ngram_min, cfg.spec_ngram_max,
                   cfg.spec_batch_max, cfg.spec_recent)  # fmt: skip


class Drafter(Protocol):
    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that may follow `tokens` (the request's prompt and output)."""
        ...


class KeptChances:
    """How often the j-th token of a guess was right, per class of the length of the match
    the guess followed, older evidence counting `decay` less per guess compared.

    The model keeps one (decaying slowly, so a server that turns from copying code to
    writing stories follows); each request one of its own (decaying fast), drawn towards the
    model's: a request copying a document keeps more of its guesses than the same matches
    in a story would, and its own record says so within a few guesses."""

    def __init__(self, depth: int, decay: float = _DECAY):
        classes = len(_MATCH_CLASSES) + 1
        self._kept = [[0.0] * depth for _ in range(classes)]
        self._tried = [[0.0] * depth for _ in range(classes)]
        self._decay = decay
        self.depth = depth

    @staticmethod
    def of_match(length: int | None) -> int:
        """The class of a guess following a match of `length` tokens (None: not known)."""
        if length is None:
            return _OTHER
        return max(0, bisect.bisect_right(_MATCH_CLASSES, length) - 1)

    def record(self, cls: int, right: int, compared: int) -> None:
        """A guess of class `cls` compared with what was written: its first `right` tokens of
        `compared` right (right < compared: the next one was wrong)."""
        kept, tried = self._kept[cls], self._tried[cls]
        for j in range(min(right + 1, compared, len(tried))):
            tried[j] = tried[j] * self._decay + 1
            kept[j] = kept[j] * self._decay + (j < right)

    def chances(self, cls: int, k: int, own: KeptChances | None = None) -> list[float]:
        """The chance that the first 1, 2, … k tokens of a guess of class `cls` are all kept:
        these counts, or a request's `own` counts with these as its prior. Where evidence is
        thin, a token is taken to hold as often as the one before it did (the first token,
        as often as after a shorter match): once a copy holds, it tends to go on holding."""
        prior = 0.5
        for shorter in range(cls if cls != _OTHER else 0):
            prior = self._held(shorter, 0, prior)
        out, chance = [], 1.0
        for j in range(min(k, self.depth)):
            held = prior = self._held(cls, j, prior)
            if own is not None:
                held = own._held(cls, j, held, _OWN_PRIOR)
            chance *= held
            out.append(chance)
        return out

    def _held(self, cls: int, j: int, prior: float, weight: float = _PRIOR_TRIED) -> float:
        return (self._kept[cls][j] + weight * prior) / (self._tried[cls][j] + weight)


class DecodeSizes:
    """What a decode of n positions without prefill costs: the median of its latest timings;
    a size timed fewer than _SIZE_MIN_SAMPLES times, the line fitted through all timings
    (`DecodeCost`); while that line has no fixed part (one size timed), a one-position decode
    and _UNTIMED_POSITION of one per position more."""

    def __init__(self) -> None:
        self._line = DecodeCost()
        self._fit: tuple[float, float] | None = None
        self._timed = 0
        self._by_size: dict[int, deque[float]] = {}
        self._median: dict[int, float] = {}

    def add(self, positions: int, seconds: float) -> None:
        samples = self._by_size.setdefault(positions, deque(maxlen=_SIZE_SAMPLES))
        samples.append(seconds)
        if len(samples) >= _SIZE_MIN_SAMPLES:
            self._median[positions] = statistics.median(samples)
        self._line.add(positions, seconds)
        self._timed += 1
        if self._timed % _REFIT_EVERY == 1:
            fit = self._line.fit()
            self._fit = fit if fit is not None and fit[0] > 0 and fit[1] > 0 else None

    def seconds(self, positions: int) -> float | None:
        """None: not known (nothing timed yet)."""
        measured = self._median.get(positions)
        if measured is not None:
            return measured
        if self._fit is not None:
            fixed, per_token = self._fit
            return fixed + per_token * positions
        one = self._median.get(1)
        return None if one is None else one * (1 + _UNTIMED_POSITION * (positions - 1))


@dataclass
class _Tracked:
    """A request's drafter, its guesses not yet compared in full (class, tokens, its output
    length then) and its own record."""

    drafter: Drafter
    own: KeptChances
    open: list[tuple[int, list[int], int]] = field(default_factory=list)


@dataclass
class _Guess:
    request: Request
    tokens: list[int]
    chances: list[float]  # of its first 1, 2, … tokens all being kept


@dataclass
class Speculator:
    """Drafts for the scheduler (`plan`), decode timings and verification results from the
    engine, and the totals."""

    config: SpecConfig
    make_drafter: Callable[[SpecConfig], Drafter] = lambda c: NgramDrafter(c.ngram_min, c.ngram_max)
    drafted: int = 0
    accepted: int = 0
    sizes: DecodeSizes = field(default_factory=DecodeSizes)
    kept: KeptChances = field(init=False)
    recent: RecentSequences = field(init=False)
    _tracked: dict[str, _Tracked] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kept = KeptChances(max(1, self.config.draft_max))
        self.recent = RecentSequences(max_sequences=self.config.recent)

    def timed(self, tokens: int, seconds: float) -> None:
        """A decode without prefill: `tokens` positions in `seconds`."""
        self.sizes.add(tokens, seconds)

    def wants(self, req: Request) -> bool:
        setting = req.params.speculate
        return self.config.enabled if setting is None else setting and self.config.draft_max > 0

    def plan(self, decoding: Sequence[Request], room: int) -> dict[str, list[int]]:
        """The step's drafts (request id -> tokens) for the requests decoding one token each,
        `room` draft tokens at most in all: the guessed tokens likeliest to be kept first, as
        many as make the step's expected tokens per second highest."""
        guesses = [g for req in decoding if (g := self._guess(req)) is not None]
        ranked = sorted(
            ((chance, j, i) for i, g in enumerate(guesses) for j, chance in enumerate(g.chances)),
            key=lambda t: (-t[0], t[1]),
        )  # a guess's chances fall with j: each request's tokens are taken in order
        ranked = ranked[: max(0, min(room, self.config.batch_max))]
        taken = self._worth(len(decoding), [chance for chance, _, _ in ranked])
        counts = Counter(i for _, _, i in ranked[:taken])
        return {guesses[i].request.request_id: guesses[i].tokens[:n] for i, n in counts.items()}

    def _worth(self, decoding: int, chances: list[float]) -> int:
        """How many guessed tokens (each one's chance of being kept, likeliest first) make the
        expected tokens per second of a step of `decoding` one-token decodes highest; all of
        them while no decode was timed."""
        alone = self.sizes.seconds(decoding)
        if alone is None:
            return len(chances)
        best, best_rate, expected = 0, decoding / alone, float(decoding)
        for n, chance in enumerate(chances, 1):
            expected += chance
            seconds = self.sizes.seconds(decoding + n)
            if seconds is not None and seconds > 0 and expected / seconds > best_rate:
                best, best_rate = n, expected / seconds
        return best

    def _guess(self, req: Request) -> _Guess | None:
        if not self.wants(req):
            return None
        tracked = self._tracked.get(req.request_id)
        if tracked is None:
            tracked = self._tracked[req.request_id] = _Tracked(
                self.make_drafter(self.config), KeptChances(self.kept.depth, _OWN_DECAY)
            )
        self._compare(req, tracked)
        # Never guess past max_tokens: those positions could never be kept.
        k = min(self.config.draft_max, req.params.max_tokens - req.num_output_tokens - 1)
        if k <= 0:
            return None
        drafter, tokens = tracked.drafter, req.all_token_ids
        if isinstance(drafter, NgramDrafter):
            # The longer match is the better evidence: a repeated request's own prompt may
            # match where its earlier answer, which it is repeating, matches longer.
            suffixes = drafter.suffixes(tokens)  # one set of keys for every table looked up
            own = drafter.propose_matched(tokens, k, suffixes)
            other = self.recent.propose(tokens, k, suffixes)
            length, guess = other if other[0] > own[0] else own
            cls = KeptChances.of_match(length)
        else:
            guess, cls = drafter.propose(tokens, k)[:k], _OTHER
        if not guess:
            return None
        tracked.open.append((cls, guess, req.num_output_tokens))
        return _Guess(req, guess, self.kept.chances(cls, len(guess), tracked.own))

    def _compare(self, req: Request, tracked: _Tracked) -> None:
        """The request's earlier guesses against the tokens it wrote since: each compared in
        full, or wrong somewhere, goes into the chances of its class."""
        output = req.output_token_ids
        still: list[tuple[int, list[int], int]] = []
        for cls, guess, at in tracked.open:
            written = output[at : at + len(guess)]
            right = 0
            while right < len(written) and written[right] == guess[right]:
                right += 1
            if right < len(written) or len(written) == len(guess):
                self.kept.record(cls, right, len(written))
                tracked.own.record(cls, right, len(written))
            else:
                still.append((cls, guess, at))
        tracked.open = still

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

    def forget(self, req: Request) -> None:
        tracked = self._tracked.pop(req.request_id, None)
        if tracked is not None and isinstance(tracked.drafter, NgramDrafter):
            tracked.drafter.index_all(req.all_token_ids)
            self.recent.add(req.all_token_ids, tracked.drafter)
