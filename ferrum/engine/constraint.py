"""Structured output with llguidance: grammars from request fields, compiled once, one matcher
per constrained sequence.

    source (JSON Schema, regex, choice, Lark or GBNF) ──to_grammar──▶ llguidance grammar text
    grammar text ──Constraints.check (preparation thread)──▶ compiled matcher, kept by text
                                                              (with its uniqueItems rules)
    kept matcher ──Constraints.constraint (engine thread, a deep copy)──▶ Constraint, one a
                                                              sequence (and a UniqueWatch)

No llama.cpp here: a model's vocabulary builds the llguidance tokenizer (`engine/llama/vocab.py`
from llama.cpp's vocabulary, the tests' fake from bytes) and hands it to `Constraints`.

Compiling is the costly part (a large schema takes tens to hundreds of milliseconds, with the
GIL released), so it happens once per distinct grammar, in the preparation thread: the API
checks a grammar before the request is queued, and the engine thread only copies the kept
matcher. Each compile runs under `LIMITS` (grammar size, lexer states and fuel, Earley items per
step): a grammar past them is a ValueError naming what failed, never a stall. A mask that
would pass the per-step limits puts the matcher in its error state; the sampler then ends the
output (see `Constraint.allowed`).

Rules for a sampler using a Constraint: a token reaches `accept` only after `allows` said yes;
an end-of-generation token is allowed only when the grammar is complete (`is_accepting`) and
is never consumed (the output ends there).

JSON Schema's `uniqueItems`, which llguidance lacks, travels in the grammar text as rules
(`with_unique`, key UNIQUE_KEY, which llguidance ignores) and is enforced beside the matcher
by a `UniqueWatch` (`unique_items.py`): `allows` asks both, and a mask is the matcher's with
the tokens the watch refuses cleared (in Python, with the GIL, on the tokens that can matter).

Masks of one engine step come together: `allowed_together` fills the rows of every sequence
that needs one in a single call on llguidance's thread pool, without the GIL (the rows share
one bitmask array; the watches' part follows, one row at a time). A mask on SmolLM2's
vocabulary takes ~5-10 µs and handing rows to the pool ~15 µs, so a few rows keep the plain
call (which also runs without the GIL) one at a time.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from ferrum.engine.lru import SizedLRU
from ferrum.engine.unique_items import Rule, TokenKinds, UniqueWatch

# llguidance's own bounds, tightened where its defaults allow more than one request should
# cost: 250,000 lexer states is up to ~500 MB; 50,000 is ~100 MB at worst and far above what
# real schemas build (hundreds). The rest are its defaults, stated so they cannot drift.
LIMITS = dict(
    max_items_in_row=2_000,
    initial_lexer_fuel=1_000_000,  # ~20 ms of regex analysis
    step_lexer_fuel=200_000,  # ~15 ms a mask, at most
    step_max_items=50_000,
    max_lexer_states=50_000,
    max_grammar_size=500_000,
    verbose_errors=False,  # an error names the problem, not the parser's whole state
)
# Source text one grammar may have (regex, choice list, Lark, GBNF); JSON schemas are bounded
# by the API's schema_limits. Compile time grows with it.
MAX_SOURCE_BYTES = 128 * 1024
# How much of llguidance's message a client sees.
_MESSAGE_CHARS = 400
# Compiled matchers kept: by count and by an estimate of their memory (a compiled grammar
# holds its lexer and rules: a few hundred bytes a source character, measured coarsely).
_KEPT = 128
_BYTES_PER_CHAR = 256
_KEPT_BYTES = 256 * 1024 * 1024
# Whitespace between JSON tokens, bounded (llguidance's default allows any run) so that a model
# cannot run away in it: a space, or a newline and an indent.
_JSON_OPTIONS = {"whitespace_pattern": r"(?: |\n[ \t]{0,20})?"}
# Threads of the pool that fills a step's masks together. A step rarely has more rows needing a
# mask than this, and the pool runs while another model's decode may hold the cores.
_MASK_THREADS = 8
# Rows from which the pool is used: below, its hand-off costs more than the parallel fill saves.
TOGETHER_FROM = 4
# Where a grammar text carries its `uniqueItems` rules (unique_items.py) beside llguidance's own
# keys, which llguidance ignores.
UNIQUE_KEY = "x_ferrum_unique"
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_MAX_FORMATS_DROPPED = 32

KINDS = ("json_schema", "regex", "choice", "grammar")
# How a compile failure is counted (`refusal_reason`): llguidance's errors are text, so its
# own words for a keyword it cannot honour and for a limit passed are matched here, once.
_UNSUPPORTED = ("Unimplemented keys", "Unknown format")
_PAST_LIMITS = ("fuel", "limit", "exceeded", "too many", "too large", "too big")


def _limits() -> Any:
    return llguidance.LLParserLimits(**LIMITS)  # type: ignore[arg-type]


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MESSAGE_CHARS else message[:_MESSAGE_CHARS] + "…"


class TooLarge(ValueError):
    """A grammar source over MAX_SOURCE_BYTES."""


class Unenforceable(ValueError):
    """A keyword the engine cannot enforce where it stands (`where`: its place in the
    schema, ".properties.tags", "" at the root)."""

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where


def with_unique(grammar: str, rules: Sequence[dict[str, Any]]) -> str:
    """A grammar text that also carries `uniqueItems` rules (none: the text as it is)."""
    if not rules:
        return grammar
    return json.dumps({**json.loads(grammar), UNIQUE_KEY: list(rules)})


def rules_of(grammar: str) -> tuple[Rule, ...]:
    """The `uniqueItems` rules a grammar text carries (`with_unique`); none for any other
    text, whatever it contains; ValueError where a rule's pattern is not a regex."""
    if UNIQUE_KEY not in grammar:
        return ()
    try:
        data = json.loads(grammar)
    except ValueError:
        return ()
    rules = data.get(UNIQUE_KEY) if isinstance(data, dict) else None
    return tuple(Rule.from_json(r) for r in rules) if isinstance(rules, list) else ()


