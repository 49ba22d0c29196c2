"""Prefix copies on sliding-window models: a donor whose window lost cells is passed over.

llama.cpp recycles a window-cache cell once its only owner is `n_swa` positions past it, so a
parked sequence keeps its recent window but not its old one. The scenario (issue 10), scaled to
the tiny Gemma 3 (window 8, 256 cells): X parks; A = S + question parks after 40 tokens; Y's
admission evicts X and its prefill runs through X's freed cells into A's old window cells;
B = S + another question then shares S with A, whose window around the end of S is gone.
"""

from __future__ import annotations

import random

import llama_cpp as ll

from ferrum.engine.contracts import BatchItem
from ferrum.engine.engine import LLMEngine
from tests.factories import llama_engine, run_to_completion, sampling
from tests.tiny_models import BOS_ID


def _engine(path: str, prefix_cache: bool = True, swa_windows: bool = False):
    return llama_engine(
        path, prefix_cache, ctx=256, parallel=2, batch=32, swa_windows=swa_windows
    )


def _run(engine: LLMEngine, rid: str, prompt: list[int], n: int) -> dict:
    engine.add_request(rid, prompt, sampling(max_tokens=n, ignore_eos=True))
    return run_to_completion(engine)[rid]


def _prompts(seed: int = 3) -> dict[str, list[int]]:
    rng = random.Random(seed)

    def rand(n: int) -> list[int]:
        return [rng.randrange(5, 690) for _ in range(n)]

    x, s = [BOS_ID, *rand(40)], [BOS_ID, *rand(30)]
    a, b, y = s + rand(3), s + rand(3), [BOS_ID, *rand(130)]
    return {"x": x, "s": s, "a": a, "b": b, "y": y}


def _holes_in_a(engine: LLMEngine, p: dict[str, list[int]]) -> int:
    """Runs X, A, Y; returns A's parked sequence id, whose old window cells Y took."""
    _run(engine, "x", p["x"], 4)
    _run(engine, "a", p["a"], 40)
    _run(engine, "y", p["y"], 4)
    (donor,) = [q for q in engine.kv_manager.parked if q.all_token_ids[: len(p["s"])] == p["s"]]
    return donor.seq_id


def test_probe_sees_a_hole_above_the_lowest_position(tiny_gemma3):
    """`llama_memory_seq_pos_min` cannot see a hole above the lowest position; the probe can."""
    with _engine(tiny_gemma3) as engine:
        runner = engine.runner
        runner.execute([BatchItem(0, list(range(5, 25)), 0)])
        ll.llama_memory_seq_rm(runner._mem, 0, 14, 16)
        assert ll.llama_memory_seq_pos_min(runner._mem, 0) == 0
        assert not runner.holds_window(0, 20)  # a copy of [0, 20) attends to [13, 20)
        assert not runner.holds_window(0, 15)  # [8, 15) lacks 14
        assert runner.holds_window(0, 14)  # [7, 14) is whole
        assert runner.holds_window(0, 5)  # [0, 5)


def test_donor_without_its_window_is_passed_over(tiny_gemma3):
    p = _prompts()
    with _engine(tiny_gemma3, prefix_cache=False) as engine:
        fresh = _run(engine, "b", p["b"], 12)["tokens"]
    with _engine(tiny_gemma3) as engine:
        donor = _holes_in_a(engine, p)
        # pos_min reports the window cache: the dense cache still holds A from position 0.
        assert ll.llama_memory_seq_pos_min(engine.runner._mem, donor) > len(p["s"]) - 8
        assert not engine.runner.holds_window(donor, len(p["s"]))
        b = _run(engine, "b", p["b"], 12)
        assert engine.kv_manager.window_fallbacks == 1
        assert b["final"].cached_tokens == 0
        assert b["tokens"] == fresh


def test_without_the_guard_the_copy_decodes_over_the_hole(tiny_gemma3, monkeypatch):
    """The control: the scenario above really corrupts output when the window is not checked
    (a copy shares the donor's cells; with --swa-windows a copy into cells of its own checks
    the window once more as it writes the state out)."""
    p = _prompts()
    with _engine(tiny_gemma3, prefix_cache=False) as engine:
        fresh = _run(engine, "b", p["b"], 12)["tokens"]
    with _engine(tiny_gemma3) as engine:
        _holes_in_a(engine, p)
        monkeypatch.setattr(engine.runner, "holds_window", lambda seq_id, length: True)
        b = _run(engine, "b", p["b"], 12)
        assert b["final"].cached_tokens == len(p["s"])
        assert b["tokens"] != fresh


def test_a_copy_into_its_own_cells_checks_the_window_as_it_writes_it(tiny_gemma3, monkeypatch):
    """--swa-windows: even with the plan's check defeated, the copy's state is written only
    from a donor that holds the window, so the output is a fresh prefill's."""
    p = _prompts()
    with _engine(tiny_gemma3, prefix_cache=False) as engine:
        fresh = _run(engine, "b", p["b"], 12)["tokens"]
    with _engine(tiny_gemma3, swa_windows=True) as engine:
        assert engine.info.own_copies
        _holes_in_a(engine, p)
        monkeypatch.setattr(engine.runner, "holds_window", lambda seq_id, length: True)
        b = _run(engine, "b", p["b"], 12)
        assert b["final"].cached_tokens == 0
        assert b["tokens"] == fresh
