"""A least-recently-used map bounded both by entries and by bytes.

A count alone does not bound memory when one entry may be a thousand times larger than
another (a grammar of 1 KB or of 1 MB): each entry is put with its size, and the least
recently used go until both bounds hold again. An entry larger than the whole byte bound is
not kept at all. `on_evict` receives every value that leaves (evicted, refused or cleared),
so an owner of C handles frees them in one place. Not thread-safe: the owner locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class SizedLRU(Generic[K, V]):
    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        on_evict: Callable[[V], None] | None = None,
    ):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._on_evict = on_evict
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        """The keys, least recently used first."""
        return iter(self._entries)

    def get(self, key: K) -> V | None:
        """The value, now the most recently used; None when not kept."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, size: int) -> bool:
        """Keep `value` as the most recently used; False (and evicted at once) when it alone
        is larger than the byte bound."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.total_bytes -= old[1]
            if old[0] is not value:
                self._evicted(old[0])
        if size > self.max_bytes:
            self._evicted(value)
            return False
        self._entries[key] = (value, size)
        self.total_bytes += size
        while len(self._entries) > self.max_entries or self.total_bytes > self.max_bytes:
            _, (gone, gone_size) = self._entries.popitem(last=False)
            self.total_bytes -= gone_size
            self._evicted(gone)
        return True

    def clear(self) -> None:
        while self._entries:
            gone, _ = self._entries.popitem()[1]
            self._evicted(gone)
        self.total_bytes = 0

    def _evicted(self, value: V) -> None:
        if self._on_evict is not None:
            self._on_evict(value)
