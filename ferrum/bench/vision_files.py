"""Random-weight vision projectors (mmproj GGUFs) that libmtmd loads and encodes, and the
images sent to them: the vision study's projector and, at the tiny shape, the tests'.

No vision model can be downloaded here, so a projector is made for whatever language model
it pairs with: llama.cpp's llava "mlp" type, the simplest libmtmd builds on a CPU
(`tools/mtmd/clip.cpp` `load_hparams`/`load_tensors`, graph `models/llava.cpp`):

    RGB image ──resize to image_size²──▶ conv patches (patch_size²) + position embeddings
      ──▶ ViT blocks (ln1, attn q/k/v/out, ln2, ffn up/down; the llava graph stops one block
          before the last) ──▶ mm.0 (linear) ─ GELU ─ mm.2 (linear) ──▶ n_embd per patch

so an image is (image_size / patch_size)² embeddings of the language model's width
(`mtmd_init_from_file` refuses a projector whose output width differs from the text model's
n_embd). Weights are seeded and random: only the mechanics and the cost are meaningful.

`TINY` pairs with tests/tiny_models.py's llama (encodes in about a millisecond); `BENCH` is
sized so that one image costs the encoder a measurable time on a CPU (see
docs/benchmarks/vision.md for the figure) while its file stays a few tens of MB (f16).
The bench's file is written once into the bench cache, named by the model and the shape.
"""

from __future__ import annotations

import base64
import io
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from PIL import Image

from ferrum.bench.arms import cache_dir


@dataclass(frozen=True)
class Shape:
    """A projector's sizes. V_FF != V_EMBD: clip.cpp takes an ffn_down whose input width is
    the embedding width for a swapped pair."""

    image_size: int
    patch_size: int
    embd: int
    heads: int
    ff: int
    layers: int
    mm_hidden: int
    f16: bool = False  # the matrices in f16 (half the file; what real projectors ship)
    kind: str = "mlp"  # or "gemma3": patches average-pooled by `merge` per side, non-causal
    merge: int = 1

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_tokens(self) -> int:
        return self.patches // self.merge**2


TINY = Shape(image_size=32, patch_size=8, embd=32, heads=2, ff=64, layers=2, mm_hidden=64)
# Gemma 3's projector type: its images are decoded with attention both ways (16 positions).
TINY_GEMMA3 = Shape(image_size=64, patch_size=8, embd=32, heads=2, ff=64, layers=2,
                    mm_hidden=0, kind="gemma3", merge=2)  # fmt: skip
BENCH = Shape(image_size=224, patch_size=16, embd=384, heads=6, ff=1536, layers=6,
              mm_hidden=1024, f16=True)  # fmt: skip


def _normal(rng: np.random.Generator, *shape: int, std: float) -> np.ndarray:
    return rng.normal(0.0, std, size=shape).astype(np.float32)


def _block(rng: np.random.Generator, i: int, s: Shape) -> dict[str, np.ndarray]:
    """One ViT block; numpy shapes are llama.cpp's {ne0, ne1} reversed."""
    std = s.embd**-0.5
    tensors: dict[str, np.ndarray] = {}
    for name in ("ln1", "ln2"):
        tensors[f"v.blk.{i}.{name}.weight"] = np.ones(s.embd, dtype=np.float32)
        tensors[f"v.blk.{i}.{name}.bias"] = np.zeros(s.embd, dtype=np.float32)
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        tensors[f"v.blk.{i}.{name}.weight"] = _normal(rng, s.embd, s.embd, std=std)
        tensors[f"v.blk.{i}.{name}.bias"] = np.zeros(s.embd, dtype=np.float32)
    tensors[f"v.blk.{i}.ffn_up.weight"] = _normal(rng, s.ff, s.embd, std=std)
    tensors[f"v.blk.{i}.ffn_up.bias"] = np.zeros(s.ff, dtype=np.float32)
    tensors[f"v.blk.{i}.ffn_down.weight"] = _normal(rng, s.embd, s.ff, std=s.ff**-0.5)
    tensors[f"v.blk.{i}.ffn_down.bias"] = np.zeros(s.embd, dtype=np.float32)
    return tensors


