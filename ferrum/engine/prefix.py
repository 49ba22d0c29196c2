"""Prefix index: which resident token sequence shares the longest prefix with a new prompt.

Owners are llama.cpp sequences that hold (or are about to hold) KV for their tokens: running
requests (indexed over their whole token list, so a newcomer can wait for a donor that is
still prefilling) and parked sequences (finished requests whose KV was kept); and saved
states of evicted sequences, in host RAM or on disk (`tiers.Saved`), which are restored
rather than shared.

Full blocks are keyed by a chained hash, so a lookup walks the prompt block by block; the match
is then extended token by token inside the first unmatched block and checked against the
owner's real tokens (a hash collision can never produce a wrong reuse):

    prompt:   [ b0 ][ b1 ][ b2 ][ b3 ][ b4 ...
    owner:    [ b0 ][ b1 ][ b2 ][ b3'...          chain hash of b0..b2 found, b3 differs
    match:    |<------ 3 blocks ---->|+k tokens   k < block_size, compared one by one
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from ferrum.engine.kv import PageTable
from ferrum.engine.request import Request


@dataclass(eq=False)
class Parked:
    """A finished request's sequence kept resident: KV holds exactly `all_token_ids`."""

    seq_id: int
    all_token_ids: list[int]
    page_table: PageTable = field(default_factory=PageTable)


class Owner(Protocol):
    """Anything whose first positions hold KV (or saved state) for `all_token_ids`."""

    @property
    def all_token_ids(self) -> list[int]: ...


def _rank(owner: Owner) -> int:
    """On a tie: a parked owner first (only it can be taken over), a saved one last (only it
    costs a restore)."""
    return 0 if isinstance(owner, Parked) else 1 if isinstance(owner, Request) else 2


@dataclass(frozen=True)
class ResidentPrefixes:
    """What an engine holds, compactly: its prefix blocks' chained hashes (running, parked
    and saved sequences, shallow blocks first)."""

    block_size: int
    hashes: tuple[int, ...]


@dataclass(frozen=True)
class Match:
    owner: Owner
    length: int


class PrefixIndex:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._owners_by_hash: dict[int, dict[int, Owner]] = {}
        self._chains: dict[int, list[int]] = {}  # id(owner) → hashes of its indexed blocks

    def __len__(self) -> int:
        return len(self._chains)

    def __contains__(self, owner: Owner) -> bool:
        return id(owner) in self._chains

    def add(self, owner: Owner) -> None:
        self._chains[id(owner)] = []
        self.extend(owner)

    def extend(self, owner: Owner) -> None:
        """Indexes the owner's blocks completed since the last call."""
        chain = self._chains[id(owner)]
        tokens, bs = owner.all_token_ids, self.block_size
        h = chain[-1] if chain else 0
        for i in range(len(chain), len(tokens) // bs):
            h = _chain(h, tokens[i * bs : (i + 1) * bs])
            chain.append(h)
            self._owners_by_hash.setdefault(h, {})[id(owner)] = owner

    def remove(self, owner: Owner) -> None:
        for h in self._chains.pop(id(owner), ()):
            owners = self._owners_by_hash[h]
            del owners[id(owner)]
            if not owners:
                del self._owners_by_hash[h]

    def resident_hashes(self, limit: int) -> list[int]:
        """The chained hashes of the indexed blocks, shallow blocks first, at most `limit`.

        What a replica tells a cluster's router it holds (`block_hashes` computes the same
        chain over a prompt). A prompt can only match a block whose predecessors match too, so
        when the bound cuts, it cuts the deepest blocks: every system prompt and conversation
        start stays visible.
        """
        out: list[int] = []
        seen: set[int] = set()
        chains = list(self._chains.values())
        depth = 0
        while len(out) < limit and any(depth < len(c) for c in chains):
            for chain in chains:
                if depth < len(chain) and chain[depth] not in seen:
                    seen.add(chain[depth])
                    out.append(chain[depth])
                    if len(out) == limit:
                        break
            depth += 1
        return out

    def matches(self, tokens: list[int]) -> Iterator[Match]:
        """Every owner sharing at least one full block with `tokens`, longest match first
        (parked, then running, then saved on a tie).

        Lazy: the planner usually takes the first; it reads further only when a donor cannot
        serve its match (a sliding window that lost cells), so a shallower owner (a shared
        system prompt) is still found then.
        """
        bs = self.block_size
        levels: list[dict[int, Owner]] = []
        for h in block_hashes(tokens, bs):
            owners = self._owners_by_hash.get(h)
            if not owners:
                break
            levels.append(owners)
        seen: set[int] = set()
        for depth in range(len(levels), 0, -1):
            full = depth * bs
            found = []
            for key, owner in levels[depth - 1].items():
                if key in seen:
                    continue
                seen.add(key)
                own = owner.all_token_ids
                if own[:full] != tokens[:full]:
                    continue  # hash collision
                found.append(Match(owner, full + _common_prefix(own, tokens, full)))
            found.sort(key=lambda m: (-m.length, _rank(m.owner)))
            yield from found


def _chain(previous: int, block: list[int]) -> int:
    # Python hashes ints and tuples of ints the same in every process (PYTHONHASHSEED salts
    # only str and bytes), so another process (a cluster's router) computes the same chain.
    return hash((previous, tuple(block)))


def block_hashes(tokens: list[int], block_size: int) -> Iterator[int]:
    """The chained hash of each full block of `tokens`, as the index keys them (lazily)."""
    h = 0
    for i in range(len(tokens) // block_size):
        h = _chain(h, tokens[i * block_size : (i + 1) * block_size])
        yield h


def _common_prefix(a: list[int], b: list[int], start: int) -> int:
    n = 0
    for x, y in zip(itertools.islice(a, start, None), itertools.islice(b, start, None)):  # noqa: B905
        if x != y:
            break
        n += 1
    return n


class ParkedLRU:
    """Parked sequences, least recently used first."""

    def __init__(self) -> None:
        self._entries: OrderedDict[int, Parked] = OrderedDict()
        self._num_blocks: int | None = 0  # None: recount (entries changed)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Parked]:
        return iter(self._entries.values())

    def add(self, p: Parked) -> None:
        self._entries[id(p)] = p
        self._num_blocks = None

    def remove(self, p: Parked) -> None:
        del self._entries[id(p)]
        self._num_blocks = None

    def touch(self, p: Parked) -> None:
        self._entries.move_to_end(id(p))

    def oldest(self, exclude: Parked | None = None) -> Parked | None:
        for p in self._entries.values():
            if p is not exclude:
                return p
        return None

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held by parked sequences (they often share their prefix blocks).

        Read every engine step for the gauges, so counted again only after a change; a parked
        table never changes while it is parked.
        """
        if self._num_blocks is None:
            self._num_blocks = len({b for p in self._entries.values() for b in p.page_table.blocks})
        return self._num_blocks