def refusal_reason(exc: Exception) -> str:
    """The metrics' reason for a grammar that failed `to_grammar` or `Constraints.check`:
    too_large, unsupported_keyword, compile_limits (one of `LIMITS` passed) or compile_error."""
    if isinstance(exc, TooLarge):
        return "too_large"
    if isinstance(exc, Unenforceable):
        return "unsupported_keyword"
    message = str(exc)
    if any(word in message for word in _UNSUPPORTED):
        return "unsupported_keyword"
    lowered = message.lower()
    if isinstance(exc, RecursionError) or any(word in lowered for word in _PAST_LIMITS):
        return "compile_limits"
    return "compile_error"


def to_grammar(kind: str, source: Any) -> str:
    """llguidance grammar text for a request's constraint; ValueError naming what is wrong
    (not yet compiled: `Constraints.check` does that against the model's tokenizer)."""
    if kind == "json_schema":
        return json_schema_grammar(source)
    text = source if isinstance(source, str) else json.dumps(source)
    if len(text) > MAX_SOURCE_BYTES:
        raise TooLarge(f"is {len(text)} bytes; at most {MAX_SOURCE_BYTES} are allowed")
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(text))
    if kind == "choice":
        if (
            not isinstance(source, list)
            or not source
            or not all(isinstance(c, str) for c in source)
        ):
            raise ValueError("must be a non-empty list of strings")
        lark = "start: " + " | ".join(json.dumps(c) for c in source)
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    if kind == "grammar":  # Lark as it is, GBNF (llama.cpp's) converted to Lark
        try:
            return str(llguidance.grammar_from("gbnf", text))
        except ValueError as exc:
            raise ValueError(_short(str(exc))) from exc
    raise ValueError(f"unknown grammar kind {kind!r}")


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of a JSON schema. A `format` llguidance does not know is an annotation (JSON
    Schema 2020-12 does not require a validator to enforce formats) and is left out; any other
    keyword it cannot honour stays and fails the compile, naming it."""
    for _ in range(_MAX_FORMATS_DROPPED):
        grammar = str(
            llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
        )
        found = _UNKNOWN_FORMAT.search(llguidance.LLMatcher.validate_grammar(grammar))
        if found is None:
            return grammar
        schema = _without_format(schema, found.group(1))
    return grammar


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark rule body that embeds a JSON schema (llguidance's `%json`), formats handled as
    in `json_schema_grammar`."""
    grammar = json.loads(json_schema_grammar(schema))
    embedded = grammar["grammars"][0].get("json_schema", schema)
    return "%json " + json.dumps(embedded)


