"""One step's sampling across its items: each at its last real token and, while the pick equals
the next guess, at that guess too (speculation's verification); the grammar masks a round needs
are filled together.

    round j:  begin every live row at position b + j   (free and allowed picks are done here)
              fill the waiting picks' masks together   (`constraint.allowed_together`)
              finish the waiting picks                 (resampled over their masks)
              a row goes on to round j + 1 while its pick equals its guess j

A row's rounds run in order (each position's grammar state follows the token taken before it),
and rows are independent (each sampler has its own chain, RNG and matcher), so a row samples
exactly what it would alone: only where its masks are computed changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ferrum.engine.constraint import allowed_together
from ferrum.engine.contracts import BatchItem, TokenLogprobs
from ferrum.engine.llama.sampler import Pick, Sampler


@dataclass(eq=False)
class Row:
    """One item to sample: `b` is the batch index of its last real token (its guesses follow)."""

    item: BatchItem
    sampler: Sampler
    b: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        """Guesses taken."""
        return len(self.tokens) - 1


def sample_rows(ctx: Any, rows: Sequence[Row]) -> None:
    """Samples every row (its tokens and logprobs filled in), one round per position."""
    live = list(rows)
    j = 0
    while live:
        picks = [row.sampler.begin(ctx, row.b + j) for row in live]
        _finish_waiting(live, picks)
        going = []
        for row, pick in zip(live, picks, strict=True):
            row.tokens.append(pick.token)
            if pick.logprobs is not None:
                row.logprobs.append(pick.logprobs)
            draft = row.item.draft
            if j < draft and pick.token == row.item.tokens[len(row.item.tokens) - draft + j]:
                going.append(row)
        live = going
        j += 1


def _finish_waiting(rows: Sequence[Row], picks: Sequence[Pick]) -> None:
    waiting = [
        (row, pick, pick.waits)
        for row, pick in zip(rows, picks, strict=True)
        if pick.waits is not None
    ]
    if not waiting:
        return
    masks = allowed_together([c for _, _, c in waiting], waiting[0][1].n_vocab)
    for (row, pick, _), allowed in zip(waiting, masks, strict=True):
        row.sampler.finish(pick, allowed)
