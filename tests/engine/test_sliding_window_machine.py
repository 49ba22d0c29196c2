"""The engine state machine on a real sliding-window model: tiny Gemma 3, window 8.

Same random traffic as `tests/unit/test_engine_state_machine.py` (prompts that repeat, extend
and branch off earlier ones; n > 1; hang-ups; next turns of conversations), on llama.cpp
itself: with a context of 128 cells and a window of 8, window cells of parked and running
sequences are recycled within a few steps, so every kind of prefix copy meets donors with
holes. Oracles: greedy output equals the prompt decoded alone on a model without prefix reuse,
and every running sequence holds the whole window it decodes from. A near tie (the top two
within TIE_NATS) may be decided either way by batch-shape float noise; past such a token the
oracle continues from the side the engine took.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant

from ferrum.config import EngineConfig
from ferrum.engine.engine import LLMEngine
from ferrum.engine.kv.tiers import TierConfig
from ferrum.engine.llama.runner import LlamaRunner
from ferrum.engine.request import ImageSpan
from ferrum.engine.speculation.speculator import SpecConfig
from tests.factories import count_copies, run_to_completion, sampling
from tests.profiles import examples
from tests.tiny_models import BOS_ID
from tests.unit.test_engine_state_machine import EngineMachine
from tests.unit.test_tiers import AlwaysRestore

CTX, PARALLEL, BATCH, BLOCK = 128, 3, 24, 8
Spans = Callable[[list[int]], tuple[ImageSpan, ...]]


# Two tokens whose log-probabilities lie closer than this are a tie that float noise may
# break either way: llama.cpp's kernels sum in another order for another batch shape (seen:
# 0.0004 nats between the top two of a step, decided differently in a crowd and alone).
TIE_NATS = 0.01


class _Oracle:
    """Greedy tokens of a prompt decoded alone, on a runner without prefix reuse (cached),
    with the top log-probabilities at each step."""

    def __init__(self, path: str, mmproj: str = "", spans: Spans = lambda prompt: (), **kv: str):
        cfg = EngineConfig(
            ctx_size=CTX, parallel=1, batch_size=BATCH, threads=2, no_prefix_cache=True, **kv
        )
        runner = LlamaRunner(cfg, path, mmproj=mmproj)
        self.engine = LLMEngine(runner, block_size=BLOCK, prefix_cache=False)
        self.spans = spans  # a prompt's images (a vision model's machine)
        self.known: dict[tuple[int, ...], tuple[list[int], list[dict[int, float]]]] = {}

    def run(self, prompt: list[int], n: int) -> tuple[list[int], list[dict[int, float]]]:
        """The first n tokens and, per token, its top alternatives' log-probabilities."""
        have = self.known.get(tuple(prompt), ([], []))
        if len(have[0]) < n:
            params = sampling(max_tokens=n, ignore_eos=True, logprobs=4)
            self.engine.add_request("oracle", prompt, params, images=self.spans(prompt))
            out = run_to_completion(self.engine)["oracle"]
            tops = [dict(entry.top) for entry in out["logprobs"]]
            have = self.known[tuple(prompt)] = (out["tokens"], tops)
        return have[0][:n], have[1][:n]

    def tokens(self, prompt: list[int], n: int) -> list[int]:
        return self.run(prompt, n)[0]

    def agreeing(self, prompt: list[int], n: int, got: list[int]) -> list[int]:
        """The oracle's tokens, except where `got` took the other side of a tie: from there
        on, what the prompt alone gives after `got`'s choice."""
        tokens, tops = self.run(prompt, n)
        for i, (want, token) in enumerate(zip(tokens, got, strict=False)):
            if want != token:
                top = tops[i]
                if token in top and top[want] - top[token] < TIE_NATS:
                    rest = self.agreeing([*prompt, *got[: i + 1]], n - i - 1, got[i + 1 :])
                    return [*got[: i + 1], *rest]
                break
        return tokens


def _ram_tier() -> TierConfig:
    """A RAM tier as the server has one (the default window cache then parks nothing: a
    finished sequence is saved there), of a few states."""
    return TierConfig(64 * 2**20, 0, None, "tiny-gemma3", io_thread=False)


