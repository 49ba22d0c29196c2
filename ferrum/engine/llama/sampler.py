"""llama.cpp sampling for one request: a sampler chain, an optional grammar, and logprobs.

The chain, in order:  [logit bias] [penalties]  greedy
                                              | top-k → top-p → min-p → temperature → dist
Logprobs are the model's own log-softmax at the sampled position, taken before any of these
settings change the logits, and computed only for requests that ask.

Constrained requests (structured output: JSON Schema, regex, choice, grammars) sample against
an llguidance matcher (`engine/constraint.py`), sample-then-check: the chain picks a token from
the unmasked logits and the matcher checks that one token (microseconds); only when it refuses
is the whole vocabulary's mask computed (~50 µs) and the chain run again over the allowed
tokens. A step's sampling comes in two halves (`Sampler.begin`, then `finish` for the picks
that wait for a mask) so that a runner fills all the masks of one step together
(`constraint.allowed_together`). A constrained request that asks for logprobs gets the mask at
every position, and its logprobs describe the distribution it was sampled from (the model's,
restricted to what the grammar allows). An end-of-generation token is allowed only once the
grammar is complete; when the grammar allows nothing (or its matcher failed a step limit) the
output ends.

This module, the runner and the vocabulary are the only ones that import llama_cpp.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import llama_cpp as ll
import numpy as np

from ferrum.engine.constraint import Constraint
from ferrum.engine.contracts import TokenLogprobs
from ferrum.engine.llama.vocab import LlamaVocab
from ferrum.engine.request import SamplingParams

_PENALTY_LAST_N = 64
_BAN_BIAS = -100.0  # OpenAI's convention: a bias of -100 bans the token
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(ll.llama_token_data)


# llama_get_logits_ith returning the row's address as an int: the binding's float pointer is
# an object built per call, and numpy's view of it another (~40 µs a sample, run right after a
# decode has emptied the CPU's caches). A sampler keeps one view per row address instead.
_logits_address = ll.llama_cpp._lib["llama_get_logits_ith"]  # a function object of our own
_logits_address.argtypes = [ctypes.c_void_p, ctypes.c_int32]
_logits_address.restype = ctypes.c_void_p
_MAX_VIEWS = 64  # row addresses a sampler remembers (llama.cpp keeps its buffer between decodes)


def _chain(params: SamplingParams, n_vocab: int) -> Any:
    chain_params = ll.llama_sampler_chain_default_params()
    chain_params.no_perf = True
    chain = ll.llama_sampler_chain_init(chain_params)
    add = ll.llama_sampler_chain_add
    if params.logit_bias:
        biases = (ll.llama_logit_bias * len(params.logit_bias))()
        for i, (token, bias) in enumerate(params.logit_bias):
            biases[i].token = ll.llama_token(token)
            biases[i].bias = -np.inf if bias <= _BAN_BIAS else bias
        add(chain, ll.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
    if (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    ):
        add(
            chain,
            ll.llama_sampler_init_penalties(
                n_vocab,
                _PENALTY_LAST_N,
                params.repetition_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            ),
        )
    if params.greedy:
        add(chain, ll.llama_sampler_init_greedy())
        return chain
    if params.top_k > 0:
        add(chain, ll.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        add(chain, ll.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        add(chain, ll.llama_sampler_init_min_p(params.min_p, 1))
    add(chain, ll.llama_sampler_init_temp(params.temperature))
    seed = ll.LLAMA_DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF
    add(chain, ll.llama_sampler_init_dist(seed))
    return chain


@dataclass(eq=False)
class Pick:
    """One position's sampling between `Sampler.begin` and `Sampler.finish`: its token once
    taken, else the constraint whose mask it waits for."""

    logits: np.ndarray  # llama.cpp's row, valid until the next decode
    n_vocab: int
    token: int = -1
    logprobs: TokenLogprobs | None = None
    waits: Constraint | None = None
    dist: _Distribution | None = None


class Sampler:
    """One request's sampling state: penalty history, RNG, grammar position, token count."""

    def __init__(self, params: SamplingParams, vocab: LlamaVocab):
        n_vocab = self._n_vocab = vocab.n_vocab
        end_tokens = vocab.end_tokens()
        self._num_logprobs = params.logprobs
        self._min_tokens = params.min_tokens
        self._sampled = 0
        # Tokens that would end the output; banned while fewer than min_tokens were sampled.
        self._early_ban = np.array(
            sorted(set(end_tokens) | set(params.stop_token_ids)), dtype=np.int64
        )
        self._end_token = end_tokens[0] if end_tokens else 0
        self._candidates: np.ndarray | None = None
        self._views: dict[int, np.ndarray] = {}
        self._constraint: Constraint | None = None
        self._chain = _chain(params, n_vocab)
        # Only penalty samplers remember accepted tokens (greedy and dist keep no history).
        self._stateless_chain = (
            params.repetition_penalty == 1.0
            and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0
        )
        # Plain greedy: numpy's argmax picks what llama.cpp's greedy sampler would (the first
        # of equal maxima) without building a candidate array over the whole vocabulary.
        self._plain_greedy = params.greedy and not params.logit_bias and self._stateless_chain
        if params.grammar is not None:
            try:
                self._constraint = vocab.constraint(params.grammar)
            except ValueError:
                self.close()
                raise

    def _logits(self, ctx: Any, index: int) -> np.ndarray:
        """The logits of batch position `index`: llama.cpp's own buffer, valid until the next
        decode (a view is only ever used for the address llama.cpp has just given)."""
        address = _logits_address(ctx, index)
        if not address:
            raise ValueError(f"llama.cpp has no logits at batch position {index}")
        view = self._views.get(address)
        if view is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            row = (ctypes.c_float * self._n_vocab).from_address(address)
            view = self._views[address] = np.frombuffer(memoryview(row), dtype=np.float32)
        return view

    def begin(self, ctx: Any, index: int) -> Pick:
        """Samples batch position `index` as far as it goes without a mask: done when free or
        when the grammar allows the chain's pick; else the pick waits for its constraint's
        mask (a refusal, or logprobs asked: they describe the masked distribution), and
        `finish` completes it. A runner fills the masks of all waiting picks together."""
        pick = Pick(self._logits(ctx, index), self._n_vocab)
        constraint = self._constraint
        if constraint is not None and self._num_logprobs is not None:
            pick.waits = constraint
            return pick
        if self._num_logprobs is not None:
            # Logprobs describe the model, read before the ban below edits the logits.
            pick.dist = _Distribution(pick.logits, self._num_logprobs)
        self._ban_early_end(pick.logits)
        token = self._pick(ctx, index, pick.logits)
        if constraint is not None and not constraint.allows(token):
            pick.waits = constraint
            return pick
        self._take(pick, token)
        return pick

    def finish(self, pick: Pick, allowed: np.ndarray) -> None:
        """Samples a waiting pick again, over the tokens its mask allows."""
        if self._num_logprobs is not None:  # nothing was done in `begin`
            described = np.where(allowed, pick.logits, -np.inf)
            pick.dist = _Distribution(described, self._num_logprobs)
            self._ban_early_end(pick.logits)
        pick.waits = None
        self._take(pick, self._masked(pick.logits, allowed))

    def _ban_early_end(self, logits: np.ndarray) -> None:
        if self._sampled < self._min_tokens and self._early_ban.size:
            logits[self._early_ban] = -np.inf  # llama.cpp's own logits buffer, read after

    def _pick(self, ctx: Any, index: int, logits: np.ndarray) -> int:
        """The chain's token from the unmasked logits (not accepted into a stateful chain)."""
        if self._plain_greedy:
            return int(np.argmax(logits))
        if self._stateless_chain:
            # Fast path in C; the chain's accept of a token changes nothing.
            return int(ll.llama_sampler_sample(self._chain, ctx, index))
        if self._constraint is None:
            return int(ll.llama_sampler_sample(self._chain, ctx, index))
        return self._apply([self._chain], logits)

    def _masked(self, logits: np.ndarray, allowed: np.ndarray) -> int | None:
        """The chain's token among the allowed ones; None when the grammar admits nothing.
        Greedy picks what it would have picked had every position been masked; sampling draws
        from the allowed tokens as the chain would (temperature, top-k/p after the mask)."""
        ids = np.flatnonzero(allowed & np.isfinite(logits))
        if not ids.size:
            return None
        if self._plain_greedy:
            token = int(ids[np.argmax(logits[ids])])
        else:
            token = self._apply([self._chain], logits, ids)
        return token if allowed[token] else None

    def _take(self, pick: Pick, token: int | None) -> None:
        """The pick's token (the end where the grammar admits nothing), accepted into the
        matcher and into a chain that remembers tokens."""
        if token is None:
            token = self._end_token
        elif self._constraint is not None:
            self._constraint.accept(token)
            if not self._stateless_chain:
                ll.llama_sampler_accept(self._chain, token)
        pick.token = token
        pick.logprobs = None if pick.dist is None else pick.dist.describe(token)
        self._sampled += 1

    def take_mask_seconds(self) -> list[float]:
        """The seconds of each mask computed since the last call (for the metrics)."""
        if self._constraint is None or not self._constraint.mask_seconds:
            return []
        taken, self._constraint.mask_seconds = self._constraint.mask_seconds, []
        return taken

    def _apply(self, samplers: list[Any], logits: np.ndarray, ids: np.ndarray | None = None) -> int:
        """Runs samplers over the candidates (every token, or `ids`) without accepting."""
        n = self._n_vocab if ids is None else ids.size
        if self._candidates is None:
            self._candidates = np.empty(self._n_vocab, dtype=_TOKEN_DATA)
        cur = self._candidates[:n]
        cur["id"] = np.arange(n, dtype=np.int32) if ids is None else ids
        cur["logit"] = logits if ids is None else logits[ids]
        cur["p"] = 0.0
        data = ctypes.cast(cur.ctypes.data, ctypes.POINTER(ll.llama_token_data))
        arr = ll.llama_token_data_array(data, n, -1, False)
        for s in samplers:
            ll.llama_sampler_apply(s, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            return self._end_token
        return int(arr.data[arr.selected].id)

    def close(self) -> None:
        if self._chain is not None:
            ll.llama_sampler_free(self._chain)  # a chain frees every sampler added to it
            self._chain = None
        self._constraint = None


class _Distribution:
    """What logprobs need from one position's logits, taken before anything edits them."""

    def __init__(self, logits: np.ndarray, k: int):
        peak = float(logits.max())
        self._log_norm = peak + float(np.log(np.exp(logits - peak).sum(dtype=np.float64)))
        self._logits = logits
        self._top: tuple[tuple[int, float], ...] = ()
        if k > 0:
            k = min(k, logits.size)
            best = np.argpartition(logits, -k)[-k:]
            best = best[np.argsort(-logits[best], kind="stable")]
            self._top = tuple((int(t), float(logits[t]) - self._log_norm) for t in best)

    def describe(self, token: int) -> TokenLogprobs:
        for t, logprob in self._top:
            if t == token:
                return TokenLogprobs(token, logprob, self._top)
        return TokenLogprobs(token, float(self._logits[token]) - self._log_norm, self._top)
