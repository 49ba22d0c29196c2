"""Saved prefixes on real llama.cpp: states read out with llama_state_seq_get_data when a
parked sequence is evicted, put back with llama_state_seq_set_data into another sequence id,
cut back with llama_memory_seq_rm where the model allows, and read from disk after a restart.

Oracle: greedy output token for token equal to a fresh prefill with no prefix cache at all
(tiny models have no batch-shape noise), for an attention model (any prefix restores), a
recurrent one and a sliding-window one (only a state the prompt wholly extends restores).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ferrum.config import EngineConfig
from ferrum.engine.engine import LLMEngine
from ferrum.engine.kv.tiers import TierConfig
from ferrum.engine.llama.runner import LlamaRunner
from tests.factories import run_to_completion, sampling
from tests.unit.test_tiers import AlwaysRestore

CHATS = [f"conversation {i}: " + "the river runs past the mill and the old stone bridge " * 3
         for i in range(5)]  # fmt: skip


@pytest.fixture(params=["llama", "mamba", "gemma3"])
def model(request, tiny_llama: str, tiny_mamba: str, tiny_gemma3: str) -> str:
    return {"llama": tiny_llama, "mamba": tiny_mamba, "gemma3": tiny_gemma3}[request.param]


@contextmanager
def _engine(path: str, folder: Path | None, prefix_cache: bool = True) -> Iterator[LLMEngine]:
    # 256 cells: two of the five chats fit at once, so the others are evicted and saved.
    config = EngineConfig(ctx_size=256, parallel=2, batch_size=64, threads=2)
    runner = LlamaRunner(config, path)
    tiers = TierConfig(64 << 20, 1 << 30, folder, "tiny", io_thread=False) if folder else None
    try:
        engine = LLMEngine(runner, block_size=16, prefix_cache=prefix_cache, tiers=tiers)
        if engine.kv_manager.saved is not None:
            engine.kv_manager.saved.costs = AlwaysRestore()
        yield engine
        engine.shutdown()
    finally:
        runner.close()


def _ask(engine: LLMEngine, rid: str, tokens: list[int]) -> tuple[list[int], int]:
    engine.add_request(rid, tokens, sampling(max_tokens=12))
    out = run_to_completion(engine)[rid]
    engine.check_integrity()
    return out["tokens"], out["final"].cached_tokens


def _fresh(path: str, prompts: list[list[int]]) -> list[list[int]]:
    with _engine(path, None, prefix_cache=False) as engine:
        return [_ask(engine, f"f{i}", p)[0] for i, p in enumerate(prompts)]


def _tokenize(engine: LLMEngine, text: str) -> list[int]:
    return engine.runner.vocab.tokenize(text, True, False)


def test_restored_states_give_a_fresh_prefills_tokens(model: str, tmp_path: Path) -> None:
    with _engine(model, tmp_path) as engine:
        firsts = [_tokenize(engine, c) for c in CHATS]
        answers = [_ask(engine, f"a{i}", p)[0] for i, p in enumerate(firsts)]
        # Next turns: each first turn and its answer, then more.
        more = _tokenize(engine, " and then?")[1:]
        nexts = [p + a + more for p, a in zip(firsts, answers, strict=True)]
        second = [_ask(engine, f"b{i}", p) for i, p in enumerate(nexts)]
        stats = engine.kv_manager.saved.snapshot()
    assert stats.restores >= 3 and stats.failures == 0
    assert [t for t, _ in second] == _fresh(model, nexts)
    # Restored chats reuse their whole first turn (bar the last answer token never decoded).
    assert sum(c >= len(p) for c, p in zip([c for _, c in second], firsts, strict=True)) >= 3


def test_a_restart_restores_from_disk(model: str, tmp_path: Path) -> None:
    with _engine(model, tmp_path) as engine:
        prompts = [_tokenize(engine, c) for c in CHATS]
        answers = [_ask(engine, f"a{i}", p)[0] for i, p in enumerate(prompts)]
    # Each extends a saved state: the first turn and its answer (as a recurrent model needs).
    more = [p + a + p[-8:] for p, a in zip(prompts, answers, strict=True)]
    with _engine(model, tmp_path) as engine:
        again = [_ask(engine, f"b{i}", p) for i, p in enumerate(more)]
        stats = engine.kv_manager.saved.snapshot()
    assert stats.disk.hits == len(CHATS) and stats.failures == 0
    assert all(cached >= len(p) for (_, cached), p in zip(again, prompts, strict=True))
    assert [t for t, _ in again] == _fresh(model, more)


def test_an_attention_model_restores_a_prefix_of_a_saved_state(
    tiny_llama: str, tmp_path: Path
) -> None:
    with _engine(tiny_llama, tmp_path) as engine:
        prompts = [_tokenize(engine, c) for c in CHATS]
        for i, p in enumerate(prompts):
            _ask(engine, f"a{i}", p)
        branch = prompts[0][:40] + _tokenize(engine, "a different ending")[1:]
        tokens, cached = _ask(engine, "branch", branch)
    assert cached == 40
    assert tokens == _fresh(tiny_llama, [branch])[0]


def test_a_sliding_window_state_is_cut_back_by_one_position(
    tiny_gemma3: str, tmp_path: Path
) -> None:
    """A saved state asked for exactly again: its last position is recomputed for logits, so
    the state is cut back by one, which its window still covers (checked, not assumed)."""
    with _engine(tiny_gemma3, tmp_path) as engine:
        for i, c in enumerate(CHATS):
            _ask(engine, f"a{i}", _tokenize(engine, c))
        parked = [p.all_token_ids for p in engine.kv_manager.parked]
        entry = next(e for e in engine.kv_manager.saved if e.all_token_ids not in parked)
        same = list(entry.all_token_ids)
        tokens, cached = _ask(engine, "same", same)
        assert engine.kv_manager.window_fallbacks == 0
    assert cached == len(same) - 1
    assert tokens == _fresh(tiny_gemma3, [same])[0]
