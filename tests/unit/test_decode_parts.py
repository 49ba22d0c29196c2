"""Which llama_decode calls a step's items go into (`decode_parts.py`): the long ones apart,
by their real tokens, each item whole in one call."""

from __future__ import annotations

from ferrum.engine.contracts import BatchItem
from ferrum.engine.llama.decode_parts import decode_parts


def test_parts_keep_each_item_whole_and_count_real_tokens_not_guesses():
    items = [
        BatchItem(0, [1] * 9, 0, "a", draft=8),  # a decode with 8 guesses: 1 real token
        BatchItem(1, [2] * 8, 0),  # a chunk of 8
        BatchItem(2, [3], 5, "c"),
        BatchItem(3, [4] * 7, 0, "d"),  # a chunk of 7
    ]
    assert decode_parts([0, 1, 2, 3], items, 8) == [[1], [0, 2, 3]]
    assert decode_parts([0, 1, 2, 3], items, 7) == [[1, 3], [0, 2]]
    assert decode_parts([0, 1, 2, 3], items, 0) == [[0, 1, 2, 3]]
    assert decode_parts([0, 2], items, 8) == [[0, 2]]  # decodes only
    assert decode_parts([1, 3], items, 7) == [[1, 3]]  # long chunks only
