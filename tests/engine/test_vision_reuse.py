"""Prefix reuse over images on the tiny llama with the tiny projector (`tests/tiny_vision.py`).

An image's positions hold ids drawn from its pixels (`request.image_token_ids`), so the
prefix index keys the blocks that hold an image by that image. Oracles, greedy on llama.cpp:
every answer equals the same request alone on an engine without prefix reuse, token for
token; the same image with a new question reuses the image's KV (resident, parked, restored
from the RAM tier or, after a restart, from disk); another image, or the same one with one
pixel changed, reuses nothing past the text before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ferrum.config import EngineConfig
from ferrum.engine.contracts import RgbImage
from ferrum.engine.engine import LLMEngine
from ferrum.engine.kv.tiers import TierConfig
from ferrum.engine.llama.runner import LlamaRunner
from ferrum.engine.request import ImageSpan
from tests.engine.test_vision_engine import AFTER, MAX_TOKENS, _image, _prompt
from tests.factories import llama_engine, run_to_completion, sampling
from tests.unit.test_tiers import AlwaysRestore

Asked = tuple[RgbImage, str]  # an image and the question after it
OTHER = " and name its colours"
THIRD = " and count what is there"


def _changed_pixel(image: RgbImage) -> RgbImage:
    pixels = bytearray(image.pixels)
    pixels[len(pixels) // 2] ^= 0x01  # one channel of one pixel, by one
    return RgbImage(image.width, image.height, bytes(pixels))


def _submit(engine: LLMEngine, rid: str, asked: Asked) -> tuple[ImageSpan, ...]:
    prompt, spans = _prompt(engine, asked[0], asked[1])
    params = sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request(rid, prompt, params, images=spans)
    return spans


def _ask(engine: LLMEngine, asked: dict[str, Asked]) -> dict[str, tuple[list[int], int, int]]:
    """Each request's tokens, cached positions and its image's first position, all at once."""
    spans = {rid: _submit(engine, rid, a) for rid, a in asked.items()}
    out = run_to_completion(engine)
    engine.check_integrity()
    return {rid: (out[rid]["tokens"], out[rid]["final"].cached_tokens, spans[rid][0].start)
            for rid in asked}  # fmt: skip


def _alone(tiny_llama: str, mmproj: str, asked: dict[str, Asked]) -> dict[str, list[int]]:
    with llama_engine(tiny_llama, mmproj=mmproj, prefix_cache=False) as fresh:
        return {rid: _ask(fresh, {rid: a})[rid][0] for rid, a in asked.items()}


def _image_end(start: int) -> int:
    from tests.tiny_vision import N_IMAGE_TOKENS

    return start + N_IMAGE_TOKENS


def test_another_image_with_the_same_question_is_answered_as_alone(tiny_llama, mmproj):
    asked = {"a": (_image(1), AFTER), "b": (_image(2), AFTER)}
    with llama_engine(tiny_llama, mmproj=mmproj) as engine:
        first = _ask(engine, {"a": asked["a"]})
        assert len(engine.kv_manager.parked) == 1  # image 1's KV is there to be misused
        second = _ask(engine, {"b": asked["b"]})
    alone = _alone(tiny_llama, mmproj, asked)
    tokens, cached, image_at = second["b"]
    assert cached <= image_at  # at most the text before the image
    assert tokens == alone["b"] != first["a"][0]
    assert first["a"][0] == alone["a"]


def test_the_same_image_with_a_new_question_reuses_its_kv(tiny_llama, mmproj):
    asked = {"a": (_image(1), AFTER), "b": (_image(1), OTHER), "c": (_image(1), AFTER)}
    with llama_engine(tiny_llama, mmproj=mmproj) as engine:
        got = {rid: _ask(engine, {rid: a})[rid] for rid, a in asked.items()}
    alone = _alone(tiny_llama, mmproj, asked)
    assert got["a"][1] == 0
    for rid in ("b", "c"):
        tokens, cached, image_at = got[rid]
        assert cached >= _image_end(image_at), rid  # the image's KV was not computed again
        assert tokens == alone[rid], rid
    assert got["c"][0] == got["a"][0]  # the same question again: the same answer


def test_one_changed_pixel_changes_the_key(tiny_llama, mmproj):
    image = _image(5)
    changed = _changed_pixel(image)
    asked = {"a": (image, AFTER), "b": (changed, AFTER)}
    with llama_engine(tiny_llama, mmproj=mmproj) as engine:
        (prompt_a, _), (prompt_b, _) = _prompt(engine, image), _prompt(engine, changed)
        first = _ask(engine, {"a": asked["a"]})
        second = _ask(engine, {"b": asked["b"]})
    tokens, cached, image_at = second["b"]
    assert prompt_a[:image_at] == prompt_b[:image_at]
    assert prompt_a[image_at] != prompt_b[image_at] and prompt_a[image_at] < 0
    assert cached <= image_at
    assert tokens == _alone(tiny_llama, mmproj, asked)["b"]
    assert first["a"][0] == _alone(tiny_llama, mmproj, {"a": asked["a"]})["a"]


def test_image_requests_batched_with_reuse_equal_each_alone(tiny_llama, mmproj):
    """Several image requests at once, the same image more than once among them: the later
    ones wait for the first to compute the image's prefix, then share it; prefill chunks of
    a 32-token batch cut through the images."""
    asked = {
        "a1": (_image(1), AFTER), "a2": (_image(1), OTHER), "b": (_image(2), AFTER),
        "a3": (_image(1), THIRD), "c": (_image(3), OTHER), "b2": (_image(2), THIRD),
    }  # fmt: skip
    with llama_engine(tiny_llama, mmproj=mmproj, batch=32) as engine:
        together = _ask(engine, asked)
    alone = _alone(tiny_llama, mmproj, asked)
    assert {rid: t for rid, (t, _, _) in together.items()} == alone
    shared = [rid for rid, (_, cached, at) in together.items() if cached >= _image_end(at)]
    assert set(shared) >= {"a2", "a3", "b2"}, together
    assert together["c"][1] <= together["c"][2]


@contextmanager
def _tiered(path: str, mmproj: str, folder: Path) -> Iterator[LLMEngine]:
    config = EngineConfig(ctx_size=256, parallel=2, batch_size=64, threads=2)
    runner = LlamaRunner(config, path, mmproj=mmproj)
    tiers = TierConfig(64 << 20, 1 << 30, folder, "tiny-vision", io_thread=False)
    try:
        engine = LLMEngine(runner, block_size=16, tiers=tiers)
        assert engine.kv_manager.saved is not None
        engine.kv_manager.saved.costs = AlwaysRestore()
        yield engine
        engine.shutdown()
    finally:
        runner.close()


def test_an_image_is_reused_from_the_ram_and_disk_tiers(tiny_llama, mmproj, tmp_path):
    asked = {"a": (_image(1), AFTER), "b": (_image(1), OTHER), "c": (_image(1), THIRD),
             "d": (_image(2), OTHER)}  # fmt: skip
    with _tiered(tiny_llama, mmproj, tmp_path) as engine:
        got = _ask(engine, {"a": asked["a"]})
        while engine.kv_manager.evict_one():  # saved to the RAM tier
            pass
        got |= _ask(engine, {"b": asked["b"]})
        ram = engine.kv_manager.saved.snapshot()
    with _tiered(tiny_llama, mmproj, tmp_path) as engine:  # a restart: only the disk is left
        got |= _ask(engine, {"c": asked["c"]})
        got |= _ask(engine, {"d": asked["d"]})
        disk = engine.kv_manager.saved.snapshot()
    assert ram.restores >= 1 and disk.restores >= 1 and disk.failures == 0
    for rid in ("b", "c"):
        assert got[rid][1] >= _image_end(got[rid][2]), rid
    assert got["d"][1] <= got["d"][2]  # another image: the text before it at most
    alone = _alone(tiny_llama, mmproj, asked)
    assert {rid: t for rid, (t, _, _) in got.items()} == alone


def test_image_rows_reach_the_engine_read_only_and_unchanged(tiny_llama, mmproj):
    """The encoder's rows are kept for later requests (`EncodedImages`): decoding must not
    write into them."""
    from ferrum.api.prompting.encoded_images import EncodedImages

    class Counting:
        def on_encoded(self, seconds: float) -> None: ...
        def on_encoding_reused(self) -> None: ...

    with llama_engine(tiny_llama, mmproj=mmproj) as engine:
        kept = EncodedImages(engine.runner.images, Counting())
        prompt, spans = _prompt(engine, _image(1), encoder=kept.scoped(""))
        before = spans[0].embeds.copy()
        assert not spans[0].embeds.flags.writeable
        engine.add_request("a", prompt, sampling(max_tokens=4), images=spans)
        run_to_completion(engine)
        assert np.array_equal(spans[0].embeds, before)
        again = _prompt(engine, _image(1), encoder=kept.scoped(""))[1][0].embeds
    assert again is spans[0].embeds and kept.kept == 1
