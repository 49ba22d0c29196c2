"""What the runner tells the engine about its model and context (`ModelInfo`), read from
llama.cpp once at start-up, and the GGUF header's text values (`model_meta`)."""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp as ll

from ferrum.config import EngineConfig
from ferrum.engine.contracts import ModelInfo
from ferrum.engine.llama.vision import Projector
from ferrum.engine.llama.vocab import LlamaVocab
from ferrum.kv_types import cell_type, flash_attn_resolved


def model_meta(model: Any, key: str) -> str:
    """A GGUF header value as text ("" when the model has none)."""
    buf = ctypes.create_string_buffer(512)
    n = ll.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""


def describe(
    model: Any, ctx: Any, vocab: LlamaVocab, path: str, config: EngineConfig,
    kv_bytes_per_cell: int, *, probe: bool, projector: Projector | None, own_copies: bool,
    streams: bool,
) -> ModelInfo:  # fmt: skip
    """`probe`: one sequence id is the runner's own (the window probe's, `window.py`, or
    the one `streams.py` decodes into), not the engine's."""
    desc = ctypes.create_string_buffer(256)
    ll.llama_model_desc(model, desc, len(desc))
    template = ll.llama_model_chat_template(model, None)
    type_k, type_v = cell_type(config.cache_type_k).name, cell_type(config.cache_type_v).name
    flash_attn = flash_attn_resolved(type_v, config.flash_attn)
    n_swa = ll.llama_model_n_swa(model)
    return ModelInfo(
        path=path,
        architecture=model_meta(model, "general.architecture") or "unknown",
        description=desc.value.decode("utf-8", "replace"),
        n_ctx=ll.llama_n_ctx(ctx),
        n_ctx_train=ll.llama_model_n_ctx_train(model),
        n_batch=ll.llama_n_batch(ctx),
        n_seq_max=ll.llama_n_seq_max(ctx) - probe,
        n_vocab=vocab.n_vocab,
        n_swa=n_swa,
        threads=config.resolved_threads(),
        is_recurrent=bool(ll.llama_model_is_recurrent(model)),
        is_hybrid=bool(ll.llama_model_is_hybrid(model)),
        chat_template=template.decode("utf-8", "replace") if template else None,
        bos_text=vocab.token_text(vocab.bos),
        eos_text=vocab.token_text(vocab.eos),
        add_bos=vocab.add_bos,
        # A state saved under other cell types, V layout (flash attention transposes V when
        # off) or window cache (all positions, or the windows alone) must never be offered
        # to llama.cpp: all are in the fingerprint.
        state_format=(
            f"llama-cpp-python {ll.__version__}; kv k={type_k} v={type_v}; "
            f"flash_attn {flash_attn}; {'streams' if streams else 'unified'}; "
            + ("swa windows" if config.swa_windows and n_swa else "swa_full")
        ),
        cache_type_k=type_k,
        cache_type_v=type_v,
        flash_attn=flash_attn,
        kv_bytes_per_cell=kv_bytes_per_cell,
        vision=projector is not None,
        images_whole=projector is not None and projector.non_causal,
        own_copies=own_copies,
        kv_streams=streams,
        n_ctx_seq=ll.llama_n_ctx_seq(ctx),
    )
