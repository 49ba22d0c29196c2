"""Which models a server serves: the `--model` flags, or else every built-in model, every
model in the store and every preset with a `path`.

`--model` takes `REF` or `NAME=REF`; a REF is a GGUF file, a built-in model's name or a
store model's name (a LoRA adapter in the store is no model of its own:
`store_adapters.attach_stored` puts it on its base). `--alias NAME` with one `--model REF`
is `--model NAME=REF`, as in llama-server. The first model given (or the built-in default
chat model) answers a request that names none.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

from ferrum.models.builtin import BUILTIN_PRESETS, BUILTINS, DEFAULT_CHAT_MODEL, builtin_path
from ferrum.models.errors import ModelNotFound
from ferrum.models.presets import Preset, merge
from ferrum.models.registry import ModelSpec
from ferrum.models.store import ModelStore


def serve_specs(
    model_args: tuple[str, ...], store: ModelStore, presets: dict[str, Preset], alias: str = ""
) -> list[ModelSpec]:
    specs = [_from_arg(a, store, presets) for a in with_alias(model_args, alias)]
    if not specs:
        specs = _everything(store, presets)
    seen: set[str] = set()
    for spec in specs:
        if spec.name.lower() in seen:  # names resolve regardless of case
            raise ValueError(f"model name {spec.name!r} is given twice")
        seen.add(spec.name.lower())
    return specs


def _named(arg: str) -> bool:
    """`arg` is NAME=REF (a file may have "=" in its name)."""
    return "=" in arg and not os.path.isfile(os.path.expanduser(arg))


def with_alias(model_args: tuple[str, ...], alias: str) -> tuple[str, ...]:
    """The `--model` arguments with llama-server's `--alias NAME` applied: it names the one
    model given (`-m PATH -a NAME` is `-m NAME=PATH`). Refused (ValueError) where it names
    nothing or could name several: no model given, several, or one named already."""
    if not alias:
        return model_args
    if len(model_args) != 1:
        given = "no --model was" if not model_args else f"{len(model_args)} models were"
        raise ValueError(
            f"--alias names the one model given with --model PATH, and {given} given; "
            "name each model with --model NAME=PATH instead"
        )
    (arg,) = model_args
    if _named(arg):
        raise ValueError(f"--alias {alias!r} and --model {arg!r} both name the model: give one")
    return (f"{alias}={arg}",)


def _from_arg(arg: str, store: ModelStore, presets: dict[str, Preset]) -> ModelSpec:
    name, _, ref = arg.partition("=") if _named(arg) else ("", "", arg)
    path = os.path.expanduser(ref)
    if os.path.isfile(path):
        name = name or Path(path).stem
        return _spec(name, _fixed(os.path.abspath(path)), f"file:{path}", presets)
    if ref in BUILTINS:
        return _spec(name or ref, functools.partial(builtin_path, ref), f"builtin:{ref}", presets)
    if ref in presets and presets[ref].path:
        file = presets[ref].path
        return _spec(name or ref, _fixed(file), f"file:{file}", presets)
    if path.endswith(".gguf"):
        raise ValueError(f"model file not found: {ref}")
    try:
        manifest = store.resolve(ref)
    except ModelNotFound as exc:
        with_path = [n for n, p in presets.items() if p.path]
        names = [*BUILTINS, *(m.name for m in store.list()), *with_path]
        raise ModelNotFound(ref, names) from exc
    if manifest.base is not None:
        raise ValueError(
            f"--model {arg}: {manifest.name} is a LoRA adapter of {manifest.base}, not a model; "
            "serve its base (the store's adapters come with it)"
        )
    first = manifest.files[0]
    return _spec(name or manifest.name, _fixed(first), manifest.source, presets, manifest.added)


def _everything(store: ModelStore, presets: dict[str, Preset]) -> list[ModelSpec]:
    specs = [
        _spec(n, functools.partial(builtin_path, n), f"builtin:{n}", presets)
        for n in sorted(BUILTINS, key=lambda n: n != DEFAULT_CHAT_MODEL)
    ]
    builtins = {n.lower() for n in BUILTINS}
    for m in store.list():
        if m.name.lower() not in builtins and m.base is None:  # adapters: on their base
            specs.append(_spec(m.name, _fixed(m.files[0]), m.source, presets, m.added))
    names = {s.name.lower() for s in specs}
    for name, preset in presets.items():
        if preset.path and name.lower() not in names:
            specs.append(_spec(name, _fixed(preset.path), f"file:{preset.path}", presets))
    return specs


def _fixed(path: str) -> Callable[[], str]:
    return lambda: path


def _spec(
    name: str,
    locate: Callable[[], str],
    source: str,
    presets: dict[str, Preset],
    created: float = 0.0,
) -> ModelSpec:
    preset = presets.get(name, Preset())
    if source.startswith("builtin:"):
        preset = merge(BUILTIN_PRESETS.get(source.removeprefix("builtin:"), Preset()), preset)
    return ModelSpec(name, locate, source, created, preset)
