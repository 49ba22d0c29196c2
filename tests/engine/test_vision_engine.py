"""Images through the engine on the tiny llama with the tiny projector (`tests/tiny_vision.py`).

Oracles: ferrum's greedy tokens equal those of llama.cpp's own `mtmd_helper_eval_chunks` on a
fresh context; batched with text requests equals alone; another image (or one pixel) changes
what the model sees. Each with a causal projector and with one of Gemma 3's type, whose
images attend to each other both ways and so must never be cut between steps. Reuse of an
image's KV: `test_vision_reuse.py`.
"""

from __future__ import annotations

import ctypes

import llama_cpp as ll
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as mt

from ferrum.api.prompting.images import splice
from ferrum.engine.contracts import RgbImage
from ferrum.engine.request import ImageSpan
from ferrum.errors import InvalidRequest
from tests.factories import llama_engine, run_to_completion, sampling
from tests.tiny_vision import N_IMAGE_TOKENS

BEFORE, AFTER = "look at the", " and say what you see"
MAX_TOKENS = 10


def _image(seed: int, size: int = 32) -> RgbImage:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return RgbImage(size, size, pixels.tobytes())


def _prompt(
    engine, image: RgbImage, after: str = AFTER, encoder=None
) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """BEFORE, the image, `after`: spliced as the API splices a chat's image (its ids)."""
    vocab = engine.runner.vocab
    marked = vocab.tokenize(BEFORE, True, False) + [-1] + vocab.tokenize(after, False, False)
    return splice(marked, [image], engine.runner.images if encoder is None else encoder)


def _run(engine, requests: dict[str, RgbImage | None]) -> dict[str, list[int]]:
    for rid, image in requests.items():
        params = sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        if image is None:
            engine.add_request(rid, engine.runner.vocab.tokenize(BEFORE + AFTER, True, False),
                               params)  # fmt: skip
        else:
            prompt, spans = _prompt(engine, image)
            engine.add_request(rid, prompt, params, images=spans)
    results = run_to_completion(engine)
    return {rid: results[rid]["tokens"] for rid in requests}


def _helper_greedy(model_path: str, mmproj: str, image: RgbImage) -> list[int]:
    """llama.cpp's own path: mtmd_tokenize + mtmd_helper_eval_chunks, then argmax decoding."""
    model = ll.llama_model_load_from_file(model_path.encode(), ll.llama_model_default_params())
    cparams = ll.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 256, 64, 64
    cparams.n_threads = cparams.n_threads_batch = 2
    ctx = ll.llama_init_from_model(model, cparams)
    params = mt.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings = False, 2, False
    mctx = mt.mtmd_init_from_file(mmproj.encode(), model, params)
    data = (ctypes.c_uint8 * len(image.pixels)).from_buffer_copy(image.pixels)
    bitmap = mt.mtmd_bitmap_init(image.width, image.height, data)
    chunks = mt.mtmd_input_chunks_init()
    batch = ll.llama_batch_init(1, 0, 1)
    try:
        text = (BEFORE + mt.mtmd_default_marker().decode() + AFTER).encode()
        inp = mt.mtmd_input_text(text, len(text), True, False)
        bitmaps = (mt.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mt.mtmd_tokenize(mctx, chunks, ctypes.byref(inp), bitmaps, 1) == 0
        n_past = ll.llama_pos(0)
        assert mt.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 64, True,
                                          ctypes.byref(n_past)) == 0  # fmt: skip
        n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        out, pos = [], n_past.value
        for _ in range(MAX_TOKENS):
            logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            token = int(np.argmax(logits))
            out.append(token)
            batch.token[0], batch.pos[0], batch.n_seq_id[0] = token, pos, 1
            batch.seq_id[0][0], batch.logits[0], batch.n_tokens = 0, 1, 1
            assert ll.llama_decode(ctx, batch) == 0
            pos += 1
        return out
    finally:
        ll.llama_batch_free(batch)
        mt.mtmd_input_chunks_free(chunks)
        mt.mtmd_bitmap_free(bitmap)
        mt.mtmd_free(mctx)
        ll.llama_free(ctx)
        ll.llama_model_free(model)


