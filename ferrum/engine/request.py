"""A request as the engine sees it: token ids, sampling parameters and one progress counter.

Progress is a single counter, `num_computed_tokens`, against `num_tokens` (prompt + output).
There are no separate prefill/decode phases: a request with many uncomputed tokens is
prefilling, one with exactly one (the last sampled token) is decoding.

    all_token_ids:  [ p0 p1 p2 ... p(P-1) | o0 o1 ... o(k-1) ]
                      prompt (P tokens)     output (k tokens)
    KV resident:    [ 0 ........ num_computed_tokens )
    next chunk:     [ num_computed_tokens ... num_tokens )   ← scheduled under the step budget
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from ferrum.engine.kv.ledger import PageTable

# LoRA adapters a request decodes with: (adapter id, scale) pairs sorted by id, no zero
# scale; () is the base model. KV computed under one set is wrong under another.
AdapterSet = tuple[tuple[int, float], ...]


def adapter_scope(adapters: AdapterSet) -> str:
    """The part of a cache scope that keeps one adapter set's KV from every other set's."""
    return "" if not adapters else "|lora:" + ",".join(f"{i}*{s!r}" for i, s in adapters)


def image_token_ids(digest: bytes, n: int) -> list[int]:
    """The ids an image's `n` positions hold in a prompt: drawn from the image's `digest`
    (`RgbImage.digest`, its pixels), so the prefix index's block hashes and its token-by-token
    check tell one image from another, and the same image anywhere matches itself. Negative,
    so no vocabulary's token is ever one (they are never decoded as tokens: the image's rows
    are), and within int32 (the disk tier stores tokens so): one in [-2**31, -1] each, 31
    bits of the digest's stream per position, so two images match only where all of them do.
    """
    stream = hashlib.shake_256(digest).digest(4 * n)
    return [-1 - (int.from_bytes(stream[4 * i : 4 * i + 4], "little") & 0x7FFF_FFFF)
            for i in range(n)]  # fmt: skip


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """An image in a prompt: its projector's embeddings (float32 rows of the model's width,
    one per position) stand at prompt positions [start, start + len(embeds)); the prompt
    holds the image's ids there (`image_token_ids`), which are never decoded as tokens.

        prompt:  t0 t1 t2 [ ■  ■  ■  ■ ] t7 t8      ■ = image position, id < 0
                           start ─────▶ start + len(embeds)
    """

    start: int
    embeds: Any  # numpy float32 array, shape (positions, n_embd)

    @property
    def end(self) -> int:
        return self.start + len(self.embeds)


class FinishReason(enum.StrEnum):
    """Maps one to one onto OpenAI `finish_reason` (abort and error never reach a client)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; validated by the API before they get here."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Extensions beyond the sampler settings above:
    stop_token_ids: tuple[int, ...] = ()  # generating one of these ends the output (not shown)
    min_tokens: int = 0  # end-of-generation and stop tokens are banned until this many
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias); -100 or less bans
    logprobs: int | None = None  # None: none; k ≥ 0: the sampled token's and k alternatives
    grammar: str | None = None  # llguidance grammar text the output must match (constraint.py)
    speculate: bool | None = None  # n-gram speculation for this request; None: the server's
    # Whose prefix KV the request may reuse and leaves for reuse: only requests of the same
    # scope share cached prefixes (resident, RAM or disk), so one key cannot read another's
    # prompt from cached_tokens or timing. "" is one scope like any other.
    cache_scope: str = ""
    # Whom the request's decode slot counts against when slots are shared out fairly.
    tenant: str = ""
    # The LoRA adapters it decodes with (`AdapterSet`); each step decodes one set.
    adapters: AdapterSet = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    seq_id: int | None = None
    page_table: PageTable = field(default_factory=PageTable)
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Prompt positions whose KV was reused from another sequence instead of computed (at
    # its first admission: a resumed request's own KV is not a cache hit).
    num_cached_tokens: int = 0
    admitted: bool = False
    # Output tokens it had at its latest admission: how long it has run since (fairness).
    output_at_admission: int = 0
    images: tuple[ImageSpan, ...] = ()  # in prompt order, never overlapping
    # Prompt positions where later requests are likely to part from this one (where a
    # client's string starts: `ChatFormatter.tokenize_parts`); the window-sized cache keeps
    # its state there (`KVManager.computed`).
    checkpoints: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        self._check_image_ids()

    def _check_image_ids(self) -> None:
        """Image positions hold image ids (< 0) and no other position does: a token there
        would let a text prompt match an image's KV, an id elsewhere would reach llama_decode."""
        prompt, inside = self.prompt_token_ids, 0
        for span in self.images:  # never overlapping
            if span.end > len(prompt) or max(prompt[span.start : span.end], default=-1) >= 0:
                raise ValueError("an image's positions must hold its ids (< 0)")
            inside += span.end - span.start
        if prompt and min(prompt) < 0 and sum(t < 0 for t in prompt) != inside:
            raise ValueError("a prompt holds ids < 0 outside its images")

    @property
    def cache_scope(self) -> str:
        """Whose cached prefixes the request may reuse (its owner scope in the prefix index):
        the caller's scope and the adapter set, so KV never crosses adapter sets."""
        return self.params.cache_scope + adapter_scope(self.params.adapters)

    @property
    def adapters(self) -> AdapterSet:
        return self.params.adapters

    def reuse_floor(self, length: int) -> int:
        """The most of `length` reused positions it may take: an image is reused whole or not
        at all (back to the image's start; under a non-causal projector an image's first
        rows' KV depends on its last ones):

            prompt:   t t [■ ■ ■ ■ ■ ■] t t
            match:    |<-------->|            ends inside the image
            reused:   |<->|                   the image is computed whole
        """
        for span in self.images:
            if span.start < length < span.end:
                return span.start
        return length

    @property
    def cached_image_tokens(self) -> int:
        """Image positions among its reused ones (`num_cached_tokens`)."""
        n = self.num_cached_tokens
        return sum(max(0, min(n, span.end) - span.start) for span in self.images)

    def embeds_in(self, start: int, length: int) -> tuple[tuple[int, Any], ...]:
        """The image rows at positions [start, start + length): (offset from start, rows)."""
        runs = []
        for span in self.images:
            lo, hi = max(start, span.start), min(start + length, span.end)
            if lo < hi:
                runs.append((lo - start, span.embeds[lo - span.start : hi - span.start]))
        return tuple(runs)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
