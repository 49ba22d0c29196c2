"""llama.cpp's embeddings context; this package (`engine/llama/`) is the only one importing
`llama_cpp`.

`EmbeddingRunner` owns a model (and through it the vocabulary, `vocab.py`), one context with
embeddings on and one reusable `llama_batch`, and frees every C handle through `close()`
(idempotent). Only the embedding engine's thread calls `embed_batch`; other threads use
`vocab` and `info`. One `embed_batch` is one `llama_decode`, every input its own sequence:

    index:   0     1    2    3     |  4     5    6     |  7  ...
    token:   [CLS] a    man  [SEP] |  [CLS] hi   [SEP] |  ...
    seq:     0     0    0    0     |  1     1    1     |  2
    pos:     0     1    2    3     |  0     1    2     |  0
    output:  every token (llama.cpp requires it of an embeddings context)
    → llama_get_embeddings_seq(ctx, s): sequence s pooled (mean, cls, last; rank: scores)
    → pooling "none": llama_get_embeddings_ith(ctx, i) at s's last index (its hidden state)

What aborts the process instead of returning an error, and the rule that prevents it:
  * more tokens in one decode than n_ubatch when attention is non-causal (BERT): n_ubatch ==
    n_batch, and a decode never holds more than n_batch tokens;
  * a position at or past n_ctx_train on a model with learned position embeddings (BERT,
    GPT-2): no input is longer than `info.max_tokens` ≤ n_ctx_train.
A decode split into micro-batches would also pool a sequence cut across two of them from its
last part only; n_ubatch == n_batch keeps every decode one micro-batch.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

import llama_cpp as ll
import numpy as np

from ferrum.engine.compute import compute
from ferrum.engine.embedding import POOLINGS, EmbeddingInfo, Vector
from ferrum.engine.llama.describe import model_meta
from ferrum.engine.llama.runner import route_llama_logs
from ferrum.engine.llama.vocab import LlamaVocab
from ferrum.errors import EngineError, ModelLoadError

_POOLING_TYPES = {
    "none": ll.LLAMA_POOLING_TYPE_NONE,
    "mean": ll.LLAMA_POOLING_TYPE_MEAN,
    "cls": ll.LLAMA_POOLING_TYPE_CLS,
    "last": ll.LLAMA_POOLING_TYPE_LAST,
    "rank": ll.LLAMA_POOLING_TYPE_RANK,
}
_POOLING_NAMES = {v: k for k, v in _POOLING_TYPES.items()}
_LLAMA_MAX_SEQ = 256  # LLAMA_MAX_SEQ in llama-cparams.h: more and the context is refused


class EmbeddingRunner:
    def __init__(
        self,
        path: str,
        *,
        threads: int,
        batch_tokens: int = 2048,
        max_seqs: int = 64,
        pooling: str = "",
        gpu_layers: int = 0,
    ):
        """Loads the model and an embeddings context: pooled as the GGUF states unless
        `pooling` names one of POOLINGS; at most `batch_tokens` tokens and `max_seqs` inputs
        per decode. ModelLoadError for a file or model that cannot embed."""
        if pooling and pooling not in _POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}; got {pooling!r}")
        if not 1 <= max_seqs <= _LLAMA_MAX_SEQ or batch_tokens < 1:
            raise ValueError(f"need 1 ≤ max_seqs ≤ {_LLAMA_MAX_SEQ} and batch_tokens ≥ 1")
        if not os.path.isfile(path):
            raise ModelLoadError(f"model file not found: {path}")
        route_llama_logs()
        ll.llama_backend_init()
        self._model: Any = None
        self._ctx: Any = None
        self._batch: Any = None
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = gpu_layers
        self._model = ll.llama_model_load_from_file(path.encode(), mparams)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {path} (corrupt or unsupported)")
        self._vocab = LlamaVocab(self._model)
        try:
            self._refuse_unfit(pooling)
            self._init_context(threads, batch_tokens, max_seqs, pooling)
            self._info = self._describe()
        except Exception:
            self.close()
            raise

    @property
    def info(self) -> EmbeddingInfo:
        return self._info

    @property
    def vocab(self) -> LlamaVocab:
        """What other threads may use: the tokenizer."""
        return self._vocab

    def _refuse_unfit(self, pooling: str) -> None:
        arch = model_meta(self._model, "general.architecture") or "unknown"
        if ll.llama_model_has_encoder(self._model):
            # T5 and the draft heads: llama_decode runs their decoder, which needs an encoder
            # pass (or a target model) first; there is no pooled output to read.
            raise ModelLoadError(
                f"cannot embed with a {arch} model: it has a separate encoder (encoder-decoder "
                "or draft model); serve an embedding model (BERT-like) or a decoder"
            )
        if pooling == "rank" and model_meta(self._model, f"{arch}.pooling_type") != str(
            ll.LLAMA_POOLING_TYPE_RANK
        ):
            # Without a classification head llama.cpp reads n_cls_out floats at the wrong
            # offsets of the pooled hidden states: numbers, but meaningless ones.
            raise ModelLoadError(
                f"pooling 'rank' needs a reranker (a model with a classification head); this "
                f"{arch} model has none"
            )

    def _init_context(self, threads: int, batch_tokens: int, max_seqs: int, pooling: str) -> None:
        cparams = ll.llama_context_default_params()
        cparams.embeddings = True
        cparams.pooling_type = _POOLING_TYPES.get(pooling, ll.LLAMA_POOLING_TYPE_UNSPECIFIED)
        # The KV memory (decoder models only) holds one decode at a time: it is cleared after
        # each, so it needs no more cells than one decode has tokens.
        cparams.n_ctx = batch_tokens
        cparams.n_batch = batch_tokens
        cparams.n_ubatch = batch_tokens  # one micro-batch per decode (see the docstring)
        cparams.n_seq_max = max_seqs
        # One cell pool for all sequences; per-sequence streams would cut every sequence's
        # room to n_ctx / n_seq_max cells.
        cparams.kv_unified = True
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        self._ctx = ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise ModelLoadError(
                "llama.cpp could not create an embeddings context (out of memory?)"
            )
        pooling_type = int(ll.llama_pooling_type(self._ctx))
        if pooling_type not in _POOLING_NAMES:
            raise ModelLoadError(f"the model states a pooling llama.cpp lacks ({pooling_type})")
        self._pooling = _POOLING_NAMES[pooling_type]
        if self._pooling == "rank":  # one score per classifier output, not a hidden state
            self._n_out = int(ll.llama_model_n_cls_out(self._model))
        else:
            self._n_out = int(ll.llama_model_n_embd_out(self._model))
        # llama.cpp may lower n_batch (to n_ctx on a causal model) and n_ubatch (to n_batch).
        self._n_batch = int(min(ll.llama_n_batch(self._ctx), ll.llama_n_ubatch(self._ctx)))
        self._n_seq = int(ll.llama_n_seq_max(self._ctx))
        self._mem = ll.llama_get_memory(self._ctx)  # None for encoders (BERT): nothing kept
        self._batch = ll.llama_batch_init(self._n_batch, 0, 1)

    def _describe(self) -> EmbeddingInfo:
        model, ctx = self._model, self._ctx
        desc = ctypes.create_string_buffer(256)
        ll.llama_model_desc(model, desc, len(desc))
        causal = bool(ll.llama_get_causal_attn(ctx))
        # The longest input: the context size (a decoder), the trained length (an encoder),
        # and never past the trained length, where learned position embeddings end.
        longest = ll.llama_n_ctx(ctx) if causal else ll.llama_model_n_ctx_train(model)
        train = ll.llama_model_n_ctx_train(model)
        max_tokens = min(longest, self._n_batch, train if train > 0 else longest)
        return EmbeddingInfo(
            n_embd=self._n_out,
            max_tokens=int(max_tokens),
            pooling=self._pooling,
            architecture=model_meta(self._model, "general.architecture") or "unknown",
            description=desc.value.decode("utf-8", "replace"),
            n_vocab=self._vocab.n_vocab,
            n_batch=self._n_batch,
            n_seq_max=self._n_seq,
            causal=causal,
        )

    # -- engine thread ----------------------------------------------------------------------

    def embed_batch(self, inputs: Sequence[Sequence[int]]) -> list[Vector]:
        """One llama_decode of every input as its own sequence: each input's pooled vector
        (not normalised), in input order."""
        self._check(inputs)
        batch = self._batch
        tok, pos, nseq, seqs, out = (
            batch.token,
            batch.pos,
            batch.n_seq_id,
            batch.seq_id,
            batch.logits,
        )
        n = 0
        last: list[int] = []  # each input's last index in the batch
        for seq, tokens in enumerate(inputs):
            for p, t in enumerate(tokens):
                tok[n] = t
                pos[n] = p
                nseq[n] = 1
                seqs[n][0] = seq
                out[n] = 1
                n += 1
            last.append(n - 1)
        batch.n_tokens = n
        try:
            rc = int(compute().run(lambda: ll.llama_decode(self._ctx, batch)))
            if rc != 0:
                raise EngineError(f"llama_decode={rc} for {len(inputs)} inputs of {n} tokens")
            return [self._read(seq, last[seq]) for seq in range(len(inputs))]
        finally:
            if self._mem:
                # Decoder models keep each decode's KV cells: the next decode reuses the same
                # sequence ids from position 0, so they must go (metadata only, no memset).
                ll.llama_memory_clear(self._mem, False)

    def _check(self, inputs: Sequence[Sequence[int]]) -> None:
        # Past these limits llama.cpp aborts the process or fails the decode (docstring).
        total = sum(map(len, inputs))
        if not 0 < len(inputs) <= self._n_seq or total > self._n_batch:
            raise ValueError(
                f"{len(inputs)} inputs of {total} tokens: one decode takes 1 to {self._n_seq} "
                f"inputs of at most {self._n_batch} tokens"
            )
        longest = self._info.max_tokens
        if not all(0 < len(tokens) <= longest for tokens in inputs):
            raise ValueError(f"every input must have 1 to {longest} tokens")

    def _read(self, seq: int, last: int) -> Vector:
        if self._pooling == "none":
            ptr = ll.llama_get_embeddings_ith(self._ctx, last)
        else:
            ptr = ll.llama_get_embeddings_seq(self._ctx, seq)
        if not ptr:
            raise EngineError(f"llama.cpp gave no embedding for sequence {seq}")
        # A copy: the next decode overwrites llama.cpp's buffer.
        return np.array(np.ctypeslib.as_array(ptr, shape=(self._n_out,)), dtype=np.float32)

    def close(self) -> None:
        if self._model is not None:
            self._vocab.close()
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            ll.llama_model_free(self._model)
            self._model = None
