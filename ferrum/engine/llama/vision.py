"""Images through llama.cpp's libmtmd: the projector (encoder) and the decode of embeddings.

`Projector` owns one `mtmd_context`, opened beside the model it projects into and freed
before it; the preparation thread alone encodes with it (`contracts.ImageEncoder`): an image
is tokenized by libmtmd into pieces (the model's image marker tokens, if any, and one image
chunk), and the image chunk is encoded into rows of the language model's width, there,
outside any engine step.

The engine thread then decodes those rows into the request's sequence. A `llama_batch`
carries tokens or embeddings, never both, so an item holding image positions is cut into
runs decoded one after another, in position order, before the step's shared token batch:

    item (seq 3, start 40):   t t t [■ ■ ■ ■] t t [■ ■] t t
    decodes:                  [t t t] [■ ■ ■ ■] [t t] [■ ■]  then  [t t] in the shared batch

Only projectors whose image positions are plain 1-D positions (one per row) load here: an
M-RoPE projector (Qwen2-VL and kin) needs 4 positions per row and is refused by name.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import llama_cpp as ll
import numpy as np
from llama_cpp import mtmd_cpp as mt

from ferrum.engine.compute import compute
from ferrum.engine.contracts import BatchItem, RgbImage
from ferrum.errors import InvalidRequest, ModelLoadError

_IMAGE = mt.MTMD_INPUT_CHUNK_TYPE_IMAGE
_TEXT = mt.MTMD_INPUT_CHUNK_TYPE_TEXT


class Projector:
    """A vision projector GGUF (mmproj) opened beside `model`."""

    def __init__(self, model: Any, path: str, threads: int, log_callback: Any):
        mt.mtmd_log_set(log_callback, ctypes.c_void_p(0))  # its INFO lines go where llama's go
        params = mt.mtmd_context_params_default()
        params.use_gpu, params.n_threads, params.print_timings = False, threads, False
        # Its warm-up runs a graph: on the compute thread, as every graph of this process.
        self._ctx: Any = compute().run(lambda: mt.mtmd_init_from_file(path.encode(), model, params))
        if not self._ctx:
            raise ModelLoadError(
                f"libmtmd could not load the projector {path} (not an mmproj GGUF, or its "
                "width differs from the model's: see its log above)"
            )
        try:
            if not mt.mtmd_support_vision(self._ctx):
                raise ModelLoadError(f"the projector {path} has no vision encoder")
            if mt.mtmd_decode_use_mrope(self._ctx):
                raise ModelLoadError(f"the projector {path} needs M-RoPE positions: not yet served")
        except ModelLoadError:
            self.close()
            raise
        # Gemma 3's images attend to each other both ways while they are decoded.
        self.non_causal = bool(mt.mtmd_decode_use_non_causal(self._ctx, None))
        self.n_embd = int(ll.llama_model_n_embd_inp(model))
        self._marker = mt.mtmd_default_marker()
        self._lock = threading.Lock()  # one encode at a time: the context holds its output

    def encode(self, image: RgbImage) -> list[list[int] | Any]:
        with self._lock:
            if self._ctx is None:
                raise RuntimeError("the projector is closed")
            return self._encode(image)

    def _encode(self, image: RgbImage) -> list[list[int] | Any]:
        data = (ctypes.c_uint8 * len(image.pixels)).from_buffer_copy(image.pixels)
        bitmap = mt.mtmd_bitmap_init(image.width, image.height, data)
        chunks = mt.mtmd_input_chunks_init()
        try:
            text = mt.mtmd_input_text(self._marker, len(self._marker), False, True)
            bitmaps = (mt.mtmd_bitmap_p_ctypes * 1)(bitmap)
            if mt.mtmd_tokenize(self._ctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
                raise InvalidRequest("the projector could not prepare this image")
            return [self._piece(mt.mtmd_input_chunks_get(chunks, i))
                    for i in range(mt.mtmd_input_chunks_size(chunks))]  # fmt: skip
        finally:
            mt.mtmd_input_chunks_free(chunks)
            mt.mtmd_bitmap_free(bitmap)

    def _piece(self, chunk: Any) -> list[int] | Any:
        kind = mt.mtmd_input_chunk_get_type(chunk)
        if kind == _TEXT:
            n = ctypes.c_size_t(0)
            tokens = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            return [int(tokens[i]) for i in range(n.value)]
        if kind != _IMAGE:
            raise InvalidRequest("only images are taken, not audio")
        n_tokens = int(mt.mtmd_input_chunk_get_n_tokens(chunk))
        if int(mt.mtmd_input_chunk_get_n_pos(chunk)) != n_tokens:
            raise InvalidRequest("this projector's images take other positions than rows")
        if compute().run(lambda: mt.mtmd_encode_chunk(self._ctx, chunk)) != 0:
            raise InvalidRequest("the projector could not encode this image")
        out = mt.mtmd_get_output_embd(self._ctx)
        return np.ctypeslib.as_array(out, shape=(n_tokens, self.n_embd)).copy()

    def close(self) -> None:
        if self._ctx is not None:
            mt.mtmd_free(self._ctx)
            self._ctx = None


def cut(item: BatchItem) -> tuple[list[BatchItem], BatchItem | None]:
    """An item with image rows as the runs decoded before the shared batch (token runs and
    one-run image items, whose `embeds` hold their rows), and what is left for the shared
    batch: its last token run (None when it ends in an image, whose run then samples)."""
    runs: list[BatchItem] = []
    cursor = 0
    for offset, rows in item.embeds:
        if offset > cursor:
            runs.append(BatchItem(item.seq_id, item.tokens[cursor:offset],
                                  item.start_pos + cursor, adapters=item.adapters))  # fmt: skip
        runs.append(BatchItem(item.seq_id, item.tokens[offset:offset + len(rows)],
                              item.start_pos + offset, adapters=item.adapters,
                              embeds=((0, rows),)))  # fmt: skip
        cursor = offset + len(rows)
    if cursor < len(item.tokens):
        tail = BatchItem(item.seq_id, item.tokens[cursor:], item.start_pos + cursor,
                         item.sample_for, item.draft, item.adapters)  # fmt: skip
        return runs, tail
    last = runs[-1]
    runs[-1] = BatchItem(last.seq_id, last.tokens, last.start_pos, item.sample_for,
                         adapters=last.adapters, embeds=last.embeds)  # fmt: skip
    return runs, None


class EmbeddingBatch:
    """A reusable `llama_batch` of embedding rows for one sequence run at a time."""

    def __init__(self, n_batch: int, n_embd: int, non_causal: bool):
        self._batch: Any = ll.llama_batch_init(n_batch, n_embd, 1)
        self._n_batch, self._n_embd, self._non_causal = n_batch, n_embd, non_causal

    def decode(self, ctx: Any, item: BatchItem) -> int:
        """llama_decode of the item's one run of rows; logits at its last row when it
        samples (read them at batch index len(rows) - 1)."""
        ((_, rows),) = item.embeds
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        n, batch = len(rows), self._batch
        if n > self._n_batch or rows.shape[1] != self._n_embd:
            raise ValueError(f"{n} image rows of width {rows.shape[1]} do not fit the batch")
        ctypes.memmove(batch.embd, rows.ctypes.data, rows.nbytes)
        for i in range(n):
            batch.pos[i], batch.n_seq_id[i] = item.start_pos + i, 1
            batch.seq_id[i][0], batch.logits[i] = item.seq_id, 0
        batch.logits[n - 1] = item.sample_for is not None
        batch.n_tokens = n
        return int(compute().run(lambda: self._decode(ctx)))

    def _decode(self, ctx: Any) -> int:
        if not self._non_causal:
            return int(ll.llama_decode(ctx, self._batch))
        ll.llama_set_causal_attn(ctx, False)
        try:
            return int(ll.llama_decode(ctx, self._batch))
        finally:
            ll.llama_set_causal_attn(ctx, True)

    def free(self) -> None:
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
