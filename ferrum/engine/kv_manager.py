"""KV residency: who holds which llama.cpp sequence and blocks, prefix reuse, parking, eviction.

The scheduler decides *when* a request runs; this module decides *where its KV comes from*:

  fresh      new sequence id, every prompt position computed
  copy       new sequence id; llama_memory_seq_cp shares the donor's cells [0, n) (unified KV:
             metadata only). Whole blocks below n are shared in the ledger (ref counts); the
             block that straddles n is private to the newcomer, so a shared block is never
             written:
                 donor   [ B0 ][ B1 ][ B2 ··n····]
                 new     [ B0 ][ B1 ][ P2 ··n····]   B0, B1 ref 2; P2 private
  takeover   a parked sequence whose every resident token is a prefix of the prompt continues
             as the new request's sequence (multi-turn chats; the only reuse that recurrent and
             hybrid models allow, since their state cannot be copied or rolled back)

Sliding-window models (Gemma 3) keep a second cache for their windowed layers, where llama.cpp
recycles a cell once its only owner has moved `n_swa` positions past it. A parked or running
sequence therefore keeps its own recent window but may lose older window cells at any time.
Takeover is always safe; a copy of the first L positions is taken only while the donor still
holds [max(0, L - n_swa + 1), L) (`KvOps.holds_window`), and checked again on the copy:

    donor's window cache   0 ··· [recycled] ··· L-n_swa+1 ············ L ····· newest
    copy of [0, L) needs                        |<-- every position -->|

A donor that is still prefilling the shared prefix makes the newcomer wait (`plan` returns
None) instead of computing the prefix twice. Reuse always leaves at least the last prompt
token to compute, since logits exist only for tokens in a batch.

Parked sequences (finished requests whose KV is kept) are bounded by blocks and sequence ids,
not by a count: when either runs short they are evicted, least recently used first. Evicting
one frees only its private blocks; blocks a running request shares stay (ref counts), so a
running request never loses a prefix it depends on.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ferrum.engine.batch import KvOps
from ferrum.engine.kv import BlockManager, IntegrityError, SeqIdPool, blocks_for
from ferrum.engine.prefix import Parked, ParkedLRU, PrefixIndex
from ferrum.engine.request import Request


@dataclass(frozen=True)
class Reuse:
    donor: Request | Parked | None = None
    length: int = 0
    takeover: bool = False
    # Longer matches passed over because their donor had lost part of the sliding window.
    window_refusals: int = 0


_FRESH = Reuse()


class KVManager:
    def __init__(
        self,
        blocks: BlockManager,
        ops: KvOps,
        num_seq_ids: int,
        prefix_cache: bool = True,
        share_cells: bool = True,
    ):
        self.blocks = blocks
        self.seq_ids = SeqIdPool(num_seq_ids)
        self.ops = ops
        self.prefix_cache = prefix_cache
        self.share_cells = share_cells
        self.index = PrefixIndex(blocks.block_size)
        self.parked = ParkedLRU()
        self.evictions = 0
        self.window_fallbacks = 0  # admissions that reused less because a window had holes

    # -- admission --------------------------------------------------------------------------

    def plan(self, req: Request) -> Reuse | None:
        """Where req's KV comes from; None: wait, a running donor is computing the prefix.

        Owners are tried longest match first. On a sliding-window model a donor's old window
        cells can be recycled by llama.cpp while it is parked or decoding on, so a partial
        copy is taken only from a donor that still holds the newcomer's whole window; else
        the next owner (a shorter match) is tried, and only then a fresh prefill.
        """
        if not self.prefix_cache:
            return _FRESH
        refused = 0
        for match in self.index.matches(req.all_token_ids):
            length = min(match.length, req.num_tokens - 1)
            donor = match.owner
            if length <= 0:
                break
            if donor.seq_id is None:
                continue  # a request preempted within this step
            if isinstance(donor, Parked) and length == len(donor.all_token_ids):
                # Continuing the owner itself: a sequence always keeps its own recent window.
                return Reuse(donor, length, takeover=True, window_refusals=refused)
            if not self.share_cells:
                continue
            if isinstance(donor, Request) and donor.num_computed_tokens < length:
                return None
            if not self.ops.holds_window(donor.seq_id, length):
                refused += 1
                continue
            return Reuse(donor, length, window_refusals=refused)
        return Reuse(window_refusals=refused) if refused else _FRESH

    def admit(self, req: Request, reuse: Reuse, keep_free: int = 0) -> int | None:
        """Gives req a sequence and blocks for all its tokens (+1) and returns how many of its
        positions are already resident (reused); None, changing nothing, when it cannot fit."""
        bs = self.blocks.block_size
        donor = reuse.donor
        if donor is None:
            shared = 0
        elif reuse.takeover:
            shared = len(donor.page_table.blocks)
        else:
            shared = reuse.length // bs
        need = max(0, blocks_for(req.num_tokens + 1, bs) - shared) + (1 if reuse.takeover else 0)
        exclude = donor if isinstance(donor, Parked) else None
        if not self._make_room(need + keep_free, exclude, need_seq=not reuse.takeover):
            # A parked donor so large that req can never fit beside it (e.g. a sequence that ran
            # to the end of the context) would block req, and the queue behind it, forever:
            # give up the reuse, so the donor can be evicted like any other parked sequence.
            # A donor that merely waits for running requests to finish is kept.
            if exclude is None or need + len(exclude.page_table.blocks) <= self.blocks.num_blocks:
                return None
            return self.admit(req, _FRESH, keep_free)
        try:
            self._attach(req, reuse)
        except BaseException:
            self._detach(req)  # a failed admission must not keep a sequence id or blocks
            raise
        if reuse.window_refusals:
            self.window_fallbacks += 1
        if self.prefix_cache:
            self.index.add(req)
        return reuse.length

    def _attach(self, req: Request, reuse: Reuse) -> None:
        donor = reuse.donor
        if isinstance(donor, Parked) and reuse.takeover:
            self._take_over(req, donor)
        else:
            seq_id = req.seq_id = self.seq_ids.acquire()
            if seq_id is None:
                raise IntegrityError("admission made room but no sequence id is free")
            if donor is not None:
                self._copy_from(req, seq_id, donor, reuse.length)
        if not self.blocks.grow(req.page_table, req.num_tokens):
            raise IntegrityError("admission made room but the ledger refused the blocks")

    def _detach(self, req: Request) -> None:
        self.blocks.release(req.page_table)
        if req.seq_id is not None:
            self.ops.clear_sequence(req.seq_id)
            self.seq_ids.release(req.seq_id)
            req.seq_id = None

    def _take_over(self, req: Request, parked: Parked) -> None:
        self.parked.remove(parked)
        self.index.remove(parked)
        req.seq_id = parked.seq_id
        req.page_table = parked.page_table
        last = len(parked.all_token_ids) // self.blocks.block_size
        if len(parked.all_token_ids) % self.blocks.block_size and last < len(req.page_table.blocks):
            self.blocks.copy_on_write(req.page_table, last)  # never write a shared block

    def _copy_from(self, req: Request, seq_id: int, donor: Request | Parked, length: int) -> None:
        if donor.seq_id is None:
            raise IntegrityError("a prefix donor without a sequence")
        self.ops.copy_sequence(donor.seq_id, seq_id, length)
        req.page_table = self.blocks.fork(donor.page_table, length)
        if isinstance(donor, Parked):
            self.parked.touch(donor)
        if not self.ops.holds_window(seq_id, length):
            raise IntegrityError(f"a copy of {length} positions lacks its sliding window")

    def _make_room(self, blocks: int, exclude: Parked | None, need_seq: bool) -> bool:
        """Evicts parked sequences (oldest first) until `blocks` blocks and, if asked, a
        sequence id are free; evicts nothing when even evicting all of them would not do."""
        if not self._room_possible(blocks, exclude, need_seq):
            return False
        while self.blocks.num_free < blocks or (need_seq and self.seq_ids.num_free == 0):
            if not self.evict_one(exclude):
                raise IntegrityError("eviction freed less than the ledger promised")
        return True

    def _room_possible(self, blocks: int, exclude: Parked | None, need_seq: bool) -> bool:
        free, seqs = self.blocks.num_free, self.seq_ids.num_free
        if free >= blocks and (seqs > 0 or not need_seq):
            return True
        victims = [p for p in self.parked if p is not exclude]
        # A block returns to the free list only when every holder is evicted: running
        # requests (and the excluded donor) keep theirs.
        held = Counter(b for p in victims for b in p.page_table.blocks)
        freeable = sum(1 for b, n in held.items() if self.blocks.ref_count(b) == n)
        return free + freeable >= blocks and (seqs + len(victims) > 0 or not need_seq)

    # -- growth, release --------------------------------------------------------------------

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Room for num_tokens positions, evicting parked sequences if needed."""
        while not self.blocks.grow(req.page_table, num_tokens):
            if not self.evict_one():
                return False
        return True

    def trim(self, req: Request) -> None:
        """Drops req's cells past its computed positions (draft tokens it did not keep)."""
        if req.seq_id is not None:
            self.ops.trim_sequence(req.seq_id, req.num_computed_tokens)

    def on_tokens_appended(self, req: Request) -> None:
        if self.prefix_cache:
            self.index.extend(req)

    def release(self, req: Request, park: bool) -> None:
        """Ends req's hold on KV: its sequence is parked for reuse, or cleared and freed."""
        if req in self.index:
            self.index.remove(req)
        seq_id = req.seq_id
        if seq_id is None:
            return
        resident = req.num_computed_tokens
        if park and self.prefix_cache and resident >= self.blocks.block_size:
            self._park(req, seq_id, resident)
        else:
            self.blocks.release(req.page_table)
            self.ops.clear_sequence(seq_id)
            self.seq_ids.release(seq_id)
        req.seq_id = None

    def _park(self, req: Request, seq_id: int, resident: int) -> None:
        table = req.page_table
        keep = blocks_for(resident, self.blocks.block_size)
        self.blocks.free(table.blocks[keep:])  # room reserved for positions never computed
        del table.blocks[keep:]
        parked = Parked(seq_id, req.all_token_ids[:resident], table)
        req.page_table = type(table)()
        self.parked.add(parked)
        self.index.add(parked)

    def evict_one(self, exclude: Parked | None = None) -> bool:
        victim = self.parked.oldest(exclude)
        if victim is None:
            return False
        self.parked.remove(victim)
        self.index.remove(victim)
        self.blocks.release(victim.page_table)
        self.ops.clear_sequence(victim.seq_id)
        self.seq_ids.release(victim.seq_id)
        self.evictions += 1
        return True

    def drop_parked(self) -> None:
        while self.evict_one():
            pass

    # -- checks -----------------------------------------------------------------------------

    def check_integrity(self, running: list[Request]) -> None:
        parked = list(self.parked)
        self.blocks.check_integrity(
            [r.page_table for r in running] + [p.page_table for p in parked]
        )
        owned = [r.seq_id for r in running if r.seq_id is not None]
        if len(owned) != len(running):
            raise IntegrityError("a running request holds no sequence id")
        self.seq_ids.check_integrity(owned + [p.seq_id for p in parked])
        if self.prefix_cache and len(self.index) != len(running) + len(parked):
            raise IntegrityError("prefix index out of step with running and parked sequences")
