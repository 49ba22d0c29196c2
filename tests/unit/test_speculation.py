"""N-gram speculation over the fake model: the drafter and draft lengths on their own, then the
engine with drafts that are right, wrong or half right, against the oracle of the same engine
without speculation (token for token, finish reason, logprobs, text)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from ferrum.engine.engine import LLMEngine
from ferrum.engine.ngram import NgramDrafter, RecentSequences
from ferrum.engine.request import Request
from ferrum.engine.speculation import KeptChances, SpecConfig, Speculator
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
    # "1 2 3" last occurred at 4..6, followed by 8 5 1 2 3
    assert d.propose_matched(tokens, 3) == (3, [8, 5, 1])
    # "1 2 3 8" (a 4-gram) occurred at 4..7
    assert d.propose_matched(tokens + [8], 5) == (4, [5, 1, 2, 3, 8])
    assert d.propose(tokens + [8, 5], 1) == [1]
    assert NgramDrafter(2, 4).propose([1, 2, 3, 4], 3) == []  # no earlier occurrence
    # The suffix never matches itself, even after tables grew from a longer sequence.
    d2 = NgramDrafter(2, 2)
    assert d2.propose([7, 7], 4) == []
    assert d2.propose([7, 7, 7], 4) == [7]  # "7 7" at 0..1 was followed by one 7
    assert NgramDrafter(3, 6).propose([7, 8, 9, 5, 9], 4) == []  # shorter than ngram_min
    assert NgramDrafter(1, 6).propose_matched([7, 8, 9, 5, 9], 4) == (1, [5, 9])


def test_chances_are_learned_per_class_of_match_length():
    kept = KeptChances(4)
    assert kept.chances(0, 3) == [0.5, 0.25, 0.125]  # no evidence: even odds a token
    for _ in range(60):
        kept.record(0, 0, 1)  # one-token matches: the first token wrong
        kept.record(KeptChances.of_match(30), 4, 4)  # long matches: all four right
    assert kept.chances(0, 1)[0] < 0.05
    assert kept.chances(KeptChances.of_match(24), 4)[-1] > 0.85
    assert KeptChances.of_match(30) == KeptChances.of_match(24) != KeptChances.of_match(12)
    assert KeptChances.of_match(None) not in {KeptChances.of_match(n) for n in range(1, 99)}
    # Compared in part (the request wrote two tokens so far, both right): no verdict on the
    # third yet. Without evidence of its own, a token holds as often as the one before it.
    before = kept.chances(2, 3)
    kept.record(2, 2, 2)
    after = kept.chances(2, 3)
    assert after[0] > before[0]
    assert after[2] / after[1] == pytest.approx(after[1] / after[0])
    # A class without evidence starts where the class of shorter matches stands.
    assert kept.chances(1, 1) == pytest.approx(kept.chances(0, 1))
    assert kept.chances(KeptChances.of_match(48), 1)[0] > 0.9  # above 24+, never seen


def test_a_requests_own_record_moves_its_chances_away_from_the_models():
    """Across the server, guesses after matches of this class held one token (prose); this
    request's all held (it is copying): its chances follow its own record."""
    model = KeptChances(4)
    for _ in range(60):
        model.record(3, 1, 2)
    own = KeptChances(4, decay=0.9)
    assert model.chances(3, 2, own) == model.chances(3, 2)  # no record of its own yet
    for _ in range(20):
        own.record(3, 4, 4)
    assert model.chances(3, 2)[1] < 0.1 < 0.6 < model.chances(3, 2, own)[1]


# What a decode of n positions took on 2 Zen 3 cores (ms): a second position costs 75% of
# a first; tiles make 3 positions cost nearly 4, and 7 nearly 8.
ZEN3_MS = {1: 17.6, 2: 30.9, 3: 43.8, 4: 46.2, 5: 55.9, 6: 61.5, 7: 76.8, 8: 77.2, 9: 92.3}


def _timed(spec: Speculator, table: dict[int, float]) -> None:
    for _ in range(3):
        for positions, ms in table.items():
            spec.timed(positions, ms / 1000)


