"""The models ferrum serves: built-in ones (`builtin.py`), the on-disk store (`store.py`),
pulls from the Hugging Face Hub (`pull.py`), per-model presets (`presets.py`) and the registry
of a running server (`registry.py`). It depends on nothing of the engine or the API."""

from __future__ import annotations

from ferrum.models.builtin import BENCH_MODEL, DEFAULT_CHAT_MODEL, builtin_path

__all__ = ["BENCH_MODEL", "DEFAULT_CHAT_MODEL", "builtin_path", "default_model_path"]


def default_model_path() -> str:
    """The default chat model's GGUF."""
    return builtin_path(DEFAULT_CHAT_MODEL)
