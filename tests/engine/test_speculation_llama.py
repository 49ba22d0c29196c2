"""Speculation on real llama.cpp with tiny generated models: verification through
llama_decode with logits at every guessed position, and the rollback with
llama_memory_seq_rm, checked against the same engine without speculation.

Oracles: greedy output token for token (tiny models have no batch-shape noise); seeded
sampling token for token too, since verification draws one random number per kept token,
as decoding one at a time does; models that cannot roll back never speculate.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from contextlib import contextmanager

from ferrum.config import EngineConfig
from ferrum.engine.engine import LLMEngine
from ferrum.engine.llama.runner import LlamaRunner
from ferrum.engine.speculation.ngram import NgramDrafter
from ferrum.engine.speculation.pricing import StepCosts
from ferrum.engine.speculation.speculator import SpecConfig
from tests.factories import run_to_completion, sampling

PROMPTS = [
    "the model of the world",
    "Hello, wörld! 你好 " * 6,
    "a b a b a b a b",
    "there is a time for every thing under the sun and the moon",
]


@contextmanager
def _engine(path: str, spec: SpecConfig | None, drafter=None):
    config = EngineConfig(ctx_size=1024, parallel=4, batch_size=64, threads=2)
    runner = LlamaRunner(config, path)
    try:
        yield LLMEngine(runner, block_size=16, speculation=spec, drafter=drafter)
    finally:
        runner.close()


def _outputs(engine: LLMEngine, **params) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        tokens = engine.runner.vocab.tokenize(p, True, False)
        engine.add_request(f"r{i}", tokens, sampling(**{"max_tokens": 40, **params}))
    results = run_to_completion(engine)
    return [results[f"r{i}"]["tokens"] for i in range(len(PROMPTS))]


class _ReplayDrafter:
    """Guesses the reference output (what the engine gave without speculation), wrong at a
    random position half of the time: every acceptance length reaches the real runner."""

    def __init__(self, references: list[list[int]], rng: random.Random):
        self.references, self.rng = references, rng

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        for ref in self.references:
            for start in range(len(tokens)):  # the reference whose output tokens ends with
                if list(tokens[start:]) == ref[: len(tokens) - start]:
                    guess = list(ref[len(tokens) - start : len(tokens) - start + k])
                    if guess and self.rng.random() < 0.5:
                        guess[self.rng.randrange(len(guess))] ^= 1
                    return guess
        return []


def test_greedy_output_is_the_same_with_guesses_right_and_wrong(tiny_llama):
    with _engine(tiny_llama, None) as plain:
        reference = _outputs(plain, ignore_eos=True)
    rng = random.Random(0)
    spec = SpecConfig(draft_max=6, batch_max=16)
    with _engine(tiny_llama, spec, lambda _: _ReplayDrafter(reference, rng)) as engine:
        assert _outputs(engine, ignore_eos=True) == reference
        assert engine.speculator is not None
        assert 0 < engine.speculator.accepted < engine.speculator.drafted


def test_ngram_drafts_change_no_output_greedy_or_seeded(tiny_llama):
    spec = SpecConfig(draft_max=8, ngram_min=1, ngram_max=3)
    for params in ({"ignore_eos": True}, {"temperature": 1.0, "seed": 7, "top_k": 40}):
        with _engine(tiny_llama, None) as plain:
            reference = _outputs(plain, **params)
        with _engine(tiny_llama, spec) as engine:
            assert _outputs(engine, **params) == reference, params
            assert engine.speculator is not None and engine.speculator.drafted > 0


def test_models_that_cannot_roll_back_never_speculate(tiny_mamba):
    """Recurrent state cannot drop rejected guesses. (A sliding window can: tiny Gemma 3
    speculates, tests/engine/test_sliding_window_machine.py.)"""
    with _engine(tiny_mamba, SpecConfig()) as engine:
        assert engine.speculator is None
        assert all(_outputs(engine, max_tokens=8))


def test_a_sliding_window_model_speculates(tiny_gemma3):
    with _engine(tiny_gemma3, SpecConfig()) as engine:
        assert engine.speculator is not None


def test_one_token_matches_of_a_request_decoding_alone_change_no_output(tiny_llama, monkeypatch):
    """ngram_min 3, one request at a time, decode costs timed: matches shorter than 3 tokens
    are looked up too, and followed while their rate pays. (The tiny model's decode times
    are too small to time reliably, so the cost is set: a position 0.4 of a token.)"""
    spec = SpecConfig(draft_max=8, ngram_min=3, ngram_max=6)
    monkeypatch.setattr(StepCosts, "seconds", lambda self, positions: 0.006 + 0.004 * positions)
    follow = NgramDrafter.follow
    matched: list[int] = []  # the length of each match found

    def recording(self, *args, **kwargs):
        found = follow(self, *args, **kwargs)
        matched.append(found[0])
        return found

    monkeypatch.setattr(NgramDrafter, "follow", recording)

    def one_by_one(engine: LLMEngine) -> list[list[int]]:
        outputs = []
        for i, p in enumerate(PROMPTS * 2):
            tokens = engine.runner.vocab.tokenize(p, True, False)
            engine.add_request(f"r{i}", tokens, sampling(max_tokens=40, ignore_eos=True))
            outputs.append(run_to_completion(engine)[f"r{i}"]["tokens"])
        return outputs

    with _engine(tiny_llama, None) as plain:
        reference = one_by_one(plain)
    with _engine(tiny_llama, spec) as engine:
        assert one_by_one(engine) == reference
        assert engine.speculator is not None and engine.speculator.drafted > 0
    assert any(0 < n < 3 for n in matched)  # guesses followed matches under ngram_min
