"""The tiny random-weight vision projector (mmproj) the tests pair with `tiny_models.py`'s
llama, and the images they send: `ferrum/bench/vision_files.py` writes it (one writer for the
tests and the vision study) at its `TINY` shape, here with the tests' seed and width."""

from __future__ import annotations

import pathlib

from ferrum.bench.vision_files import (
    TINY,
    TINY_GEMMA3,
    Shape,
    data_uri,
    flat_image_bytes,
    image_bytes,
    write_mmproj,
)
from tests.tiny_models import N_EMBD

__all__ = [
    "N_IMAGE_TOKENS",
    "TINY_GEMMA3",
    "data_uri",
    "flat_image_bytes",
    "image_bytes",
    "write_tiny_mmproj",
]

SEED = 4321
N_IMAGE_TOKENS = TINY.image_tokens


def write_tiny_mmproj(path: pathlib.Path, shape: Shape = TINY) -> pathlib.Path:
    """Write the projector GGUF (architecture "clip", projector type "mlp" unless `shape`
    says otherwise: `TINY_GEMMA3`) to `path`."""
    return write_mmproj(pathlib.Path(path), N_EMBD, shape, SEED, "tiny-mmproj-test")
