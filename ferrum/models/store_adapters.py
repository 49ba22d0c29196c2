"""LoRA adapters in the store: pulled like models (`pull.adapter_base` records each one's
base model in its manifest), served only on their base.

At start every stored adapter is attached to the served model its base names (after the
preset's and the `--lora` adapters, whose ids follow llama-server's numbering), under the
store name's last part (`org/support-bot-GGUF:F16` is `BASE:support-bot-GGUF`, listed so in
/v1/models, /api/tags and `ferrum list`). An adapter whose base is not served is left out
with a warning; one whose name a served adapter has already is left out too. Loading one
while serving (`/v1/load_lora_adapter` with its file or store name) onto a model its base
does not name is a 400 that says which base it needs (`check_base`).

A base names a model as the store, the Hub or the GGUF's metadata spell it: it matches a
served model's name or alias regardless of case, its `:TAG` (quantization) and a `-GGUF`
suffix left out of both, so `org/Model` is the base of `org/Model-GGUF:Q4_K_M`; a served
name without an organization (a built-in's, a file's stem) matches the base's repository
name alone, so `HuggingFaceTB/SmolLM2-135M-Instruct` is the base of the built-in
`smollm2-135m-instruct`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ferrum.errors import InvalidRequest
from ferrum.models.adapters import LoraAdapter
from ferrum.models.store import Manifest

if TYPE_CHECKING:
    from ferrum.models.registry import ModelSpec

log = logging.getLogger("ferrum.models")


def adapter_name(manifest: Manifest) -> str:
    """The name a stored adapter is served under: its store name's repository part."""
    repo = manifest.name.partition(":")[0].rpartition("/")[2]
    name = re.sub(r"[^A-Za-z0-9._-]", "-", repo).lstrip("._-")[:64]
    return name or "adapter"


def listed_name(manifest: Manifest) -> str:
    """How the store lists a model: its name, or an adapter's `BASE:ADAPTER`."""
    return manifest.name if manifest.base is None else f"{manifest.base}:{adapter_name(manifest)}"


def base_matches(base: str, spec: ModelSpec) -> bool:
    wanted = _plain(base)
    for name in (_plain(n) for n in (spec.name, *spec.aliases)):
        if name == wanted or ("/" not in name and name == wanted.rpartition("/")[2]):
            return True
    return False


def _plain(name: str) -> str:
    name = name.lower().partition(":")[0]
    return name.removesuffix("-gguf")


def attach_stored(specs: Sequence[ModelSpec], manifests: Sequence[Manifest]) -> list[ModelSpec]:
    """The specs with the store's adapters attached to their bases (ids after the others)."""
    specs = list(specs)
    for m in manifests:
        if m.base is None:
            continue
        i = next((i for i, s in enumerate(specs) if base_matches(m.base, s)), -1)
        if i < 0:
            log.warning("LoRA adapter %s is left out: its base %s is not served", m.name, m.base)
            continue
        spec, name = specs[i], adapter_name(m)
        if any(a.name == name and not a.removed for a in spec.adapters):
            log.warning(
                "LoRA adapter %s is left out: %s has an adapter %r", m.name, spec.name, name
            )
            continue
        adapter = LoraAdapter(name, os.path.abspath(m.files[0]))
        specs[i] = dataclasses.replace(spec, adapters=(*spec.adapters, adapter))
    return specs


def stored_adapter(manifests: Sequence[Manifest], given: str, path: str) -> Manifest | None:
    """The stored adapter an admin's load names: by store name (`given`) or by its file."""
    for m in manifests:
        if m.base is not None and (
            m.name.lower() == given.lower() or os.path.realpath(m.files[0]) == path
        ):
            return m
    return None


def check_base(manifest: Manifest, spec: ModelSpec) -> None:
    """400 unless the stored adapter `manifest` was made for the model `spec`."""
    if manifest.base is not None and not base_matches(manifest.base, spec):
        raise InvalidRequest(
            f"LoRA adapter {manifest.name!r} was made for {manifest.base!r}, not for model "
            f"{spec.name!r}: load it on its base model",
            param="lora_path",
        )
