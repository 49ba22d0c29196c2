"""What the tiers hold and count: a saved state, its tier, the per-tier counts, the
configuration of one model's tiers and the fingerprint that ties files to a model."""

from __future__ import annotations

import enum
import hashlib
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from ferrum.engine.kv.tiers.files import EntryHeader, token_bytes


class Tier(enum.StrEnum):
    RAM = "ram"
    DISK = "disk"


@dataclass(eq=False)
class Saved:
    """One saved sequence state: its tokens (what it holds, positions 0..n), whose it is (only
    prompts of its cache scope find it in the index) and where it is."""

    key: str
    all_token_ids: list[int]
    state_bytes: int
    cache_scope: str
    data: bytearray | None = None  # the state in RAM
    header: EntryHeader | None = None  # the state's file, once written
    writing: bool = False
    loading: bool = False
    source: Tier = Tier.RAM  # DISK while its data is the copy just read back from disk
    pinned: bool = False  # read back for a waiting request: RAM keeps it until restored
    seq_id: None = None  # never resident: an index owner without a sequence

    @property
    def tier(self) -> Tier:
        return Tier.RAM if self.data is not None else Tier.DISK

    @property
    def length(self) -> int:
        return len(self.all_token_ids)


@dataclass
class TierCounts:
    entries: int = 0
    bytes: int = 0
    hits: int = 0  # restores that reused this tier's entry
    restore_seconds: float = 0.0


@dataclass
class TierStats:
    """Per tier, plus the failures that fell back to prefill (each logged)."""

    ram: TierCounts = field(default_factory=TierCounts)
    disk: TierCounts = field(default_factory=TierCounts)
    saves: int = 0
    restores: int = 0
    restored_tokens: int = 0
    failures: int = 0  # loads or restores refused: a fresh prefill instead
    write_failures: int = 0  # files that could not be written (a full disk): RAM only
    # Files deleted when the folder was scanned, never offered to llama.cpp: another model's,
    # build's or KV settings' (cell types, flash attention), torn or left over from a crash.
    files_dropped: int = 0

    def copy(self) -> TierStats:
        """A copy for observers (published every engine step: two small objects, no deepcopy)."""
        return replace(self, ram=replace(self.ram), disk=replace(self.disk))


@dataclass(frozen=True)
class TierConfig:
    ram_bytes: int
    disk_bytes: int = 0
    folder: Path | None = None  # this model's folder under --cache-dir; None: no disk tier
    fingerprint: str = ""
    io_thread: bool = True  # False: file I/O inline on the engine thread (tests: reproducible)

    @classmethod
    def for_model(
        cls, ram_mib: float, disk_gib: float, cache_dir: str, model_path: str, state_format: str
    ) -> TierConfig | None:
        """The tiers of one model: its own folder (named by its file) under cache_dir, and
        a fingerprint that also names the llama.cpp build; None when both tiers are off."""
        ram, disk = int(ram_mib * 2**20), int(disk_gib * 2**30)
        if ram <= 0 and disk <= 0:
            return None
        model = file_fingerprint(model_path)
        folder = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / model if disk > 0 else None
        digest = hashlib.sha256(state_format.encode()).hexdigest()[:16]
        return cls(ram, disk, folder, f"{model}-{digest}")


DEFAULT_CACHE_DIR = "~/.cache/ferrum/kv"


def file_fingerprint(path: str) -> str:
    """A model file's identity: its size and a hash of its first and last 4 MiB (a full hash
    of a multi-GB file would cost seconds at every start)."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(4 << 20))
        f.seek(max(0, size - (4 << 20)))
        h.update(f.read(4 << 20))
    return h.hexdigest()[:24]


def state_key(tokens: list[int], scope: str) -> str:
    """An entry's name: the same tokens of two scopes are two entries."""
    h = hashlib.sha256(scope.encode("utf-8", "surrogatepass") + b"\0")
    h.update(token_bytes(tokens))
    return h.hexdigest()[:32]


