"""LoRA adapters served on a base model: the `--lora` flags, and what a request picks.

Flags (`ModelsConfig.lora`, in the order given; `--lora-scaled PATH SCALE` is stored as
`PATH@SCALE`):

    --lora PATH                 llama-server's: named after the file's stem
    --lora NAME=PATH            on the one model served
    --lora BASE:NAME=PATH       on model BASE (needed when several models are served)
    ...@SCALE                   the scale a request gets by naming the adapter (default 1)

A base model's adapters are numbered 0, 1, ... in flag order, as llama-server numbers them.
A request picks adapters by model name `BASE:NAME` (vLLM/SGLang style: that adapter at its
default scale) or by llama-server's `lora: [{"id": 0, "scale": 1.0}]` (several at once;
listed ids override the name's). The set it decodes with (`AdapterSet`) is sorted by id,
without zero scales: a request whose scales are all 0 decodes with the base.

KV computed under an adapter is wrong under any other file, and an id alone does not say
which file: a restarted server numbers its `--lora` files from 0 again (its disk tier keeps
the KV of the last run's), and a file may be replaced in place before its model reloads. So
each adapter carries its file's `digest` (its content, hashed when its model loads or when
it is loaded while serving, in a worker thread), and a request's cache scope names the
digests of the files it decodes with (`files_scope`) beside their ids and scales.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ferrum.errors import InvalidRequest, PermissionDenied
from ferrum.models.errors import ModelNotFound

if TYPE_CHECKING:
    from ferrum.models.registry import ModelSpec

# The largest |scale| a request may ask for: far past any useful value, and it keeps a typo
# (1e6) from turning the model's output into noise for the request alone.
MAX_SCALE = 100.0


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str
    scale: float = 1.0  # when a request names it by `BASE:NAME`
    # The scale requests that pick no adapter get (llama-server's POST /lora-adapters).
    default: float = 0.0
    # Unloaded while serving: its id stays taken (ids never move), nothing may pick it.
    removed: bool = False
    # The file's content as llama.cpp loaded it (`file_digest`); "" until it is hashed.
    digest: str = ""


@dataclass(frozen=True)
class LoraFlag:
    base: str  # "" : the one model served
    adapter: LoraAdapter


def parse_lora_flag(text: str) -> LoraFlag:
    """One `--lora` value; ValueError naming it when it does not parse."""
    body, scale = text, 1.0
    head, at, tail = text.rpartition("@")
    if at and head:
        try:
            scale = float(tail)
            body = head
        except ValueError:
            pass  # an '@' that is part of the path
    check_scale(scale, ValueError, f"--lora {text}")
    base, name, path = "", "", body
    left, eq, right = body.partition("=")
    if eq and left and "/" not in left:
        path = right
        base, _, name = left.rpartition(":")
    if not path:
        raise ValueError(f"--lora {text}: no adapter file given")
    return LoraFlag(base, LoraAdapter(name or Path(path).stem, path, scale))


def check_scale(scale: float, error: Callable[[str], Exception], what: str) -> None:
    if not math.isfinite(scale) or abs(scale) > MAX_SCALE:
        raise error(f"{what}: a LoRA scale must be a finite number in [-{MAX_SCALE:g}, "
                    f"{MAX_SCALE:g}], not {scale}")  # fmt: skip


def attach(specs: Sequence[ModelSpec], flags: Iterable[str]) -> list[ModelSpec]:
    """The specs with their `--lora` adapters (ids in flag order); ValueError for a flag
    without a base while several models are served, an unknown base or a repeated name."""
    specs = list(specs)
    by_name = {n.lower(): i for i, s in enumerate(specs) for n in (s.name, *s.aliases)}
    # A preset's adapters first (`presets.py`: checked and on their own model), then flags.
    given = [(i, text) for i, s in enumerate(specs) for text in s.preset.lora]
    for text in flags:
        base = parse_lora_flag(text).base
        if not base and len(specs) != 1:
            raise ValueError(
                f"--lora {text}: several models are served; name the base as BASE:NAME=PATH"
            )
        i = by_name.get(base.lower(), -1) if base else 0
        if i < 0:
            raise ValueError(f"--lora {text}: no model {base!r} is served")
        given.append((i, text))
    for i, text in given:
        flag = parse_lora_flag(text)
        if not os.path.isfile(os.path.expanduser(flag.adapter.path)):
            raise ValueError(f"--lora {text}: file not found: {flag.adapter.path}")
        path = os.path.abspath(os.path.expanduser(flag.adapter.path))
        spec = specs[i]
        if any(a.name == flag.adapter.name for a in spec.adapters):
            raise ValueError(f"--lora {text}: {spec.name} already has an adapter of that name")
        adapter = dataclasses.replace(flag.adapter, path=path)
        specs[i] = dataclasses.replace(spec, adapters=(*spec.adapters, adapter))
    return specs


def adapter_names(spec: ModelSpec) -> list[str]:
    """The `BASE:NAME` model names of a spec's adapters (for /v1/models and /api/tags)."""
    return [f"{spec.name}:{a.name}" for a in spec.adapters if not a.removed]


