"""A long prefill chunk in a llama_decode of its own (`--split-prefill`, `decode_parts.py`), on
the tiny llama.

Oracles: a step mixing a long chunk with decodes makes two llama_decode calls and samples what
one call samples; a step of decodes only, or of short chunks only, makes one; the engine's
output with most steps split equals its output unsplit, also while "no KV slot" faults split
each part further. Which items go into which call: `tests/unit/test_decode_parts.py`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from ferrum.config import EngineConfig
from ferrum.engine.contracts import BatchItem, StepResult
from ferrum.engine.llama.runner import LlamaRunner
from tests.engine.test_tiny_models import PROMPTS, _generate, _RecordingMetrics, engine_for
from tests.factories import sampling

SPLIT_AT = 8


@contextmanager
def runner_for(path: str, split_prefill: int) -> Iterator[LlamaRunner]:
    cfg = EngineConfig(
        ctx_size=512, parallel=4, batch_size=64, threads=2, split_prefill=split_prefill
    )
    runner = LlamaRunner(cfg, path)
    try:
        for rid in "abc":
            runner.start_request(rid, sampling())
        yield runner
    finally:
        runner.close()


def _steps(runner: LlamaRunner) -> list[StepResult]:
    """Three steps: a's prompt alone; a's decode beside b's long prompt (split); a's and b's
    decodes beside c's short prompt (not split: every item is under SPLIT_AT)."""
    a, b, c = list(range(10, 30)), list(range(40, 52)), [7, 8, 9]
    first = runner.execute([BatchItem(0, a, 0, "a")])
    ta = first.sampled[0][0]
    mixed = runner.execute([BatchItem(0, [ta], len(a), "a"), BatchItem(1, b, 0, "b")])
    ta2, tb = mixed.sampled[0][0], mixed.sampled[1][0]
    short = runner.execute(
        [
            BatchItem(0, [ta2], len(a) + 1, "a"),
            BatchItem(1, [tb], len(b), "b"),
            BatchItem(2, c, 0, "c"),
        ]
    )
    return [first, mixed, short]


def test_a_long_chunk_beside_decodes_takes_its_own_call_and_samples_the_same(tiny_llama):
    with runner_for(tiny_llama, SPLIT_AT) as runner:
        split = _steps(runner)
    with runner_for(tiny_llama, 0) as runner:
        whole = _steps(runner)
    assert [s.decode_calls for s in split] == [1, 2, 1]
    assert [s.split_calls for s in split] == [0, 1, 0]
    assert [s.decode_calls for s in whole] == [1, 1, 1]
    assert [s.sampled for s in split] == [s.sampled for s in whole]
    assert all(not s.failed for s in split + whole)
    assert split[1].decode_s > 0


@pytest.mark.parametrize("faults", [0.0, 0.8])
def test_engine_output_with_most_steps_split_equals_unsplit(tiny_llama, faults):
    with engine_for(tiny_llama, split_prefill=0) as engine:
        expected = _generate(engine, PROMPTS, max_tokens=16)
    metrics = _RecordingMetrics()
    with engine_for(tiny_llama, split_prefill=4, inject_faults=faults) as engine:
        engine.observer = metrics
        calls = []
        execute = engine.runner.execute

        def counting(items):
            result = execute(items)
            calls.append((result.decode_calls, result.split_calls))
            return result

        engine.runner.execute = counting
        assert _generate(engine, PROMPTS, max_tokens=16) == expected
    assert any(split for _, split in calls), "no step was split"
    assert sum(s.decode_failures for s in metrics.steps) == 0
    retries = sum(s.decode_retries for s in metrics.steps)
    assert retries == sum(max(0, n - 1 - split) for n, split in calls)
    assert (retries > 0) == (faults > 0)  # a planned split is not counted as a retry
