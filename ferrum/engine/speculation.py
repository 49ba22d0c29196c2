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

The drafter (`NgramDrafter`) looks for the longest recent earlier occurrence (n from
`ngram_max` down to `ngram_min`) of the sequence's last n tokens and proposes what followed
it, as many tokens as the match is longer than `ngram_min` (plus one). Where a guess costs
under half a token (one request decoding, on a CPU), matches down to one token count, so a
request that departs from what it copies guesses again at once. The same lookup runs
over the model's latest finished requests (`RecentSequences`: a regeneration or a retry
repeats an earlier answer), and the longer of the two matches gives the guess; a match of
`ngram_max` tokens is measured further back, so an answer regenerated from the same prompt
follows its earlier run, not a few lines of its own prompt. Lengths adapt per request
(`DraftState`): a draft starts at 2 tokens, doubles after a full acceptance, shrinks to what
was accepted plus one otherwise, and a request whose drafts keep failing follows only
matches longer than `ngram_min` for a while. A guess must also pay for its position: the
decode cost measured so far, the number of requests decoding and the request's rate of kept
guesses decide how many guesses in a row are worth it (`Speculator`), so where the batch is
already wide only likely guesses go in. Across the step, `batch_max` bounds the draft tokens of all
requests together.

Off for recurrent and hybrid models (their state cannot drop the rejected positions) and
for sliding-window models (the window cache may recycle cells a rollback needs again).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ferrum.config import EngineConfig
from ferrum.engine.ngram import NgramDrafter, RecentSequences
from ferrum.engine.request import Request
from ferrum.engine.turns import DecodeCost

_FAILS_BEFORE_PAUSE = 4  # drafts in a row with nothing accepted
_PAUSE_TOKENS = 32  # tokens generated after that following long matches only
_RATE_DECAY = 0.9  # per verification: how much of a request's older evidence still counts
_PRIOR_TRIES = 4.0  # weight of the model-wide rate in a request's own (as guesses tried)
_PROBE_EVERY = 16  # output tokens between single guesses while no guess pays (to re-measure)
_REFIT_EVERY = 8  # timed decodes between two fits of the decode cost
# Where a guessed position costs under this share of a token (the bar below; one request
# decoding on a CPU), guesses follow n-grams down to _CHEAP_NGRAM_MIN tokens, not ngram_min.
_CHEAP_BAR = 0.5
_CHEAP_NGRAM_MIN = 1


@dataclass(frozen=True)
class SpecConfig:
    """--spec-type and its bounds."""

    kind: str = "ngram"  # "ngram" or "none"
    draft_max: int = 8
    ngram_min: int = 3
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


@dataclass
class DraftState:
    """One request's drafter, how long its drafts currently are, and how often its guesses
    are kept."""

    drafter: Drafter
    length: int
    fails: int = 0
    paused_until: int = 0  # output length before which only long matches are followed
    kept: float = 0.0  # guesses kept, older verifications counting less (_RATE_DECAY)
    tried: float = 0.0  # guesses sampled at: each kept one and the first refused
    probe_at: int = 0  # output length of the next single guess while none pays

    def rate(self, prior: float) -> float:
        """The chance that its next guess is kept, given the previous one was: its own
        recent record, starting from `prior` (the model's)."""
        return (self.kept + prior * _PRIOR_TRIES) / (self.tried + _PRIOR_TRIES)

    def update(self, drafted: int, accepted: int, draft_max: int, num_output: int) -> None:
        self.kept = self.kept * _RATE_DECAY + accepted
        self.tried = self.tried * _RATE_DECAY + accepted + (accepted < drafted)
        if accepted == drafted:
            self.length = min(draft_max, self.length * 2)
            self.fails = 0
            return
        self.length = max(1, accepted + 1)
        self.fails = 0 if accepted else self.fails + 1
        if self.fails >= _FAILS_BEFORE_PAUSE:
            self.fails = 0
            self.paused_until = num_output + _PAUSE_TOKENS


