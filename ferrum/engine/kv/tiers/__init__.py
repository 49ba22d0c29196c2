"""Saved prefixes: sequences evicted from the KV pool, kept as llama.cpp state in host RAM and
on disk, indexed in the same prefix index as resident ones, restored when that beats prefill.

    KV pool      running + parked sequences         cells in llama.cpp (kv/residency.py)
      │ a parked sequence is evicted: its state is read out (llama_state_seq_get_data)
      ▼
    RAM tier     --cache-ram MiB, least recently used out        Saved.data
      │ every entry is also written behind to disk (an I/O thread), so it survives restarts
      ▼
    disk tier    --cache-dir, --cache-disk GiB, least recently used out   files.py

An entry leaves RAM when RAM is over its bound (and its file is written); it is forgotten
(and unindexed) once it is in neither tier. A disk-only entry is read back into RAM by the
I/O thread while its request waits (`ready`), so the engine thread never waits on a disk;
restoring from RAM is one memory copy inside llama.cpp (`KvOps.restore_sequence`).

Rules: every entry is in the prefix index exactly while it is in a tier; only the engine
thread changes entries (the I/O thread reports back through a queue, applied by `poll`); a
file is loaded only when its header names this model's fingerprint and its checksum holds.

Whether to restore is decided by `Costs`: measured prefill speed (tokens/s) against measured
restore speed (bytes/s, per tier), never a constant; until either is measured, restore.
"""

from ferrum.engine.kv.tiers.costs import Costs
from ferrum.engine.kv.tiers.entries import (
    DEFAULT_CACHE_DIR,
    Saved,
    Tier,
    TierConfig,
    TierCounts,
    TierStats,
    file_fingerprint,
)
from ferrum.engine.kv.tiers.store import SavedStates

__all__ = [
    "DEFAULT_CACHE_DIR",
    "Costs",
    "Saved",
    "SavedStates",
    "Tier",
    "TierConfig",
    "TierCounts",
    "TierStats",
    "file_fingerprint",
]