def _without_format(node: Any, name: str) -> Any:
    if isinstance(node, dict):
        return {
            k: _without_format(v, name)
            for k, v in node.items()
            if not (k == "format" and v == name)
        }
    if isinstance(node, list):
        return [_without_format(v, name) for v in node]
    return node


class Constraints:
    """One model's compiled grammars: checked once, kept by text, copied per sequence;
    thread-safe (the lock guards only the cache; compiling runs outside it)."""

    def __init__(self, tokenizer: Any, end_tokens: Sequence[int], kept_bytes: int = _KEPT_BYTES):
        self.tokenizer = tokenizer
        self.n_vocab: int = tokenizer.vocab_size
        self.end_tokens = np.array(sorted(set(end_tokens)), dtype=np.int64)
        # Each grammar text's compiled matcher and its uniqueItems rules.
        self._kept: SizedLRU[str, tuple[Any, tuple[Rule, ...]]] = SizedLRU(_KEPT, kept_bytes)
        self._lock = threading.Lock()
        self.compile_s = 0.0  # seconds spent compiling, for the tests and metrics
        self._executor: Any = None  # the thread pool of `allowed_together`, made on first use
        self._token_bytes: list[bytes] | None = None  # for uniqueItems rules, made on first use
        self.token_kinds = TokenKinds.of([])  # which tokens hold a quote, a bracket, ...

    @property
    def executor(self) -> Any:
        """llguidance's thread pool for masks filled together (the engine thread's only)."""
        if self._executor is None:
            threads = max(1, min(_MASK_THREADS, os.cpu_count() or 1))
            self._executor = llguidance.LLExecutor(num_threads=threads)
        return self._executor

    def check(self, grammar: str) -> None:
        """ValueError naming why the grammar cannot be used; else it is kept compiled."""
        with self._lock:
            if self._kept.get(grammar) is not None:
                return
        start = time.monotonic()
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_limits())
        self.compile_s += time.monotonic() - start
        if matcher.is_error():
            raise ValueError(_short(matcher.get_error()))
        rules = rules_of(grammar)
        if rules:
            self._learn_token_bytes()
        with self._lock:
            self._kept.put(grammar, (matcher, rules), _BYTES_PER_CHAR * len(grammar))

    def _learn_token_bytes(self) -> None:
        """Every token's bytes (end tokens none), and which hold the bytes a uniqueItems watch
        reacts to (one pass over the vocabulary, in the preparation thread)."""
        with self._lock:
            if self._token_bytes is not None:
                return
        ends = set(int(t) for t in self.end_tokens)
        table = [
            b"" if t in ends else bytes(self.tokenizer.decode_bytes([t]))
            for t in range(self.n_vocab)
        ]
        kinds = TokenKinds.of(table)
        with self._lock:
            self.token_kinds = kinds
            self._token_bytes = table

    def token_bytes(self, token: int) -> bytes:
        assert self._token_bytes is not None, "learned when a grammar with rules was checked"
        return self._token_bytes[token] if token < len(self._token_bytes) else b""

    def constraint(self, grammar: str) -> Constraint:
        """A fresh matcher at the grammar's start for one sequence (compiled first if it was
        not kept)."""
        self.check(grammar)
        with self._lock:
            kept = self._kept.get(grammar)
        if kept is None:  # pushed out by other grammars in between
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_limits())
            kept = (matcher, rules_of(grammar))
            if kept[1]:
                self._learn_token_bytes()
        matcher, rules = kept
        return Constraint(matcher.deep_copy(), self, UniqueWatch(rules) if rules else None)

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return self._kept.total_bytes

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()


