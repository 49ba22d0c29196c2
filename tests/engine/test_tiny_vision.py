"""The tiny projector of `tests/tiny_vision.py` is a real libmtmd model: loaded beside the tiny
llama, it turns a small RGB image into one chunk of finite embeddings of the llama's width."""

from __future__ import annotations

import ctypes

import llama_cpp as ll
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as mt

from tests.tiny_models import N_EMBD
from tests.tiny_vision import N_IMAGE_TOKENS, write_tiny_mmproj


@pytest.fixture(scope="module")
def mtmd(tiny_llama, tmp_path_factory):
    mmproj = write_tiny_mmproj(tmp_path_factory.mktemp("vision") / "mmproj.gguf")
    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(tiny_llama.encode(), ll.llama_model_default_params())
    params = mt.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings = False, 2, False
    ctx = mt.mtmd_init_from_file(str(mmproj).encode(), model, params)
    assert ctx, "libmtmd refused the tiny projector"
    yield ctx
    mt.mtmd_free(ctx)
    ll.llama_model_free(model)


def _image(width: int, height: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _encode(ctx, pixels: np.ndarray) -> tuple[list[tuple[int, int, int]], np.ndarray]:
    """Tokenize "<text> <marker> <text>" with the image; return each chunk's (type, n_tokens,
    n_pos) and the image chunk's embeddings."""
    height, width, _ = pixels.shape
    data = (ctypes.c_uint8 * pixels.size).from_buffer_copy(pixels.tobytes())
    bitmap = mt.mtmd_bitmap_init(width, height, data)
    chunks = mt.mtmd_input_chunks_init()
    try:
        prompt = b"look at " + mt.mtmd_default_marker() + b" and say"
        text = mt.mtmd_input_text(prompt, len(prompt), True, True)
        bitmaps = (mt.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mt.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        shapes, embd = [], None
        for i in range(mt.mtmd_input_chunks_size(chunks)):
            chunk = mt.mtmd_input_chunks_get(chunks, i)
            kind = mt.mtmd_input_chunk_get_type(chunk)
            n_tokens = mt.mtmd_input_chunk_get_n_tokens(chunk)
            shapes.append((kind, n_tokens, mt.mtmd_input_chunk_get_n_pos(chunk)))
            if kind == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                assert mt.mtmd_encode_chunk(ctx, chunk) == 0
                out = mt.mtmd_get_output_embd(ctx)
                embd = np.ctypeslib.as_array(out, shape=(n_tokens, N_EMBD)).copy()
        assert embd is not None
        return shapes, embd
    finally:
        mt.mtmd_input_chunks_free(chunks)
        mt.mtmd_bitmap_free(bitmap)


def test_an_image_becomes_one_chunk_of_finite_embeddings_of_the_models_width(mtmd):
    shapes, embd = _encode(mtmd, _image(24, 20, seed=1))
    text, image = mt.MTMD_INPUT_CHUNK_TYPE_TEXT, mt.MTMD_INPUT_CHUNK_TYPE_IMAGE
    assert [kind for kind, _, _ in shapes] == [text, image, text]
    assert shapes[1] == (image, N_IMAGE_TOKENS, N_IMAGE_TOKENS)
    assert embd.shape == (N_IMAGE_TOKENS, N_EMBD)
    assert np.isfinite(embd).all() and embd.std() > 0.1


def test_the_encoding_depends_on_the_pixels_and_only_on_them(mtmd):
    pixels = _image(32, 32, seed=2)
    _, first = _encode(mtmd, pixels)
    _, again = _encode(mtmd, pixels)
    changed = pixels.copy()
    changed[0, 0] = 255 - changed[0, 0]
    _, other = _encode(mtmd, changed)
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)
