"""Random low-rank LoRA adapters for a real model's GGUF (the lora study's fine-tunes).

No fine-tune of the built-in models ships anywhere, so the study makes its own: per weight
W of the targeted kinds, A (rank × in) and B (out × rank) drawn from a seed, written as
llama.cpp's loader reads an adapter (general.type "adapter", adapter.type "lora",
adapter.lora.alpha, tensors `W.lora_a` and `W.lora_b`), as tests/tiny_models.py writes the
tiny llama's. Names and shapes are read from the model file, so any llama-like GGUF works.

Sizes: llama.cpp adds scale · alpha/rank · B·A x to W x. A's entries have variance 1/in (A x
has unit entries for an RMS-normed x), and B's are drawn so that B·A x is as large as W x
(the weight's own RMS, dequantized). A request's `scale` is then about the relative change
of each targeted projection: 0.05-0.5 changes the text without making it nonsense.

Files are written once into the bench cache (`arms.cache_dir()`), named by the model file,
rank and seed, never into the repository.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize

from ferrum.bench.arms import cache_dir

TARGETS = ("attn_q", "attn_v", "ffn_up")
RANK, ALPHA = 8, 16.0


def targets(model: Path) -> dict[str, tuple[int, int, float]]:
    """Each targeted weight of `model`: (in, out, its values' RMS), by tensor name."""
    reader = gguf.GGUFReader(model)
    out: dict[str, tuple[int, int, float]] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in TARGETS:
            w = dequantize(t.data, t.tensor_type)  # numpy order: (out, in)
            rms = float(np.sqrt(np.mean(np.square(w, dtype=np.float64))))
            out[t.name] = (w.shape[1], w.shape[0], rms)
    if not out:
        raise ValueError(f"{model}: no {'/'.join(TARGETS)} weights to adapt")
    return out


def factors(model: Path, seed: int, rank: int = RANK) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Weight name -> (A, B) in numpy order, A (rank, in), B (out, rank)."""
    rng = np.random.default_rng(seed)
    result = {}
    for name, (n_in, n_out, rms) in sorted(targets(model).items()):
        a = rng.normal(0.0, n_in**-0.5, size=(rank, n_in)).astype(np.float32)
        # B·A x has entries of std b_std·sqrt(rank)·alpha/rank; W x of rms·sqrt(in).
        b_std = rms * math.sqrt(n_in) * rank / (ALPHA * math.sqrt(rank))
        result[name] = (a, rng.normal(0.0, b_std, size=(n_out, rank)).astype(np.float32))
    return result


def write(model: Path, path: Path, seed: int, rank: int = RANK) -> Path:
    arch = gguf.GGUFReader(model).fields["general.architecture"].contents()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, str(arch))
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, ALPHA)
    for name, (a, b) in factors(model, seed, rank).items():
        writer.add_tensor(f"{name}.lora_a", a)
        writer.add_tensor(f"{name}.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)  # a run stopped mid-write leaves no half file under the real name
    return path


def adapter(model: str, seed: int, rank: int = RANK) -> Path:
    """The adapter of `seed` for `model`, written on first use."""
    source = Path(model)
    folder = cache_dir() / "lora"
    folder.mkdir(parents=True, exist_ok=True)
    key = f"{source.stem}-{source.stat().st_size}-r{rank}-s{seed}"
    path = folder / f"{key}.gguf"
    return path if path.is_file() else write(source, path, seed, rank)