def _restoring(engine: LLMEngine) -> LLMEngine:
    """Every saved state worth restoring: the tiny model prefills faster than a restore, so
    measured costs would leave the restores untried."""
    assert engine.kv_manager.saved is not None
    engine.kv_manager.saved.costs = AlwaysRestore()
    return engine


class SlidingWindowMachine(EngineMachine):
    bos = BOS_ID
    path: str = ""
    alone: _Oracle | None = None  # not `oracle`: that is the base machine's method
    # A variant's engine settings: KV cache types and flash attention, --split-prefill.
    kv: dict[str, str | int] = {}

    own_copies = 0  # prefix copies into cells of their own (--swa-windows)

    def make_engine(self):
        cfg = EngineConfig(ctx_size=CTX, parallel=PARALLEL, batch_size=BATCH, threads=2, **self.kv)
        runner = LlamaRunner(cfg, self.path)
        count_copies(runner, self.copied)
        engine = LLMEngine(runner, block_size=BLOCK, max_running=PARALLEL, tiers=_ram_tier())
        return runner, _restoring(engine)

    def copied(self, length: int) -> None:
        type(self).own_copies += 1

    def expected(self, prompt: list[int], n: int) -> list[int]:
        assert self.alone is not None
        return self.alone.tokens(prompt, n)

    def expected_for(self, prompt: list[int], n: int, got: list[int]) -> list[int]:
        assert self.alone is not None
        return self.alone.agreeing(prompt, n, got)

    @invariant()
    def running_sequences_hold_their_window(self) -> None:
        for req in self.engine.scheduler.running:
            if req.num_computed_tokens:
                assert self.runner.holds_window(req.seq_id, req.num_computed_tokens), (
                    f"{req.request_id} decodes over a hole in its window"
                )

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self.runner.close()