def _projection(rng: np.random.Generator, n_embd: int, s: Shape) -> dict[str, np.ndarray]:
    """Into the language model's width, large enough that the image embeddings move its
    logits visibly: llava's mm.0 - GELU - mm.2, or Gemma 3's RMS norm and one matrix."""
    if s.kind == "gemma3":
        return {
            "mm.soft_emb_norm.weight": np.ones(s.embd, dtype=np.float32),
            "mm.input_projection.weight": _normal(rng, s.embd, n_embd, std=2.0 * s.embd**-0.5),
        }
    return {
        "mm.0.weight": _normal(rng, s.mm_hidden, s.embd, std=s.embd**-0.5),
        "mm.0.bias": np.zeros(s.mm_hidden, dtype=np.float32),
        "mm.2.weight": _normal(rng, n_embd, s.mm_hidden, std=2.0 * s.mm_hidden**-0.5),
        "mm.2.bias": np.zeros(n_embd, dtype=np.float32),
    }


def tensors(n_embd: int, s: Shape, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    fan_in = 3 * s.patch_size * s.patch_size
    out = {
        # conv kernel, ggml {kw, kh, channels, out}
        "v.patch_embd.weight": _normal(
            rng, s.embd, 3, s.patch_size, s.patch_size, std=fan_in**-0.5
        ),  # fmt: skip
        "v.position_embd.weight": _normal(rng, s.patches, s.embd, std=0.5),
    }
    for i in range(s.layers):
        out |= _block(rng, i, s)
    out |= _projection(rng, n_embd, s)
    if s.f16:  # matrices only: norms, biases and position embeddings stay f32, as in real files
        out = {k: v.astype(np.float16) if v.ndim >= 2 and "position" not in k else v
               for k, v in out.items()}  # fmt: skip
    return out


def write_mmproj(path: Path, n_embd: int, s: Shape, seed: int, name: str) -> Path:
    """Write a projector GGUF (architecture "clip", projector type `s.kind`) into `n_embd`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if s.f16 else gguf.LlamaFileType.ALL_F32)
    writer.add_string("clip.projector_type", s.kind)
    if s.merge > 1:
        writer.add_uint32("clip.vision.projector.scale_factor", s.merge)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", s.image_size)
    writer.add_uint32("clip.vision.patch_size", s.patch_size)
    writer.add_uint32("clip.vision.embedding_length", s.embd)
    writer.add_uint32("clip.vision.feed_forward_length", s.ff)
    writer.add_uint32("clip.vision.block_count", s.layers)
    writer.add_uint32("clip.vision.attention.head_count", s.heads)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_uint32("clip.vision.projection_dim", n_embd)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    for key, data in tensors(n_embd, s, seed).items():
        writer.add_tensor(key, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def model_width(model: Path) -> int:
    """The language model's n_embd (`{arch}.embedding_length`), the projector's output width."""
    fields = gguf.GGUFReader(model).fields
    arch = fields["general.architecture"].contents()
    return int(fields[f"{arch}.embedding_length"].contents())


def projector(model: str, s: Shape = BENCH, seed: int = 1) -> Path:
    """The projector of `seed` and shape `s` for `model`, written on first use."""
    source = Path(model)
    folder = cache_dir() / "vision"
    folder.mkdir(parents=True, exist_ok=True)
    key = f"{source.stem}-{source.stat().st_size}-i{s.image_size}p{s.patch_size}"
    key += f"e{s.embd}l{s.layers}f{s.ff}{'h' if s.f16 else ''}-s{seed}"
    path = folder / f"{key}.gguf"
    if path.is_file():
        return path
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    write_mmproj(tmp, model_width(source), s, seed, "bench-mmproj")
    tmp.replace(path)  # a run stopped mid-write leaves no half file under the real name
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
