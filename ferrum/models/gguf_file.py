"""What a GGUF file says about itself, read from its header in pure Python.

Rules:
- Only the header is read: the metadata values needed (architecture, context length,
  attention shape, name, split numbers, alignment, file type) are decoded, every other
  value is skipped, and arrays (the tokenizer's vocabulary: 100k+ strings) are stepped over
  without being built.
- A file is refused (`InvalidModelFile`) when it is not GGUF (bad magic), has a version other
  than 2 or 3, ends inside its header, or is shorter than the end of its tensor data
  ("truncated: N of M bytes"): the download stopped early or the copy was cut.
- The end of the tensor data is the data section's start (the header's end rounded up to
  `general.alignment`, default 32) plus the largest `offset + nbytes` among the tensors;
  `nbytes` comes from the ggml type table below. A tensor of a type not in the table leaves
  it unknown (`expected_size` None) and only the header is checked.
- A split model's shard (`split.count` > 1) describes its own tensors only, so each shard is
  checked against its own size; the first shard (`split.no` 0) carries the metadata.

File layout (little-endian; big-endian files are detected by their version word):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x (key: string, type: u32, value)
    tensor_count x (name: string, n_dims: u32, dims: n_dims x u64, type: u32, offset: u64)
    padding to alignment | tensor data (offsets are relative to here)
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, BinaryIO

from ferrum.models.errors import InvalidModelFile

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# Sanity bounds, so a damaged header fails fast instead of allocating or looping for ever.
_MAX_STRING = 64 * 2**20
_MAX_DIMS = 8
_MAX_COUNT = 2**32

# GGUF metadata value types: (struct code, size) of the fixed-size ones.
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
    6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
}  # fmt: skip

# ggml tensor types: id -> (name, elements per block, bytes per block).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}  # fmt: skip

# llama.cpp's `general.file_type` (llama_ftype): the quantization a whole file was made with.
FILE_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE",
}  # fmt: skip


@dataclass(frozen=True)
class GGUFFacts:
    architecture: str  # "" only on a split model's later shards, which carry no metadata
    context_length: int | None
    has_chat_template: bool
    name: str | None  # general.name
    split_count: int  # 1: not split
    split_no: int  # 0-based
    tensor_count: int
    expected_size: int | None  # bytes up to the end of the tensor data; None: unknown type
    file_type: int | None = None  # general.file_type
    # K and V values one token adds to the KV cache over all layers (None: not stated).
    kv_values_per_token: int | None = None
    # The same split into K and V (layers x KV heads x head size each), and the head sizes
    # (llama.cpp's n_embd_head_k / n_embd_head_v; 0: not stated).
    k_values_per_token: int = 0
    v_values_per_token: int = 0
    head_k: int = 0
    head_v: int = 0
    pooling_type: int | None = None  # {arch}.pooling_type: 1 mean, 2 cls, 3 last, 4 rank
    causal: bool | None = None  # {arch}.attention.causal (False: BERT-like encoders)
    # An adapter's kind (`adapter.type`, "lora") when `general.type` is "adapter"; None: a model.
    adapter: str | None = None
    # The model it was made from (`general.base_model.0.*`): "org/repo" or a name; None: unsaid.
    base_model: str | None = None

    @property
    def is_embedding_model(self) -> bool:
        """An encoder or a model that states its pooling: it embeds, it does not chat."""
        return self.causal is False or bool(self.pooling_type)

    @property
    def quant(self) -> str | None:
        """The file's quantization by its `general.file_type` (e.g. "Q4_K_M")."""
        return None if self.file_type is None else FILE_TYPES.get(self.file_type)


def read_gguf(path: str | os.PathLike[str]) -> GGUFFacts:
    """The facts of a GGUF file; `InvalidModelFile` if it is not a whole, readable one."""
    path = Path(path)
    try:
        with open(path, "rb", buffering=2**20) as f:
            facts = _Header(f, path).read()
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise InvalidModelFile(f"cannot read {path}: {exc.strerror or exc}") from exc
    if facts.expected_size is not None and size < facts.expected_size:
        raise InvalidModelFile(f"{path}: truncated: {size} of {facts.expected_size} bytes")
    return facts