def test_a_step_takes_the_guesses_that_make_its_tokens_per_second_highest():
    """A lone request's j-th token kept with chance rate**j; each size priced as timed."""
    spec = Speculator(SpecConfig(draft_max=8))
    chances = {rate: [rate**j for j in range(1, 9)] for rate in (0.7, 0.8, 0.9, 0.95)}
    assert spec._worth(1, chances[0.7]) == 8  # nothing timed: every guess goes in
    _timed(spec, ZEN3_MS)
    assert spec.sizes.seconds(2) == pytest.approx(0.0309)
    assert spec._worth(1, chances[0.7]) == 0  # 1.7 tokens in 30.9 ms < 1 in 17.6
    assert spec._worth(1, chances[0.8]) == 3  # 4 positions cost little more than 3
    assert spec._worth(1, chances[0.9]) == 5
    assert spec._worth(1, chances[0.95]) == 7  # 8 positions, not 9 (15 ms more)
    # A wide batch (a straight line: 6 ms + 5 a position) already pays for its positions:
    # only its likeliest guesses go in.
    wide = Speculator(SpecConfig())
    _timed(wide, {n: 6 + 5 * n for n in range(1, 30)})
    for rate in (0.5, 0.7, 0.9, 0.97):
        counts = [wide._worth(d, [rate**j for j in range(1, 9)]) for d in (1, 2, 4, 8)]
        assert counts == sorted(counts, reverse=True)
    assert wide._worth(8, [0.97**j for j in range(1, 9)]) == 3


def test_before_wider_decodes_are_timed_a_position_is_priced_at_half_a_decode():
    spec = Speculator(SpecConfig())
    assert spec.sizes.seconds(3) is None
    for _ in range(9):
        spec.timed(1, 0.02)  # one size only: the line has no fixed part
    assert spec.sizes.seconds(1) == pytest.approx(0.02)
    assert spec.sizes.seconds(3) == pytest.approx(0.04)
    assert spec._worth(1, [0.6]) == 1  # 1.6 tokens for 1.5 decodes: wider sizes get timed


def _copying(rid: str, max_tokens: int = 500) -> Request:
    """A request whose prompt holds 0 … 39 twice: it has just begun writing it a third time."""
    return Request(rid, list(range(40)) * 2 + [0, 1, 2, 3], sampling(max_tokens=max_tokens))


def test_guesses_that_were_not_drafted_still_teach_their_chances():
    """A guess too unlikely to go in is still compared with what the request then writes: a
    request that keeps writing what its guesses said soon drafts them."""
    spec = Speculator(SpecConfig(draft_max=4))
    _timed(spec, ZEN3_MS)  # even odds do not pay here
    req = _copying("r")
    drafts = []
    for _ in range(30):
        drafted = spec.plan([req], 16).get("r", [])
        drafts.append(len(drafted))
        req.append_output((req.all_token_ids[-1] + 1) % 40)  # it goes on copying
    assert drafts[0] == 0 and drafts[-1] == 4
    assert spec.drafted == 0  # nothing verified: the chances came from comparing alone


def test_a_step_ranks_guesses_across_requests_and_keeps_each_in_order():
    spec = Speculator(SpecConfig(draft_max=4, batch_max=16))
    spec.kept = KeptChances(4)
    for _ in range(60):
        spec.kept.record(KeptChances.of_match(24), 4, 4)  # long matches hold
        spec.kept.record(KeptChances.of_match(1), 0, 1)  # one-token ones do not

    def step(room: int) -> dict[str, list[int]]:  # two fresh requests
        for req in requests:
            spec.forget(req)
        return spec.plan(requests, room)

    weak = Request("weak", [5, 6, 7, 5], sampling(max_tokens=500))  # a one-token match
    requests = [weak, _copying("strong")]

    assert step(16) == {"strong": [4, 5, 6, 7], "weak": [6, 7, 5]}  # nothing timed: all
    assert step(5) == {"strong": [4, 5, 6, 7], "weak": [6]}  # the likeliest first
    _timed(spec, ZEN3_MS)
    assert step(16) == {"strong": [4, 5, 6, 7]}
    capped = _copying("capped", max_tokens=3)  # never guessed past max_tokens
    assert spec.plan([capped], 16) == {"capped": [4, 5]}
    off = Request("off", _copying("x").prompt_token_ids, sampling(speculate=False))
    assert spec.plan([off], 16) == {}