class Constraint:
    """One sequence's position in its grammar (and, for `uniqueItems`, in its JSON)."""

    def __init__(self, matcher: Any, constraints: Constraints, watch: UniqueWatch | None = None):
        self._matcher = matcher
        self._watch = watch
        self.owner = constraints
        self._end = constraints.end_tokens
        self._end_set = frozenset(int(t) for t in self._end)
        self._n_vocab = constraints.n_vocab
        self._bitmask = llnp.allocate_token_bitmask(1, self._n_vocab)
        self.mask_seconds: list[float] = []  # each mask's time, until the runner takes them

    def allows(self, token: int) -> bool:
        if token in self._end_set:
            return bool(self._matcher.is_accepting())
        if self._matcher.validate_tokens([token]) != 1:
            return False
        return self._watch is None or self._watch.admits(self.owner.token_bytes(token))

    def accept(self, token: int) -> None:
        """Advances past a token `allows` admitted (an end token is not consumed)."""
        if token not in self._end_set:
            self._matcher.consume_token(token)
            if self._watch is not None:
                self._watch.feed(self.owner.token_bytes(token))

    def allowed(self, n_vocab: int) -> np.ndarray:
        """Which of the first n_vocab tokens may come next (booleans); none when the matcher
        failed (a step limit passed), so the sampler ends the output."""
        start = time.perf_counter()
        llnp.fill_next_token_bitmask(self._matcher, self._bitmask)
        allowed = self._completed(_unpacked(self._bitmask, self._n_vocab, n_vocab)[0])
        self.mask_seconds.append(time.perf_counter() - start)
        return allowed

    def _completed(self, allowed: np.ndarray) -> np.ndarray:
        """A filled mask with the end tokens allowed where the grammar is complete."""
        ends = self._end[self._end < allowed.size]
        allowed[ends] = bool(self._matcher.is_accepting())
        if self._matcher.is_error():
            allowed[:] = False
        elif self._watch is not None:
            self._watch.refuse_in(allowed, self.owner.token_bytes, self.owner.token_kinds)
        return allowed


def _unpacked(bitmask: np.ndarray, n_grammar: int, n_vocab: int) -> np.ndarray:
    """A bitmask's rows as booleans, n_vocab each: tokens past the grammar's vocabulary (a
    llama.cpp vocabulary may be longer) are not allowed."""
    m = min(n_grammar, n_vocab)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=m, bitorder="little")
    if m < n_vocab:
        bits = np.pad(bits, ((0, 0), (0, n_vocab - m)))
    return bits.view(bool)


def allowed_together(
    constraints: Sequence[Constraint], n_vocab: int, pool_from: int = TOGETHER_FROM
) -> list[np.ndarray]:
    """Each constraint's `allowed`; from `pool_from` rows, the masks filled in one call on
    the owner's thread pool (the GIL released; the constraints must be distinct and share one
    `Constraints`). That call's time is shared equally among its rows, so the metrics count
    one mask a row and their summed time is the time spent."""
    if len(constraints) < max(2, pool_from):
        return [c.allowed(n_vocab) for c in constraints]
    owner = constraints[0].owner
    if any(c.owner is not owner for c in constraints) or len(set(map(id, constraints))) < len(
        constraints
    ):
        raise ValueError("masks filled together: distinct constraints of one model")
    start = time.perf_counter()
    bitmask = llnp.allocate_token_bitmask(len(constraints), owner.n_vocab)
    rows = [(c._matcher, k) for k, c in enumerate(constraints)]
    llnp.fill_next_token_bitmask_par(owner.executor, rows, bitmask)
    unpacked = _unpacked(bitmask, owner.n_vocab, n_vocab)
    masks = [c._completed(unpacked[k]) for k, c in enumerate(constraints)]
    share = (time.perf_counter() - start) / len(constraints)
    for c in constraints:
        c.mask_seconds.append(share)
    return masks