def named_adapter(spec: ModelSpec, requested: str) -> int | None:
    """The id of the adapter `requested` (a `BASE:NAME` model name, or an adapter's bare
    name) picks on `spec`, None when it names the base itself; a 404 listing the adapters
    when it names one `spec` lacks."""
    if not spec.adapters:
        return None
    base, colon, name = requested.rpartition(":")
    if not colon:
        name = requested  # an adapter's bare name, as vLLM serves them
    for i, a in enumerate(spec.adapters):
        if a.name == name and not a.removed:
            return i
    wanted = base.lower()
    ours = wanted in (n.lower() for n in (spec.name, *spec.aliases))
    if colon and ours and name.lower() != "latest":
        raise ModelNotFound(requested, adapter_names(spec), what="LoRA adapter")
    return None


def adapter_set(
    adapters: Sequence[LoraAdapter], named: int | None, listed: Iterable[tuple[int, float]]
) -> tuple[tuple[int, float], ...]:
    """A request's adapter set: the named adapter at its scale, then each listed (id,
    scale), a later one replacing an earlier of the same id; 400 for an unknown id or a
    scale out of range."""
    chosen: dict[int, float] = {}
    if named is not None:
        chosen[named] = adapters[named].scale
    for i, scale in listed:
        if not 0 <= i < len(adapters) or adapters[i].removed:
            live = [f"{j}: {a.name}" for j, a in enumerate(adapters) if not a.removed]
            raise InvalidRequest(
                f"lora: no adapter id {i}; this model has {len(live)} "
                f"({', '.join(live) or 'none'})",
                param="lora",
            )
        check_scale(scale, _lora_error, f"lora id {i}")
        chosen[i] = float(scale)
    return tuple(sorted((i, s) for i, s in chosen.items() if s != 0.0))


def _lora_error(message: str) -> InvalidRequest:
    return InvalidRequest(message, param="lora")


# What an adapter loaded while serving may be called: it becomes part of model names
# (`BASE:NAME`) and of metric labels.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_ADAPTERS = 64  # adapters one model may serve at once (each costs memory on every load)


def check_new_adapter(adapters: Sequence[LoraAdapter], name: str) -> None:
    """400 for a name an adapter loaded while serving may not take on these adapters."""
    if not _NAME.fullmatch(name):
        raise InvalidRequest(
            f"lora_name {name!r}: letters, digits, '.', '_' and '-' (at most 64)",
            param="lora_name",
        )
    live = [a for a in adapters if not a.removed]
    if any(a.name == name for a in live):
        raise InvalidRequest(f"LoRA adapter {name!r} is already loaded", param="lora_name")
    if len(live) >= MAX_ADAPTERS:
        raise InvalidRequest(
            f"this model serves {MAX_ADAPTERS} LoRA adapters already; unload one first",
            param="lora_name",
        )


def loadable_path(given: str, folders: Sequence[str], files: Iterable[str]) -> str:
    """The adapter file an admin names for loading while serving, as a real path: one of
    `files` (the --lora adapters, and those loaded before) or a file under one of `folders`
    (the model store, --lora-dir), symbolic links resolved first, so a link or `..` cannot
    lead elsewhere. 403 for any other path, 400 for no such file. Errors repeat the path as
    given, never the server's own paths."""
    if not given or "\0" in given:
        raise InvalidRequest("lora_path: no adapter file given", param="lora_path")
    base = folders[0] if folders else os.getcwd()  # a relative path: in the model store
    real = os.path.realpath(os.path.join(base, given))
    known = {os.path.realpath(f) for f in files}
    inside = any(_under(real, os.path.realpath(os.path.expanduser(d))) for d in folders)
    if real not in known and not inside:
        raise PermissionDenied(
            f"lora_path {given!r}: adapters load only from the model store, the --lora files "
            "and the folders the operator named with --lora-dir"
        )
    if not os.path.isfile(real):
        raise InvalidRequest(f"lora_path {given!r}: no such file", param="lora_path")
    return real


def _under(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder and path != folder


def file_digest(path: str) -> str:
    """An adapter file's identity: a hash of all its bytes (an adapter is small next to its
    model, and two fine-tunes of one base differ in their tensors, not their headers); ""
    for a file that cannot be read (llama.cpp's load then says why)."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()[:24]
    except OSError:
        return ""


def with_digests(adapters: Sequence[LoraAdapter]) -> tuple[LoraAdapter, ...]:
    """The adapters with their files' digests as the files are now (call it in a worker
    thread, as the model loads: it reads every file)."""
    return tuple(
        a if a.removed else dataclasses.replace(a, digest=file_digest(a.path)) for a in adapters
    )


def files_scope(adapters: Sequence[LoraAdapter], chosen: Iterable[tuple[int, float]]) -> str:
    """The part of a request's cache scope that names the files of the adapters it decodes
    with (the engine adds their ids and scales: `engine.request.adapter_scope`)."""
    digests = [adapters[i].digest for i, _ in chosen]
    return "" if not digests else "|lorafile:" + ",".join(digests)
