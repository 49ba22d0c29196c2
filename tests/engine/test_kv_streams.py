"""--kv-streams on real llama.cpp: a cell stream per sequence id. Prefixes are copied through
the state API, conversations continue their own parked stream, and every output equals the
prompt decoded alone without prefix reuse (tiny llama; tiny Gemma 3, whose window must come
along whole; tiny Mamba, whose state is never copied)."""

from __future__ import annotations

import logging

import pytest

from ferrum.engine.engine import InvalidRequest
from ferrum.errors import ModelLoadError
from tests.engine.test_prefix_reuse import SYSTEM, _conversation, _run
from tests.factories import count_copies, llama_engine


@pytest.fixture(params=["llama", "gemma3", "mamba"])
def any_model(request, tiny_llama, tiny_gemma3, tiny_mamba) -> str:
    return {"llama": tiny_llama, "gemma3": tiny_gemma3, "mamba": tiny_mamba}[request.param]


def _contents(outs: dict[str, dict]) -> dict[str, str]:
    return {k: v["content"] for k, v in outs.items()}


def test_streams_reuse_equals_a_fresh_prefill(any_model):
    prompts = {f"q{i}": SYSTEM + f"the {i} model" for i in range(4)}
    with llama_engine(any_model, prefix_cache=False) as engine:
        fresh_burst = _run(engine, prompts)
        fresh_turns, _ = _conversation(engine, 4)
    with llama_engine(any_model, kv_streams=True) as engine:
        copies: list[int] = []
        count_copies(engine.runner, copies.append)
        burst = _run(engine, prompts)
        turns, cached = _conversation(engine, 4)
        engine.check_integrity()
        recurrent = engine.info.is_recurrent
    assert _contents(burst) == _contents(fresh_burst)
    assert turns == fresh_turns
    if not recurrent:
        # The burst's later prompts copied the first one's system prompt into their streams,
        # and each later turn continued the conversation's own.
        assert copies and all(n > len(SYSTEM) // 8 for n in copies)
        assert all(burst[f"q{i}"]["final"].cached_tokens > 0 for i in (1, 2, 3))
        assert all(c > 0 for c in cached[1:])


def test_a_request_holds_at_most_a_stream(tiny_llama, caplog):
    caplog.set_level(logging.INFO, logger="ferrum.llama")
    with llama_engine(tiny_llama, ctx=1024, parallel=4, kv_streams=True) as engine:
        assert engine.info.kv_streams and engine.max_positions == 256
        assert "one request holds at most 256 positions" in caplog.text  # said at start
        assert engine.info.request_ctx == 256  # the context length the APIs report
        assert engine.clamp_max_tokens(200, 1000) == 56
        with pytest.raises(InvalidRequest):
            engine.clamp_max_tokens(256, 1)
        # Without streams any request may use the whole context.
    with llama_engine(tiny_llama, ctx=1024, parallel=4) as engine:
        assert engine.max_positions == engine.info.request_ctx == 1024


def test_streams_and_window_sized_cache_are_refused_together(tiny_gemma3):
    refused = pytest.raises(ModelLoadError, match="--kv-streams")
    with refused, llama_engine(tiny_gemma3, kv_streams=True, swa_windows=True):
        pass
