"""N-gram speculation over the fake model: the drafter and draft lengths on their own, then the
engine with drafts that are right, wrong or half right, against the oracle of the same engine
without speculation (token for token, finish reason, logprobs, text)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from ferrum.engine.engine import LLMEngine
from ferrum.engine.request import Request
from ferrum.engine.speculation.ngram import NgramDrafter, RecentSequences
from ferrum.engine.speculation.pricing import KeepRates, StepCosts
from ferrum.engine.speculation.speculator import DraftState, SpecConfig, Speculator
from tests.factories import (
    EOS,
    FakeRunner,
    default_next_token,
    model_info,
    run_to_completion,
    sampling,
)


def test_the_drafter_follows_the_latest_longest_match():
    d = NgramDrafter(2, 4)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    # "1 2 3" last occurred at 4..6, followed by 8 5 1; a 3-gram match guesses 2 tokens
    assert d.propose(tokens, 3) == [8, 5]
    # "1 2 3 8" (a 4-gram) occurred at 4..7: three tokens, however many are asked for
    assert d.propose(tokens + [8], 5) == [5, 1, 2]
    assert d.propose(tokens + [8, 5], 1) == [1]
    assert NgramDrafter(2, 4).propose([1, 2, 3, 4], 3) == []  # no earlier occurrence
    # The suffix never matches itself, even after tables grew from a longer sequence.
    d2 = NgramDrafter(2, 2)
    assert d2.propose([7, 7], 4) == []
    assert d2.propose([7, 7, 7], 4) == [7]  # "7 7" at 0..1 was followed by one 7


def test_draft_lengths_adapt_and_pause_after_failures():
    state = DraftState(NgramDrafter(2, 3), length=2)
    state.update(drafted=2, accepted=2, draft_max=8, num_output=10)
    assert state.length == 4  # doubles while guesses hold
    state.update(drafted=4, accepted=4, draft_max=5, num_output=10)
    assert state.length == 5  # up to draft_max
    state.update(drafted=5, accepted=1, draft_max=8, num_output=12)
    assert state.length == 2
    for _ in range(4):
        state.update(drafted=2, accepted=0, draft_max=8, num_output=20)
    assert state.paused_until > 20


def test_a_request_whose_guesses_keep_failing_follows_only_long_matches_for_a_while():
    spec = Speculator(SpecConfig(ngram_min=2, ngram_max=6, draft_max=8))
    # The prompt holds "5 6 7 8 9" and "1 2"; the output has just written "1 2" then "5 6 7".
    req = Request("r", [5, 6, 7, 8, 9, 40, 1, 2, 30, 41, 42, 43, 44], sampling(max_tokens=500))
    assert spec.draft(req, 8) == []  # nothing to follow yet
    for _ in range(4):
        spec.verified(req, 2, 0)  # four drafts in a row refused: paused
    req.append_output(1)
    req.append_output(2)
    assert spec.draft(req, 8) == []  # "1 2" is only ngram_min long
    for token in (5, 6, 7):
        req.append_output(token)
    assert spec.draft(req, 8) == [8]  # "5 6 7" is longer: it is copying again
    for token in [0] * 38 + [1, 2]:  # the pause over: ngram_min again ("1 2" last
        req.append_output(token)  # went on with 5)
    assert spec.draft(req, 8) == [5]


# Decode milliseconds by positions as measured on 2 CPU cores: a second position costs nine
# tenths of a token, the third and fourth much less; between and past the sizes timed, lines.
CPU = {1: 10, 2: 19, 3: 24, 4: 28, 8: 40, 9: 48, 16: 70}
CHEAP = {n: 8 + 2 * n for n in range(1, 10)}  # a position costs a fifth of a token


def _measured(spec: Speculator, table: dict[int, float] = CPU) -> Speculator:
    for size, ms in table.items():
        spec.timed(size, ms / 1000)
    return spec


def test_step_costs_are_each_sizes_median_rising_and_lines_between():
    costs = StepCosts()
    assert costs.seconds(1) is None
    costs.add(1, 0.010)
    assert costs.seconds(1) is None  # one size: nothing to weigh a guess against
    costs.add(1, 0.500)  # an outlier: the median of 0.010, 0.500 and 0.010 holds
    costs.add(1, 0.010)
    costs.add(4, 0.028)
    costs.add(8, 0.040)
    assert costs.seconds(1) == 0.010 and costs.seconds(4) == 0.028
    assert costs.seconds(6) == pytest.approx(0.034)  # halfway from 4 to 8
    assert costs.seconds(15) == pytest.approx(0.040 + 7 * 0.003)  # the cheapest slope
    costs.add(6, 0.045)  # slower than 8 positions (noise): 8 costs at least as much
    assert costs.seconds(8) == 0.045 and costs.seconds(7) == 0.045


def test_a_step_takes_the_likeliest_guesses_that_give_it_the_most_tokens_per_second():
    """A step of d requests yields d tokens; each guess adds a position and its chance of
    being kept (all the guesses of its draft before it kept too). The step takes the m
    likeliest guesses of all drafts, m for the most expected tokens per second."""
    spec = Speculator(SpecConfig(draft_max=8))
    assert spec.paying(1, [[0.9]]) is None  # nothing timed: no bound
    _measured(spec)
    assert spec.paying(1, [[0.8]]) == [0]  # 1.8 tokens in 19 ms against 1 in 10: slower
    assert spec.paying(1, [[0.8, 0.64, 0.51]]) == [3]  # 2.95 in 28 ms: faster
    assert spec.paying(1, [[0.5, 0.25]]) == [0]
    likely = [0.99**j for j in range(1, 9)]
    assert spec.paying(1, [likely]) == [7]  # the 9th position costs 8 ms for 0.92 tokens
    assert spec.paying(8, [[0.95]]) == [0]  # 8 tokens in 40 ms; 8.95 in 48
    # Weighed together: one draft alone does not pay in a step of 8, eight do (8 tokens in
    # 40 ms, 15.9 in 70); the likeliest guesses go first, the first of each draft.
    assert spec.paying(8, [likely[:1]] * 8) == [1] * 8
    assert spec.paying(8, [likely[:1]] * 7 + [[0.4]]) == [1] * 7 + [0]
    assert spec.paying(8, [likely[:1]] * 8, limit=3) == [1, 1, 1, 0, 0, 0, 0, 0]


def test_keep_rates_are_by_match_length_and_a_guess_is_tried_at_its_own():
    rates = KeepRates(longest=6)
    assert rates.chance(3) == pytest.approx(0.8)  # hopeful before any evidence
    for _ in range(20):
        rates.record(3, tried=2, accepted=1)  # kept after 3 tokens, refused after 4
    assert rates.chance(3) > 0.9 and rates.chance(4) < 0.2
    assert rates.chance(5) == pytest.approx(0.8)  # never tried: a refusal ends a draft
    for _ in range(20):
        rates.record(9, tried=2, accepted=2)  # longer than 6: one rate for all of them
    assert rates.chance(6) == rates.chance(40) > 0.9
    assert rates.runs(3, 2) == pytest.approx([rates.chance(3), rates.chance(3) * rates.chance(4)])
    assert rates.likeliest() == max(rates.chance(n) for n in range(1, 7))


def test_a_request_that_beats_the_model_wide_rates_has_its_guesses_weighed_likelier():
    state = DraftState(NgramDrafter(2, 3), length=2)
    assert state.odds() == 1.0  # no record: the model's rates as they are
    for _ in range(10):
        state.scored(kept=4, tried=4, expected=3.2)  # all kept where 80% were expected
    assert state.odds() > 3
    rates = KeepRates(longest=6)
    assert rates.runs(3, 1, state.odds())[0] > 0.9 > rates.runs(3, 1)[0] == pytest.approx(0.8)
    for _ in range(10):
        state.scored(kept=0, tried=1, expected=0.8)  # then every first guess refused
    assert state.odds() < 0.5 and rates.runs(3, 1, state.odds())[0] < 0.7


def test_a_request_whose_guesses_do_not_pay_still_guesses_one_now_and_then():
    spec = _measured(Speculator(SpecConfig(ngram_min=1, ngram_max=2, draft_max=8)))
    req = Request("r", [5] * 30, sampling(max_tokens=500))  # every guess right: 5 follows 5
    sizes = []
    for _ in range(2 * 64):
        req.append_output(5)
        sizes.append(len(spec.draft(req, 8, decoding=8)))  # a wide step: nothing pays
    assert sizes.count(1) == 2 and set(sizes) == {0, 1}  # a probe every 64 tokens
    for _ in range(30):
        spec.rates.record(2, 1, 1)  # what the probes found: guesses here are kept
    assert spec.draft(req, 8, decoding=1) == [5]  # alone, a likely guess pays


def test_once_costs_are_timed_every_match_length_is_looked_up_and_its_rate_decides():
    """Before any cost is timed, guesses follow ngram_min and longer. After, a request that
    just departed from its prompt guesses from its last token alone, while one-token
    matches are kept often enough to pay."""
    config = SpecConfig(ngram_min=3, ngram_max=6, draft_max=8)

    def departed() -> Request:
        # The prompt holds 7 8 9 10 11 12 once; the output departed (99), then wrote 9.
        req = Request("r", [1, 2, 7, 8, 9, 10, 11, 12], sampling(max_tokens=500))
        for token in (99, 9):
            req.append_output(token)
        return req

    assert Speculator(config).draft(departed(), 8, decoding=1) == []  # ngram_min
    alone = _measured(Speculator(config), CHEAP)
    req = departed()
    assert alone.draft(req, 8, decoding=1) == [10]  # a one-token match: one guess
    req.append_output(10)  # kept: the two-token match 9 10 guesses two tokens
    alone.verified(req, 1, 1)
    assert alone.draft(req, 8, decoding=1) == [11, 12]
    picky = _measured(Speculator(config), CHEAP)
    for _ in range(20):
        picky.rates.record(1, 1, 0)  # one-token matches here are never kept
    req = departed()
    assert picky.draft(req, 8, decoding=1) == [10]  # a probe
    assert picky.draft(req, 8, decoding=1) == []
    # A drafter asked for its ngram_min only follows that, whatever its floor holds.
    assert NgramDrafter(3, 6, floor=1).propose([7, 8, 9, 5, 9], 4) == []
    assert NgramDrafter(3, 6, floor=1).propose_matched([7, 8, 9, 5, 9], 4, shortest=1) == (
        1,
        [5],
    )


def _finished(tokens: list[int]) -> NgramDrafter:
    d = NgramDrafter(2, 4)
    d.index_all(tokens)  # every n-gram, as a finished request's drafter has
    return d


def test_recent_sequences_continue_the_longest_match_the_newest_on_a_tie():
    recent = RecentSequences(max_sequences=3, max_tokens=100)
    older, newer = [1, 2, 3, 4, 5, 6], [9, 2, 3, 7, 8, 9]
    recent.add(older, _finished(older), "")
    recent.add(newer, _finished(newer), "")
    assert recent.propose([0, 2, 3], 4, "") == (2, [7])  # "2 3" in both: the newer one's sequel
    assert recent.propose([5, 9, 2, 3], 4, "") == (3, [7, 8])  # a 3-gram match: two tokens
    assert recent.propose([0, 4, 5], 4, "") == (2, [6])  # only in the older one
    assert recent.propose([1, 2, 3], 4, "") == (3, [4, 5])  # longer in the older one: it wins
    assert recent.propose([5, 6], 4, "") == (0, [])  # "5 6" ends its sequence: nothing follows
    assert recent.propose([0, 0, 0], 4, "") == (0, [])
    # Only a match longer than one already found counts; the guess is as long as before.
    assert recent.propose([5, 9, 2, 3], 4, "", above=2) == (3, [7, 8])
    assert recent.propose([5, 9, 2, 3], 4, "", above=3) == (0, [])


def test_recent_sequences_are_bounded_oldest_out():
    recent = RecentSequences(max_sequences=2, max_tokens=10)
    for base in (10, 20, 30):
        seq = [base, base + 1, base + 2, base + 3]
        recent.add(seq, _finished(seq), "")
    assert len(recent) == 2 and recent.propose([10, 11], 2, "") == (0, [])
    assert recent.propose([30, 31], 2, "") == (2, [32])
    long = list(range(100, 111))
    recent.add(long, _finished(long), "")  # longer than the whole bound: not kept
    assert len(recent) == 2 and recent.propose([100, 101], 2, "") == (0, [])
    seq = list(range(40, 47))
    recent.add(seq, _finished(seq), "")  # 7 tokens: 4 + 7 > 10, so the oldest goes
    assert len(recent) == 1


def test_one_scopes_flood_of_finished_requests_keeps_another_scopes_sequence():
    """The attack: key A finishes request after request; key B's regeneration should still
    follow B's earlier answer. With one bound for all scopes A's flood pushed B's sequence
    out (B's speculation slower: a cost A imposes on B); each scope now keeps its own newest
    up to the bound, and the total stays within `max_total_tokens`."""
    mine = [1, 2, 3, 4, 5, 6]

    def flooded(recent: RecentSequences) -> RecentSequences:
        recent.add(mine, _finished(mine), "key:b")
        for base in range(100, 1000, 10):  # A's flood, in one scope
            seq = [base + i for i in range(8)]
            recent.add(seq, _finished(seq), "key:a")
        return recent

    mine_again = [9, 2, 3, 4]  # "2 3 4" was followed by "5 6" in B's answer
    assert flooded(RecentSequences(max_sequences=2, max_tokens=20)).propose(
        mine_again, 4, "key:b"
    ) == (3, [5, 6])
    recent = flooded(RecentSequences(max_sequences=2, max_tokens=20, max_total_tokens=60))
    assert recent.propose(mine_again, 4, "key:b") == (3, [5, 6])
    assert recent.held("key:a") == 2 and recent.held("key:b") == 1
    assert recent.propose([990, 991], 4, "key:a") == (2, [992])  # A's newest kept
    assert recent.propose([100, 101], 4, "key:a") == (0, [])  # A's oldest gone, its own
    # A's flood over many scopes (a cache_salt each): memory stays bounded, and the scope
    # holding the most tokens is trimmed first: A's own, while it holds more than B.
    for salt in range(50):
        seq = [2000 + salt, 3000 + salt, 4000 + salt, 5000 + salt, 6000 + salt, 7000 + salt]
        recent.add(seq, _finished(seq), f"salt:{salt}")
        assert recent.tokens <= 60 and len(recent) <= 10
        if salt == 7:  # 22 + 8 * 6 tokens offered: A's two sequences went, B's stayed
            assert recent.held("key:a") == 0 and recent.held("key:b") == 1
    # Once every scope holds as little as B, the oldest goes (B's): the bound is per scope,
    # and a key with many salts is many scopes. B's next finished request is kept again.
    recent.add(mine, _finished(mine), "key:b")
    assert recent.propose(mine_again, 4, "key:b") == (3, [5, 6])


def test_the_longer_match_guesses_whether_own_or_recent():
    spec = Speculator(SpecConfig(ngram_min=2, ngram_max=4))
    done = Request("a", [1, 2, 3, 4, 5, 6, 7], sampling(max_tokens=50))
    spec.draft(done, 8)
    spec.forget(done)  # finished: its tokens join the recent ones
    # Own tokens: "4 5" was followed by 8 (a 2-gram); the finished one: "3 4 5" by 6 7.
    assert spec.draft(Request("b", [4, 5, 8, 3, 4, 5], sampling(max_tokens=50)), 8) == [6, 7]
    # Own tokens match longer ("8 4 5" by 9): own wins.
    assert spec.draft(Request("c", [8, 4, 5, 9, 8, 4, 5], sampling(max_tokens=50)), 8) == [9, 8]


def test_only_recent_sequences_of_the_requests_own_scope_are_followed():
    """Output would not change (guesses are verified), but a guess from another key's answer
    being kept would make that answer faster to write: its text readable by timing."""
    spec = Speculator(SpecConfig(ngram_min=2, ngram_max=4))
    done = Request("a", [1, 2, 3, 4, 5, 6, 7], sampling(max_tokens=50, cache_scope="key:a"))
    spec.draft(done, 8)
    spec.forget(done)
    prompt = [4, 5, 8, 3, 4, 5]  # "3 4 5" was followed by "6 7" in a's tokens
    other = Request("b", prompt, sampling(max_tokens=50, cache_scope="key:b"))
    assert spec.draft(other, 8) == [8]  # its own tokens only: "4 5" was followed by 8
    same = Request("c", prompt, sampling(max_tokens=50, cache_scope="key:a"))
    assert spec.draft(same, 8) == [6, 7]


def test_a_match_of_ngram_max_is_measured_back_so_a_regeneration_follows_its_answer():
    """A prompt that holds "1 2 3 4" twice, asked again: its own tokens match that 4-gram
    (ngram_max) at the prompt's start and no further back; the finished run of the same
    prompt matches all 12 tokens, so its answer is the guess."""
    prompt = [1, 2, 3, 4, 70, 50, 51, 52, 1, 2, 3, 4]
    answer = [60, 61, 62]
    own = NgramDrafter(2, 4)
    assert own.propose_matched(prompt, 8) == (4, [70, 50, 51])
    recent = RecentSequences()
    recent.add(prompt + answer, _finished(prompt + answer), "")
    assert recent.propose(prompt, 8, "") == (12, [60, 61, 62])  # 12 long: as many as there are
    spec = Speculator(SpecConfig(ngram_min=2, ngram_max=4))
    spec.recent = recent
    assert spec.draft(Request("again", prompt, sampling(max_tokens=50)), 8) == [60, 61]
    # Measured in doubling steps: a run that breaks inside a step counts up to that step.
    broken = [9, 8, 7, 1, 2, 3, 4, 5, 6, 8, 7, 1, 2, 3, 4]  # 6 long; the step of 3 breaks
    assert NgramDrafter(2, 4).propose_matched(broken, 2) == (4, [5, 6])
    long = list(range(100, 700))  # a run of 300: measured up to 256
    assert NgramDrafter(2, 4).propose_matched(long + long[:300], 1) == (256, [400])


def _repeat(recent: int) -> tuple[dict, dict, int]:
    """The same prompt twice, one after the other: both outputs and the guesses kept for the
    second."""
    runner = FakeRunner(info=model_info(n_ctx=512, n_batch=32, n_seq_max=8))
    spec = SpecConfig(ngram_min=2, ngram_max=4, recent=recent)
    engine = LLMEngine(runner, block_size=8, max_running=2, speculation=spec)
    assert engine.speculator is not None
    prompt = [256, *b"seed 17:"]
    engine.add_request("a", prompt, sampling(max_tokens=40))
    first = run_to_completion(engine)
    before = engine.speculator.accepted
    engine.add_request("b", prompt, sampling(max_tokens=40))
    second = run_to_completion(engine)
    return first["a"], second["b"], engine.speculator.accepted - before


def test_a_repeated_request_guesses_from_the_earlier_answer():
    """The second time, its own tokens hold no match, but the first answer does: most tokens
    come from kept guesses (3 a step with 4-grams), and the output is the same."""
    first, second, kept = _repeat(recent=8)
    assert second["tokens"] == first["tokens"]
    assert kept >= 25
    _, alone, kept_alone = _repeat(recent=0)  # --spec-recent 0: its own tokens only
    assert alone["tokens"] == first["tokens"] and kept_alone < 5


class OracleDrafter:
    """Guesses from the fake model itself: the true next tokens, corrupted at a random
    position (or not at all), so every acceptance length is exercised."""

    def __init__(self, rng: random.Random, next_token=default_next_token):
        self.rng = rng
        self.next_token = next_token

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        history, out = list(tokens), []
        for _ in range(k):
            history.append(self.next_token(history))
            out.append(history[-1])
        wrong = self.rng.randrange(k + 2)  # k or more: all right
        if wrong < k:
            out[wrong] = (out[wrong] + 1) % 256
        return out


def _engine(runner: FakeRunner, spec: bool, seed: int = 0) -> LLMEngine:
    rng = random.Random(seed)
    config = SpecConfig(draft_max=6, batch_max=12) if spec else None
    return LLMEngine(
        runner, block_size=8, max_running=4, speculation=config,
        drafter=lambda c: OracleDrafter(rng, runner.next_token),
    )  # fmt: skip


def _run(spec: bool, requests: dict, runner_kw: dict | None = None, seed: int = 0) -> dict:
    """Per request: (tokens, content, finish reason, stop string, logprob tokens)."""
    runner = FakeRunner(info=model_info(n_ctx=512, n_batch=32, n_seq_max=8), **(runner_kw or {}))
    engine = _engine(runner, spec, seed)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, list] = {rid: [[], "", None, None, []] for rid in requests}
    while engine.has_work:
        for o in engine.step():
            r = got[o.request_id]
            r[0] += o.token_ids
            r[1] += o.content
            r[4] += [e.token for e in o.logprobs or ()]
            if o.finished:
                r[2], r[3] = o.finish_reason, o.stop_string
        engine.check_integrity()
    if spec:
        assert engine.speculator is not None and engine.speculator.drafted > 0
    for parked in engine.kv_manager.parked:  # no guess left behind in a parked sequence
        assert len(runner.kv[parked.seq_id]) == len(parked.all_token_ids)
    return {rid: tuple(r) for rid, r in got.items()}


@pytest.mark.parametrize("seed", range(6))
def test_greedy_output_is_the_same_with_and_without_drafts(seed):
    rng = random.Random(seed)
    requests = {
        f"r{i}": ([256, *rng.choices(b"ab c", k=rng.randrange(1, 40))],
                  sampling(max_tokens=rng.randrange(1, 60)))
        for i in range(6)
    }  # fmt: skip
    assert _run(True, requests, seed=seed) == _run(False, requests)


def test_a_stop_string_inside_an_accepted_run_cuts_there():
    prompt = [256, *b"abc"]
    plain = _run(False, {"r": (prompt, sampling(max_tokens=40))})["r"]
    text = plain[1]
    stop = text[10:12]  # a stop string the output reaches in its middle
    params = sampling(max_tokens=40, stop=(stop,))
    with_spec = _run(True, {"r": (prompt, params)})["r"]
    assert with_spec == _run(False, {"r": (prompt, params)})["r"]
    assert with_spec[3] == stop and with_spec[1] == text[: text.index(stop)]


def test_end_of_generation_and_max_tokens_inside_a_run():
    def ends(cells: Sequence[int]) -> int:
        return EOS if len(cells) >= 20 else default_next_token(cells)

    kw = {"next_token": ends}
    requests = {
        "eos": ([256, *b"ab"], sampling(max_tokens=50)),
        "cap": ([256, *b"xyz"], sampling(max_tokens=7)),
        "logprobs": ([256, *b"q"], sampling(max_tokens=12, logprobs=2)),
    }
    spec = _run(True, requests, kw)
    assert spec == _run(False, requests, kw)
    assert spec["eos"][2].value == "stop" and len(spec["cap"][0]) == 7
    assert spec["logprobs"][4] == spec["logprobs"][0]  # one entry per token kept


def test_a_request_can_turn_speculation_off_and_parked_kv_holds_no_guesses():
    runner = FakeRunner(info=model_info(n_ctx=512, n_batch=32, n_seq_max=8))
    engine = _engine(runner, spec=True)
    engine.add_request("off", [256, *b"abc"], sampling(max_tokens=20, speculate=False))
    run_to_completion(engine)
    assert engine.speculator is not None and engine.speculator.drafted == 0
    engine.add_request("on", [256, *b"abd"], sampling(max_tokens=20, stop=("zz",)))
    run_to_completion(engine)
    # Parked sequences hold exactly their tokens' positions: guesses were rolled back.
    for parked in engine.kv_manager.parked:
        assert len(runner.kv[parked.seq_id]) == len(parked.all_token_ids)


def test_metrics_count_guesses_and_kept_ones():
    from ferrum.metrics import Metrics

    runner = FakeRunner(info=model_info(n_ctx=512, n_batch=32, n_seq_max=8))
    metrics = Metrics()
    rng = random.Random(1)
    engine = LLMEngine(
        runner, block_size=8, observer=metrics, speculation=SpecConfig(draft_max=4),
        drafter=lambda c: OracleDrafter(rng, runner.next_token),
    )  # fmt: skip
    engine.add_request("r", [256, *b"abc"], sampling(max_tokens=30))
    run_to_completion(engine)
    spec = metrics.snapshot()["speculation"]
    assert spec["draft_tokens"] == engine.speculator.drafted > spec["accepted_tokens"] > 0
    assert spec["verifications"] > 0
    text = metrics.render().decode()
    assert "ferrum_spec_accepted_tokens_total" in text and "ferrum_spec_draft_tokens_total" in text


def test_with_a_stream_per_sequence_only_a_lone_decode_guesses():
    """--kv-streams: llama.cpp puts only rows of equal length from several streams into one
    micro-batch, so a guess beside another decode would cost a pass of its own."""
    info = model_info(n_ctx=512, n_ctx_seq=128, kv_streams=True, n_batch=32, n_seq_max=4)
    runner = FakeRunner(info=info)
    engine = _engine(runner, spec=True)
    widths: list[tuple[int, int]] = []  # (decoding rows, rows with guesses) per step
    execute = runner.execute

    def seen(items):
        decodes = [i for i in items if i.sample_for is not None]
        widths.append((len(decodes), sum(1 for i in decodes if i.draft)))
        return execute(items)

    runner.execute = seen  # type: ignore[method-assign]
    engine.add_request("a", [256, *b"abc"], sampling(max_tokens=20))
    engine.add_request("b", [256, *b"xyz"], sampling(max_tokens=40))
    got = run_to_completion(engine)
    assert all(drafted == 0 for rows, drafted in widths if rows > 1)
    assert any(drafted for rows, drafted in widths if rows == 1)  # b alone, after a ended
    plain = FakeRunner(info=info)
    alone = _engine(plain, spec=False)
    alone.add_request("a", [256, *b"abc"], sampling(max_tokens=20))
    alone.add_request("b", [256, *b"xyz"], sampling(max_tokens=40))
    want = run_to_completion(alone)
    assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in want.items()}
