"""LoRA adapters of one model's context: loaded at start, freed at close, and set on the
context before each decode whose adapter set differs from the last one's.

llama.cpp applies adapters to the context, not to a sequence: `llama_set_adapters_lora` sets
the whole set for every token of the next `llama_decode`, and a changed set makes that decode
re-reserve its graph. So a decode carries one adapter set (the scheduler groups requests by
set), and the set is only sent to llama.cpp when it changes.

Ids are the adapters' indices in the order they were given (llama-server's numbering); an
adapter set is a tuple of (id, scale), sorted by id, with no zero scale (empty: the base).
An adapter loaded while serving takes the next id; one unloaded leaves its id empty (an
empty path at start), so the ids of the others never move.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from typing import Any

import llama_cpp as ll

from ferrum.engine.request import AdapterSet
from ferrum.errors import ModelLoadError

log = logging.getLogger("ferrum.llama")


class LoraAdapters:
    """The adapters loaded for one model, in id order; the set last put on the context."""

    def __init__(self, model: Any, paths: Sequence[str], ctx: Any = None):
        self._model, self._ctx = model, ctx
        self._handles: list[Any] = []  # None: an id whose adapter was unloaded
        self._current: AdapterSet = ()
        try:
            for path in paths:
                self._handles.append(_load(model, path) if path else None)
        except Exception:
            self.free()
            raise

    def __len__(self) -> int:
        return len(self._handles)

    def use(self, ctx: Any, adapters: AdapterSet) -> bool:
        """Puts `adapters` on the context unless they are there already; True if changed."""
        if adapters == self._current:
            return False
        n = len(adapters)
        if any(not 0 <= i < len(self._handles) or not self._handles[i] for i, _ in adapters):
            raise ValueError(f"adapter set {adapters} names an adapter not loaded")
        if n == 0:
            rc = ll.llama_set_adapters_lora(ctx, None, 0, None)
        else:
            handles = (ll.llama_adapter_lora_p_ctypes * n)(*(self._handles[i] for i, _ in adapters))
            scales = (ctypes.c_float * n)(*(s for _, s in adapters))
            rc = ll.llama_set_adapters_lora(ctx, handles, n, scales)
        if rc != 0:
            raise RuntimeError(f"llama.cpp refused the adapter set {adapters} ({rc})")
        self._current = adapters
        return True

    def load(self, path: str) -> int:
        """Loads one more adapter (ModelLoadError when llama.cpp refuses it); its id."""
        self._handles.append(_load(self._model, path))
        return len(self._handles) - 1

    def unload(self, adapter_id: int) -> None:
        """Frees one adapter; its id stays empty. The context lets go of it first: it keeps
        the set last given, and its next decode would read the freed adapter."""
        handle = self._handles[adapter_id]
        if handle is None:
            return
        if any(i == adapter_id for i, _ in self._current):
            self.use(self._ctx, ())
        self._handles[adapter_id] = None
        ll.llama_adapter_lora_free(handle)

    def free(self) -> None:
        """Frees every adapter (after the context that used them, before their model)."""
        for handle in self._handles:
            if handle is not None:
                ll.llama_adapter_lora_free(handle)
        self._handles = []
        self._current = ()


def _load(model: Any, path: str) -> Any:
    if not os.path.isfile(path):
        raise ModelLoadError(f"LoRA adapter file not found: {path}")
    handle = ll.llama_adapter_lora_init(model, path.encode())
    if not handle:
        # llama.cpp logs why (not an adapter, another architecture, a tensor of the wrong
        # shape: an adapter of another base model) and returns NULL.
        raise ModelLoadError(
            f"llama.cpp refused the LoRA adapter {path}: not a LoRA adapter GGUF of this "
            "model (another base model, architecture or shape; see the log)"
        )
    alpha = _meta(handle, "adapter.lora.alpha")
    log.info("loaded LoRA adapter %s (alpha %s)", path, alpha or "none")
    return handle


def _meta(handle: Any, key: str) -> str:
    buf = ctypes.create_string_buffer(128)
    n = ll.llama_adapter_meta_val_str(handle, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""
