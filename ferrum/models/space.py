"""The store's room: free disk and the quota (`--models-max-bytes`), with the bytes that pulls
under way still expect reserved, so that two pulls cannot both pass a check that only one fits.

Rules:
- A pull reserves its model's whole size (the hub states file sizes before any byte is
  fetched) for as long as it runs, under one lock (`reserve`): the check and the reservation
  are one step. What a reservation still expects is its size less the part files its pull
  has written so far; those part files are already on disk.
- The quota counts what the store keeps on disk: its files (a hard-linked copy counts once,
  a duplicated one twice: each inode once), every part file, and what reservations still
  expect. Files outside the store (an adopted file, a built-in model's) do not count.
- Disk space: what reservations still expect must fit the disk's free bytes.
- The lock and the reservations are this process's (one server): a `ferrum pull` in another
  process checks the disk for itself and has no quota.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from ferrum.models.errors import InsufficientStorage, StoreQuotaExceeded


class StoreSpace:
    def __init__(self, root: Path, files: Path, partial: Path, max_bytes: int = 0):
        self.root, self.files, self.partial = root, files, partial
        self.max_bytes = max_bytes  # 0: no quota
        self._lock = threading.Lock()
        self._reserved: dict[int, tuple[Path | None, int]] = {}  # id -> (part dir, bytes)
        self._next = 0

    @contextlib.contextmanager
    def reserve(self, what: str, parts: Path | None, size: int) -> Iterator[None]:
        """Holds `size` bytes for `what` (whose part files grow in `parts`) until the block
        ends; `StoreQuotaExceeded` or `InsufficientStorage` when they do not fit."""
        with self._lock:
            coming = self._coming() + max(0, size - _bytes_in(parts))
            free = shutil.disk_usage(self.root).free
            if coming > free:
                raise InsufficientStorage(
                    f"not enough disk space in {self.root} for {what}: it needs {coming} more "
                    f"bytes (with the pulls under way), {free} are free"
                )
            used = self.used()
            if self.max_bytes and used + coming > self.max_bytes:
                raise StoreQuotaExceeded(
                    f"{what} does not fit the model store's quota (--models-max-bytes "
                    f"{self.max_bytes}): the store holds {used} bytes and needs {coming} more "
                    "(with the pulls under way); delete a model first"
                )
            key, self._next = self._next, self._next + 1
            self._reserved[key] = (parts, size)
        try:
            yield
        finally:
            with self._lock:
                del self._reserved[key]

    def used(self) -> int:
        """Bytes the store keeps on disk: its files (each inode once) and part files."""
        seen: set[tuple[int, int]] = set()
        total = 0
        for top in (self.files, self.partial):
            for path in top.rglob("*"):
                with contextlib.suppress(OSError):
                    st = path.lstat()
                    if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_size
        return total

    def _coming(self) -> int:
        return sum(max(0, size - _bytes_in(parts)) for parts, size in self._reserved.values())


def _bytes_in(parts: Path | None) -> int:
    if parts is None or not parts.is_dir():
        return 0
    return sum(p.stat().st_size for p in parts.glob("*.part") if os.path.isfile(p))
