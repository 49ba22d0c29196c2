"""The RAM and disk tiers of one model's engine: bounds, write-behind, read-back, restart."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from ferrum.engine.kv.prefix import PrefixIndex
from ferrum.engine.kv.tiers import files
from ferrum.engine.kv.tiers.costs import Costs
from ferrum.engine.kv.tiers.entries import Saved, Tier, TierConfig, TierCounts, TierStats, state_key

log = logging.getLogger("ferrum.tiers")


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
        # Writes (and deletes) behind at the lowest CPU priority: nothing waits on them, and
        # on a CPU server they would take time from the decode threads. Reads at normal
        # priority: a request waits on each.
        self._writer: _Worker | None = None
        self._reader: _Worker | None = None
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
                self._writer = _Worker("ferrum-kv-write", nice=19)
                self._reader = _Worker("ferrum-kv-read", nice=0)

    def __iter__(self) -> Iterator[Saved]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    # -- engine thread ----------------------------------------------------------------------

    def get(self, tokens: list[int], scope: str) -> Saved | None:
        return self._entries.get(state_key(tokens, scope))

    def save(self, tokens: list[int], scope: str, state: bytearray) -> Saved:
        """Keeps a state of `scope` in RAM (and writes it behind to disk); the same tokens
        twice in one scope keep one."""
        self.poll()
        key = state_key(tokens, scope)
        entry = self._entries.get(key)
        if entry is not None:
            self.touch(entry)
            return entry
        entry = Saved(key, list(tokens), len(state), scope, data=state)
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

    def keep(
        self,
        tokens: list[int],
        scope: str,
        state_of: Callable[[], bytearray | None],
        any_prefix: bool,
    ) -> None:
        """Keeps a finished sequence's state (read by `state_of` only if it is kept), unless
        a saved state already holds its tokens, or more where `any_prefix` of one can be
        restored; then the saved states it extends are dropped."""
        if self.get(tokens, scope) is not None:
            return
        shorter = []
        for match in self.index.matches(tokens, scope):
            owner = match.owner
            if isinstance(owner, Saved) and match.length == len(tokens) and any_prefix:
                self.touch(owner)
                return  # a longer saved state holds these tokens
            if isinstance(owner, Saved) and match.length == owner.length < len(tokens):
                shorter.append(owner)
        state = state_of()
        if state is None:
            return
        self.save(tokens, scope, state)
        if any_prefix:
            for owner in shorter:
                self.drop(owner)

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
            self._submit(lambda: self._load(entry, header), self._reader)
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
            self._submit(partial(_touch_file, path), self._writer)

    def failed(self, entry: Saved, why: str) -> None:
        """llama.cpp refused the state (or its file was bad): forgotten, file deleted."""
        log.warning("saved prefix of %d tokens not restored (%s)", len(entry.all_token_ids), why)
        self.stats.failures += 1
        self._forget(entry)

    def drop(self, entry: Saved) -> None:
        """A shorter entry a new save supersedes (its tokens are a prefix of the new one's)."""
        self._forget(entry)

    def poll(self) -> None:
        """Applies what the I/O thread finished (the engine thread is the one consumer: what
        `empty` says is there stays there; it runs every step, raising nothing when idle)."""
        done = self._done
        while not done.empty():
            done.get_nowait()()

    def snapshot(self) -> TierStats:
        self.poll()
        s = self.stats
        s.ram.entries, s.ram.bytes = len(self._ram), self._ram_bytes
        s.disk.entries, s.disk.bytes = len(self._disk), self._disk_bytes
        return s

    def close(self, timeout: float = 60.0) -> None:
        """Finishes the writes under way (a stop must not lose what it just saved)."""
        for worker in (self._reader, self._writer):
            if worker is not None:
                worker.stop(timeout)
        self._reader = self._writer = None
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
                self._forget(entry)
        for key in list(self._disk):
            if self._disk_bytes <= self.config.disk_bytes:
                break
            entry = self._disk[key]
            if entry.loading:
                continue
            self._unfile(entry)
            if entry.data is None:
                self._forget(entry)

    def _forget(self, entry: Saved) -> None:
        """Out of every tier and the index; its file (if written) deleted."""
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
        self._unfile(entry)

    def _unfile(self, entry: Saved) -> None:
        if self._disk.pop(entry.key, None) is not None and entry.header is not None:
            self._disk_bytes -= entry.header.file_bytes
            path = entry.header.path
            self._submit(lambda: path.unlink(missing_ok=True), self._writer)
        entry.header = None

    def _counts(self, tier: Tier) -> TierCounts:
        return self.stats.ram if tier is Tier.RAM else self.stats.disk

    # -- disk -------------------------------------------------------------------------------

    def _load_folder(self, folder: Path) -> None:
        """Indexes the entries a previous run left, oldest use first."""
        kept, dropped = files.scan(folder, self.config.fingerprint)
        for path, why in dropped:
            log.warning("prefix cache: deleted %s (%s)", path.name, why)
        self.stats.files_dropped += len(dropped)
        kept.sort(key=lambda h: _mtime(h.path))
        for header in kept:
            key = state_key(header.tokens, header.scope)
            if header.path.name != key + files.SUFFIX or key in self._entries:
                header.path.unlink(missing_ok=True)
                continue
            entry = Saved(key, header.tokens, header.state_bytes, header.scope, header=header)
            self._entries[key] = entry
            self._disk[key] = entry
            self._disk_bytes += header.file_bytes
            self.index.add(entry)
        self._fit()
        log.info(
            "prefix cache tiers: RAM %.0f MiB, disk %.1f GiB in %s (%d saved prefixes, "
            "%.1f MiB, from earlier runs)",
            self.config.ram_bytes / 2**20, self.config.disk_bytes / 2**30, folder,
            len(self._disk), self._disk_bytes / 2**20,
        )  # fmt: skip

    def _write(self, entry: Saved, state: bytearray) -> None:
        assert self.config.folder is not None
        path = self.config.folder / (entry.key + files.SUFFIX)
        tokens, fingerprint, scope = entry.all_token_ids, self.config.fingerprint, entry.cache_scope
        entry.writing = True
        self._pending_bytes += len(state)

        def job() -> None:
            try:
                size = files.write_entry(path, fingerprint, tokens, scope, state)
            except OSError as exc:
                self._done.put(partial(self._written, entry, path, None, exc))
            else:
                self._done.put(partial(self._written, entry, path, size, None))

        self._submit(job, self._writer)

    def _written(self, entry: Saved, path: Path, size: int | None, exc: OSError | None) -> None:
        entry.writing = False
        self._pending_bytes -= entry.state_bytes
        if size is None:
            self.stats.write_failures += 1
            log.warning("prefix cache: could not write %s (%s); kept in RAM only", path.name, exc)
        elif self._entries.get(entry.key) is not entry:
            path.unlink(missing_ok=True)  # forgotten while it was being written
        else:
            entry.header = files.EntryHeader(
                path, entry.all_token_ids, entry.cache_scope, entry.state_bytes, 0, size
            )
            self._disk[entry.key] = entry
            self._disk_bytes += size
        self._fit()

    def _load(self, entry: Saved, header: files.EntryHeader) -> None:
        t0 = time.monotonic()
        try:
            full = files.read_header(header.path, self.config.fingerprint)
            state = files.read_state(full)
        except files.EntryError as exc:
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

    @staticmethod
    def _submit(job: Callable[[], None], worker: _Worker | None) -> None:
        if worker is not None:
            worker.jobs.put(job)
        else:
            job()  # no I/O threads (tests): inline, reported through the same queue


class _Worker:
    """One I/O thread and its queue of jobs, at a CPU priority of its own (Linux nice)."""

    def __init__(self, name: str, nice: int):
        self.jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._nice = nice
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self.jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        if self._nice:
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # an I/O job never takes the thread down
                log.exception("prefix cache I/O failed")


_MAX_PINS = 8


def _touch_file(path: Path) -> None:
    with contextlib.suppress(OSError):  # deleted meanwhile (another server on the folder)
        os.utime(path)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
