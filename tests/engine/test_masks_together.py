"""A step's grammar masks filled together (issue #41) on real llama.cpp (tiny llama).

Several constrained requests run at once (JSON schemas, a regex, a choice, a GBNF grammar;
greedy, seeded, with logprobs, two choices of one prompt as n > 1 sends them), with and
without n-gram speculation. The random weights make the model refuse the grammars at most
steps, so most steps have several rows waiting for a mask.

Oracles:
- the same requests with each mask computed on its own (the runner's fill replaced by one
  `Constraint.allowed` a row, the path before masks came together) give the same tokens and
  logprobs, token for token; the run that fills together does fill several rows in one call
  on llguidance's pool;
- every output ends by its grammar and matches it (jsonschema, re.fullmatch, membership);
- the metrics count one mask a row, whether it was filled alone or with others.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import jsonschema
import llguidance.numpy as llnp
import pytest
from prometheus_client import CollectorRegistry

from ferrum.config import EngineConfig
from ferrum.engine import constraint as constraint_module
from ferrum.engine.constraint import Constraint, to_grammar
from ferrum.engine.engine import LLMEngine
from ferrum.engine.llama import step_sampling
from ferrum.engine.llama.runner import LlamaRunner
from ferrum.engine.outputs import EngineObserver, StepStats
from ferrum.engine.speculation.speculator import SpecConfig
from ferrum.structured_metrics import StructuredMetrics
from tests.factories import run_to_completion, sampling

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
NUMBERS = {"type": "array", "items": {"type": "integer", "maximum": 999}, "maxItems": 3}
REGEX = r"[a-z]{2,6}( [a-z]{2,6}){1,2}\."
CHOICES = ["the sun", "the moon", "water of the world"]
GBNF = r'root ::= "{" [a-z]{2,5} "}"'


def _json_fits(schema: dict[str, Any]) -> Callable[[str], bool]:
    def fits(text: str) -> bool:
        jsonschema.validate(json.loads(text), schema)
        return True

    return fits


# (grammar, does a finished text match it)
GRAMMARS = {
    "person": (to_grammar("json_schema", PERSON), _json_fits(PERSON)),
    "numbers": (to_grammar("json_schema", NUMBERS), _json_fits(NUMBERS)),
    "regex": (to_grammar("regex", REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": (to_grammar("choice", CHOICES), lambda t: t in CHOICES),
    "gbnf": (to_grammar("grammar", GBNF), lambda t: re.fullmatch(r"\{[a-z]{2,5}\}", t)),
}
# (request id, grammar, prompt, sampling settings); "n0"/"n1" are two choices of one request.
SEEDED = {"temperature": 1.0, "top_k": 40}
REQUESTS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("person", "person", "name and age of the model", {}),
    ("numbers", "numbers", "three numbers", {"logprobs": 2}),
    ("regex", "regex", "the world under the sun", {**SEEDED, "seed": 3}),
    ("choice", "choice", "which one", {**SEEDED, "seed": 5, "logprobs": 1}),
    ("gbnf", "gbnf", "a short word", {"repetition_penalty": 1.3}),
    ("n0", "person", "a person", {**SEEDED, "seed": 11}),
    ("n1", "person", "a person", {**SEEDED, "seed": 12}),
    ("same", "regex", "the world under the sun", {}),
]


class _MaskCount(EngineObserver):
    """The metrics' mask series, fed with each step's statistics as the server's are."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = StructuredMetrics(self.registry)

    def on_step(self, stats: StepStats) -> None:
        self.metrics.count_masks(stats.mask_seconds)

    def value(self, name: str) -> float:
        found = self.registry.get_sample_value(name)
        return 0.0 if found is None else found


@contextmanager
def _engine(path: str, spec: SpecConfig | None, observer: EngineObserver) -> Iterator[LLMEngine]:
    config = EngineConfig(ctx_size=2048, parallel=8, batch_size=128, threads=2)
    runner = LlamaRunner(config, path)
    try:
        yield LLMEngine(runner, block_size=16, speculation=spec, observer=observer)
    finally:
        runner.close()


def _run(
    path: str, spec: SpecConfig | None, fill: Callable[..., list[Any]], monkeypatch
) -> tuple[dict[str, dict], list[int], list[int], _MaskCount, int]:
    """Every request at once; the results, the rows waiting in each round and those of each
    fill on llguidance's pool, the mask metrics and the guesses made."""
    rows: list[int] = []
    pooled: list[int] = []

    def recording(constraints: Sequence[Constraint], n_vocab: int) -> list[Any]:
        rows.append(len(constraints))
        return fill(constraints, n_vocab)

    def pool(executor: Any, matchers: list[Any], bitmask: Any) -> None:
        pooled.append(len(matchers))
        par(executor, matchers, bitmask)

    par = llnp.fill_next_token_bitmask_par
    monkeypatch.setattr(step_sampling, "allowed_together", recording)
    monkeypatch.setattr(llnp, "fill_next_token_bitmask_par", pool)
    observer = _MaskCount()
    with _engine(path, spec, observer) as engine:
        for rid, name, prompt, extra in REQUESTS:
            grammar = GRAMMARS[name][0]
            params = sampling(max_tokens=64, grammar=grammar, **extra)
            engine.add_request(rid, engine.runner.vocab.tokenize(prompt, True, False), params)
        results = run_to_completion(engine)
        engine.check_integrity()
        drafted = engine.speculator.drafted if engine.speculator is not None else 0
    return results, rows, pooled, observer, drafted


def _one_at_a_time(constraints: Sequence[Constraint], n_vocab: int) -> list[Any]:
    return [c.allowed(n_vocab) for c in constraints]


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculating"])
def test_masks_filled_together_equal_masks_one_at_a_time(tiny_llama, monkeypatch, speculate):
    spec = SpecConfig(draft_max=6, ngram_min=1, ngram_max=3) if speculate else None
    together, rows, pooled, count, drafted = _run(
        tiny_llama, spec, constraint_module.allowed_together, monkeypatch
    )
    alone, alone_rows, none, alone_count, _ = _run(tiny_llama, spec, _one_at_a_time, monkeypatch)

    assert not none and pooled and min(pooled) >= constraint_module.TOGETHER_FROM, pooled
    assert sum(pooled) < sum(rows)  # fewer rows than TOGETHER_FROM were filled alone
    assert not speculate or drafted > 0
    for rid, name, _, extra in REQUESTS:
        got, want = together[rid], alone[rid]
        assert got["tokens"] == want["tokens"], rid
        assert got["logprobs"] == want["logprobs"], rid
        if "logprobs" in extra:  # each token's but the end's, which is not shown
            assert len(got["logprobs"]) >= len(got["tokens"]) - 1 > 0, rid
        assert got["final"].finish_reason == "stop", (rid, got["content"])
        assert GRAMMARS[name][1](got["content"]), (rid, got["content"])
    # One mask a row in the metrics, filled together or alone, each with its time.
    for observed, filled in ((count, rows), (alone_count, alone_rows)):
        assert observed.value("ferrum_structured_masks_total") == sum(filled) > 0
        assert observed.value("ferrum_structured_mask_seconds_count") == sum(filled)
        assert observed.value("ferrum_structured_mask_seconds_sum") > 0