def run_machine(
    machine: type[SlidingWindowMachine], path: str, max_examples: int,
    alone: _Oracle | None = None, steps: int = 40, at_least: int = 1,
) -> None:  # fmt: skip
    """Runs `machine` on the model at `path` against its oracle (default: the same model
    decoding alone), `max_examples` scaled by the profile but never below `at_least`."""
    machine.path = path
    machine.alone = alone or _Oracle(path)
    try:
        case = machine.TestCase()
        case.settings = settings(
            max_examples=max(examples(max_examples), at_least),
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        case.runTest()
    finally:
        machine.alone.engine.runner.close()


def test_sliding_window_state_machine(tiny_gemma3):
    run_machine(SlidingWindowMachine, tiny_gemma3, 60)
    assert SlidingWindowMachine.own_copies == 0  # the default: copies share cells


class _WindowDrafter:
    """Guesses from the model itself: a history's greedy continuation decoded alone,
    corrupted at a random position (or not at all), so every acceptance length and every
    rollback depth meets the window cache."""

    def __init__(self, alone: _Oracle, rng: random.Random):
        self.alone, self.rng = alone, rng

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        out = self.alone.tokens(list(tokens), k)
        wrong = self.rng.randrange(k + 2)  # k or more: all right
        if wrong < len(out):
            out[wrong] = (out[wrong] + 1) % 64
        return out


class SpeculatingSlidingWindowMachine(SlidingWindowMachine):
    """The same traffic with guesses of up to 4 tokens on the decodes: a rejected guess is
    rolled back after llama.cpp placed it, and the window cells it displaced must not be any
    the sequence still attends to (speculator.py says why they are not). Same oracles."""

    drafts = 0  # verified drafts over the whole run: the guesses did go in

    def make_engine(self):
        assert self.alone is not None
        cfg = EngineConfig(ctx_size=CTX, parallel=PARALLEL, batch_size=BATCH, threads=2, **self.kv)
        runner = LlamaRunner(cfg, self.path)
        count_copies(runner, self.copied)
        drafter = _WindowDrafter(self.alone, random.Random(0))
        spec = SpecConfig(draft_max=4, batch_max=8)
        engine = LLMEngine(
            runner, block_size=BLOCK, max_running=PARALLEL, speculation=spec,
            drafter=lambda _: drafter, tiers=_ram_tier(),
        )  # fmt: skip
        _restoring(engine)
        # Untimed, every guess goes in. Timed, which guesses pay follows the wall clock, so
        # the same rules would meet other waiting requests in a replay and Hypothesis fails
        # the run as flaky ("Inconsistent data generation") rather than finding a fault.
        assert engine.speculator is not None
        engine.speculator.timed = lambda tokens, seconds: None  # type: ignore[method-assign]
        return runner, engine

    def teardown(self) -> None:
        if self.engine.speculator is not None:
            type(self).drafts += self.engine.speculator.drafted
        super().teardown()


def test_sliding_window_state_machine_with_speculation(tiny_gemma3):
    run_machine(SpeculatingSlidingWindowMachine, tiny_gemma3, 40)
    assert SpeculatingSlidingWindowMachine.drafts > 0


class WindowSizedCacheMachine(SpeculatingSlidingWindowMachine):
    """The speculating traffic with --swa-windows: a window cache sized to the windows, where
    a prefix copy takes cells of its own and leaves checkpoints in the RAM tier, finished
    sequences are saved there instead of parked, and rollbacks meet a small cache. Same
    oracles."""

    kv: dict[str, str | int] = {"swa_windows": 1}
    own_copies = 0
    drafts = 0
    checkpoint_hints = True  # as a chat's requests carry (`Request.checkpoints`)

    def teardown(self) -> None:
        checkpoints = self.engine.kv_manager.checkpoints
        assert checkpoints is not None
        type(self).checkpoints_kept += checkpoints.kept
        super().teardown()


def test_sliding_window_state_machine_window_sized_cache(tiny_gemma3):
    run_machine(WindowSizedCacheMachine, tiny_gemma3, 40)
    machine = WindowSizedCacheMachine
    assert machine.own_copies > 0 and machine.drafts > 0 and machine.checkpoints_kept > 0


class StreamsMachine(SpeculatingSlidingWindowMachine):
    """The speculating traffic with --kv-streams: a cell stream per sequence id, so every
    prefix copy is a whole-stream copy cut back (its data landing at the next decode, or
    sooner where a save or restore needs the stream: `streams.py`), finished sequences park
    in their own stream, and the probe counts windows across streams. Same oracles."""

    kv: dict[str, str | int] = {"kv_streams": 1}
    own_copies = 0
    drafts = 0
    settled = 0

    def teardown(self) -> None:
        assert self.runner._copies is not None
        type(self).settled += self.runner._copies.settled
        super().teardown()


def test_sliding_window_state_machine_streams(tiny_gemma3):
    run_machine(StreamsMachine, tiny_gemma3, 40)
    assert StreamsMachine.own_copies > 0 and StreamsMachine.drafts > 0


class Splitting:
    """Mixed into a machine: its engine decodes prefill chunks of 4 tokens or more in a
    llama_decode apart from the step's other rows (`decode_parts.py`; the oracle decodes
    unsplit, its chunks never reaching the default), so most steps that prefill beside
    decodes split. Counts the split steps: the split did happen."""

    kv: dict[str, str | int] = {"split_prefill": 4}
    splits = 0

    def make_engine(self):
        runner, engine = super().make_engine()  # type: ignore[misc]
        execute = runner.execute

        def counted(items):
            result = execute(items)
            type(self).splits += result.split_calls
            return result

        runner.execute = counted
        return runner, engine


class SplittingSlidingWindowMachine(Splitting, SpeculatingSlidingWindowMachine):
    """Speculation with most steps split: a draft stays whole in its part, and each part's
    rejected guesses are rolled back before the next part is placed (`speculator.py`), so
    the window oracle holds here too."""

    drafts = 0  # its own count, not the plain speculating machine's


def test_sliding_window_state_machine_split_and_speculating(tiny_gemma3):
    run_machine(SplittingSlidingWindowMachine, tiny_gemma3, 40)
    assert SplittingSlidingWindowMachine.splits > 0
    assert SplittingSlidingWindowMachine.drafts > 0