@pytest.fixture(params=["mlp", "gemma3"])
def projector(request, mmproj, mmproj_gemma3) -> str:
    """Both kinds of image decode: causal (llava's mlp) and attention both ways (Gemma 3)."""
    return mmproj if request.param == "mlp" else mmproj_gemma3


def test_image_request_equals_llama_cpps_own_helper(tiny_llama, projector):
    image = _image(1)
    with llama_engine(tiny_llama, mmproj=projector) as engine:
        ours = _run(engine, {"a": image})["a"]
    assert ours == _helper_greedy(tiny_llama, projector, image)


@pytest.mark.parametrize("whole", [True, False])
def test_a_non_causal_image_is_decoded_whole(tiny_llama, mmproj_gemma3, whole):
    """A 20-position budget would end the first chunk 8 rows into the image: the scheduler
    cuts before it instead and decodes it whole in the next step, giving llama.cpp's own
    logits. The oracle's teeth: cut inside (the old scheduler), the image's first rows
    never see its last ones and the first token's log-probabilities move."""
    image = _image(1)
    params = sampling(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=5)
    with llama_engine(tiny_llama, mmproj=mmproj_gemma3, parallel=1, batch=64) as engine:
        prompt, spans = _prompt(engine, image)
        engine.add_request("wide", prompt, params, images=spans)
        wide = run_to_completion(engine)["wide"]
    assert spans[0].start < 20 < spans[0].end  # where a 20-position budget would cut
    with llama_engine(tiny_llama, mmproj=mmproj_gemma3, parallel=1, batch=20) as engine:
        assert engine.runner.info.images_whole
        engine.scheduler.whole_images = whole
        engine.add_request("narrow", prompt, params, images=spans)
        narrow = run_to_completion(engine)["narrow"]
    first = [lp for _, lp in narrow["logprobs"][0].top]
    same = first == pytest.approx([lp for _, lp in wide["logprobs"][0].top], abs=1e-4)
    assert same is whole


def test_an_image_longer_than_a_step_is_refused_by_name(tiny_llama, mmproj_gemma3):
    """Where images go whole, one that cannot fit a step beside the other slots' decodes
    is a 400, never a request that waits for ever."""
    with llama_engine(tiny_llama, mmproj=mmproj_gemma3, parallel=8, batch=20) as engine:
        prompt, spans = _prompt(engine, _image(1))
        with pytest.raises(InvalidRequest, match="does not fit one step"):
            engine.add_request("a", prompt, sampling(), images=spans)
        assert not engine.has_work


def test_the_image_is_seen_not_its_placeholders(tiny_llama, mmproj):
    with llama_engine(tiny_llama, mmproj=mmproj) as engine:
        prompt, spans = _prompt(engine, _image(1))
        assert len(prompt) == len(engine.runner.vocab.tokenize(BEFORE + AFTER, True, False)) + (
            N_IMAGE_TOKENS
        )
        seen = _run(engine, {"a": _image(1)})["a"]
        params = sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        blind = [max(t, 0) for t in prompt]  # token 0 at the image's positions
        engine.add_request("blind", blind, params)
        blind = run_to_completion(engine)["blind"]["tokens"]
    assert seen != blind


def test_batched_with_text_and_images_equals_alone(tiny_llama, projector):
    # batch 32 < 3 prompts of ~24 positions: prefill chunks cut through the images (before
    # them where images go whole)
    requests = {"t0": None, "i1": _image(1), "t2": None, "i3": _image(3), "i4": _image(4)}
    with llama_engine(tiny_llama, mmproj=projector, batch=32) as engine:
        together = _run(engine, requests)
        alone = {rid: _run(engine, {rid: image})[rid] for rid, image in requests.items()}
    assert together == alone


def test_one_changed_pixel_changes_the_embeddings(tiny_llama, mmproj):
    image = _image(5)
    pixels = bytearray(image.pixels)
    pixels[0] ^= 0xFF
    changed = RgbImage(image.width, image.height, bytes(pixels))
    with llama_engine(tiny_llama, mmproj=mmproj) as engine:
        (a,) = [p for p in engine.runner.images.encode(image) if not isinstance(p, list)]
        (b,) = [p for p in engine.runner.images.encode(changed) if not isinstance(p, list)]
    assert a.shape == b.shape == (N_IMAGE_TOKENS, 64)
    assert not np.allclose(a, b)
