"""The llama.cpp runner; this package (`engine/llama/`) is the only one importing `llama_cpp`.

It owns the model (and through it the vocabulary, `vocab.py`), the context, one reusable
`llama_batch` and each running request's sampler (by request id), and frees every C handle
through `close()` (idempotent). Only the engine thread calls it; other threads use `vocab`.
It knows nothing of blocks: the engine hands it (sequence id, tokens, first position,
request to sample for) items per step.

    one step's llama_batch (n_tokens ≤ n_batch):
      index:   0    1    2    3    4    5    6   ...
      token:   a5 | b9 | c0   c1   c2   c3 | d7  ...
      seq:     0  | 1  | 2    2    2    2  | 3
      pos:     40 | 12 | 0    1    2    3  | 88
      logits:  1  | 1  | 0    0    0    1  | 1      ← only where a token is sampled
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import llama_cpp as ll

from ferrum.config import EngineConfig
from ferrum.engine.compute import compute
from ferrum.engine.contracts import BatchItem, ModelInfo, StepResult
from ferrum.engine.llama.adapters import LoraAdapters
from ferrum.engine.llama.context_params import NO_LAYOUT, context_params
from ferrum.engine.llama.decode_parts import decode_parts
from ferrum.engine.llama.describe import describe, model_meta
from ferrum.engine.llama.sampler import Sampler
from ferrum.engine.llama.step_sampling import Row, sample_rows
from ferrum.engine.llama.streams import StreamCopies
from ferrum.engine.llama.vision import EmbeddingBatch, Projector, cut
from ferrum.engine.llama.vocab import LlamaVocab
from ferrum.engine.llama.window import WindowProbe
from ferrum.engine.request import SamplingParams
from ferrum.errors import ModelLoadError

log = logging.getLogger("ferrum.llama")

# llama_decode's "no KV slot for this batch" return code; anything else non-zero is an error.
_DECODE_NO_SLOT = 1


def _forward_llama_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    # llama.cpp is chatty at load time; keep only its warnings and errors at our INFO level.
    if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
        msg = text.decode("utf-8", "replace").rstrip()
        if msg:
            log.warning("%s", msg)


_LOG_CALLBACK = ll.llama_log_callback(_forward_llama_log)


def route_llama_logs() -> None:
    """llama.cpp's own log lines go to ferrum's logger (warnings and errors only). The
    callback object lives at module level: llama.cpp keeps a pointer to it."""
    ll.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


class LlamaRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        lora_paths: Sequence[str] = (),
        kv_bytes_per_cell: int = 0,
        mmproj: str = "",
    ):
        """`lora_paths`: the LoRA adapters requests may pick (`adapters.py`);
        `kv_bytes_per_cell`: what one KV cell costs at the configured types (the composition
        root computes it from the GGUF header with `ferrum.kv_types`), reported in `info`;
        `mmproj`: a vision projector GGUF opened beside the model (`vision.py`)."""
        if not os.path.isfile(model_path):
            raise ModelLoadError(f"model file not found: {model_path}")
        route_llama_logs()
        ll.llama_backend_init()
        self._model: Any = None
        self._ctx: Any = None
        self._batch: Any = None
        self._window: WindowProbe | None = None
        self._layout = NO_LAYOUT  # the context's sequence ids and KV layout
        self._copies: StreamCopies | None = None  # copies between streams (`streams.py`)
        self._samplers: dict[str, Sampler] = {}
        self._adapters: LoraAdapters | None = None
        self._projector: Projector | None = None
        self._embd_batch: EmbeddingBatch | None = None
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = config.gpu_layers
        self._model = ll.llama_model_load_from_file(model_path.encode(), mparams)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {model_path} (corrupt or unsupported)")
        self._vocab = LlamaVocab(self._model)
        try:
            self._init_context(config)
            self._adapters = LoraAdapters(self._model, lora_paths, self._ctx)  # ids: this order
            if mmproj:
                self._open_projector(mmproj, config)
        except Exception:
            self.close()
            raise
        self._split_at = config.split_prefill
        self._fault_rate = config.inject_faults
        self._faults = random.Random(0)  # the same faults in the same traffic
        if self._fault_rate > 0:
            log.warning("testing aid on: faking 'no KV slot' for %g of decodes", self._fault_rate)
        self._info = describe(
            self._model, self._ctx, self._vocab, model_path, config, kv_bytes_per_cell,
            probe=self._layout.spare, projector=self._projector,
            own_copies=self._layout.own_copies, streams=self._layout.streams,
        )  # fmt: skip

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def adapters(self) -> LoraAdapters | None:
        return self._adapters

    @property
    def vocab(self) -> LlamaVocab:
        """What other threads may use: tokenizer, token bytes, grammars."""
        return self._vocab

    @property
    def images(self) -> Projector | None:
        """The vision projector (the preparation thread encodes with it); None: text only."""
        return self._projector

    def _open_projector(self, path: str, config: EngineConfig) -> None:
        if not os.path.isfile(path):
            raise ModelLoadError(f"projector file not found: {path}")
        threads = config.resolved_threads()
        self._projector = Projector(self._model, path, threads, _LOG_CALLBACK)
        self._embd_batch = EmbeddingBatch(
            self._n_batch, self._projector.n_embd, self._projector.non_causal
        )

    def _init_context(self, config: EngineConfig) -> None:
        cparams, layout = context_params(self._model, config)
        self._layout = layout
        self._ctx = ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise ModelLoadError(
                "llama.cpp could not create a context (out of memory, or KV cache settings it "
                "refuses for this model: see its log above)"
            )
        if layout.streams:
            log.info(
                "--kv-streams: one request holds at most %d positions",
                ll.llama_n_ctx_seq(self._ctx),
            )
        self._n_batch: int = ll.llama_n_batch(self._ctx)
        self._batch = ll.llama_batch_init(self._n_batch, 0, 1)
        self._mem = ll.llama_get_memory(self._ctx)
        self._window = None
        if layout.streams and layout.spare:
            self._copies = StreamCopies(self._ctx, self._mem, self._batch, layout.n_seq)
        if layout.windowed:
            # Llama 4 windows are chunks: position p sees back to the start of its own chunk.
            chunked = model_meta(self._model, "general.architecture") == "llama4"
            self._window = WindowProbe(
                self._ctx, self._mem, self._model, self._batch, layout.n_seq, chunked,
                layout.streams,
            )  # fmt: skip

    # -- requests -------------------------------------------------------------------------

    def start_request(self, request_id: str, params: SamplingParams) -> None:
        if request_id in self._samplers:
            raise ValueError(f"request {request_id} already has a sampler")
        self._samplers[request_id] = Sampler(params, self._vocab)

    def finish_request(self, request_id: str) -> None:
        sampler = self._samplers.pop(request_id, None)
        if sampler is not None:
            sampler.close()

    # -- memory -----------------------------------------------------------------------------

    def clear_sequence(self, seq_id: int) -> None:
        # Removing a whole sequence never fails, for KV and recurrent memory alike.
        ll.llama_memory_seq_rm(self._mem, seq_id, 0, -1)

    def trim_sequence(self, seq_id: int, length: int) -> None:
        if not ll.llama_memory_seq_rm(self._mem, seq_id, length, -1):
            raise RuntimeError(f"llama.cpp refused to trim sequence {seq_id} to {length}")

    def copy_sequence(self, src: int, dst: int, length: int) -> None:
        """dst shares src's cells for positions [0, length): metadata only on a unified KV."""
        if self.info.is_recurrent or self.info.is_hybrid or self._layout.streams:
            raise ValueError("cells are not shared between recurrent states or streams")
        ll.llama_memory_seq_cp(self._mem, src, dst, 0, length)

    def checkpoint(self, src: int, length: int) -> bytearray | None:
        """The state of src's first `length` positions with the window that position
        `length` attends to, copied out through the probe sequence (only unmasked window
        cells are written); None where src no longer holds that window."""
        if self._window is None or not self._window.holds(src, length):
            return None
        return self._window.state_of(src, length, self.save_sequence)

    def copy_own(self, src: int, dst: int, length: int) -> bytearray | None:
        """dst gets cells of its own holding src's first `length` positions and their window
        (`checkpoint`, read back into dst): no cell is shared, so the window cache can
        recycle every one. Returns that state, or None, dst left empty, when src no longer
        holds the window or llama.cpp refused the state."""
        if self._copies is not None:  # --kv-streams: the caller checks the window
            self._copies.copy(src, dst, length)
            return bytearray()  # no state of its own: nothing to keep as a checkpoint
        state = self.checkpoint(src, length)
        if state is None or not self.restore_sequence(dst, state):
            return None
        return state

    def holds_window(self, seq_id: int, length: int) -> bool:
        """Whether seq_id still holds, in the sliding-window cache, every position that a
        copy of its first `length` positions attends to from position `length` on."""
        return self._window is None or self._window.holds(seq_id, length)

    def save_sequence(self, seq_id: int) -> bytearray | None:
        if self._copies is not None:
            self._copies.settle(seq_id)
        size = int(ll.llama_state_seq_get_size(self._ctx, seq_id))
        if size <= 0:
            return None
        state = bytearray(size)
        view = (ctypes.c_uint8 * size).from_buffer(state)
        written = int(ll.llama_state_seq_get_data(self._ctx, view, size, seq_id))
        del view  # releases the bytearray's buffer
        return state if written == size else None

    def restore_sequence(self, seq_id: int, state: bytearray) -> bool:
        if self._copies is not None:
            self._copies.settle(seq_id)
        view = (ctypes.c_uint8 * len(state)).from_buffer(state)
        read = int(ll.llama_state_seq_set_data(self._ctx, view, len(state), seq_id))
        del view
        if read != len(state):
            self.clear_sequence(seq_id)  # a refused restore may have placed some cells
            return False
        return True

    def execute(self, items: Sequence[BatchItem]) -> StepResult:
        """Decodes all items, a long prefill chunk in a llama_decode of its own
        (`decode_parts.py`), and samples where asked (image rows first, in runs of their own:
        `vision.py`)."""
        result = StepResult()
        if any(item.embeds for item in items):
            items = self._decode_images(items, result)
        idx = [i for i, item in enumerate(items) if item.tokens and i not in result.failed]
        if idx:
            parts = decode_parts(idx, items, self._split_at)
            result.split_calls = len(parts) - 1
            for part in parts:
                self._decode_split(part, items, result)
        return result

    def _decode_images(self, items: Sequence[BatchItem], result: StepResult) -> list[BatchItem]:
        """Decodes each item's runs up to its last token run (each once: the shared batch's
        "no slot" split must not decode them again); the items left for the shared batch,
        an empty one where nothing is left."""
        left = list(items)
        self._use_adapters(list(items), result)
        for i, item in enumerate(items):
            if not item.embeds:
                continue
            runs, tail = cut(item)
            left[i] = tail or BatchItem(item.seq_id, (), item.start_pos)
            for run in runs:
                rc = self._decode_run(run, i, result)
                if rc != 0:
                    result.failed[i] = f"llama_decode={rc} on an image"
                    break
        return left

    def _decode_run(self, run: BatchItem, i: int, result: StepResult) -> int:
        if not run.embeds:
            return self._decode([0], [run], StepResult())
        if self._embd_batch is None:
            raise ValueError("image rows for a model without a projector")
        result.decode_calls += 1
        rc = self._embd_batch.decode(self._ctx, run)
        if rc == 0 and run.sample_for is not None:
            self._sample([(i, run, len(run.tokens) - 1, run.sample_for)], result)
        return rc

    def _decode_split(self, idx: list[int], items: Sequence[BatchItem], result: StepResult) -> None:
        rc = self._injected_fault(idx, result) or self._decode(idx, items, result)
        if rc == 0:
            return
        if rc == _DECODE_NO_SLOT and len(idx) > 1:
            half = len(idx) // 2
            self._decode_split(idx[:half], items, result)
            self._decode_split(idx[half:], items, result)
            return
        reason = "no KV slot for the batch" if rc == _DECODE_NO_SLOT else f"llama_decode={rc}"
        for i in idx:
            result.failed[i] = reason

    def _injected_fault(self, idx: list[int], result: StepResult) -> int:
        """--inject-faults: llama.cpp's "no KV slot" for a batch of several sequences, without
        decoding it. Only where the split below can recover, so no request ever fails of it."""
        if len(idx) > 1 and self._fault_rate > 0 and self._faults.random() < self._fault_rate:
            result.faults_injected += 1
            return _DECODE_NO_SLOT
        return 0

    def _decode(self, idx: list[int], items: Sequence[BatchItem], result: StepResult) -> int:
        batch = self._batch
        tok, pos, nseq, seqs, out = (
            batch.token,
            batch.pos,
            batch.n_seq_id,
            batch.seq_id,
            batch.logits,
        )
        n = 0
        # (item index, item, batch index of the last real token, request id)
        sample_at: list[tuple[int, BatchItem, int, str]] = []
        if self._layout.streams:
            # llama.cpp puts rows of several streams in one micro-batch only where their
            # sequence ids follow one another in batch order: else a decode costs a pass of
            # the weights per run of ids.
            idx = sorted(idx, key=lambda i: items[i].seq_id)
        for i in idx:
            item = items[i]
            seq, p = item.seq_id, item.start_pos
            for t in item.tokens:
                tok[n] = t
                pos[n] = p
                nseq[n] = 1
                seqs[n][0] = seq
                out[n] = 0
                n += 1
                p += 1
            if item.sample_for is not None:
                for b in range(n - 1 - item.draft, n):
                    out[b] = 1
                sample_at.append((i, item, n - 1 - item.draft, item.sample_for))
        if n > self._n_batch:
            raise ValueError(f"batch of {n} tokens exceeds n_batch {self._n_batch}")
        self._use_adapters([items[i] for i in idx], result)
        batch.n_tokens = n
        result.decode_calls += 1
        start = time.perf_counter()
        rc = int(compute().run(lambda: ll.llama_decode(self._ctx, batch)))
        result.decode_s += time.perf_counter() - start
        if rc != 0:
            return rc
        if self._copies is not None:
            self._copies.decoded()
        self._sample(sample_at, result)
        return 0

    def _use_adapters(self, items: list[BatchItem], result: StepResult) -> None:
        """The decode's one LoRA set on the context, sent only when it changed."""
        sets = {item.adapters for item in items}
        if len(sets) > 1:
            raise ValueError(f"one decode cannot mix adapter sets: {sorted(sets)}")
        if self._adapters is not None and self._adapters.use(self._ctx, sets.pop()):
            result.adapter_switches += 1

    def _sample(self, at: list[tuple[int, BatchItem, int, str]], result: StepResult) -> None:
        """Samples each item at its last real token (batch index b) and at each guess taken,
        the step's masks together (`step_sampling.py`); removes the guesses not taken."""
        rows = [Row(item, self._samplers[rid], b) for _, item, b, rid in at]
        sample_rows(self._ctx, rows)
        for (i, item, _, _), row in zip(at, rows, strict=True):
            result.sampled[i] = row.tokens
            result.mask_seconds += row.sampler.take_mask_seconds()
            if row.logprobs:
                result.logprobs[i] = row.logprobs
            if row.accepted < item.draft:
                kept = item.start_pos + len(item.tokens) - item.draft + row.accepted
                self.trim_sequence(item.seq_id, kept)

    def close(self) -> None:
        for request_id in list(self._samplers):
            self.finish_request(request_id)
        if self._model is not None:
            self._vocab.close()
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._embd_batch is not None:
            self._embd_batch.free()
            self._embd_batch = None
        if self._projector is not None:  # it holds the model: freed before it
            self._projector.close()
            self._projector = None
        if self._ctx is not None:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._adapters is not None:  # after the context that used them, before the model
            self._adapters.free()
            self._adapters = None
        if self._model is not None:
            ll.llama_model_free(self._model)
            self._model = None
