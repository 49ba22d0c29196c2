"""Vision projectors (llama.cpp's `mmproj` GGUFs) served beside a model: the `--mmproj` flags.

    --mmproj PATH          on the one model served
    --mmproj NAME=PATH     on model NAME (needed when several models are served)

A model with a projector takes images (`capabilities: ["vision"]` in /api/show and
/v1/models); the projector is opened beside the model when it loads and freed with it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ferrum.models.registry import ModelSpec


def attach(specs: Sequence[ModelSpec], flags: Iterable[str]) -> list[ModelSpec]:
    """The specs with their `--mmproj` projectors; ValueError naming the flag for a missing
    file, a flag without a name while several models are served, an unknown name or a
    second projector on one model."""
    specs = list(specs)
    by_name = {n.lower(): i for i, s in enumerate(specs) for n in (s.name, *s.aliases)}
    for text in flags:
        name, eq, path = text.partition("=")
        if not eq or "/" in name or not name:
            name, path = "", text
        if not name and len(specs) != 1:
            raise ValueError(f"--mmproj {text}: several models are served; give it as NAME=PATH")
        i = by_name.get(name.lower(), -1) if name else 0
        if i < 0:
            raise ValueError(f"--mmproj {text}: no model {name!r} is served")
        path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isfile(path):
            raise ValueError(f"--mmproj {text}: file not found: {path}")
        if specs[i].mmproj:
            raise ValueError(f"--mmproj {text}: {specs[i].name} already has a projector")
        specs[i] = dataclasses.replace(specs[i], mmproj=path)
    return specs


def capabilities(spec: ModelSpec) -> list[str]:
    """What a model takes beyond text, as Ollama names it."""
    return ["vision"] if spec.mmproj else []
