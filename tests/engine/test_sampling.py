"""Sampling settings on real llama.cpp (tiny llama): grammars, logit bias, min_tokens, logprobs.

Grammars get the hardest cases: llama.cpp kills the process if a grammar is made to accept a
token it refuses, so every way a constrained request can run out of allowed tokens is here.
"""

from __future__ import annotations

import math
import re

import pytest

from ferrum.engine.constraint import to_grammar
from ferrum.engine.engine import LLMEngine
from tests.factories import run_to_completion, sampling
from tests.tiny_models import EOS_ID, IM_END_ID

from .test_tiny_models import engine_for

PROMPT = "the model of the world under the sun"
SHORT_OBJECT = to_grammar("grammar", r'root ::= "{" [a-z]{2,5} "}"')


def _run(engine: LLMEngine, **params) -> dict:
    engine.add_request("r", engine.runner.vocab.tokenize(PROMPT, True, False), sampling(**params))
    result = run_to_completion(engine)["r"]
    engine.check_integrity()
    return result


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"ignore_eos": True},  # a grammar still ends the output when it is complete
        {"min_tokens": 15},  # cannot be met inside the grammar: the grammar wins
        {"repetition_penalty": 1.3},  # the chain that remembers tokens
        {"temperature": 1.0, "seed": 7},
        {"temperature": 1.0, "seed": 7, "top_k": 5, "top_p": 0.9},
    ],
)
def test_grammar_output_matches_and_ends(tiny_llama, extra):
    with engine_for(tiny_llama) as engine:
        result = _run(engine, max_tokens=30, grammar=SHORT_OBJECT, **extra)
    assert re.fullmatch(r"\{[a-z]{2,5}\}", result["content"]), result["content"]
    assert result["final"].finish_reason == "stop"


def test_grammar_requests_batch_with_free_ones(tiny_llama):
    with engine_for(tiny_llama) as engine:
        alone = _run(engine, max_tokens=12, ignore_eos=True)["content"]
        tokens = engine.runner.vocab.tokenize(PROMPT, True, False)
        for i in range(4):
            grammar = SHORT_OBJECT if i % 2 else None
            engine.add_request(
                f"r{i}", tokens, sampling(max_tokens=12, ignore_eos=True, grammar=grammar)
            )
        results = run_to_completion(engine)
    for i in range(4):
        text = results[f"r{i}"]["content"]
        assert re.fullmatch(r"\{[a-z]{2,5}\}", text) if i % 2 else text == alone


def test_invalid_grammar_is_refused_before_any_request(tiny_llama):
    with engine_for(tiny_llama) as engine:
        with pytest.raises(ValueError):
            engine.runner.vocab.check_grammar('root ::= "unclosed')
        with pytest.raises(ValueError):
            engine.runner.vocab.check_grammar("root ::= missing-rule")
        engine.runner.vocab.check_grammar(SHORT_OBJECT)


def test_logit_bias_bans_and_forces(tiny_llama):
    with engine_for(tiny_llama) as engine:
        free = _run(engine, max_tokens=8, ignore_eos=True)["tokens"]
        banned = _run(engine, max_tokens=8, ignore_eos=True, logit_bias=((free[0], -100.0),))
        forced = _run(engine, max_tokens=4, ignore_eos=True, logit_bias=((free[3], 100.0),))
    assert free[0] not in banned["tokens"]
    assert forced["tokens"] == [free[3]] * 4


def test_min_tokens_holds_back_the_end(tiny_llama):
    end_now = ((EOS_ID, 100.0), (IM_END_ID, 100.0))
    with engine_for(tiny_llama) as engine:
        at_once = _run(engine, max_tokens=20, logit_bias=end_now)
        held = _run(engine, max_tokens=20, logit_bias=end_now, min_tokens=6)
        stop_ids = _run(
            engine, max_tokens=20, logit_bias=((300, 100.0),), stop_token_ids=(300,), min_tokens=3
        )
    assert len(at_once["tokens"]) == 1 and at_once["final"].finish_reason == "stop"
    assert len(held["tokens"]) == 7 and held["tokens"][-1] in (EOS_ID, IM_END_ID)
    assert held["final"].finish_reason == "stop"
    assert len(stop_ids["tokens"]) == 4 and stop_ids["tokens"][-1] == 300


def test_logprobs_are_the_models_distribution(tiny_llama):
    with engine_for(tiny_llama) as engine:
        tokens = engine.runner.vocab.tokenize(PROMPT, True, False)
        engine.add_request("r", tokens, sampling(max_tokens=6, ignore_eos=True, logprobs=5))
        entries = []
        while engine.has_work:
            for out in engine.step():
                entries += out.logprobs or []
    assert len(entries) == 6
    for e in entries:
        assert len(e.top) == 5 and e.top[0][0] == e.token  # greedy takes the most likely
        assert e.logprob == pytest.approx(e.top[0][1])
        assert [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
        assert sum(math.exp(lp) for _, lp in e.top) <= 1.0 + 1e-6


def test_seeded_sampling_is_reproducible_alone_and_batched(tiny_llama):
    params = {"max_tokens": 16, "ignore_eos": True, "temperature": 1.0, "seed": 42}
    with engine_for(tiny_llama) as engine:
        alone = _run(engine, **params)["tokens"]
        again = _run(engine, **params)["tokens"]
        tokens = engine.runner.vocab.tokenize(PROMPT, True, False)
        engine.add_request("a", tokens, sampling(**params))
        engine.add_request("b", tokens, sampling(**{**params, "seed": 43}))
        batched = run_to_completion(engine)
    assert alone == again == batched["a"]["tokens"]
    assert batched["b"]["tokens"] != alone


def test_plain_greedy_shortcut_picks_what_the_sampler_chain_picks(tiny_llama):
    # A zero bias keeps llama.cpp's chain in the loop without changing any logit.
    with engine_for(tiny_llama) as engine:
        shortcut = _run(engine, max_tokens=24, ignore_eos=True)["tokens"]
        chain = _run(engine, max_tokens=24, ignore_eos=True, logit_bias=((0, 0.0),))["tokens"]
    assert shortcut == chain
