"""The KV cache's cell types and the one rule for what a KV cell costs in bytes.

llama.cpp stores K and V per layer as rows of `n_head_kv × head size` values in a ggml type;
a quantized type packs `block` values into `size` bytes. Everything that counts KV bytes
(the registry's estimate and `--memory-budget`, the engine's gauges, /health, /api/ps) calls
`kv_bytes_per_cell`, so they all follow `--cache-type-k` / `--cache-type-v`.

The rules for which combinations llama.cpp's context accepts (`check_kv_settings`,
`check_head_sizes`) are refused here at start, with the flag's name, instead of a null
context later: a quantized V cache needs flash attention (without it V is stored transposed,
one value per row, which a block type cannot hold), and a quantized type's block must divide
the head size (a head would otherwise start inside a block).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CellType:
    name: str
    ggml_type: int  # ggml's `enum ggml_type`, what `llama_context_params.type_k/v` take
    block: int  # values per block
    size: int  # bytes per block

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def bytes_for(self, values: int) -> int:
        """Bytes of `values` values (a whole number of blocks per row in llama.cpp)."""
        return -(-values // self.block) * self.size


# What llama.cpp's KV cache accepts (ggml's type traits: block size and bytes per block).
CELL_TYPES: dict[str, CellType] = {
    t.name: t
    for t in (
        CellType("f32", 0, 1, 4),
        CellType("f16", 1, 1, 2),
        CellType("bf16", 30, 1, 2),
        CellType("q8_0", 8, 32, 34),
        CellType("q4_0", 2, 32, 18),
        CellType("q4_1", 3, 32, 20),
        CellType("iq4_nl", 20, 32, 18),
        CellType("q5_0", 6, 32, 22),
        CellType("q5_1", 7, 32, 24),
    )
}
FLASH_ATTN = ("on", "off", "auto")


def cell_type(name: str, flag: str = "--cache-type-k") -> CellType:
    """The type named `name`; ValueError naming the flag and the choices otherwise."""
    found = CELL_TYPES.get(name.strip().lower())
    if found is None:
        raise ValueError(f"{flag} must be one of {', '.join(CELL_TYPES)} (got {name!r})")
    return found


def check_kv_settings(type_k: str, type_v: str, flash_attn: str) -> None:
    """ValueError naming the flag for settings no model's context accepts."""
    cell_type(type_k, "--cache-type-k")
    v = cell_type(type_v, "--cache-type-v")
    if flash_attn not in FLASH_ATTN:
        raise ValueError(f"--flash-attn must be on, off or auto (got {flash_attn!r})")
    if v.quantized and flash_attn == "off":
        raise ValueError(
            f"--cache-type-v {v.name} needs flash attention: llama.cpp refuses a quantized V "
            "cache with --flash-attn off (use --flash-attn on or auto, or --cache-type-v f16)"
        )


def check_head_sizes(type_k: str, type_v: str, head_k: int, head_v: int) -> None:
    """ValueError naming the flag when a type's block does not divide the model's head size
    (0: unknown, not checked)."""
    checks = (("--cache-type-k", type_k, head_k), ("--cache-type-v", type_v, head_v))
    for flag, name, head in checks:
        t = cell_type(name, flag)
        if head and head % t.block:
            raise ValueError(
                f"{flag} {t.name} stores blocks of {t.block} values, which do not divide this "
                f"model's attention heads of {head} values (choose f16, bf16 or f32 for it, "
                "e.g. in its preset)"
            )


def flash_attn_resolved(type_v: str, flash_attn: str) -> str:
    """What flash attention will be: llama.cpp turns `auto` on for a quantized V cache; else
    `auto` is llama.cpp's choice for the device (on for CPU), kept as `auto`."""
    if flash_attn == "auto" and cell_type(type_v, "--cache-type-v").quantized:
        return "on"
    return flash_attn


def kv_bytes_per_cell(k_values: int, v_values: int, type_k: str, type_v: str) -> int:
    """Bytes one KV cell (one token's position) takes over all layers: `k_values` K values and
    `v_values` V values (layers × KV heads × head size each) at the chosen types."""
    return cell_type(type_k, "--cache-type-k").bytes_for(k_values) + cell_type(
        type_v, "--cache-type-v"
    ).bytes_for(v_values)
