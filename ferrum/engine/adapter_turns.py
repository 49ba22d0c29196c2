"""Whose turn it is to decode: one LoRA adapter set per step, the sets taking turns.

llama.cpp applies one adapter set to a whole `llama_decode` (`llama/adapters.py`), so each
step's batch holds requests of one set only. The sets that have work (running or waiting
requests) take turns in a fixed cycle (sorted by set), starting after the set that decoded
last; a set whose turn schedules nothing (no slot, no memory) passes it on within the same
step. So a request of a set with work waits at most (sets with work − 1) steps between two
of its set's turns, however few requests its set has: a minority adapter never starves, and
requests of one set still batch together. With a single set (no adapters: the base only)
every step is that set's, as before adapters existed.
"""

from __future__ import annotations

from collections.abc import Iterable

from ferrum.engine.request import AdapterSet, Request


class AdapterTurns:
    def __init__(self) -> None:
        self.last: AdapterSet | None = None  # the set of the last step that decoded
        self.switches = 0  # steps whose set differed from the step before

    def order(self, *groups: Iterable[Request]) -> list[AdapterSet]:
        """The sets with work, the one whose turn it is first, then the rest in cycle."""
        sets = sorted({r.adapters for group in groups for r in group})
        if self.last is None or len(sets) <= 1:
            return sets
        after = [s for s in sets if s > self.last]
        return after + [s for s in sets if s <= self.last]

    def decoded(self, adapters: AdapterSet) -> None:
        if self.last is not None and adapters != self.last:
            self.switches += 1
        self.last = adapters