def _finished(tokens: list[int]) -> NgramDrafter:
    d = NgramDrafter(2, 4)
    d.index_all(tokens)  # every n-gram, as a finished request's drafter has
    return d


def test_recent_sequences_continue_the_longest_match_the_newest_on_a_tie():
    recent = RecentSequences(max_sequences=3, max_tokens=100)
    older, newer = [1, 2, 3, 4, 5, 6], [9, 2, 3, 7, 8, 9]
    recent.add(older, _finished(older))
    recent.add(newer, _finished(newer))
    assert recent.propose([0, 2, 3], 4) == (2, [7, 8, 9])  # "2 3" in both: the newer's sequel
    assert recent.propose([5, 9, 2, 3], 2) == (3, [7, 8])  # a 3-gram match
    assert recent.propose([0, 4, 5], 4) == (2, [6])  # only in the older one
    assert recent.propose([1, 2, 3], 4) == (3, [4, 5, 6])  # longer in the older one: it wins
    assert recent.propose([5, 6], 4) == (0, [])  # "5 6" ends its sequence: nothing follows
    assert recent.propose([0, 0, 0], 4) == (0, [])


def test_recent_sequences_are_bounded_oldest_out():
    recent = RecentSequences(max_sequences=2, max_tokens=10)
    for base in (10, 20, 30):
        seq = [base, base + 1, base + 2, base + 3]
        recent.add(seq, _finished(seq))
    assert len(recent) == 2 and recent.propose([10, 11], 2) == (0, [])
    assert recent.propose([30, 31], 1) == (2, [32])
    long = list(range(100, 111))
    recent.add(long, _finished(long))  # longer than the whole bound: not kept
    assert len(recent) == 2 and recent.propose([100, 101], 2) == (0, [])
    seq = list(range(40, 47))
    recent.add(seq, _finished(seq))  # 7 tokens: 4 + 7 > 10, so the oldest goes
    assert len(recent) == 1


def _draft(spec: Speculator, req: Request) -> list[int]:
    """req's draft decoding alone (nothing timed: every guessed token goes in)."""
    return spec.plan([req], 16).get(req.request_id, [])


def test_the_longer_match_guesses_whether_own_or_recent():
    spec = Speculator(SpecConfig(ngram_min=2, ngram_max=4))
    done = Request("a", [1, 2, 3, 4, 5, 6, 7], sampling(max_tokens=50))
    _draft(spec, done)
    spec.forget(done)  # finished: its tokens join the recent ones
    # Own tokens: "4 5" was followed by 8 (a 2-gram); the finished one: "3 4 5" by 6 7.
    assert _draft(spec, Request("b", [4, 5, 8, 3, 4, 5], sampling(max_tokens=50))) == [6, 7]
    # Own tokens match longer ("8 4 5" by 9 8 4 5): own wins.
    c = Request("c", [8, 4, 5, 9, 8, 4, 5], sampling(max_tokens=50))
    assert _draft(spec, c) == [9, 8, 4, 5]


def test_a_match_of_ngram_max_is_measured_back_so_a_regeneration_follows_its_answer():
    """A prompt that holds "1 2 3 4" twice, asked again: its own tokens match that 4-gram
    (ngram_max) at the prompt's start and no further back; the finished run of the same
    prompt matches all 12 tokens, so its answer is the guess."""
    prompt = [1, 2, 3, 4, 70, 50, 51, 52, 1, 2, 3, 4]
    answer = [60, 61, 62]
    own = NgramDrafter(2, 4)
    assert own.propose_matched(prompt, 3) == (4, [70, 50, 51])
    recent = RecentSequences()
    recent.add(prompt + answer, _finished(prompt + answer))
    assert recent.propose(prompt, 8) == (12, [60, 61, 62])  # 12 long: as many as there are
    spec = Speculator(SpecConfig(ngram_min=2, ngram_max=4))
    spec.recent = recent
    assert _draft(spec, Request("again", prompt, sampling(max_tokens=50))) == [60, 61, 62]
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
