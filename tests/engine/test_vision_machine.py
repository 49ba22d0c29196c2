"""The engine state machine on the tiny vision model: tiny llama with the tiny projector.

The traffic of `tests/unit/test_engine_state_machine.py` (prompts that repeat, extend and
branch off earlier ones, n > 1, hang-ups, next turns), with images among the prompt symbols:
three images, each a run of its 16 ids (`image_token_ids`) with the projector's rows. So
requests send no image, an image seen before (its KV resident, parked or being computed by
another request) or another image after the same text, and branches cut through images.
Oracle: every answer equals its prompt, with its images, decoded alone on an engine without
prefix reuse (batch-shape float noise may break a near tie either way: `_Oracle.agreeing`).
The machine knows an image by its ids, so that the ids differ between images is proven by
`test_vision_reuse.py` (another image, one changed pixel), not here.
"""

from __future__ import annotations

import numpy as np

from ferrum.config import EngineConfig
from ferrum.engine.contracts import RgbImage
from ferrum.engine.engine import LLMEngine
from ferrum.engine.llama.runner import LlamaRunner
from ferrum.engine.request import ImageSpan, image_token_ids
from tests.engine.test_sliding_window_machine import (
    BATCH,
    BLOCK,
    CTX,
    PARALLEL,
    SlidingWindowMachine,
    Splitting,
    _Oracle,
    run_machine,
)  # fmt: skip
from tests.unit.test_engine_state_machine import image_spans


def _rows(path: str, mmproj: str, seeds: tuple[int, ...]) -> dict[int, np.ndarray]:
    """Each image's ids → its rows, one per id, from the projector."""
    cfg = EngineConfig(ctx_size=CTX, parallel=1, batch_size=BATCH, threads=2)
    runner = LlamaRunner(cfg, path, mmproj=mmproj)
    rows: dict[int, np.ndarray] = {}
    try:
        for seed in seeds:
            pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
            image = RgbImage(32, 32, pixels.tobytes())
            assert runner.images is not None
            (embeds,) = [p for p in runner.images.encode(image) if not isinstance(p, list)]
            ids = image_token_ids(image.digest, len(embeds))
            rows |= dict(zip(ids, embeds, strict=True))
    finally:
        runner.close()
    return rows


class VisionMachine(SlidingWindowMachine):
    mmproj: str = ""
    rows: dict[int, np.ndarray] = {}

    def make_engine(self):
        cfg = EngineConfig(ctx_size=CTX, parallel=PARALLEL, batch_size=BATCH, threads=2, **self.kv)
        runner = LlamaRunner(cfg, self.path, mmproj=self.mmproj)
        return runner, LLMEngine(runner, block_size=BLOCK, max_running=PARALLEL)

    def image_rows(self, ids: list[int]) -> np.ndarray:
        return _stacked(ids)


def _stacked(ids: list[int]) -> np.ndarray:
    return np.stack([VisionMachine.rows[i] for i in ids])


def _images(tiny_llama: str, mmproj: str) -> _Oracle:
    """The machines' three images set up; the oracle that decodes a prompt alone with them."""
    VisionMachine.path, VisionMachine.mmproj = tiny_llama, mmproj
    VisionMachine.rows = _rows(tiny_llama, mmproj, (1, 2, 3))
    ids = list(VisionMachine.rows)
    n = len(ids) // 3
    VisionMachine.images = tuple(ids[k * n : (k + 1) * n] for k in range(3))
    return _Oracle(tiny_llama, mmproj=mmproj, spans=lambda prompt: image_spans(prompt, _stacked))


def test_vision_state_machine(tiny_llama, mmproj):
    run_machine(VisionMachine, tiny_llama, 30, _images(tiny_llama, mmproj), steps=30)


class SplittingVisionMachine(Splitting, VisionMachine):
    """The tiny llama's traffic, images among it, with most steps split (an image item's token
    tail after its last image run counts by its own length)."""


def test_vision_state_machine_split(tiny_llama, mmproj):
    alone = _images(tiny_llama, mmproj)
    # At least 6 examples: the dev profile's 2 may not run a prefill beside a decode.
    run_machine(SplittingVisionMachine, tiny_llama, 20, alone, steps=30, at_least=6)
    assert SplittingVisionMachine.splits > 0


def _pieces(prompt: list[int]) -> list[tuple[int, list[int] | None]]:
    """The prompt as (position, the whole image starting there, or None for one id)."""
    out, i = [], 0
    while i < len(prompt):
        image = next((m for m in VisionMachine.images if prompt[i : i + len(m)] == m), None)
        out.append((i, image))
        i += len(image) if image is not None else 1
    return out


def _whole(prompt: list[int]) -> list[int]:
    """The prompt with every part of an image that is not a whole image left out: prompts
    from the API hold whole images only, and under attention both ways the first rows of a
    part would differ from the same rows of the whole (here they would share its ids)."""
    out: list[int] = []
    for i, image in _pieces(prompt):
        out += image if image is not None else [prompt[i]] if prompt[i] >= 0 else []
    return out


def _whole_spans(prompt: list[int]) -> tuple[ImageSpan, ...]:
    """Each image its own span, even side by side (the API splices them so)."""
    pieces = _pieces(prompt)
    assert all(image is not None or prompt[i] >= 0 for i, image in pieces), "a part of an image"
    return tuple(ImageSpan(i, _stacked(image)) for i, image in pieces if image is not None)


class WholeImagesCappedMachine(VisionMachine):
    """A projector of Gemma 3's type (its images attend both ways, so each is decoded whole,
    never cut between steps) and a prefill cap of 5 positions beside the decodes: images
    pass the cap alone, text waits behind them. Prompts hold whole images only."""

    def _draw_prompt(self, data):
        prompt, like = super()._draw_prompt(data)
        return _whole(prompt) or [self.bos], like

    def spans(self, prompt: list[int]) -> tuple[ImageSpan, ...]:
        return _whole_spans(prompt)

    def make_engine(self):
        cfg = EngineConfig(ctx_size=CTX, parallel=PARALLEL, batch_size=BATCH, threads=2, **self.kv)
        runner = LlamaRunner(cfg, self.path, mmproj=self.mmproj)
        engine = LLMEngine(runner, block_size=BLOCK, max_running=PARALLEL, prefill_cap=5)
        assert engine.scheduler.whole_images
        return runner, engine


def test_vision_state_machine_whole_images_capped(tiny_llama, mmproj_gemma3):
    _images(tiny_llama, mmproj_gemma3)
    alone = _Oracle(tiny_llama, mmproj=mmproj_gemma3, spans=_whole_spans)
    run_machine(WholeImagesCappedMachine, tiny_llama, 20, alone, steps=30)
