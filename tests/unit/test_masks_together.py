"""`allowed_together` on the fake byte vocabulary (real llguidance matchers): the masks filled
in one call on the pool equal those filled one at a time, row for row, including the end token
where a grammar is complete; rows it cannot fill together are refused."""

from __future__ import annotations

import numpy as np
import pytest

from ferrum.engine.constraint import TOGETHER_FROM, Constraints, allowed_together, to_grammar
from tests.factories import EOS, N_VOCAB, FakeVocab

GRAMMARS = [
    to_grammar("regex", "[a-c]{2,4}"),
    to_grammar("choice", ["yes", "no"]),
    to_grammar("json_schema", {"type": "array", "items": {"type": "integer"}, "maxItems": 2}),
]
PREFIXES = [b"", b"ab", b"y", b"yes", b"[1", b"abcc"]
COMPLETE = (b"ab", b"yes", b"abcc")


def _constraints(n: int):
    vocab = FakeVocab()
    made = []
    for i in range(n):
        prefix = PREFIXES[i % len(PREFIXES)]
        grammar = {b"y": 1, b"yes": 1, b"[1": 2}.get(prefix, 0)
        c = vocab.constraints().constraint(GRAMMARS[grammar])
        for byte in prefix:
            assert c.allows(byte)
            c.accept(byte)
        made.append(c)
    return made


@pytest.mark.parametrize(
    ("n", "pool_from"),
    [
        (1, TOGETHER_FROM),
        (2, TOGETHER_FROM),
        (2, 2),
        (TOGETHER_FROM, TOGETHER_FROM),
        (7, TOGETHER_FROM),
    ],
)
def test_masks_together_equal_masks_one_at_a_time(n, pool_from):
    alone = [c.allowed(N_VOCAB) for c in _constraints(n)]
    constraints = _constraints(n)
    together = allowed_together(constraints, N_VOCAB, pool_from)
    for want, got in zip(alone, together, strict=True):
        assert np.array_equal(want, got)
    complete = [PREFIXES[i % len(PREFIXES)] in COMPLETE for i in range(n)]
    assert [bool(m[EOS]) for m in together] == complete
    assert all(len(c.mask_seconds) == 1 and c.mask_seconds[0] > 0 for c in constraints)


def test_rows_of_one_sequence_twice_or_of_two_models_are_refused():
    constraints = _constraints(TOGETHER_FROM)
    with pytest.raises(ValueError, match="distinct constraints of one model"):
        allowed_together([*constraints, constraints[0]], N_VOCAB)
    vocab = FakeVocab()
    other = Constraints(vocab.constraints().tokenizer, [EOS]).constraint(GRAMMARS[0])
    with pytest.raises(ValueError, match="distinct constraints of one model"):
        allowed_together([*constraints, other], N_VOCAB)
