"""KV memory accounting: fixed-size blocks, page tables, reference counts, sequence ids.

llama.cpp owns the real KV cells (one unified cache shared by all sequences, or with
`--kv-streams` a stream per sequence, of which a page table holds at most one). This module is
the engine's ledger of them: the engine never asks llama.cpp for more cells than the ledger
has handed out, so a decode never runs out of KV slots mid-request.

    token positions   0 ......... 15 | 16 ........ 31 | 32 .. 37
    logical blocks    [     0       ] [      1       ] [   2   ]      PageTable.blocks[i]
    physical blocks   [    17       ] [      4       ] [   9   ]      ids in the BlockManager

Rules (checked by `check_integrity`):
  1. A block is either on the free list (ref count 0) or referenced (ref count ≥ 1), never both.
  2. A block's ref count equals the number of page-table slots that point at it.
  3. free + referenced == total: no block is ever lost.
  4. A block referenced by more than one page table is shared and read-only: a writer first
     takes a private copy (`copy_on_write`).
Sequence ids obey the same rules through `SeqIdPool`: each id has at most one owner.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field


class IntegrityError(RuntimeError):
    """A KV ledger rule was broken: a bug, never a user error."""


@dataclass
class PageTable:
    """Logical → physical block ids of one sequence."""

    blocks: list[int] = field(default_factory=list)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, seq_blocks: int = 0):
        """`seq_blocks`: the most blocks one page table may hold (0: all; with a cell stream
        per sequence, a stream's)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.seq_blocks = min(seq_blocks, num_blocks) if seq_blocks > 0 else num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def retain_block(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise IntegrityError(f"retain of free block {block}")
        self._refs[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drops one reference from each block; a block returns to the free list at zero."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise IntegrityError(f"double free of block {b}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def grow(self, table: PageTable, num_tokens: int) -> bool:
        """Gives `table` room for `num_tokens` positions; False (and no change) if it can't."""
        want = blocks_for(num_tokens, self.block_size)
        need = want - len(table.blocks)
        if need <= 0:
            return True
        if need > len(self._free) or want > self.seq_blocks:
            return False
        table.blocks.extend(self.allocate(need))
        return True

    def release(self, table: PageTable) -> None:
        self.free(table.blocks)
        table.blocks.clear()

    def fork(self, src: PageTable, num_tokens: int) -> PageTable:
        """A new table sharing the whole blocks that hold src's first `num_tokens` positions."""
        shared = src.blocks[: num_tokens // self.block_size]
        for b in shared:
            self.retain_block(b)
        return PageTable(list(shared))

    def copy_on_write(self, table: PageTable, index: int) -> tuple[int, int] | None:
        """Makes logical block `index` private before a write.

        Returns (old, new) when a copy is needed (the caller copies the cells), None when the
        block was already private. Raises MemoryError when no block is free.
        """
        old = table.blocks[index]
        if self._refs[old] == 1:
            return None
        (new,) = self.allocate(1)
        self.free([old])
        table.blocks[index] = new
        return old, new

    def check_integrity(self, tables: Iterable[PageTable]) -> None:
        counted = Counter(b for t in tables for b in t.blocks)
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("a block is on the free list twice")
        for b in range(self.num_blocks):
            refs = self._refs[b]
            if refs != counted.get(b, 0):
                raise IntegrityError(f"block {b}: ref count {refs}, {counted.get(b, 0)} owners")
            if (refs == 0) != (b in free):
                raise IntegrityError(f"block {b}: ref count {refs} but free={b in free}")
        if len(free) + sum(1 for r in self._refs if r > 0) != self.num_blocks:
            raise IntegrityError("free + referenced != total")


class SeqIdPool:
    """llama.cpp sequence ids: stable handles on KV cells, one owner each."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[int] = list(range(size))  # a heap: the lowest free id first, so
        self._used: set[int] = set()  # with a stream per id, running ones lie side by side

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        if not self._free:
            return None
        seq = heapq.heappop(self._free)
        self._used.add(seq)
        return seq

    def release(self, seq: int) -> None:
        if seq not in self._used:
            raise IntegrityError(f"release of unowned sequence id {seq}")
        self._used.remove(seq)
        heapq.heappush(self._free, seq)

    def check_integrity(self, owned: Iterable[int]) -> None:
        owned = list(owned)
        if len(owned) != len(set(owned)):
            raise IntegrityError("a sequence id has two owners")
        if set(owned) != self._used:
            raise IntegrityError(f"sequence ids in use {sorted(self._used)} != owned {owned}")
        if len(self._used) + len(self._free) != self.size:
            raise IntegrityError("a sequence id was lost")