class _Header:
    """One pass over a header: keeps the wanted metadata, steps over the rest."""

    def __init__(self, f: BinaryIO, path: Path):
        self.f, self.path = f, path
        self.order = "<"
        self.meta: dict[str, Any] = {}

    def read(self) -> GGUFFacts:
        if self.f.read(4) != _MAGIC:
            raise InvalidModelFile(f"{self.path}: not a GGUF file")
        version = self._int("I")
        if version & 0xFFFF == 0:  # a big-endian file read as little-endian: 3 -> 0x03000000
            self.order = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in _VERSIONS:
            raise InvalidModelFile(f"{self.path}: unsupported GGUF version {version}")
        n_tensors, n_kv = self._count(), self._count()
        for _ in range(n_kv):
            key = self._string()
            value = self._value(self._int("I"), keep=_wanted(key))
            if value is not None:
                self.meta[key] = value
        ends = [self._tensor_end() for _ in range(n_tensors)]
        alignment = self.meta.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise InvalidModelFile(f"{self.path}: bad general.alignment {alignment!r}")
        data_start = -(-self.f.tell() // alignment) * alignment
        known = None not in ends
        expected = data_start + max((e for e in ends if e is not None), default=0)
        return self._facts(n_tensors, expected if known else None)

    def _facts(self, n_tensors: int, expected_size: int | None) -> GGUFFacts:
        meta = self.meta
        arch = meta.get("general.architecture")
        split_no = _int_or(meta.get("split.no"), 0)
        if not isinstance(arch, str) and split_no == 0:
            raise InvalidModelFile(f"{self.path}: no general.architecture")
        arch = arch if isinstance(arch, str) else ""
        name = meta.get("general.name")
        return GGUFFacts(
            architecture=arch,
            context_length=_int_or(meta.get(f"{arch}.context_length"), None),
            has_chat_template=isinstance(meta.get("tokenizer.chat_template"), str),
            name=name if isinstance(name, str) else None,
            split_count=_int_or(meta.get("split.count"), 1),
            split_no=split_no,
            tensor_count=n_tensors,
            expected_size=expected_size,
            file_type=_int_or(meta.get("general.file_type"), None),
            **self._kv_shape(arch),
            pooling_type=_int_or(meta.get(f"{arch}.pooling_type"), None),
            causal=_bool_or_none(meta.get(f"{arch}.attention.causal")),
            adapter=_adapter(meta),
            base_model=_base_model(meta),
        )

    def _kv_shape(self, arch: str) -> dict[str, Any]:
        """layers x KV heads x (key + value length), from the attention shape, in all and
        for K and V apart, and the head sizes. A per-layer array (some models vary heads by
        layer) is skipped, so the head count stands in."""
        meta = self.meta

        def get(key: str) -> int | None:
            value: int | None = _int_or(meta.get(f"{arch}.{key}"), None)
            return value

        layers, embd = get("block_count"), get("embedding_length")
        heads = get("attention.head_count")
        if not (layers and embd and heads):
            return {}
        kv_heads = get("attention.head_count_kv") or heads
        k_len = get("attention.key_length") or embd // heads
        v_len = get("attention.value_length") or embd // heads
        return {
            "kv_values_per_token": layers * kv_heads * (k_len + v_len),
            "k_values_per_token": layers * kv_heads * k_len,
            "v_values_per_token": layers * kv_heads * v_len,
            "head_k": k_len,
            "head_v": v_len,
        }

    def _tensor_end(self) -> int | None:
        self._string()  # name
        n_dims = self._int("I")
        if n_dims > _MAX_DIMS:
            raise InvalidModelFile(f"{self.path}: a tensor with {n_dims} dimensions")
        dims = [self._int("Q") for _ in range(n_dims)]
        ggml_type, offset = self._int("I"), self._int("Q")
        block = GGML_TYPES.get(ggml_type)
        if block is None:
            return None
        _, per_block, block_bytes = block
        return offset + prod(dims) // per_block * block_bytes

    def _value(self, vtype: int, *, keep: bool) -> Any:
        if vtype in _SCALARS:
            code, size = _SCALARS[vtype]
            return self._scalar(code) if keep else self._skip(size)
        if vtype == _STRING:
            return self._string() if keep else self._skip(self._count(_MAX_STRING))
        if vtype == _ARRAY:
            # Arrays are never wanted: step over them (strings one length at a time).
            etype, n = self._int("I"), self._count()
            if etype in _SCALARS:
                return self._skip(n * _SCALARS[etype][1])
            for _ in range(n):
                self._value(etype, keep=False)
            return None
        raise InvalidModelFile(f"{self.path}: unknown metadata type {vtype}")

    def _exact(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise InvalidModelFile(f"{self.path}: truncated header")
        return data

    def _skip(self, n: int) -> None:
        # Seeking past the end succeeds silently; the read that follows then comes up short.
        self.f.seek(n, os.SEEK_CUR)

    def _scalar(self, code: str) -> Any:
        return struct.unpack(self.order + code, self._exact(struct.calcsize(code)))[0]

    def _int(self, code: str) -> int:
        return int(self._scalar(code))

    def _count(self, limit: int = _MAX_COUNT) -> int:
        n = self._int("Q")
        if n > limit:
            raise InvalidModelFile(f"{self.path}: implausible count {n} in the header")
        return n

    def _string(self) -> str:
        return self._exact(self._count(_MAX_STRING)).decode("utf-8", errors="replace")


_SHAPE_KEYS = (
    ".context_length",
    ".pooling_type",
    ".attention.causal",
    ".block_count",
    ".embedding_length",
    ".attention.head_count",
    ".attention.head_count_kv",
    ".attention.key_length",
    ".attention.value_length",
)


def _wanted(key: str) -> bool:
    return (
        key.startswith(("general.", "split.", "adapter."))
        or key.endswith(_SHAPE_KEYS)
        or (key == "tokenizer.chat_template")
    )


def _int_or(value: Any, default: int | None) -> Any:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _bool_or_none(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _adapter(meta: dict[str, Any]) -> str | None:
    if meta.get("general.type") != "adapter":
        return None
    kind = meta.get("adapter.type")
    return kind if isinstance(kind, str) else ""


def _base_model(meta: dict[str, Any]) -> str | None:
    """The first base model a file names, as a Hub repository ("org/repo", from its address
    or its organization and name) or else its name."""
    prefix = "general.base_model.0."
    url = meta.get(prefix + "repo_url")
    if isinstance(url, str):
        host, _, repo = url.removeprefix("https://").removeprefix("http://").partition("/")
        if host in ("huggingface.co", "hf.co") and repo.count("/") == 1:
            return repo
    name, org = meta.get(prefix + "name"), meta.get(prefix + "organization")
    if not isinstance(name, str) or not name:
        return None
    return f"{org}/{name}" if isinstance(org, str) and org else name
