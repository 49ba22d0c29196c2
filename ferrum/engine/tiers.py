"""Saved prefixes: sequences evicted from the KV pool, kept as llama.cpp state in host RAM and
on disk, indexed in the same prefix index as resident ones, restored when that beats prefill.

    KV pool      running + parked sequences         cells in llama.cpp (kv_manager.py)
      │ a parked sequence is evicted: its state is read out (llama_state_seq_get_data)
      ▼
    RAM tier     --cache-ram MiB, least recently used out        Saved.data
      │ every entry is also written behind to disk (an I/O thread), so it survives restarts
      ▼
    disk tier    --cache-dir, --cache-disk GiB, least recently used out   tier_files.py

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

from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from ferrum.engine import tier_files
from ferrum.engine.prefix import PrefixIndex

log = logging.getLogger("ferrum.tiers")


class Tier(enum.StrEnum):
    RAM = "ram"
    DISK = "disk"


@dataclass(eq=False)
class Saved:
    """One saved sequence state: its tokens (what it holds, positions 0..n) and where it is."""

    key: str
    all_token_ids: list[int]
    state_bytes: int
    data: bytearray | None = None  # the state in RAM
    header: tier_files.EntryHeader | None = None  # the state's file, once written
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


class Costs:
    """Measured speeds: prefill tokens/s from engine steps, restore bytes/s per tier."""

    _WEIGHT = 0.3  # of each new measurement in the running average

    def __init__(self) -> None:
        self.prefill_tps: float | None = None
        self.restore_bps: dict[Tier, float] = {}

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens >= 32 and seconds > 0:
            self.prefill_tps = self._mix(self.prefill_tps, tokens / seconds)

    def restored(self, tier: Tier, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.restore_bps[tier] = self._mix(self.restore_bps.get(tier), nbytes / seconds)

    def worth(self, entry: Saved, tokens_saved: int) -> bool:
        """Whether restoring `entry` costs less than computing `tokens_saved` positions."""
        bps = self.restore_bps.get(entry.tier)
        if self.prefill_tps is None or bps is None:
            return True
        if entry.tier is Tier.DISK and Tier.RAM in self.restore_bps:
            # From disk: read into RAM, then the RAM restore.
            bps = 1 / (1 / bps + 1 / self.restore_bps[Tier.RAM])
        return entry.state_bytes / bps < tokens_saved / self.prefill_tps

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self._WEIGHT * (new - old)


class SavedStates:
    """The RAM and disk tiers of one model's engine (engine thread, but for its I/O thread)."""

    def __init__(self, config: TierConfig, index: PrefixIndex):
        self.config = config
        self.index = index
        self.costs = Costs()
        self.stats = TierStats()
        self._entries: dict[str, Saved] = {}
        self._ram: OrderedDict[str, Saved] = OrderedDict()
        self._disk: OrderedDict[str, Saved] = OrderedDict()
        self._ram_bytes = self._disk_bytes = self._pending_bytes = 0
        self._pins: OrderedDict[str, Saved] = OrderedDict()
        self._done: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._io: threading.Thread | None = None
        self.disk = False
        if config.folder is not None and config.disk_bytes > 0:
            try:
                config.folder.mkdir(parents=True, exist_ok=True)
                self._load_folder(config.folder)
            except OSError as exc:
                log.warning("prefix cache: no disk tier, %s is unusable (%s)", config.folder, exc)
                return
            self.disk = True
            if config.io_thread:
                self._io = threading.Thread(target=self._io_loop, name="ferrum-kv-io", daemon=True)
                self._io.start()

    def __iter__(self) -> Iterator[Saved]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    # -- engine thread ----------------------------------------------------------------------

    def get(self, tokens: list[int]) -> Saved | None:
        return self._entries.get(_key(tokens))

    def save(self, tokens: list[int], state: bytearray) -> Saved:
        """Keeps a state in RAM (and writes it behind to disk); the same tokens twice keep one."""
        self.poll()
        key = _key(tokens)
        entry = self._entries.get(key)
        if entry is not None:
            self.touch(entry)
            return entry
        entry = Saved(key, list(tokens), len(state), data=state)
        self._entries[key] = entry
        self._ram[key] = entry
        self._ram_bytes += len(state)
        self.index.add(entry)
        self.stats.saves += 1
        # Written behind unless the writer is already a RAM budget behind (a slow disk).
        if self.disk and self._pending_bytes + len(state) <= self._write_backlog:
            self._write(entry, state)
        self._fit()
        return entry

    @property
    def _write_backlog(self) -> int:
        return max(self.config.ram_bytes, 256 << 20)

    def touch(self, entry: Saved) -> None:
        for lru in (self._ram, self._disk):
            if entry.key in lru:
                lru.move_to_end(entry.key)

    def ready(self, entry: Saved) -> bool:
        """Whether entry's state is in RAM; if it is only on disk, starts reading it in."""
        self.poll()
        if entry.data is not None:
            return True
        if not entry.loading and entry.header is not None and entry.key in self._entries:
            entry.loading = True
            header = entry.header
            self._submit(lambda: self._load(entry, header))
        return False

    def restored(self, entry: Saved, tokens: int, seconds: float, source: Tier) -> None:
        counts = self._counts(source)
        counts.hits += 1
        counts.restore_seconds += seconds
        self.stats.restores += 1
        self.stats.restored_tokens += tokens
        self.costs.restored(Tier.RAM, entry.state_bytes, seconds)
        self.touch(entry)
        self._unpin(entry)
        if entry.header is not None:  # recency on disk outlives this process: the file's mtime
            path = entry.header.path
            self._submit(partial(_touch_file, path))

    def failed(self, entry: Saved, why: str) -> None:
        """llama.cpp refused the state (or its file was bad): forgotten, file deleted."""
        log.warning("saved prefix of %d tokens not restored (%s)", len(entry.all_token_ids), why)
        self.stats.failures += 1
        self._forget(entry, delete_file=True)

    def drop(self, entry: Saved) -> None:
        """A shorter entry a new save supersedes (its tokens are a prefix of the new one's)."""
        self._forget(entry, delete_file=True)

    def poll(self) -> None:
        """Applies what the I/O thread finished."""
        while True:
            try:
                apply = self._done.get_nowait()
            except queue.Empty:
                return
            apply()

    def snapshot(self) -> TierStats:
        self.poll()
        s = self.stats
        s.ram.entries, s.ram.bytes = len(self._ram), self._ram_bytes
        s.disk.entries, s.disk.bytes = len(self._disk), self._disk_bytes
        return s

    def close(self, timeout: float = 60.0) -> None:
        """Finishes the writes under way (a stop must not lose what it just saved)."""
        if self._io is None:
            return
        self._jobs.put(None)
        self._io.join(timeout)
        self._io = None
        self.poll()

    # -- bounds -----------------------------------------------------------------------------

    @property
    def pinned_bytes(self) -> int:
        return sum(e.state_bytes for e in self._pins.values())

    def _unpin(self, entry: Saved) -> None:
        if self._pins.pop(entry.key, None) is not None:
            entry.pinned = False
            self._fit()

    def _fit(self) -> None:
        for key in list(self._ram):
            if self._ram_bytes <= self.config.ram_bytes:
                break
            entry = self._ram[key]
            if entry.writing or entry.pinned:
                continue  # its data is still being written, or about to be restored
            del self._ram[key]
            self._ram_bytes -= entry.state_bytes
            entry.data = None
            if entry.header is None:
                self._forget(entry, delete_file=False)
        for key in list(self._disk):
            if self._disk_bytes <= self.config.disk_bytes:
                break
            entry = self._disk[key]
            if entry.loading:
                continue
            self._unfile(entry)
            if entry.data is None:
                self._forget(entry, delete_file=False)

    def _forget(self, entry: Saved, delete_file: bool) -> None:
        if self._entries.get(entry.key) is not entry:
            return
        del self._entries[entry.key]
        if self._pins.pop(entry.key, None) is not None:
            entry.pinned = False
        if entry in self.index:
            self.index.remove(entry)
        if self._ram.pop(entry.key, None) is not None:
            self._ram_bytes -= entry.state_bytes
        entry.data = None
        if delete_file or entry.key in self._disk:
            self._unfile(entry)

    def _unfile(self, entry: Saved) -> None:
        if self._disk.pop(entry.key, None) is not None and entry.header is not None:
            self._disk_bytes -= entry.header.file_bytes
            path = entry.header.path
            self._submit(lambda: path.unlink(missing_ok=True))
        entry.header = None

    def _counts(self, tier: Tier) -> TierCounts:
        return self.stats.ram if tier is Tier.RAM else self.stats.disk

    # -- disk -------------------------------------------------------------------------------

    def _load_folder(self, folder: Path) -> None:
        """Indexes the entries a previous run left, oldest use first."""
        kept, dropped = tier_files.scan(folder, self.config.fingerprint)
        for path, why in dropped:
            log.warning("prefix cache: deleted %s (%s)", path.name, why)
        kept.sort(key=lambda h: _mtime(h.path))
        for header in kept:
            key = _key(header.tokens)
            if header.path.name != key + tier_files.SUFFIX or key in self._entries:
                header.path.unlink(missing_ok=True)
                continue
            entry = Saved(key, header.tokens, header.state_bytes, header=header)
            self._entries[key] = entry
            self._disk[key] = entry
            self._disk_bytes += header.file_bytes
            self.index.add(entry)
        self._fit()
        if kept:
            log.info(
                "prefix cache: %d saved prefixes (%.1f MiB) found in %s",
                len(self._disk), self._disk_bytes / 2**20, folder,
            )  # fmt: skip

    def _write(self, entry: Saved, state: bytearray) -> None:
        assert self.config.folder is not None
        path = self.config.folder / (entry.key + tier_files.SUFFIX)
        tokens, fingerprint = entry.all_token_ids, self.config.fingerprint
        entry.writing = True
        self._pending_bytes += len(state)

        def job() -> None:
            try:
                size = tier_files.write_entry(path, fingerprint, tokens, state)
            except OSError as exc:
                self._done.put(partial(self._written, entry, path, None, exc))
            else:
                self._done.put(partial(self._written, entry, path, size, None))

        self._submit(job)

    def _written(self, entry: Saved, path: Path, size: int | None, exc: OSError | None) -> None:
        entry.writing = False
        self._pending_bytes -= entry.state_bytes
        if size is None:
            self.stats.write_failures += 1
            log.warning("prefix cache: could not write %s (%s); kept in RAM only", path.name, exc)
        elif self._entries.get(entry.key) is not entry:
            path.unlink(missing_ok=True)  # forgotten while it was being written
        else:
            entry.header = tier_files.EntryHeader(
                path, entry.all_token_ids, entry.state_bytes, 0, size
            )
            self._disk[entry.key] = entry
            self._disk_bytes += size
        self._fit()

    def _load(self, entry: Saved, header: tier_files.EntryHeader) -> None:
        t0 = time.monotonic()
        try:
            full = tier_files.read_header(header.path, self.config.fingerprint)
            state = tier_files.read_state(full)
        except tier_files.EntryError as exc:
            self._done.put(partial(self._loaded, entry, None, str(exc), 0.0))
        else:
            self._done.put(partial(self._loaded, entry, state, "", time.monotonic() - t0))

    def _loaded(self, entry: Saved, state: bytearray | None, why: str, seconds: float) -> None:
        entry.loading = False
        if self._entries.get(entry.key) is not entry:
            return
        if state is None:
            self.failed(entry, f"its file was unreadable: {why}")
            return
        self.costs.restored(Tier.DISK, len(state), seconds)
        self._counts(Tier.DISK).restore_seconds += seconds
        entry.data = state
        entry.source = Tier.DISK
        self._ram[entry.key] = entry
        self._ram_bytes += len(state)
        self.touch(entry)
        # Kept in RAM, over its bound if need be, until the waiting request restores it: else
        # an entry larger than what RAM may hold would be read again and again. A request
        # that went away meanwhile leaves its pin to the oldest-out below.
        entry.pinned = True
        self._pins[entry.key] = entry
        while len(self._pins) > _MAX_PINS:
            _, old = self._pins.popitem(last=False)
            old.pinned = False
        self._fit()

    def _submit(self, job: Callable[[], None]) -> None:
        if self._io is not None:
            self._jobs.put(job)
        else:
            job()

    def _io_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # an I/O job never takes the thread down
                log.exception("prefix cache I/O failed")


_MAX_PINS = 8


def _key(tokens: list[int]) -> str:
    return hashlib.sha256(tier_files.token_bytes(tokens)).hexdigest()[:32]


def _touch_file(path: Path) -> None:
    with contextlib.suppress(OSError):  # deleted meanwhile (another server on the folder)
        os.utime(path)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
