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

With `--swa-windows` llama.cpp sizes that cache to the windows (n_swa cells per sequence id
and a micro-batch), which holds only while no window cell is shared: it recycles a cell only once
it has one owner. So there a copy takes cells of its own (`KvOps.copy_own`: shared, written
out, read back). And since that cache grows with the sequence ids and every decode of the
window layers attends over the part in use, a finished sequence is not parked there but saved
to the tiers at once (where there are tiers; the context then has no sequence ids for
parking); window checkpoints kept in the tiers serve the prompts that part from it earlier
(`checkpoints.py`). By default the window cache is as large as the
context (llama.cpp's swa_full): copies share cells, finished sequences park, and old window
cells stay until the space is needed, so a finished sequence still lends its prefix.

With `--kv-streams` every sequence id has a cell stream of its own (`KVManager.streams`):
cells are never shared, so a copy takes cells of its own too (the donor's stream copied whole
and cut back, `llama/streams.py`), a parked sequence costs no other decode (never bounded),
and a page table holds at most a stream's blocks (`BlockManager.seq_blocks`).

Every reuse (copy, takeover, waiting for a donor, restore) starts from the prefix index,
which only finds owners of the request's own cache scope: requests of different scopes never
share a block, which `check_integrity` proves on the ledger. Images take part like text: an
image's positions hold ids drawn from its pixels (`request.image_token_ids`), so only the same
image matches, and a reuse that would end inside an image stops at its start
(`Request.reuse_floor`): an image's KV is reused whole or not at all.

A donor that is still prefilling the shared prefix makes the newcomer wait (`plan` returns
None) instead of computing the prefix twice. Reuse always leaves at least the last prompt
token to compute, since logits exist only for tokens in a batch.

Parked sequences (finished requests whose KV is kept) are bounded by blocks and sequence ids,
not by a count: when either runs short they are evicted, least recently used first. With
tiers, they are also cut to the running requests' blocks before each decode
(`bound_parked`): every used cell costs every decoded token, parked or not. Evicting
one frees only its private blocks; blocks a running request shares stay (ref counts), so a
running request never loses a prefix it depends on.

With tiers (`tiers/`), an evicted sequence's state is saved first, and a fourth plan joins:

  restore    new sequence id; a saved state (RAM, or disk read in first while the request
             waits) is put back with llama_state_seq_set_data, then trimmed to the match:
                 saved   [ 0 ·········· match ······ n )    restored whole, then
                 new     [ 0 ·········· match )              positions ≥ match removed
             chosen only when it is longer than the best resident reuse and measured speeds
             say restoring beats computing the difference. Attention models restore any
             prefix; recurrent and hybrid ones only a saved state the prompt wholly extends
             (their state cannot be cut back); sliding-window ones that, or one cut back by a
             single position, checked with `holds_window` (older window cells are gone),
             or any prefix of one no longer than the window (it lost no window cell)
"""

from __future__ import annotations

import functools
import time
from collections import Counter

from ferrum.engine.contracts import KvOps
from ferrum.engine.kv.checkpoints import Checkpoints
from ferrum.engine.kv.ledger import BlockManager, IntegrityError, SeqIdPool, blocks_for
from ferrum.engine.kv.plan import FRESH, Reuse, plan_reuse
from ferrum.engine.kv.prefix import Parked, ParkedLRU, PrefixIndex
from ferrum.engine.kv.tiers import Saved, SavedStates, Tier, TierConfig
from ferrum.engine.request import Request


class KVManager:
    def __init__(
        self,
        blocks: BlockManager,
        ops: KvOps,
        num_seq_ids: int,
        prefix_cache: bool = True,
        share_cells: bool = True,
        tiers: TierConfig | None = None,
        restore_cut: int | None = None,
        own_copies: bool = False,
        window: int = 0,
        streams: bool = False,
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
        self.saved: SavedStates | None = None
        if prefix_cache and tiers is not None and (tiers.ram_bytes > 0 or tiers.disk_bytes > 0):
            self.saved = SavedStates(tiers, self.index)
        # How many positions a restored state may be cut back by (None: any, 0: none),
        # unless it is no longer than the sliding `window` (0: none), which it holds whole.
        self.restore_cut = restore_cut
        self.window = window
        # The window cache is sized to the windows (`ModelInfo.own_copies`): a copy takes
        # cells of its own, and with tiers a finished sequence is saved instead of parked,
        # window checkpoints kept in its place.
        self.own_copies = own_copies
        # A cell stream per sequence id (--kv-streams): every copy takes cells of its own,
        # and a parked sequence costs no other sequence's decode.
        self.streams = streams
        self.checkpoints: Checkpoints | None = None
        if own_copies and self.saved is not None:
            self.checkpoints = Checkpoints(ops, self.saved, blocks.block_size)

    @property
    def private_copies(self) -> bool:
        """A prefix copy takes cells of its own (`KvOps.copy_own`), never shared ones."""
        return self.own_copies or self.streams

    # -- admission --------------------------------------------------------------------------

    def plan(self, req: Request) -> Reuse | None:
        """Where req's KV comes from; None: wait (`plan.py`)."""
        return plan_reuse(self, req)

    def admit(self, req: Request, reuse: Reuse, keep_free: int = 0) -> int | None:
        """Gives req a sequence and blocks for all its tokens (+1) and returns how many of its
        positions are already resident (reused); None, changing nothing, when it cannot fit."""
        bs = self.blocks.block_size
        donor = reuse.donor
        state = reuse.saved.data if reuse.saved is not None else None  # kept through _make_room
        if reuse.saved is not None and state is None:
            return self.admit(req, FRESH, keep_free)  # left RAM since it was planned
        if reuse.saved is not None:
            # Restored whole before it is cut back to the match: room for all of it first.
            need = max(blocks_for(req.num_tokens + 1, bs), blocks_for(reuse.saved.length, bs))
        else:
            shared = 0 if donor is None or self.private_copies else reuse.length // bs
            if reuse.takeover and donor is not None:
                shared = len(donor.page_table.blocks)
            need = max(0, blocks_for(req.num_tokens + 1, bs) - shared)
            need += 1 if reuse.takeover else 0
        exclude = donor if isinstance(donor, Parked) else None
        if not self._make_room(need + keep_free, exclude, need_seq=not reuse.takeover):
            # A parked donor so large that req can never fit beside it (e.g. a sequence that ran
            # to the end of the context) would block req, and the queue behind it, forever:
            # give up the reuse, so the donor can be evicted like any other parked sequence.
            # A donor that merely waits for running requests to finish is kept, unless it holds
            # the only sequence id while req, copying from it, needs one of its own.
            if exclude is None:
                return None
            fits = need + len(exclude.page_table.blocks) <= self.blocks.num_blocks
            if fits and (reuse.takeover or self.seq_ids.size > 1):
                return None
            return self.admit(req, FRESH, keep_free)
        try:
            reused = self._attach(req, reuse, state)
        except BaseException:
            self._detach(req)  # a failed admission must not keep a sequence id or blocks
            raise
        if reuse.window_refusals:
            self.window_fallbacks += 1
        if self.prefix_cache:
            self.index.add(req)
        return reused

    def _attach(self, req: Request, reuse: Reuse, state: bytearray | None) -> int:
        donor = reuse.donor
        reused = reuse.length
        if isinstance(donor, Parked) and reuse.takeover:
            self._take_over(req, donor)
        else:
            seq_id = req.seq_id = self.seq_ids.acquire()
            if seq_id is None:
                raise IntegrityError("admission made room but no sequence id is free")
            if donor is not None and self.private_copies:
                reused = self._copy_own(req, seq_id, donor, reuse.length)
            elif donor is not None:
                self._copy_from(req, seq_id, donor, reuse.length)
            elif reuse.saved is not None and state is not None:
                reused = self._restore(seq_id, reuse.saved, state, reuse.length)
        if not self.blocks.grow(req.page_table, req.num_tokens):
            raise IntegrityError("admission made room but the ledger refused the blocks")
        return reused

    def _restore(self, seq_id: int, entry: Saved, state: bytearray, length: int) -> int:
        """Puts entry's state back as seq_id and keeps its first `length` positions; 0 (a
        fresh prefill) when llama.cpp refuses it."""
        assert self.saved is not None
        source, entry.source = entry.source, Tier.RAM
        t0 = time.monotonic()
        if not self.ops.restore_sequence(seq_id, state):
            self.saved.failed(entry, "llama.cpp refused the state")
            return 0
        if length < len(entry.all_token_ids):
            self.ops.trim_sequence(seq_id, length)
            if not self.ops.holds_window(seq_id, length):
                # The saved window did not reach back far enough for the cut: prefill.
                self.ops.clear_sequence(seq_id)
                self.window_fallbacks += 1
                return 0
        self.saved.restored(entry, length, time.monotonic() - t0, source)
        return length

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
        self.ops.copy_sequence(_donor_seq(donor), seq_id, length)
        req.page_table = self.blocks.fork(donor.page_table, length)
        self._copied(seq_id, donor, length)

    def _copied(self, seq_id: int, donor: Request | Parked, length: int) -> None:
        """After a copy: a parked donor was used, and the copy holds its whole window (with
        streams it holds the donor's very cells below `length`, which the plan found whole
        this step: counting them again would copy a whole stream into the probe)."""
        if isinstance(donor, Parked):
            self.parked.touch(donor)
        if not self.streams and not self.ops.holds_window(seq_id, length):
            raise IntegrityError(f"a copy of {length} positions lacks its sliding window")

    def _copy_own(self, req: Request, seq_id: int, donor: Request | Parked, length: int) -> int:
        """A copy into cells of req's own (the ledger's blocks are all private); 0 when the
        donor had lost the window meanwhile or llama.cpp refused the state. Its state stays
        in the tiers as a checkpoint (`Checkpoints.copied`)."""
        src = _donor_seq(donor)
        state = self.ops.copy_own(src, seq_id, length)
        if state is None:
            return 0  # a fresh prefill
        self._copied(seq_id, donor, length)
        if self.checkpoints is not None:
            self.checkpoints.copied(req, src, length, state)
        return length

    def computed(self, req: Request, start: int, end: int) -> None:
        """req's prompt positions [start, end) were computed: window checkpoints among them."""
        if self.checkpoints is not None:
            self.checkpoints.computed(req, start, end)

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
        if blocks_for(num_tokens, self.blocks.block_size) > self.blocks.seq_blocks:
            return False  # more than one sequence may hold: evicting would not help
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
            parked = self._park(req, seq_id, resident)
            if self.own_copies and self.saved is not None:
                self._evict(parked)  # to the tiers: the window cache holds running ones only
        else:
            self.blocks.release(req.page_table)
            self.ops.clear_sequence(seq_id)
            self.seq_ids.release(seq_id)
        req.seq_id = None

    def _park(self, req: Request, seq_id: int, resident: int) -> Parked:
        table = req.page_table
        keep = blocks_for(resident, self.blocks.block_size)
        self.blocks.free(table.blocks[keep:])  # room reserved for positions never computed
        del table.blocks[keep:]
        parked = Parked(seq_id, req.all_token_ids[:resident], table, req.cache_scope)
        req.page_table = type(table)()
        self.parked.add(parked)
        self.index.add(parked)
        return parked

    def evict_one(self, exclude: Parked | None = None, save: bool = True) -> bool:
        """Evicts the least recently used parked sequence, saving its state to the tiers."""
        victim = self.parked.oldest(exclude)
        if victim is None:
            return False
        self._evict(victim, save)
        return True

    def _evict(self, victim: Parked, save: bool = True) -> None:
        if save:
            self._save(victim)
        self.parked.remove(victim)
        self.index.remove(victim)
        self.blocks.release(victim.page_table)
        self.ops.clear_sequence(victim.seq_id)
        self.seq_ids.release(victim.seq_id)
        self.evictions += 1

    def bound_parked(self, running: list[Request]) -> int:
        """Before a decode: evicts parked sequences, least recently used first and saved to the
        tiers, while the blocks only they hold outnumber the running requests' blocks. Returns
        how many went.

        llama.cpp attends over every cell of the unified cache up to the highest one in use,
        masked or not, so each parked cell costs every decoded token: SmolLM2-135M, one
        stream, 9.7 ms a token with nothing parked and 12.2 ms beside 3,500 parked cells;
        bounded so, it stays at 9.4-10.1 ms. A parked sequence is still reused at once by the
        request that arrives next (admission runs before this), and later from the RAM tier.
        Without tiers an evicted sequence would be lost, so nothing is bounded there."""
        if self.streams:
            return 0  # a parked stream is attended by no decode but its own
        used = self.blocks.num_blocks - self.blocks.num_free
        # Only parked ones hold at most parked.num_blocks (cached); running ones the rest.
        if self.saved is None or 2 * self.parked.num_blocks <= used:
            return 0  # no set of the running blocks to build, step after step
        held = {b for req in running for b in req.page_table.blocks}
        evicted = 0
        while self.blocks.num_blocks - self.blocks.num_free - len(held) > len(held):
            if not self.evict_one():
                break
            evicted += 1
        return evicted

    def drop_parked(self) -> None:
        """Evicts every parked sequence without saving (the ledger may be wrong)."""
        while self.evict_one(save=False):
            pass

    def save_parked(self) -> None:
        """Saves every parked sequence to the tiers and waits for their files (a stop)."""
        if self.saved is None:
            return
        for parked in list(self.parked):
            self._save(parked)
        self.saved.close()

    @property
    def any_prefix(self) -> bool:
        """Whether any prefix of a saved state can be restored (attention KV alone)."""
        return self.restore_cut is None

    def _save(self, parked: Parked) -> None:
        """Keeps parked's state in the tiers (`SavedStates.keep`)."""
        if self.saved is not None:
            state_of = functools.partial(self.ops.save_sequence, parked.seq_id)
            self.saved.keep(parked.all_token_ids, parked.cache_scope, state_of, self.any_prefix)

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
        _one_scope_per_block([*running, *parked])
        saved = len(self.saved) if self.saved is not None else 0
        if self.prefix_cache and len(self.index) != len(running) + len(parked) + saved:
            raise IntegrityError("prefix index out of step with running, parked and saved")


def _one_scope_per_block(owners: list[Request | Parked]) -> None:
    """A block shared in the ledger was shared through the index: never across scopes."""
    scopes: dict[int, str] = {}
    for owner in owners:
        for block in owner.page_table.blocks:
            if scopes.setdefault(block, owner.cache_scope) != owner.cache_scope:
                raise IntegrityError(f"block {block} is shared across cache scopes")


def _donor_seq(donor: Request | Parked) -> int:
    if donor.seq_id is None:
        raise IntegrityError("a prefix donor without a sequence")
    return donor.seq_id
