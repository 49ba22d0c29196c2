"""N-gram drafters: what followed the latest earlier occurrence of a sequence's last tokens,
in its own tokens (`NgramDrafter`) or in the model's latest finished requests
(`RecentSequences`). `speculator.py` decides when and how many of their guesses go in."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

# A match of ngram_max tokens is measured back up to this many: a regenerated answer matches
# its earlier run from the prompt's start, where its own prompt matches only a few lines.
_MEASURE_MAX = 256

Match = tuple[int, list[int]]  # (length of the n-gram matched, the tokens that followed it)
Suffixes = list[tuple[int, tuple[int, ...]]]  # (n, a sequence's last n tokens), longest first
_NO_MATCH: Match = (0, [])


class NgramDrafter:
    """Proposes what followed the latest earlier occurrence of the longest suffix n-gram.

    Tables map each n-gram to the position after its latest occurrence; they are extended
    with the tokens added since the last call, so a step costs what it adds, not the length
    of the sequence.
    """

    def __init__(self, ngram_min: int, ngram_max: int, floor: int | None = None):
        """Follows n-grams of ngram_max down to ngram_min tokens; a caller may ask for matches
        down to `floor` (the tables hold those sizes too)."""
        self._min = ngram_min
        self._sizes = tuple(range(ngram_max, min(ngram_min, floor or ngram_min) - 1, -1))
        self._tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self._sizes}
        self._indexed = 0  # n-grams ending before this position are in the tables

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        return self.propose_matched(tokens, k)[1]

    def propose_matched(
        self,
        tokens: Sequence[int],
        k: int,
        suffixes: Suffixes | None = None,
        shortest: int | None = None,
    ) -> Match:
        """The guess and the length of the n-gram it follows (0: none). `suffixes`: those of
        `tokens`, when the caller already has them; `shortest`: see `follow`."""
        end = len(tokens)
        self._index(tokens, end - 1)  # every n-gram but the suffix's own
        suffixes = self.suffixes(tokens) if suffixes is None else suffixes
        found = self.follow(suffixes, tokens, tokens, k, shortest)
        self._index(tokens, end)
        return found

    def index_all(self, tokens: Sequence[int]) -> None:
        """Every n-gram of `tokens` in the tables (a finished sequence, for others to follow)."""
        self._index(tokens, len(tokens))

    def suffixes(self, tokens: Sequence[int]) -> Suffixes:
        """The last n tokens for each n looked up, longest first."""
        end = len(tokens)
        return [(n, tuple(tokens[end - n : end])) for n in self._sizes if end >= n]

    def follow(
        self,
        suffixes: Suffixes,
        source: Sequence[int],
        tokens: Sequence[int],
        k: int,
        shortest: int | None = None,
        above: int = 0,
    ) -> Match:
        """What followed the latest earlier occurrence, in `source` (the tokens these tables
        index), of the longest of `suffixes` (those of `tokens`) that occurs there, `shortest`
        tokens or more (default: ngram_min; at least the floor) and longer than `above` (a
        match the caller already has). A match of the longest n-gram is measured further
        back, up to _MEASURE_MAX."""
        least = self._min if shortest is None else max(shortest, self._sizes[-1])
        for n, key in suffixes:
            # The longest n-gram is measured further back: it may beat any `above`.
            if n < least or n <= min(above, self._sizes[0] - 1):
                break
            at = self._tables[n].get(key)
            if at is not None and at < len(source):
                if n == self._sizes[0]:
                    n = _run_length(source, at, tokens, n)
                # As long a guess as the evidence: a match of the shortest n-gram guesses one
                # token, each longer match one more.
                return n, list(source[at : at + min(k, n - least + 1)])
        return _NO_MATCH

    def _index(self, tokens: Sequence[int], last: int) -> None:
        """Adds the n-grams ending at positions up to `last` (exclusive ends)."""
        for stop in range(max(self._indexed, 1), last + 1):
            for n, table in self._tables.items():
                if stop >= n:
                    table[tuple(tokens[stop - n : stop])] = stop
        self._indexed = max(self._indexed, last + 1)


def _run_length(source: Sequence[int], at: int, tokens: Sequence[int], n: int) -> int:
    """How many tokens before source[at] equal the last ones of `tokens`, knowing the last n
    do: measured in doubling steps up to _MEASURE_MAX (a coarse length is enough to rank
    matches, and slices compare at C speed)."""
    end = len(tokens)
    step = n
    while n < _MEASURE_MAX:
        step = min(step, _MEASURE_MAX - n, at - n, end - n)
        if step <= 0:
            return n
        if list(source[at - n - step : at - n]) != list(tokens[end - n - step : end - n]):
            return n
        n += step
        step *= 2
    return n


class RecentSequences:
    """The n-grams of the model's latest finished requests (prompt and output), for a request
    whose own tokens match less: a regenerated answer, an agent's retry, the same document
    asked about again repeat an earlier sequence. Each keeps the tables its drafter built
    while it ran.

    A request follows only sequences of its own cache scope: its output would not change
    (every guess is verified) but its speed would, a guess from another key's answer being
    kept faster than one computed, which would let that key's text be read back by timing.

    Bounds, per scope and in all: each scope keeps its newest sequences, at most
    `max_sequences` and `max_tokens` of them, its oldest out first, so one key's flood of
    finished requests replaces only its own (a shared bound would let it slow every other
    key's speculation). Memory is bounded by `max_total_tokens` over all scopes (drafter
    tables grow with their tokens; a scope holds at least one sequence, so this bounds the
    number of scopes too): past it, the oldest sequence of the scope holding the most tokens
    goes (ties: the scope whose oldest is oldest), so a scope is trimmed only while none
    holds more. The bound is per scope, not per key: a key spreading its requests over many
    `cache_salt`s counts as many scopes, and at equal shares the oldest sequence goes."""

    def __init__(
        self, max_sequences: int = 8, max_tokens: int = 16_384, max_total_tokens: int = 65_536
    ):
        self._max_sequences, self._max_tokens = max_sequences, max_tokens
        self._max_total = max_total_tokens
        # scope → its sequences, oldest first: (when added, tokens, the drafter's tables)
        self._scopes: dict[str, deque[tuple[int, tuple[int, ...], NgramDrafter]]] = {}
        self._scope_tokens: dict[str, int] = {}
        self._tokens = 0
        self._added = 0  # stamps, for the oldest among scopes

    def add(self, tokens: Sequence[int], drafter: NgramDrafter, scope: str) -> None:
        size = len(tokens)
        if not size or size > min(self._max_tokens, self._max_total) or not self._max_sequences:
            return
        self._added += 1
        self._scopes.setdefault(scope, deque()).append((self._added, tuple(tokens), drafter))
        self._scope_tokens[scope] = self._scope_tokens.get(scope, 0) + size
        self._tokens += size
        own = self._scopes[scope]
        while len(own) > self._max_sequences or self._scope_tokens[scope] > self._max_tokens:
            self._drop_oldest(scope)
        while self._tokens > self._max_total:
            most = max(self._scope_tokens.values())
            heaviest = [s for s, n in self._scope_tokens.items() if n == most]
            self._drop_oldest(min(heaviest, key=lambda s: self._scopes[s][0][0]))

    def _drop_oldest(self, scope: str) -> None:
        size = len(self._scopes[scope].popleft()[1])
        self._tokens -= size
        self._scope_tokens[scope] -= size
        if not self._scopes[scope]:
            del self._scopes[scope], self._scope_tokens[scope]

    def propose(
        self,
        tokens: Sequence[int],
        k: int,
        scope: str,
        suffixes: Suffixes | None = None,
        shortest: int | None = None,
        above: int = 0,
    ) -> Match:
        """The continuation of the longest suffix match in any of them of `scope` (the newest
        on a tie), if longer than `above`. `suffixes`: those of `tokens`, when the caller
        already has them; `shortest`: see `NgramDrafter.follow`."""
        own = self._scopes.get(scope)
        if not own:
            return _NO_MATCH
        if suffixes is None:  # every drafter here looks up the same sizes
            suffixes = own[0][2].suffixes(tokens)
        best = _NO_MATCH
        for _, source, drafter in reversed(own):
            found = drafter.follow(suffixes, source, tokens, k, shortest, max(above, best[0]))
            if found[0] > best[0] and found[1]:
                best = found
        return best

    def __len__(self) -> int:
        return sum(len(own) for own in self._scopes.values())

    @property
    def tokens(self) -> int:
        """Tokens kept over all scopes."""
        return self._tokens

    def held(self, scope: str) -> int:
        """How many sequences `scope` keeps."""
        return len(self._scopes.get(scope, ()))
