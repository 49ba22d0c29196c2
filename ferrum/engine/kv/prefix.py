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

Rule: owners of different cache scopes (`SamplingParams.cache_scope`: an API key's tenant, a
`cache_salt`, or "" shared by all) never share a block through the index. The scope is decided
in one place, the chain's seed (`scope_seed`): every chain starts from its owner's seed, so a
prompt's walk only meets its own scope's blocks, and the token-by-token extension happens only
behind an owner found that way. Without it another key could learn a prompt token by token
from `cached_tokens` or from timing. The empty scope seeds 0: a single-tenant server's chains
are what they always were.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from ferrum.engine.kv.ledger import PageTable
from ferrum.engine.request import Request


@dataclass(eq=False)
class Parked:
    """A finished request's sequence kept resident: KV holds exactly `all_token_ids`."""

    seq_id: int
    all_token_ids: list[int]
    page_table: PageTable = field(default_factory=PageTable)
    cache_scope: str = ""  # the finished request's: who may reuse it


class Owner(Protocol):
    """Anything whose first positions hold KV (or saved state) for `all_token_ids`, reusable
    only by prompts of its `cache_scope`."""

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def cache_scope(self) -> str: ...


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
        h = chain[-1] if chain else scope_seed(owner.cache_scope)
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

    def matches(self, tokens: list[int], scope: str) -> Iterator[Match]:
        """Every owner of `scope` sharing at least one full block with `tokens`, longest match
        first (parked, then running, then saved on a tie). Owners of other scopes are never
        found: their chains start from another seed.

        Lazy: the planner usually takes the first; it reads further only when a donor cannot
        serve its match (a sliding window that lost cells), so a shallower owner (a shared
        system prompt) is still found then.
        """
        bs = self.block_size
        levels: list[dict[int, Owner]] = []
        for h in block_hashes(tokens, bs, scope):
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
                if own[:full] != tokens[:full] or owner.cache_scope != scope:
                    continue  # hash collision (within a scope or, seeds apart, across)
                found.append(Match(owner, full + _common_prefix(own, tokens, full)))
            found.sort(key=lambda m: (-m.length, _rank(m.owner)))
            yield from found


def _chain(previous: int, block: list[int]) -> int:
    # Python hashes ints and tuples of ints the same in every process (PYTHONHASHSEED salts
    # only str and bytes), so another process (a cluster's router) computes the same chain.
    return hash((previous, tuple(block)))


@functools.lru_cache(maxsize=4096)
def scope_seed(scope: str) -> int:
    """Where a cache scope's chains start: 0 for "", else 64 bits of its sha256 (a str's own
    hash is salted per process, and a cluster's router must compute the same chain)."""
    if not scope:
        return 0
    digest = hashlib.sha256(scope.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big")


def block_hashes(tokens: list[int], block_size: int, scope: str) -> Iterator[int]:
    """The chained hash of each full block of `tokens` in `scope`, as the index keys them
    (lazily)."""
    h = scope_seed(scope)
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
