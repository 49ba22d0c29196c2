"""What a model costs in memory before it is loaded, and how much the server may spend.

A model's cost is its weights (the GGUF files' size: llama.cpp maps them whole) plus its KV
cache at the configured context size, computed from the GGUF's attention shape at the
configured K and V cell types (`ferrum.kv_types`), an upper bound for sliding-window models. Compute
buffers are left out: they are small next to both at these model sizes.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

from ferrum.kv_types import kv_bytes_per_cell
from ferrum.models.errors import InvalidModelFile
from ferrum.models.gguf_file import GGUFFacts, read_gguf
from ferrum.models.reference import split_shards
from ferrum.models.units import parse_size

log = logging.getLogger("ferrum.models")


def model_files(path: str) -> list[Path]:
    """The files of a model: a split model's every shard beside its first."""
    first = Path(path)
    shards = split_shards(first.name)
    return [first.with_name(n) for n in shards] if shards else [first]


def kv_bytes_per_token(path: str, type_k: str = "f16", type_v: str = "f16") -> int:
    """K and V bytes one token takes in every layer at these cell types (0 when the GGUF does
    not say). For a sliding-window model this is an upper bound: its window layers keep
    fewer cells."""
    try:
        facts = read_gguf(path)
    except InvalidModelFile:
        return 0
    return facts_kv_bytes(facts, type_k, type_v)


def facts_kv_bytes(facts: GGUFFacts, type_k: str, type_v: str) -> int:
    """`kv_bytes_per_token` of a header already read."""
    return kv_bytes_per_cell(facts.k_values_per_token, facts.v_values_per_token, type_k, type_v)


def estimate_bytes(path: str, ctx_size: int, type_k: str = "f16", type_v: str = "f16") -> int:
    weights = sum(f.stat().st_size for f in model_files(path) if f.is_file())
    return weights + ctx_size * kv_bytes_per_token(path, type_k, type_v)


def memory_budget(spec: str, gpu: bool) -> int:
    """Bytes from --memory-budget: a size, 'auto' (free GPU memory on a CUDA build, else
    available RAM) or '' (no limit: 0)."""
    if not spec:
        return 0
    if spec.strip().lower() != "auto":
        return parse_size(spec)
    if gpu:
        free = _free_vram()
        if free:
            return free
    return _available_ram()


def _free_vram() -> int:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        log.warning("nvidia-smi did not answer; --memory-budget auto falls back to free RAM")
        return 0
    mib = [int(x) for x in out.split() if x.isdigit()]
    return sum(mib) * 2**20


def _available_ram() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
