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
`ngram_max` down to `ngram_min`, down to one token once decode costs are timed) of the
sequence's last n tokens and proposes what followed it, as many tokens as the match is
longer than the shortest looked up (plus one). The same lookup runs over the model's latest
finished requests of its own cache scope (`RecentSequences`: a regeneration or a retry
repeats an earlier answer; another key's answer would be read back by timing), and the longer
of the two matches gives the guess; a match of `ngram_max` tokens is measured further back,
so an answer regenerated from the same prompt follows its earlier run, not a few lines of its
own prompt. Lengths adapt per request (`DraftState`): a draft starts at 2
tokens, doubles after a full acceptance, shrinks to what was accepted plus one otherwise,
and a request whose drafts keep failing follows only matches longer than `ngram_min` for a
while. A guess must also pay for its position: the length of the match it follows says how
likely it is to be kept (`KeepRates`, learned per model, weighed by the request's own record
against them), the decodes timed so far what its position costs (`StepCosts`), and the step
takes the likeliest guesses of all its requests, as many as give it the most tokens per
second (`Speculator`), so on one stream likely guesses go in and where the batch is already
wide only the likeliest. Across the step, `batch_max` bounds the draft tokens of all
requests together.

Off for recurrent and hybrid models (their state cannot drop the rejected positions).
On sliding-window models (Gemma 3) a rollback is safe, by how llama.cpp's window cache picks
cells (vendored llama-kv-cache.cpp, `find_slot`): while placing a micro-batch it may take over
a cell whose only owner's newest position *before that micro-batch* is `n_swa` or more past
it. A draft `[last, d1 … dk]` goes into one micro-batch (n_ubatch = n_batch, and a step is
never split inside one request's tokens), so the cells it displaces lie at or below
`m + 1 - n_swa` for the sequence's newest position m before the step; after the rollback to
an accepted position a ≥ m, the next token at a + 1 attends back to `a + 2 - n_swa` > that.
The window it needs is never among what its own draft displaced. Where a step takes several
llama_decode calls (a long prefill apart, `decode_parts.py`, or a "no KV slot" split), each
call's rejected guesses are removed before the next call is placed, so no later micro-batch
sees the draft's newest position. (The sliding-window state machine checks both the tokens
and the window on tiny Gemma 3 with a window of 8, also with most steps split.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ferrum.config import EngineConfig
from ferrum.engine.request import Request
from ferrum.engine.speculation.ngram import NgramDrafter, RecentSequences
from ferrum.engine.speculation.pricing import KeepRates, StepCosts

_FAILS_BEFORE_PAUSE = 4  # drafts in a row with nothing accepted
_PAUSE_TOKENS = 32  # tokens generated after that following long matches only
_PROBE_EVERY = 64  # output tokens between single guesses while none pays (to re-measure)
_SHORTEST_MATCH = 1  # once decode costs are measured, matches this short are looked up
# A request's own record of kept guesses against what the model-wide KeepRates expected:
# each draft weighs the older ones down by _OWN_DECAY; see DraftState.odds for _OWN_PRIOR.
_OWN_DECAY = 0.9
_OWN_PRIOR = 1.0


@dataclass(frozen=True)
class SpecConfig:
    """--spec-type and its bounds."""

    kind: str = "ngram"  # "ngram" or "none"
    draft_max: int = 8
    ngram_min: int = 3
    ngram_max: int = 12
    batch_max: int = 16  # draft tokens of all requests in one step
    recent: int = 8  # finished requests kept to guess from, per scope (RecentSequences)

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
    """One request's drafter, how long its drafts currently are, the match its pending draft
    follows, and its record of kept guesses against the model-wide rates."""

    drafter: Drafter
    length: int
    fails: int = 0
    paused_until: int = 0  # output length before which only long matches are followed
    probe_at: int = 0  # output length of the next single guess while none pays
    match: int = 0  # length of the n-gram match the pending draft follows (0: not known)
    kept: float = 0.0  # its guesses kept, older drafts counting less (_OWN_DECAY)
    tried: float = 0.0  # its guesses tried (each kept one and the first refused)
    expected: float = 0.0  # how many of those the model-wide rates expected kept

    def odds(self) -> float:
        """How much likelier than the model-wide rates say its guesses are kept: the odds of
        its own record (kept against refused) over the odds those rates expected, each
        drawn towards 1 by _OWN_PRIOR guesses of each kind."""
        refused, expected_refused = self.tried - self.kept, self.tried - self.expected
        own = (self.kept + _OWN_PRIOR) / (refused + _OWN_PRIOR)
        return own * (expected_refused + _OWN_PRIOR) / (self.expected + _OWN_PRIOR)

    def scored(self, kept: int, tried: int, expected: float) -> None:
        self.kept = self.kept * _OWN_DECAY + kept
        self.tried = self.tried * _OWN_DECAY + tried
        self.expected = self.expected * _OWN_DECAY + expected

    def update(self, drafted: int, accepted: int, draft_max: int, num_output: int) -> None:
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
class Proposal:
    """One request's guess for the step, before the step's drafts are cut."""

    guess: list[int]
    runs: list[float]  # for j = 1..len(guess): the chance the first j are all kept
    match: int  # length of the n-gram match it follows (0: not an n-gram guess)
    probe: bool  # a single guess may go in even if none pays


_NO_PROPOSAL = Proposal([], [], 0, False)


def _tokens_only(guess: list[int]) -> list[int]:
    """The guess up to the first image position it copied (an id < 0, `image_token_ids`):
    an image's ids are no vocabulary's tokens, and llama_decode refuses them."""
    for i, token in enumerate(guess):
        if token < 0:
            return guess[:i]
    return guess


@dataclass
class Speculator:
    """Drafts for the scheduler, verification results from the engine, and the totals.

    A guess goes in only where it raises the step's expected tokens per second. The step's
    seconds come from the decodes timed so far (`StepCosts`, by number of positions); each
    guess adds a position and, with its chance of being kept (`KeepRates`, by the match it
    follows), tokens. Every decoding request proposes its guess first; the step then takes
    the likeliest guesses across all of them, as many as give it the most tokens per second
    (`paying`), so on one stream a likely guess pays and on a wide batch only the likeliest
    do, and a cost curve that is not a line (a dear second position, cheap ones after) is
    weighed as a whole. Until two sizes of decode are timed nothing bounds a guess but
    ngram_min and the request's draft length. While no guess pays, a request still guesses
    one token every _PROBE_EVERY tokens, so the rates follow what is written."""

    config: SpecConfig
    make_drafter: Callable[[SpecConfig], Drafter] = lambda c: NgramDrafter(
        c.ngram_min, c.ngram_max, floor=_SHORTEST_MATCH
    )
    drafted: int = 0
    accepted: int = 0
    costs: StepCosts = field(default_factory=StepCosts)
    rates: KeepRates = field(init=False)
    _states: dict[str, DraftState] = field(default_factory=dict)
    recent: RecentSequences = field(init=False)

    def __post_init__(self) -> None:
        self.recent = RecentSequences(max_sequences=self.config.recent)
        self.rates = KeepRates(self.config.ngram_max)

    def timed(self, tokens: int, seconds: float) -> None:
        """A decode without prefill: `tokens` positions in `seconds`."""
        self.costs.add(tokens, seconds)

    def paying(
        self, decoding: int, runs: Sequence[Sequence[float]], limit: int | None = None
    ) -> list[int] | None:
        """How many guesses of each draft go into a step of `decoding` requests (runs[i][j-1]:
        the chance that the first j guesses of the i-th draft are all kept), at most `limit` in
        all, for the most expected tokens per second; None: decode costs are not measured.
        Within a draft the chances fall, so the likeliest m guesses of the step are the
        first few of each draft."""
        now = self.costs.seconds(decoding)
        if now is None:
            return None
        guesses = [(c, i) for i, run in enumerate(runs) for c in run]
        ranked = sorted(guesses, key=lambda g: (-g[0], g[1]))[:limit]  # likeliest first
        best, best_rate, tokens = 0, decoding / now, float(decoding)
        for m, (chance, _) in enumerate(ranked, 1):
            tokens += chance
            secs = self.costs.seconds(decoding + m)
            if secs is not None and tokens / secs > best_rate:
                best, best_rate = m, tokens / secs
        counts = [0] * len(runs)
        for _, i in ranked[:best]:
            counts[i] += 1
        return counts

    def wants(self, req: Request) -> bool:
        setting = req.params.speculate
        return self.config.enabled if setting is None else setting and self.config.draft_max > 0

    def plan(
        self,
        reqs: Sequence[Request],
        room: int,
        limit: int | None = None,
        decoding: int | None = None,
    ) -> list[list[int]]:
        """Draft tokens for each of a step's decoding requests: up to `room` each and `limit`
        in all (none for a request that should not draft); `decoding`: the requests decoding
        in the step (default: these)."""
        width = max(len(reqs), decoding or 0)
        measured = self.costs.seconds(width) is not None
        hopeless = measured and self._hopeless(width, len(reqs), room, limit)
        proposals = [self._propose(req, room, measured, hopeless) for req in reqs]
        counts = self.paying(width, [p.runs for p in proposals], limit)
        if counts is None:  # no bound but the draft lengths
            counts = [len(p.guess) for p in proposals]
        drafts, left = [], limit
        for req, p, n in zip(reqs, proposals, counts, strict=True):
            state = self._states.get(req.request_id)
            if n == 0 and p.probe and p.guess and state is not None:
                n = 1
                state.probe_at = req.num_output_tokens + _PROBE_EVERY
            if left is not None:
                n = min(n, left)
                left -= n
            if state is not None:
                state.match = p.match if n else 0
            drafts.append(p.guess[:n])
        return drafts

    def _hopeless(self, width: int, drafting: int, room: int, limit: int | None) -> bool:
        """Not worth a lookup: even `drafting` drafts of guesses as likely as the likeliest
        would not pay in a step of `width`."""
        best = self.rates.likeliest()
        likeliest = [best**j for j in range(1, min(room, self.config.draft_max) + 1)]
        return not any(self.paying(width, [likeliest] * drafting, limit) or ())

    def draft(self, req: Request, room: int, decoding: int = 1) -> list[int]:
        """Up to `room` draft tokens for req's next step, with `decoding` requests decoding in
        it and none of the others drafting."""
        return self.plan([req], room, decoding=decoding)[0]

    def _propose(self, req: Request, room: int, measured: bool, hopeless: bool) -> Proposal:
        """req's guess for the step, as long as its drafter and draft length allow."""
        if room <= 0 or not self.wants(req):
            return _NO_PROPOSAL
        state = self._states.get(req.request_id)
        if state is None:
            # Short first: a wrong guess costs a position; lengths double while guesses hold.
            state = self._states[req.request_id] = DraftState(self.make_drafter(self.config), 2)
        state.match = 0
        drafter = state.drafter
        paused = req.num_output_tokens < state.paused_until
        if paused and not isinstance(drafter, NgramDrafter):
            return _NO_PROPOSAL
        # Never draft past max_tokens: those positions could never be kept.
        k = min(room, state.length, req.params.max_tokens - req.num_output_tokens - 1)
        probe = not paused and req.num_output_tokens >= state.probe_at
        if k <= 0 or (hopeless and not probe):
            return _NO_PROPOSAL
        tokens = req.all_token_ids
        if not isinstance(drafter, NgramDrafter):
            guess = _tokens_only(drafter.propose(tokens, k))
            return Proposal(guess, [self.rates.likeliest()] * len(guess), 0, False)
        # Once costs are measured, every match length is looked up and its own rate decides;
        # before, only ngram_min and longer. A request whose guesses kept failing departed
        # from what it followed: for a while only a match longer than ngram_min counts.
        shortest = _SHORTEST_MATCH if measured else None
        if paused:
            shortest = self.config.ngram_min + 1
        # The longer match is the better evidence: a repeated request's own prompt may match
        # where its earlier answer, which it is repeating, matches longer.
        suffixes = drafter.suffixes(tokens)  # one set of keys for every table looked up
        own = drafter.propose_matched(tokens, k, suffixes, shortest)
        other = self.recent.propose(tokens, k, req.cache_scope, suffixes, shortest, own[0])
        match, guess = other if other[0] > own[0] else own
        guess = _tokens_only(guess)
        return Proposal(guess, self.rates.runs(match, len(guess), state.odds()), match, probe)

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        state = self._states.get(req.request_id)
        if state is not None:
            if state.match:
                tried = min(drafted, accepted + 1)  # each kept guess and the first refused
                state.scored(accepted, tried, self.rates.record(state.match, tried, accepted))
            state.update(drafted, accepted, self.config.draft_max, req.num_output_tokens)

    def forget(self, req: Request) -> None:
        state = self._states.pop(req.request_id, None)
        if state is not None and isinstance(state.drafter, NgramDrafter):
            state.drafter.index_all(req.all_token_ids)
            self.recent.add(req.all_token_ids, state.drafter, req.cache_scope)
