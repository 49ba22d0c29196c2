"""A tiny random-weight vision projector (mmproj) GGUF that libmtmd loads and encodes.

No vision model is on the package index, so tests pair the tiny llama of `tiny_models.py`
with this projector: llama.cpp's llava "mlp" type, the simplest libmtmd builds on a CPU
(`tools/mtmd/clip.cpp` `load_hparams`/`load_tensors`, graph `models/llava.cpp`):

    RGB image ──resize to IMAGE_SIZE²──▶ conv patches (PATCH_SIZE²) + position embeddings
      ──▶ ViT blocks (ln1, attn q/k/v/out, ln2, ffn up/down; the llava graph stops one block
          before the last) ──▶ mm.0 (linear) ─ GELU ─ mm.2 (linear) ──▶ N_EMBD per patch

so an image is `N_IMAGE_TOKENS` (IMAGE_SIZE / PATCH_SIZE)² embeddings of the language
model's width (`mtmd_init_from_file` refuses a projector whose output width differs from the
text model's n_embd). Weights are seeded and random: only the mechanics are meaningful.
"""

from __future__ import annotations

import base64
import io
import pathlib

import gguf
import numpy as np
from PIL import Image

from tests.tiny_models import N_EMBD

SEED = 4321
IMAGE_SIZE = 32
PATCH_SIZE = 8
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
# V_FF != V_EMBD: clip.cpp takes an ffn_down whose input width is V_EMBD for a swapped pair.
V_EMBD, V_HEADS, V_FF, V_LAYERS = 32, 2, 64, 2
MM_HIDDEN = 64


def _normal(rng: np.random.Generator, *shape: int, std: float) -> np.ndarray:
    return rng.normal(0.0, std, size=shape).astype(np.float32)


def _block(rng: np.random.Generator, i: int) -> dict[str, np.ndarray]:
    """One ViT block; numpy shapes are llama.cpp's {ne0, ne1} reversed."""
    std = V_EMBD**-0.5
    tensors: dict[str, np.ndarray] = {}
    for name in ("ln1", "ln2"):
        tensors[f"v.blk.{i}.{name}.weight"] = np.ones(V_EMBD, dtype=np.float32)
        tensors[f"v.blk.{i}.{name}.bias"] = np.zeros(V_EMBD, dtype=np.float32)
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        tensors[f"v.blk.{i}.{name}.weight"] = _normal(rng, V_EMBD, V_EMBD, std=std)
        tensors[f"v.blk.{i}.{name}.bias"] = np.zeros(V_EMBD, dtype=np.float32)
    tensors[f"v.blk.{i}.ffn_up.weight"] = _normal(rng, V_FF, V_EMBD, std=std)
    tensors[f"v.blk.{i}.ffn_up.bias"] = np.zeros(V_FF, dtype=np.float32)
    tensors[f"v.blk.{i}.ffn_down.weight"] = _normal(rng, V_EMBD, V_FF, std=V_FF**-0.5)
    tensors[f"v.blk.{i}.ffn_down.bias"] = np.zeros(V_EMBD, dtype=np.float32)
    return tensors


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    fan_in = 3 * PATCH_SIZE * PATCH_SIZE
    tensors = {
        # conv kernel, ggml {kw, kh, channels, out}
        "v.patch_embd.weight": _normal(rng, V_EMBD, 3, PATCH_SIZE, PATCH_SIZE, std=fan_in**-0.5),
        "v.position_embd.weight": _normal(rng, N_IMAGE_TOKENS, V_EMBD, std=0.5),
    }
    for i in range(V_LAYERS):
        tensors |= _block(rng, i)
    # Large enough that the image embeddings move the language model's logits visibly.
    tensors["mm.0.weight"] = _normal(rng, MM_HIDDEN, V_EMBD, std=V_EMBD**-0.5)
    tensors["mm.0.bias"] = np.zeros(MM_HIDDEN, dtype=np.float32)
    tensors["mm.2.weight"] = _normal(rng, N_EMBD, MM_HIDDEN, std=2.0 * MM_HIDDEN**-0.5)
    tensors["mm.2.bias"] = np.zeros(N_EMBD, dtype=np.float32)
    return tensors


def write_tiny_mmproj(path: pathlib.Path) -> pathlib.Path:
    """Write the projector GGUF (architecture "clip", projector type "mlp") to `path`."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_name("tiny-mmproj-test")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", V_EMBD)
    writer.add_uint32("clip.vision.feed_forward_length", V_FF)
    writer.add_uint32("clip.vision.block_count", V_LAYERS)
    writer.add_uint32("clip.vision.attention.head_count", V_HEADS)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_uint32("clip.vision.projection_dim", N_EMBD)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    for name, data in _tensors().items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def image_bytes(seed: int, size: tuple[int, int] = (40, 30), fmt: str = "PNG") -> bytes:
    """A seeded noise image (width, height) as a PNG or JPEG file's bytes."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def flat_image_bytes(size: tuple[int, int]) -> bytes:
    """A large image in a small PNG file: one colour compresses to almost nothing."""
    out = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


def data_uri(data: bytes, fmt: str = "PNG") -> str:
    kind = "png" if fmt == "PNG" else "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()
