"""Where a request's KV comes from (`plan_reuse`): a fresh prefill, a copy of a donor's
prefix, a takeover of a parked sequence, a restore from the tiers, or a wait for a donor still
computing the prefix. Read-only: `KVManager.admit` carries the plan out (residency.py has the
picture of each kind)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ferrum.engine.kv.ledger import blocks_for
from ferrum.engine.kv.prefix import Parked
from ferrum.engine.kv.tiers import Saved
from ferrum.engine.request import Request

if TYPE_CHECKING:
    from ferrum.engine.kv.residency import KVManager


@dataclass(frozen=True)
class Reuse:
    """One plan: what a request reuses (nothing: `FRESH`)."""

    donor: Request | Parked | None = None
    length: int = 0
    takeover: bool = False
    # Longer matches passed over because their donor had lost part of the sliding window.
    window_refusals: int = 0
    saved: Saved | None = None  # restore this saved state, then keep `length` positions of it


FRESH = Reuse()


def plan_reuse(kv: KVManager, req: Request) -> Reuse | None:
    """Where req's KV comes from; None: wait, a running donor is computing the prefix (or
    a saved state is being read from disk).

    Owners are tried longest match first. On a sliding-window model a donor's old window
    cells can be recycled by llama.cpp while it is parked or decoding on, so a partial
    copy is taken only from a donor that still holds the newcomer's whole window; else
    the next owner (a shorter match) is tried, and only then a fresh prefill. A saved
    state longer than the resident reuse is restored when that is cheaper.
    """
    if not kv.prefix_cache:
        return FRESH
    refused = 0
    saved: Reuse | None = None
    resident: Reuse | None = None
    # Scoped: owners of another cache scope never come up (prefix.py), for every reuse
    # below (copy, takeover, waiting for a donor, restore).
    for match in kv.index.matches(req.all_token_ids, req.cache_scope):
        length = req.reuse_floor(min(match.length, req.num_tokens - 1))
        donor = match.owner
        if length <= 0:
            break
        if isinstance(donor, Saved):
            if saved is None and _restorable(kv, donor, length):
                saved = Reuse(length=length, saved=donor)
            continue
        if not isinstance(donor, (Request, Parked)) or donor.seq_id is None:
            continue  # a request preempted within this step
        if isinstance(donor, Parked) and length == len(donor.all_token_ids):
            # Continuing the owner itself: a sequence always keeps its own recent window.
            resident = Reuse(donor, length, takeover=True, window_refusals=refused)
            break
        if not kv.share_cells:
            continue
        if isinstance(donor, Request) and donor.num_computed_tokens < length:
            # Wait for the donor, unless a saved state serves more.
            return None if saved is None else _prefer_saved(kv, saved, length, None)
        if not kv.ops.holds_window(donor.seq_id, length):
            refused += 1
            continue
        resident = Reuse(donor, length, window_refusals=refused)
        break
    if resident is None:
        resident = Reuse(window_refusals=refused) if refused else FRESH
    return _prefer_saved(kv, saved, resident.length, resident)


def _restorable(kv: KVManager, entry: Saved, length: int) -> bool:
    cut = entry.length - length
    # A window model's state no longer than its window lost no window cell: any cut serves.
    allowed = kv.restore_cut is None or cut <= kv.restore_cut or entry.length <= kv.window
    # A state saved by a server with a larger context may not fit a sequence here at all.
    fits = blocks_for(entry.length + 1, kv.blocks.block_size) <= kv.blocks.seq_blocks
    return length >= kv.blocks.block_size and allowed and fits


def _prefer_saved(
    kv: KVManager, saved: Reuse | None, have: int, resident: Reuse | None
) -> Reuse | None:
    """The saved state when it serves more than the `have` positions of the resident plan
    for less than computing them costs; None while it is still being read from disk."""
    if saved is None or saved.saved is None or kv.saved is None:
        return resident
    gain = saved.length - have
    if gain < kv.blocks.block_size or not kv.saved.costs.worth(saved.saved, gain):
        return resident
    return saved if kv.saved.ready(saved.saved) else None
