"""Which llama_decode calls one step's token rows go into: a long prefill chunk apart from the
rest (`--split-prefill`).

llama.cpp's CPU flash attention walks a micro-batch's query rows in tiles, and a tile skips a
block of KV cells only where every one of its rows masks it. In one unified cell pool each
sequence's cells lie apart from the others', so a tile whose rows all belong to one prefill
chunk skips most of the pool; a decode row of another sequence in that tile makes it attend
over that sequence's cells too. Measured on Gemma 3 270M, 8 unrelated ~1,700-token prompts
with 64 tokens each: decoding the running rows apart from the long chunk took the workload
from 42.1 s to 37.4 s.

    one step, split at 256:  call 1  c0 c1 … c299 (seq 2)        the long part, in tiles of
                                     e0 … e399    (seq 5)         its own rows
                             call 2  a5 | b9 d1 d2 | f0 … f30     decodes, guesses, short chunks

The threshold is per item, on its real tokens (not its guesses): an item's own length decides
whether its rows fill tiles of their own. A crowd of short chunks mixes in its tiles however
it is grouped, so moving it apart would buy little and cost a call's fixed overhead (graph
build, the thread team's wake-up) every step.

Each item stays whole in one call (speculation's window argument: `speculator.py`). The parts
are decoded one after the other, each sampled, and its rejected guesses removed, before the
next is placed; sampling is per row, so output is the same as one call's.
"""

from __future__ import annotations

from collections.abc import Sequence

from ferrum.engine.contracts import BatchItem


def decode_parts(idx: list[int], items: Sequence[BatchItem], split_at: int) -> list[list[int]]:
    """The item indices `idx` in the calls to make, in order: items of at least `split_at` real
    tokens first, then the rest; one call where either part is empty or `split_at` is 0."""
    if split_at <= 0:
        return [idx]
    long = [i for i in idx if len(items[i].tokens) - items[i].draft >= split_at]
    if not long or len(long) == len(idx):
        return [idx]
    rest = [i for i in idx if len(items[i].tokens) - items[i].draft < split_at]
    return [long, rest]
