"""A quantized KV cache on real llama.cpp (tiny llama with heads of 32 values, so q8_0's
blocks of 32 divide them; flash attention on, as a quantized V needs).

Oracles: prefix reuse (cells shared in place) and RAM/disk restores on a q8_0 cache give,
token for token, what the same q8_0 cache gives without any reuse. A restart under other
KV settings restores nothing: the files of the old settings are deleted at scan and counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import llama_cpp as ll
import pytest

from ferrum.config import EngineConfig
from ferrum.engine.engine import LLMEngine
from ferrum.engine.kv.tiers import TierConfig
from ferrum.engine.llama.runner import LlamaRunner
from ferrum.engine.outputs import EngineObserver, StepStats
from ferrum.engine.speculation.speculator import SpecConfig
from ferrum.errors import ModelLoadError
from ferrum.kv_types import kv_bytes_per_cell
from ferrum.models.gguf_file import read_gguf
from ferrum.models.memory import kv_bytes_per_token
from tests.factories import run_to_completion, sampling
from tests.tiny_models import write_tiny_llama
from tests.unit.test_tiers import AlwaysRestore

CHATS = [f"conversation {i}: " + "the river runs past the mill and the old stone bridge " * 3
         for i in range(5)]  # fmt: skip
Q8 = {"cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"}


@pytest.fixture(scope="session")
def llama32(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny-llama-32.gguf"
    return str(write_tiny_llama(path, n_head=2))


def _config(**kv: str) -> EngineConfig:
    # 256 cells: two of the five chats fit at once, so the others are evicted and saved.
    return EngineConfig(ctx_size=256, parallel=2, batch_size=64, threads=2, **kv)  # type: ignore[arg-type]


@contextmanager
def _engine(
    path: str, kv: dict[str, str], folder: Path | None = None, prefix_cache: bool = True
) -> Iterator[LLMEngine]:
    config = _config(**kv)
    runner = LlamaRunner(config, path)
    tiers = None
    if folder is not None:  # the fingerprint a server gives its tiers (`TierConfig.for_model`)
        tiers = TierConfig.for_model(64, 1, str(folder), path, runner.info.state_format)
        tiers = dataclasses.replace(tiers, io_thread=False) if tiers else None
    try:
        engine = LLMEngine(runner, block_size=16, prefix_cache=prefix_cache, tiers=tiers)
        if engine.kv_manager.saved is not None:
            engine.kv_manager.saved.costs = AlwaysRestore()
        yield engine
        engine.shutdown()
    finally:
        runner.close()


def _ask(engine: LLMEngine, rid: str, tokens: list[int]) -> tuple[list[int], int]:
    engine.add_request(rid, tokens, sampling(max_tokens=12, ignore_eos=True))
    out = run_to_completion(engine)[rid]
    engine.check_integrity()
    return out["tokens"], out["final"].cached_tokens


def _fresh(path: str, kv: dict[str, str], prompts: list[list[int]]) -> list[list[int]]:
    with _engine(path, kv, prefix_cache=False) as engine:
        return [_ask(engine, f"f{i}", p)[0] for i, p in enumerate(prompts)]


def _tokens(engine: LLMEngine, text: str) -> list[int]:
    return engine.runner.vocab.tokenize(text, True, False)


def test_prefix_reuse_on_a_quantized_cache_equals_the_same_cache_without_reuse(
    llama32: str,
) -> None:
    with _engine(llama32, Q8) as engine:
        system = _tokens(engine, "there is a time for every thing under the sun " * 4)
        prompts = [system + _tokens(engine, f" the {i} model")[1:] for i in range(4)]
        # Two at a time: the later ones share the system prompt's cells with parked donors.
        answers = [_ask(engine, f"q{i}", p) for i, p in enumerate(prompts)]
        history = prompts[0] + answers[0][0] + _tokens(engine, " and then?")[1:]
        turn = _ask(engine, "turn", history)
    assert all(cached >= len(system) - 16 for _, cached in answers[1:])
    assert turn[1] >= len(prompts[0])
    fresh = _fresh(llama32, Q8, [*prompts, history])
    assert [t for t, _ in answers] + [turn[0]] == fresh


def test_ram_and_disk_restores_on_a_quantized_cache_equal_the_same_cache_without_reuse(
    llama32: str, tmp_path: Path
) -> None:
    with _engine(llama32, Q8, tmp_path) as engine:
        firsts = [_tokens(engine, c) for c in CHATS]
        answers = [_ask(engine, f"a{i}", p)[0] for i, p in enumerate(firsts)]
        more = _tokens(engine, " and then?")[1:]
        nexts = [p + a + more for p, a in zip(firsts, answers, strict=True)]
        second = [_ask(engine, f"b{i}", p)[0] for i, p in enumerate(nexts)]
        ram = engine.kv_manager.saved.snapshot()
    with _engine(llama32, Q8, tmp_path) as engine:  # a restart: the disk tier only
        thirds = [p + a + more for p, a in zip(nexts, second, strict=True)]
        third = [_ask(engine, f"c{i}", p) for i, p in enumerate(thirds)]
        disk = engine.kv_manager.saved.snapshot()
    assert ram.restores >= 3 and ram.failures == 0
    assert disk.disk.hits >= 3 and disk.failures == 0 and disk.files_dropped == 0
    assert sum(cached >= len(p) for (_, cached), p in zip(third, nexts, strict=True)) >= 3
    assert second == _fresh(llama32, Q8, nexts)
    assert [t for t, _ in third] == _fresh(llama32, Q8, thirds)


def test_speculation_on_a_quantized_cache_equals_the_same_cache_without_it(
    llama32: str,
) -> None:
    """Guesses verified in the decode and the positions not taken removed with seq_rm, on
    q8_0 cells: the same tokens as one-at-a-time decoding on the same cache."""
    spec = SpecConfig(draft_max=8, ngram_min=1, ngram_max=3)
    texts = ["a b a b a b a b", "the river runs past the mill " * 3, "hello hello hello"]

    def outputs(speculation: SpecConfig | None) -> tuple[list[list[int]], int]:
        runner = LlamaRunner(_config(**Q8), llama32)
        try:
            engine = LLMEngine(runner, block_size=16, speculation=speculation)
            for i, t in enumerate(texts):
                engine.add_request(f"r{i}", _tokens(engine, t), sampling(max_tokens=30))
            done = run_to_completion(engine)
            drafted = engine.speculator.drafted if engine.speculator else 0
        finally:
            runner.close()
        return [done[f"r{i}"]["tokens"] for i in range(len(texts))], drafted

    reference, _ = outputs(None)
    got, drafted = outputs(spec)
    assert drafted > 0 and got == reference


@pytest.mark.parametrize(
    "other",
    [
        {"cache_type_k": "f16", "cache_type_v": "f16", "flash_attn": "on"},
        {"cache_type_k": "q8_0", "cache_type_v": "q4_0", "flash_attn": "on"},
        {"cache_type_k": "q8_0", "cache_type_v": "f16", "flash_attn": "off"},
    ],
)
def test_a_restart_with_other_kv_settings_restores_nothing_and_drops_the_files(
    llama32: str, tmp_path: Path, other: dict[str, str]
) -> None:
    with _engine(llama32, Q8, tmp_path) as engine:
        prompts = [_tokens(engine, c) for c in CHATS]
        answers = [_ask(engine, f"a{i}", p)[0] for i, p in enumerate(prompts)]
    saved = list(tmp_path.rglob("*.kv"))
    assert len(saved) >= len(CHATS) - 1
    more = [p + a + p[-8:] for p, a in zip(prompts, answers, strict=True)]
    with _engine(llama32, other, tmp_path) as engine:
        stats = engine.kv_manager.saved.snapshot()
        assert stats.files_dropped == len(saved) and stats.disk.entries == 0
        again = [_ask(engine, f"b{i}", p) for i, p in enumerate(more)]
        stats = engine.kv_manager.saved.snapshot()
    assert stats.restores == 0 and stats.failures == 0 and stats.disk.hits == 0
    assert not any(p in saved for p in tmp_path.rglob("*.kv"))
    assert [t for t, _ in again] == _fresh(llama32, other, more)


def test_the_state_format_names_the_kv_types_and_flash_attention(llama32: str) -> None:
    formats = set()
    for kv in (Q8, {**Q8, "cache_type_v": "q4_0"}, {**Q8, "flash_attn": "auto"}, {}):
        runner = LlamaRunner(_config(**kv), llama32)
        info = runner.info
        runner.close()
        formats.add(info.state_format)
        assert (info.cache_type_k, info.cache_type_v) == (
            kv.get("cache_type_k", "f16"),
            kv.get("cache_type_v", "f16"),
        )
    # auto with a quantized V is flash attention on (llama.cpp turns it on): the same V layout.
    assert len(formats) == 3


def test_a_quantized_v_without_flash_attention_is_refused_naming_the_flag(llama32: str) -> None:
    with pytest.raises(ModelLoadError, match="--cache-type-v q8_0"):
        LlamaRunner(_config(cache_type_v="q8_0", flash_attn="off"), llama32)


@pytest.mark.parametrize("name", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0"])
def test_bytes_per_cell_match_llama_cpps_own_state(llama32: str, name: str) -> None:
    """What a sequence's saved state grows by per cell, at each type, minus what the type
    table says a cell costs, is the same for every type (llama.cpp's per-cell metadata): so
    the table's ggml type ids, block sizes and bytes are llama.cpp's."""
    facts = read_gguf(llama32)
    assert kv_bytes_per_token(llama32, name, name) == kv_bytes_per_cell(
        facts.k_values_per_token, facts.v_values_per_token, name, name
    )
    with _engine(llama32, {"cache_type_k": name, "cache_type_v": name, "flash_attn": "on"}) as e:
        runner = e.runner
        assert isinstance(runner, LlamaRunner)
        e.add_request("r", _tokens(e, CHATS[0]), sampling(max_tokens=1))
        run_to_completion(e)
        parked = next(iter(e.kv_manager.parked))
        seq, n = parked.seq_id, len(parked.all_token_ids)
        size_n = int(ll.llama_state_seq_get_size(runner._ctx, seq))
        runner.trim_sequence(seq, n - 8)
        size_less = int(ll.llama_state_seq_get_size(runner._ctx, seq))
    per_cell = (size_n - size_less) // 8
    metadata = per_cell - kv_bytes_per_token(llama32, name, name)
    assert 0 <= metadata <= 16, (name, per_cell)


class _Last(EngineObserver):
    def __init__(self) -> None:
        self.stats = StepStats()

    def on_step(self, stats: StepStats) -> None:
        self.stats = stats


def test_the_engine_counts_kv_bytes_at_the_cell_types(llama32: str) -> None:
    per_cell = kv_bytes_per_token(llama32, "q8_0", "q8_0")
    runner = LlamaRunner(_config(**Q8), llama32, kv_bytes_per_cell=per_cell)
    observer = _Last()
    try:
        engine = LLMEngine(runner, block_size=16, observer=observer)
        prompt = _tokens(engine, CHATS[0])
        engine.add_request("r", prompt, sampling(max_tokens=4))
        engine.step()
        stats = observer.stats
    finally:
        runner.close()
    # 2 layers x 1 KV head x 32 values, K and V, at 34 bytes per 32 values.
    assert runner.info.kv_bytes_per_cell == per_cell == 2 * 2 * 34
    assert stats.kv_bytes_total == 256 * per_cell
    assert stats.kv_bytes_used == -(-len(prompt) // 16) * 16 * per_cell
