"""The llama.cpp context's parameters for an engine's settings (`context_params`): cell types,
batch sizes, how many sequence ids, and the KV layout (one pool or a stream per sequence,
window layers as large as the context or sized to their windows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import llama_cpp as ll

from ferrum.config import EngineConfig
from ferrum.errors import ModelLoadError
from ferrum.kv_types import cell_type, check_kv_settings

_FLASH_ATTN = {
    "on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": ll.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    "auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO,
}


@dataclass(frozen=True)
class Layout:
    """What the runner needs to know of the context it asked for."""

    n_seq: int  # sequence ids the engine may use
    windowed: bool  # a sliding-window model whose prefixes are copied: id n_seq is the probe
    spare: bool  # id n_seq is the runner's own (the probe, or with streams, `StreamCopies`)
    own_copies: bool  # --swa-windows: a prefix copy takes window cells of its own
    streams: bool  # --kv-streams: a cell stream per sequence id


NO_LAYOUT = Layout(0, windowed=False, spare=False, own_copies=False, streams=False)


def context_params(model: Any, config: EngineConfig) -> tuple[Any, Layout]:
    try:  # refused here with the flag's name, not as a null context later
        check_kv_settings(config.cache_type_k, config.cache_type_v, config.flash_attn)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    if config.kv_streams and config.swa_windows:
        raise ModelLoadError("--kv-streams and --swa-windows cannot be combined yet")
    cparams = ll.llama_context_default_params()
    cparams.type_k = cell_type(config.cache_type_k).ggml_type
    cparams.type_v = cell_type(config.cache_type_v).ggml_type
    cparams.flash_attn_type = _FLASH_ATTN[config.flash_attn]
    cparams.n_batch = config.batch_size
    # n_ubatch == n_batch: one llama_decode is one micro-batch (on one pool; with streams, one
    # per run of sequence ids, all placed before any is computed), so a decode refused for
    # want of cells has committed nothing and the step can be retried or split safely.
    cparams.n_ubatch = config.batch_size
    # Sequence ids beyond --parallel hold parked sequences kept for prefix reuse; a model
    # with a sliding window gets one more, the probe that `holds_window` copies into.
    # Recurrent and hybrid models never copy a prefix (only takeover), so need no probe.
    copies = not (ll.llama_model_is_recurrent(model) or ll.llama_model_is_hybrid(model))
    windowed = ll.llama_model_n_swa(model) > 0 and copies and not config.no_prefix_cache
    # A window cache sized to the windows grows with n_seq_max, and each decode of the
    # window layers attends over all of it that is in use: there a finished sequence goes
    # straight to the tiers instead of parking in a sequence id of its own.
    parks = not config.no_prefix_cache and not (
        windowed and config.swa_windows and config.saves_states
    )
    # With a stream per sequence id, a parked sequence keeps its own stream (no decode
    # attends over it) and an id beyond --parallel would cost a stream's cells: finished
    # sequences park in the ids running ones leave, as llama-server's slots keep theirs.
    n_seq = config.parallel * (2 if parks and not config.kv_streams else 1)
    # With streams, copies between them land at the next decode: one id beyond the engine's
    # is decoded into to land them sooner (`streams.py`), the probe's where there is one.
    spare = windowed or (config.kv_streams and copies and not config.no_prefix_cache)
    cparams.n_seq_max = n_seq + (1 if spare else 0)
    cparams.n_ctx = config.ctx_size
    if config.kv_streams:  # ctx-size / parallel cells a stream, as llama-server's (and the probe)
        cparams.n_ctx = config.ctx_size // config.parallel * cparams.n_seq_max
    threads = config.resolved_threads()
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.no_perf = True
    # One cell pool for all sequences: any request may use the whole context, and cells can
    # be shared between sequences without copying. --kv-streams: a stream per sequence id.
    cparams.kv_unified = not config.kv_streams
    # --swa-windows: the window cache sized to the windows (n_swa cells per sequence id and
    # a micro-batch), enough only while no cell there is shared (llama.cpp recycles a cell
    # once it has one owner): a prefix copy gets cells of its own (`copy_own`). Default:
    # as large as the main cache; old window cells stay until needed, copies share cells.
    cparams.swa_full = not config.swa_windows
    own = windowed and config.swa_windows
    return cparams, Layout(n_seq, windowed, spare, own, config.kv_streams)
