"""The prefill study (`ferrum bench --study prefill`): its arms and what it reads off a run."""

from __future__ import annotations

import pytest

from ferrum.bench.studies import STUDIES, StudyRun, load
from ferrum.bench.studies.prefill import ARMS, _step_until_done, measure
from ferrum.engine.engine import LLMEngine
from tests.factories import FakeRunner, byte_tokenize, model_info, sampling


def test_the_study_is_registered_with_its_default_arms():
    study = load("prefill")
    assert STUDIES["prefill"] == "prefill" and set(study.arms) <= set(ARMS)
    assert ARMS["prefill-only"][1] == 1  # one output token: no stream beside the prefill


def test_an_unknown_arm_is_refused_before_any_child_starts(tmp_path):
    run = StudyRun("prefill", tmp_path, 2, 2, True, None)
    with pytest.raises(ValueError, match="unknown arm"):
        measure(run, "ferrum fast", 1)


def test_first_tokens_and_decode_steps_are_read_off_the_steps():
    engine = LLMEngine(FakeRunner(info=model_info(n_ctx=1024, n_batch=32)), block_size=16)
    long, short = byte_tokenize("a long prompt " * 8), byte_tokenize("short")
    engine.add_request("long", long, sampling(max_tokens=5))
    engine.add_request("short", short, sampling(max_tokens=5))
    got = _step_until_done(engine, 2)
    assert 0 < got["first_token_p50"] <= got["last_first_token"] <= got["total"]
    assert got["decode_step_ms"] > 0  # steps ran after both prompts were done


def test_a_run_without_decode_steps_reports_none():
    engine = LLMEngine(FakeRunner(info=model_info(n_ctx=1024, n_batch=32)), block_size=16)
    engine.add_request("one", byte_tokenize("a prompt"), sampling(max_tokens=1))
    assert "decode_step_ms" not in _step_until_done(engine, 1)
