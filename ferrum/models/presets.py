"""Per-model settings from a TOML presets file (`--presets`); flags give the defaults.

    [models."smollm2-135m-instruct"]
    ctx_size = 4096            # engine settings: ctx_size, parallel, batch_size,
    parallel = 4               #   split_prefill, prefill_cap, cache_type_k,
                               #   cache_type_v, flash_attn
    cache_type_k = "q8_0"
    chat_template = "chatml"   # a built-in template name or a Jinja file
    aliases = ["smol", "gpt-4o-mini"]
    system = "You are a terse assistant."   # used when a chat has no system message
    keep_alive = "10m"
    [models."smollm2-135m-instruct".sampling]   # defaults a request's own fields override
    temperature = 0.2
    max_tokens = 256

    [models.my-model]
    path = "/models/my-model.gguf"  # a model served from a file, outside the store
    lora = ["support=adapters/support.gguf@0.8", "sql.gguf"]   # as --lora, on this model

Unknown keys are refused by name, so a typo does not silently do nothing. LoRA adapters may
also be a table (`[models.my-model.lora]` with `support = "adapters/support.gguf@0.8"`); their
paths are relative to the presets file, and they take their model's ids before its --lora
flags'.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferrum.kv_types import FLASH_ATTN, cell_type
from ferrum.models.adapters import parse_lora_flag
from ferrum.models.units import parse_duration

_ENGINE_KEYS: dict[str, type] = {
    "ctx_size": int,
    "parallel": int,
    "batch_size": int,
    "split_prefill": int,
    "prefill_cap": int,
    "cache_type_k": str,
    "cache_type_v": str,
    "flash_attn": str,
}
_SAMPLING_KEYS = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "max_tokens": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "seed": int,
}
_KEYS = {"path", "chat_template", "aliases", "system", "keep_alive", "sampling", "lora",
         *_ENGINE_KEYS}  # fmt: skip


@dataclass(frozen=True)
class Preset:
    path: str = ""
    engine: dict[str, int | str] = field(default_factory=dict)
    chat_template: str = ""
    aliases: tuple[str, ...] = ()
    system: str = ""
    keep_alive: float | None = None
    sampling: dict[str, float | int] = field(default_factory=dict)
    lora: tuple[str, ...] = ()  # NAME=PATH@SCALE, each as a --lora flag on this model


def merge(base: Preset, override: Preset) -> Preset:
    """`override`'s settings over `base`'s: sampling and engine keys one by one, the rest
    where `override` sets them."""
    return Preset(
        path=override.path or base.path,
        engine={**base.engine, **override.engine},
        chat_template=override.chat_template or base.chat_template,
        aliases=override.aliases or base.aliases,
        system=override.system or base.system,
        keep_alive=base.keep_alive if override.keep_alive is None else override.keep_alive,
        sampling={**base.sampling, **override.sampling},
        lora=override.lora or base.lora,
    )


def load_presets(path: str) -> dict[str, Preset]:
    """The presets by model name; a ValueError naming the file and key on any mistake."""
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"presets file {path}: {exc}") from exc
    models = data.get("models", {})
    extra = set(data) - {"models"}
    if extra or not isinstance(models, dict):
        named = f" (found {', '.join(sorted(extra))})" if extra else ""
        raise ValueError(f"presets file {path}: only [models.NAME] tables are allowed{named}")
    return {name: _preset(path, name, table) for name, table in models.items()}


def _preset(file: str, name: str, table: Any) -> Preset:
    where = f"presets file {file}, model {name!r}"
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table")
    unknown = set(table) - _KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    engine = {k: _typed(where, k, table[k], tp) for k, tp in _ENGINE_KEYS.items() if k in table}
    _check_kv_keys(where, engine)
    sampling = table.get("sampling", {})
    if not isinstance(sampling, dict):
        raise ValueError(f"{where}: sampling must be a table")
    unknown = set(sampling) - set(_SAMPLING_KEYS)
    if unknown:
        raise ValueError(
            f"{where}: unknown sampling key(s) {', '.join(sorted(unknown))} "
            f"(known: {', '.join(_SAMPLING_KEYS)})"
        )
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ValueError(f"{where}: aliases must be a list of strings")
    keep_alive = None
    if "keep_alive" in table:
        try:
            keep_alive = parse_duration(table["keep_alive"])
        except ValueError as exc:
            raise ValueError(f"{where}: keep_alive: {exc}") from exc
    path = _text(where, table, "path")
    if path:
        path = str(Path(file).parent / Path(path).expanduser())
    return Preset(
        path=path,
        engine=engine,
        chat_template=_text(where, table, "chat_template"),
        aliases=tuple(aliases),
        system=_text(where, table, "system"),
        keep_alive=keep_alive,
        sampling={k: _typed(where, k, v, _SAMPLING_KEYS[k]) for k, v in sampling.items()},
        lora=_lora(where, file, table.get("lora", [])),
    )


def _lora(where: str, file: str, value: Any) -> tuple[str, ...]:
    """The preset's adapters as --lora values NAME=PATH@SCALE, paths made absolute from the
    presets file's folder; checked as the flag is (a scale, a name, no other base)."""
    if isinstance(value, dict):
        value = [f"{name}={entry}" for name, entry in value.items() if isinstance(entry, str)]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: lora must be a list of NAME=PATH@SCALE strings or a table")
    out = []
    for text in value:
        try:
            flag = parse_lora_flag(text)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        if flag.base:
            raise ValueError(f"{where}: lora {text!r}: a preset's adapters are on its own model")
        a = flag.adapter
        path = Path(file).parent / Path(a.path).expanduser()
        out.append(f"{a.name}={path}@{a.scale!r}")
    return tuple(out)


def _check_kv_keys(where: str, engine: dict[str, int | str]) -> None:
    """A KV type or flash-attention value that no context accepts, refused with the file."""
    try:
        for key in ("cache_type_k", "cache_type_v"):
            if key in engine:
                cell_type(str(engine[key]), key)
        if engine.get("flash_attn", "auto") not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN)}")
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def _text(where: str, table: dict[str, Any], key: str) -> str:
    value = table.get(key, "")
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key} must be a string")
    return value


def _typed(where: str, key: str, value: Any, tp: type) -> Any:
    ok = isinstance(value, tp) or (tp is float and isinstance(value, int))
    if not ok or isinstance(value, bool):
        kind = {float: "a number", int: "an integer", str: "a string"}[tp]
        raise ValueError(f"{where}: {key} must be {kind}")
    return tp(value)
