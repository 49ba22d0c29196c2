"""Window checkpoints: on the window-sized cache (`--swa-windows`, `ModelInfo.own_copies`) the
states that later requests restore from the tiers, since no finished sequence stays there.

A saved window state serves only prompts that share all of it but its last position (older
window cells are gone), so the states are kept where later requests part from this one:

    prompt     <bos> [system prompt] \\n\\n [question] <end_of_turn> … <start_of_turn>model\\n
    kept at                               ^ a client string's start        prompt end - 1 ^
                                            (`Request.checkpoints`)

  - at each of the request's `checkpoints`, the API's hint: where each client string (the
    last message's content, the one after the system prompt) starts, so a second question
    behind one system prompt, or the same conversation with another last turn, restores all
    that it shares;
  - at its prompt but the last position: the same prompt again restores all of it that it may
    (the last position is always computed, for its logits); a conversation's next turn
    restores the finished sequence itself, saved whole when it ends;
  - at a prefix copy from a running donor (`KVManager._copy_own`), the copy's state, and one
    at a block boundary a few positions below it: bursts behind one system prompt part a few
    tokens apart ("Question cold-1" and "Question warm-1").

Each is written after the step that computed its position, through the probe sequence
(`KvOps.checkpoint`), while the sequence still holds the window there; one the tiers already
hold (the same tokens and scope) is not written again. A hinted position ends its prefill
chunk (the scheduler cuts it there): a later llama_decode of the same step may recycle window
cells the sequence itself no longer attends to, which a position inside the chunk still
needs; at a chunk's end (and at the prompt but its last position) every cell its window needs
is one the sequence attends to, so none is recycled. A checkpoint is a hint: one that fails
is logged and counted (`failed`), never the request's or the step's error. llama.cpp's
server keeps checkpoints for the same reason, at user-message starts and a few tokens before
a prompt's end (and breaks its batch at the former).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from ferrum.engine.contracts import KvOps
from ferrum.engine.kv.tiers import SavedStates
from ferrum.engine.request import Request

log = logging.getLogger(__name__)


class Checkpoints:
    """Keeps window states in the tiers (`saved`) for requests on the window-sized cache."""

    def __init__(self, ops: KvOps, saved: SavedStates, block_size: int):
        self.ops = ops
        self.saved = saved
        self.block_size = block_size
        self.kept = 0  # states written to the tiers
        self.failed = 0  # states llama.cpp or the tiers could not write (logged)

    def computed(self, req: Request, start: int, end: int) -> None:
        """After req's positions [start, end) were computed: the states at its checkpoints
        and at its prompt but the last position, those among them."""
        seq = req.seq_id
        if seq is None:
            return
        for p in sorted({*req.checkpoints, req.num_prompt_tokens - 1}):
            if start < p <= end and p >= self.block_size:
                self.keep(req, p, functools.partial(self.ops.checkpoint, seq, p))

    def copied(self, req: Request, src: int, length: int, state: bytearray) -> None:
        """After a copy of src's first `length` positions (whose state is `state`): that
        state, and one at a block boundary at least two positions below it."""
        self.keep(req, length, lambda: state)
        below = (length - 2) // self.block_size * self.block_size
        if below >= self.block_size:
            self.keep(req, below, functools.partial(self.ops.checkpoint, src, below))

    def keep(self, req: Request, length: int, state: Callable[[], bytearray | None]) -> None:
        """Saves req's first `length` positions (`state` writes them) unless already saved."""
        tokens = req.all_token_ids[:length]
        if self.saved.get(tokens, req.cache_scope) is not None:
            return
        try:
            data = state()
            if data is not None:
                self.saved.save(tokens, req.cache_scope, data)
                self.kept += 1
        except Exception:  # a hint: the request goes on without it
            self.failed += 1
            log.exception("window checkpoint at %d positions failed", length)
