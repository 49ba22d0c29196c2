"""Window checkpoints on the window-sized cache (`engine/kv/checkpoints.py`): where a chat's
hints and the prompt's end say later prompts part from this one, the state is kept in the RAM
tier, and later prompts restore it with the output of a fresh prefill. The hints come from the
chat template's client strings (`ChatFormatter.tokenize_parts`)."""

from __future__ import annotations

from ferrum.api.prompting.chat_prompt import parting_points
from ferrum.api.prompting.chat_template import ChatFormatter
from ferrum.engine.engine import LLMEngine
from ferrum.engine.kv.tiers import TierConfig
from tests.factories import FakeRunner, byte_tokenize, model_info, run_to_completion, sampling
from tests.unit.test_tiers import AlwaysRestore, _fresh

HEAD = byte_tokenize("you answer questions about the bakery's opening hours and its menu. " * 2)


def _engine(window_sized: bool = True) -> tuple[FakeRunner, LLMEngine]:
    info = model_info(n_ctx=1024, n_batch=64, n_seq_max=4, n_swa=8, own_copies=window_sized)
    runner = FakeRunner(info=info)
    tiers = TierConfig(10_000_000, 0, None, "model-a", io_thread=False)
    engine = LLMEngine(runner, block_size=16, max_running=3, tiers=tiers)
    assert engine.kv_manager.saved is not None
    engine.kv_manager.saved.costs = AlwaysRestore()
    return runner, engine


def _ask(engine: LLMEngine, rid: str, prompt: list[int], marks: tuple[int, ...] = ()) -> int:
    """Runs the prompt alone; its cached tokens, after checking its output is a fresh one's."""
    engine.add_request(rid, prompt, sampling(max_tokens=8), checkpoints=marks)  # as _fresh
    out = run_to_completion(engine)[rid]
    engine.check_integrity()
    assert out["tokens"] == _fresh(prompt), rid
    return out["final"].cached_tokens


def test_a_second_question_restores_the_hinted_system_prompt() -> None:
    _, engine = _engine()
    first, second = HEAD + byte_tokenize("When?", False), HEAD + byte_tokenize("How much?", False)
    assert _ask(engine, "first", first, marks=(len(HEAD),)) == 0
    assert _ask(engine, "second", second, marks=(len(HEAD),)) == len(HEAD)


def test_without_the_hint_only_the_prompt_end_is_kept() -> None:
    _, engine = _engine()
    first, second = HEAD + byte_tokenize("When?", False), HEAD + byte_tokenize("How much?", False)
    assert _ask(engine, "first", first) == 0
    # The finished sequence is saved whole and the checkpoint is at the first prompt's end:
    # neither may be cut back to the shared part (the window's cells below are gone).
    assert _ask(engine, "second", second) == 0
    assert _ask(engine, "again", first) == len(first) - 1


def test_a_lost_window_keeps_no_checkpoint() -> None:
    runner, engine = _engine()
    checkpoint = runner.checkpoint
    runner.checkpoint = lambda src, length: None  # type: ignore[method-assign]
    prompt = HEAD + byte_tokenize("When?", False)
    assert _ask(engine, "first", prompt, marks=(len(HEAD),)) == 0
    assert engine.kv_manager.checkpoints is not None
    assert engine.kv_manager.checkpoints.kept == 0
    runner.checkpoint = checkpoint  # type: ignore[method-assign]
    assert _ask(engine, "second", HEAD + byte_tokenize("How?", False), marks=(len(HEAD),)) == 0


def test_hints_outside_the_prompt_are_left_out_and_full_window_caches_keep_none() -> None:
    _, engine = _engine()
    prompt = HEAD + byte_tokenize("When?", False)
    engine.add_request("r", prompt, sampling(max_tokens=2), checkpoints=(-3, 0, 5_000, 40))
    req = engine.scheduler.waiting[0]
    assert req.checkpoints == (40,)
    run_to_completion(engine)
    _, full = _engine(window_sized=False)
    assert full.kv_manager.checkpoints is None  # parked sequences keep their old windows


def test_a_state_no_longer_than_the_window_is_cut_back_anywhere() -> None:
    """A window model's saved state that fits in its window lost no cell: any prefix of it
    serves (here from an evicted sequence, the full window cache's tiers)."""
    info = model_info(n_ctx=256, n_batch=64, n_seq_max=2, n_swa=512)
    runner = FakeRunner(info=info)
    tiers = TierConfig(10_000_000, 0, None, "model-a", io_thread=False)
    engine = LLMEngine(runner, block_size=16, max_running=1, tiers=tiers)
    assert engine.kv_manager.saved is not None
    engine.kv_manager.saved.costs = AlwaysRestore()
    first = HEAD + byte_tokenize("When?", False)
    _ask(engine, "first", first)
    while engine.kv_manager.evict_one():
        pass
    shorter = HEAD + byte_tokenize("How?", False)
    assert _ask(engine, "shorter", shorter) == len(HEAD)


def test_client_strings_start_where_the_formatter_says() -> None:
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    fmt = ChatFormatter(template, "", "", add_bos=False)
    system = {"role": "system", "content": "be brief"}
    a = [system, {"role": "user", "content": "open when?"}]
    b = [system, {"role": "user", "content": "menu?"}]
    tokens_a, starts_a = fmt.tokenize_parts(a, byte_tokenize)
    tokens_b, starts_b = fmt.tokenize_parts(b, byte_tokenize)
    assert tokens_a == fmt.tokenize(a, byte_tokenize)
    assert starts_a == starts_b == [len("<system>"), len("<system>be brief</s><user>")]
    cut = starts_a[1]
    assert tokens_a[:cut] == tokens_b[:cut] and tokens_a[cut] != tokens_b[cut]
    assert parting_points(starts_a) == (starts_a[1],)
    assert parting_points([3, 9, 20, 31]) == (9, 31)
    assert parting_points([]) == ()


def _first_chunks(engine: LLMEngine, runner: FakeRunner, prompt: list[int], marks) -> list[int]:
    """The lengths of the prompt chunks the engine decoded for a request alone."""
    lengths: list[int] = []
    execute = runner.execute

    def watched(items):
        lengths.extend(len(i.tokens) for i in items)
        return execute(items)

    runner.execute = watched  # type: ignore[method-assign]
    engine.add_request("r", prompt, sampling(max_tokens=2), checkpoints=marks)
    run_to_completion(engine)
    return lengths


def test_a_hinted_position_ends_its_prefill_chunk_where_checkpoints_are_kept() -> None:
    """At a chunk's end the window is whole after the step: a later llama_decode of the same
    step may recycle window cells below a position inside the chunk."""
    prompt = HEAD + byte_tokenize("When?", False)
    runner, engine = _engine()
    assert _first_chunks(engine, runner, prompt, (40,))[:2] == [40, 64]  # n_batch 64
    runner, full = _engine(window_sized=False)
    assert _first_chunks(full, runner, prompt, (40,))[:2] == [64, 64]


def test_a_failing_checkpoint_is_counted_and_the_request_goes_on() -> None:
    runner, engine = _engine()

    def broken(src: int, length: int) -> bytearray | None:
        raise RuntimeError("window-cache state of 7 bytes is no whole number of cells")

    runner.checkpoint = broken  # type: ignore[method-assign]
    assert _ask(engine, "first", HEAD + byte_tokenize("When?", False), marks=(len(HEAD),)) == 0
    checkpoints = engine.kv_manager.checkpoints
    assert checkpoints is not None and checkpoints.failed == 2 and checkpoints.kept == 0
