"""Which positions a sequence still holds in llama.cpp's sliding-window cache (`WindowProbe`),
for the runner's `holds_window`: the prefix index reuses a donor's window only when it is whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import llama_cpp as ll

from ferrum.engine.compute import compute
from ferrum.errors import ModelLoadError

# The window cache alone (PARTIAL_ONLY), sized without its tensor data (ON_DEVICE skips it).
_WINDOW_STATE_FLAGS = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY | ll.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE


class WindowProbe:
    """Counts which positions a sequence still holds in the sliding-window cache.

    llama.cpp's window cache recycles a cell once its only owner's newest position is `n_swa`
    or more past it, in cell order, not position order: a donor can lose positions above its
    lowest one, so `llama_memory_seq_pos_min` alone cannot prove a window whole. What can be
    counted is a sequence's cells there: the size of its window-cache state without tensor
    data is affine in that count. So the positions in question are copied (metadata only)
    into a probe sequence of their own, counted, and removed again:

        donor      [0 ········ lo ·········· L) ··· newest
        probe                  [lo ········· L)      whole iff it holds L - lo cells

    The count covers only cells the probe's own window has not left behind, and the probe's
    newest position is below L, so every cell it holds is counted.
    """

    def __init__(
        self, ctx: Any, mem: Any, model: Any, batch: Any, probe_seq: int, chunked: bool,
        streams: bool = False,
    ):  # fmt: skip
        """`batch`: the runner's llama_batch, lent for the calibration's two-token decode;
        `chunked`: windows are chunks (Llama 4), not a span back from each position;
        `streams`: each sequence id has a cell stream of its own (`--kv-streams`)."""
        self._ctx, self._mem, self._probe = ctx, mem, probe_seq
        self._streams = streams
        self._n_swa = ll.llama_model_n_swa(model)
        self._chunked = chunked
        self._empty, self._base, self._per_cell = self._calibrate(batch)

    def holds(self, seq_id: int, length: int) -> bool:
        if self._chunked:
            lo = length // self._n_swa * self._n_swa
        else:
            lo = max(0, length - self._n_swa + 1)
        if lo >= length:
            return True
        if self._streams:
            # Between streams llama.cpp copies only whole ones (its cells now, their tensor
            # data at the next decode, which the probe never reads): copy all, cut to [lo, L).
            ll.llama_memory_seq_cp(self._mem, seq_id, self._probe, -1, -1)
            ll.llama_memory_seq_rm(self._mem, self._probe, length, -1)
            ll.llama_memory_seq_rm(self._mem, self._probe, 0, lo)
        else:
            ll.llama_memory_seq_cp(self._mem, seq_id, self._probe, lo, length)
        try:
            return bool(self._cells(self._probe) == length - lo)
        finally:
            ll.llama_memory_seq_rm(self._mem, self._probe, 0, -1)

    def state_of(
        self, seq_id: int, length: int, save: Callable[[int], bytearray | None]
    ) -> bytearray | None:
        """`save`'s state of a copy of seq_id's first `length` positions, made in the probe
        sequence and removed again; the caller checks `holds` first. One stream only."""
        if self._streams:
            raise ValueError("a window state is copied out through a shared stream only")
        ll.llama_memory_seq_cp(self._mem, seq_id, self._probe, 0, length)
        try:
            return save(self._probe)
        finally:
            ll.llama_memory_seq_rm(self._mem, self._probe, 0, -1)

    def _size(self, seq: int) -> int:
        return int(ll.llama_state_seq_get_size_ext(self._ctx, seq, _WINDOW_STATE_FLAGS))

    def _cells(self, seq: int) -> int:
        size = self._size(seq)
        if size == self._empty:
            return 0
        cells, rest = divmod(size - self._base, self._per_cell)
        if rest or cells <= 0:
            raise RuntimeError(f"window-cache state of {size} bytes is no whole number of cells")
        return cells

    def _calibrate(self, batch: Any) -> tuple[int, int, int]:
        """Sizes of the probe's state at 0, 1 and 2 cells, from a two-token decode."""
        empty = self._size(self._probe)
        for i in range(2):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = 0, i, 1
            batch.seq_id[i][0], batch.logits[i] = self._probe, i
        batch.n_tokens = 2
        try:
            if compute().run(lambda: ll.llama_decode(self._ctx, batch)) != 0:
                raise ModelLoadError("llama.cpp could not decode two tokens at start-up")
            two = self._size(self._probe)
            ll.llama_memory_seq_rm(self._mem, self._probe, 1, -1)
            one = self._size(self._probe)
        finally:
            ll.llama_memory_seq_rm(self._mem, self._probe, 0, -1)
        per_cell = two - one
        if per_cell <= 0 or one <= empty:
            raise ModelLoadError("cannot measure the sliding-window cache of this model")
        return empty, one - per_cell, per_cell
