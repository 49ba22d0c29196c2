"""Prefix copies between cell streams (`--kv-streams`: llama.cpp's non-unified KV cache, a
stream per sequence id), for the runner's `copy_own`.

Between streams llama.cpp copies only a whole one, and in two halves: the cells' metadata at
once, their tensor data at the start of the next `llama_decode`. A copy of the first L
positions is a whole-stream copy cut back to L (metadata only, so at once too):

    src stream   [0 ············ L ········ newest]     every cell, window ones included
    dst stream   [0 ············ L)                     same cells, same indices; data at
                                                        the next decode
The state API cannot do this instead: a sequence's saved state holds only the window cells
its own newest position attends to, so a copy cut back below them would have no window.

Until that decode, a stream on either end of a copy must not be read or written through the
state API: a save would read data not yet copied, and a restore would be overwritten (as
destination) or copied on (as source). `settle` lands the copies first, by decoding one
token into the runner's spare sequence id and removing it again.
"""

from __future__ import annotations

from typing import Any

import llama_cpp as ll

from ferrum.engine.compute import compute


class StreamCopies:
    def __init__(self, ctx: Any, mem: Any, batch: Any, spare_seq: int):
        """`batch`: the runner's llama_batch, lent for `settle`'s one-token decode."""
        self._ctx, self._mem, self._batch, self._spare = ctx, mem, batch, spare_seq
        self._pending: set[int] = set()  # sequence ids at either end of an unlanded copy
        self.settled = 0  # decodes made only to land copies (a count for tests)

    def copy(self, src: int, dst: int, length: int) -> None:
        """dst holds src's first `length` positions (data from the next decode on)."""
        ll.llama_memory_seq_cp(self._mem, src, dst, -1, -1)  # dst's cells replaced
        ll.llama_memory_seq_rm(self._mem, dst, length, -1)
        self._pending.update((src, dst))

    def decoded(self) -> None:
        """A llama_decode succeeded: every copy before it has landed."""
        self._pending.clear()

    def settle(self, seq_id: int) -> None:
        """Lands the copies before seq_id's stream is read or written through the state API."""
        if seq_id not in self._pending:
            return
        batch = self._batch
        batch.token[0], batch.pos[0], batch.n_seq_id[0] = 0, 0, 1
        batch.seq_id[0][0], batch.logits[0] = self._spare, 0
        batch.n_tokens = 1
        try:
            rc = compute().run(lambda: ll.llama_decode(self._ctx, batch))
        finally:
            ll.llama_memory_seq_rm(self._mem, self._spare, 0, -1)
        if rc != 0:
            raise RuntimeError(f"llama.cpp could not land a copy between streams (rc {rc})")
        self.settled += 1
        self.decoded()