@dataclass
class Speculator:
    """Drafts for the scheduler, verification results from the engine, and the totals.

    A guess pays only when it is likely enough to be kept. A decode of n positions takes
    about fixed + n x per_token seconds (`DecodeCost`, fitted to the decodes without
    prefill); with `decoding` requests in the step, each output token costs
    (fixed + decoding x per_token) / decoding, and a request's j-th guess adds per_token
    for a token kept with chance rate**j. So it drafts the guesses whose chance beats
    per_token / that cost: on 2 CPU cores, a position costs about half a one-stream step, so
    one stream drafts at rates over ~0.5 and 4 streams only over ~0.8, where the batch is
    already wide. While no guess pays, a request still guesses one token every _PROBE_EVERY
    tokens, so its rate follows what it writes."""

    config: SpecConfig
    make_drafter: Callable[[SpecConfig], Drafter] = lambda c: NgramDrafter(
        c.ngram_min, c.ngram_max, floor=_CHEAP_NGRAM_MIN
    )
    drafted: int = 0
    accepted: int = 0
    tried: int = 0  # guesses sampled at (each kept one and the first refused), model-wide
    cost: DecodeCost = field(default_factory=DecodeCost)
    _states: dict[str, DraftState] = field(default_factory=dict)
    recent: RecentSequences = field(init=False)
    _fit: tuple[float, float] | None = None
    _timed: int = 0

    def __post_init__(self) -> None:
        self.recent = RecentSequences(max_sequences=self.config.recent)

    def timed(self, tokens: int, seconds: float) -> None:
        """A decode without prefill: `tokens` positions in `seconds`."""
        self.cost.add(tokens, seconds)
        self._timed += 1
        if self._timed % _REFIT_EVERY == 1:
            fit = self.cost.fit()
            # A fit without a fixed part (decodes of one size only) cannot weigh a guess.
            self._fit = fit if fit is not None and fit[0] > 0 and fit[1] > 0 else None

    def bar(self, decoding: int) -> float | None:
        """The chance of being kept at which a guess pays for its position with `decoding`
        requests in the step (its cost over a token's share of the step); None: the decode
        cost is not measured."""
        if self._fit is None:
            return None
        fixed, per_token = self._fit
        return per_token * decoding / (fixed + per_token * decoding)

    def paying(self, rate: float, decoding: int) -> int | None:
        """How many guesses in a row pay for their positions at `rate` with `decoding`
        requests in the step; None: the decode cost is not measured (no bound)."""
        bar = self.bar(decoding)
        return None if bar is None else self._guesses_over(rate, bar)

    def _guesses_over(self, rate: float, bar: float) -> int:
        """How many guesses in a row each keep a chance over `bar` at `rate`."""
        k, chance = 0, rate
        while k < self.config.draft_max and chance > bar:
            k += 1
            chance *= rate
        return k

    def wants(self, req: Request) -> bool:
        setting = req.params.speculate
        return self.config.enabled if setting is None else setting and self.config.draft_max > 0

    def draft(self, req: Request, room: int, decoding: int = 1) -> list[int]:
        """Up to `room` draft tokens for req's next step (none when it should not draft),
        `decoding` requests decoding in it."""
        if room <= 0 or not self.wants(req):
            return []
        state = self._states.get(req.request_id)
        if state is None:
            # Short first: a wrong guess costs a position; lengths double while guesses hold.
            state = self._states[req.request_id] = DraftState(self.make_drafter(self.config), 2)
        drafter = state.drafter
        paused = req.num_output_tokens < state.paused_until
        if paused and not isinstance(drafter, NgramDrafter):
            return []
        # Never draft past max_tokens: those positions could never be kept.
        k = min(room, state.length, req.params.max_tokens - req.num_output_tokens - 1)
        bar = self.bar(decoding)  # once: it decides both how many guesses and from what
        rate = state.rate((self.accepted + 1) / (self.tried + 2))
        pays = None if bar is None else self._guesses_over(rate, bar)
        if pays == 0 and not paused and req.num_output_tokens >= state.probe_at:
            pays = 1
            state.probe_at = req.num_output_tokens + _PROBE_EVERY
        if pays is not None:
            k = min(k, pays)
        if k <= 0:
            return []
        tokens = req.all_token_ids
        if not isinstance(drafter, NgramDrafter):
            return drafter.propose(tokens, k)
        # Where a guess costs little (one request decoding), a match of one token is worth
        # following: right after the output departs from what it copies, it guesses again
        # at the next token instead of ngram_min tokens later. Where the batch is wide, weak
        # guesses would lower the request's rate and with it the strong ones the gate admits.
        shortest = _CHEAP_NGRAM_MIN if bar is not None and bar < _CHEAP_BAR else None
        if paused:
            # Its guesses kept failing: it departed from what it was following. For a while
            # only a match longer than ngram_min counts, the sign it is copying again.
            shortest = self.config.ngram_min + 1
        # The longer match is the better evidence: a repeated request's own prompt may match
        # where its earlier answer, which it is repeating, matches longer.
        suffixes = drafter.suffixes(tokens)  # one set of keys for every table looked up
        own = drafter.propose_matched(tokens, k, suffixes, shortest)
        other = self.recent.propose(tokens, k, suffixes, shortest)
        return other[1] if other[0] > own[0] else own[1]

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.tried += accepted + (accepted < drafted)
        state = self._states.get(req.request_id)
        if state is not None:
            state.update(drafted, accepted, self.config.draft_max, req.num_output_tokens)

    def forget(self, req: Request) -> None:
        state = self._states.pop(req.request_id, None)
        if state is not None and isinstance(state.drafter, NgramDrafter):
            state.drafter.index_all(req.all_token_ids)
            self.recent.add(req.all_token_ids, state.drafter)
