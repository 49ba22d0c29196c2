"""Contracts between the engine and a runner (llama.cpp or the tests' fake).

Plain data and Protocols, no llama.cpp: the engine and the API depend on this file, never on
the runner module. The model is behind two objects with different owners:

    Vocabulary   read-only once loaded; any thread (the API's request preparation, the
                 engine's detokenizer): tokenizer, token bytes, end-of-generation, grammars
    Runner       the engine thread alone: context, batch, KV operations, sampling state

A runner keeps each request's sampling state (penalty history, RNG, grammar position) by
request id from `start_request` to `finish_request`; a batch item names the request whose
sampler picks the token at its last position.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ferrum.engine.request import AdapterSet, SamplingParams


@dataclass(slots=True)
class BatchItem:
    """Tokens of one sequence for one step; `sample_for` names the request whose sampler
    picks a token from the last position's logits (None: no token is sampled).

    With a draft, the last `draft` tokens are guesses (`speculation/`): the sampler picks
    at the last real token and at each guess in order while its pick equals the next guess;
    the positions of guesses it did not take are removed from the sequence.

    Every item of one step has the same `adapters` (LoRA set): llama.cpp applies one set to
    a whole decode.

    `embeds`: (offset into `tokens`, rows) for each run of image positions in the item: there
    the rows are decoded, not the placeholder tokens (`request.ImageSpan`)."""

    seq_id: int
    tokens: Sequence[int]
    start_pos: int
    sample_for: str | None = None
    draft: int = 0
    adapters: AdapterSet = ()
    embeds: tuple[tuple[int, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The model's log-probabilities at one sampled position (before any sampler setting)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


@dataclass
class StepResult:
    # item index → the tokens sampled: one, or the accepted guesses and the next token.
    sampled: dict[int, list[int]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)  # item index → reason
    # item index → logprobs of each sampled token
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    decode_calls: int = 0
    split_calls: int = 0  # calls made apart on purpose (a long prefill: `decode_parts.py`)
    faults_injected: int = 0  # "no KV slot" answers faked by --inject-faults
    decode_s: float = 0.0  # seconds inside llama_decode (0: not measured, as by test fakes)
    # Structured output: token masks computed (a constrained pick the grammar refused, or
    # logprobs asked), each one's seconds.
    mask_seconds: list[float] = field(default_factory=list)
    adapter_switches: int = 0  # decodes that changed the context's LoRA set


@dataclass(frozen=True)
class ModelInfo:
    path: str
    architecture: str
    description: str
    n_ctx: int
    n_ctx_train: int
    n_batch: int
    n_seq_max: int  # sequence ids the engine may use
    n_vocab: int
    n_swa: int
    threads: int
    is_recurrent: bool
    is_hybrid: bool
    chat_template: str | None
    bos_text: str
    eos_text: str
    add_bos: bool
    # What a saved sequence state depends on besides the model file: the llama.cpp build and
    # the KV settings (`tiers.model_fingerprint`).
    state_format: str = ""
    # The KV cache's cell types and flash attention (on, off, or auto: llama.cpp's choice),
    # and the bytes one cell takes over all layers at those types (0: not known).
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"
    kv_bytes_per_cell: int = 0
    vision: bool = False  # a projector is loaded: prompts may hold images
    # Its images attend to each other both ways (Gemma 3): each goes whole into one decode.
    images_whole: bool = False
    # The sliding-window layers' cache holds the windows only (not swa_full): a prefix copy
    # takes cells of its own (`KvOps.copy_own`), and where there are tiers a finished
    # sequence is saved there instead of parked, so that cache holds the running windows.
    own_copies: bool = False
    # A cell stream per sequence id (--kv-streams): cells are never shared, a prefix copy
    # takes cells of its own, and one sequence holds at most `n_ctx_seq` positions.
    kv_streams: bool = False
    n_ctx_seq: int = 0  # the most cells one sequence may hold (0: n_ctx, one pool)

    @property
    def request_ctx(self) -> int:
        """The context one request may fill (what the APIs report as its context length)."""
        return self.n_ctx_seq if self.kv_streams and self.n_ctx_seq else self.n_ctx


class Vocabulary(Protocol):
    """The model's tokenizer and grammar parser: read-only, safe from any thread."""

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes:
        """The token's bytes as output text: control tokens render as nothing."""
        ...

    def is_eog(self, token: int) -> bool: ...

    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for (its piece or, for a special token,
        its spelling): a text of more than n times this cannot tokenize into n tokens or fewer.
        Computed once per vocabulary."""
        ...

    def check_grammar(self, grammar: str) -> None:
        """ValueError naming why llguidance cannot compile the grammar text
        (`engine/constraint.py`); a compiled grammar is kept, so a request that uses it later
        is not compiled again."""
        ...


@dataclass(frozen=True)
class RgbImage:
    """A decoded image: width × height pixels, 3 bytes (R, G, B) each, rows top to bottom."""

    width: int
    height: int
    pixels: bytes

    @functools.cached_property
    def digest(self) -> bytes:
        """The image's identity: a hash of its size and pixels (what libmtmd's
        `mtmd_bitmap_set_id` names a bitmap by), whatever file or format it came in."""
        head = f"{self.width}x{self.height}:".encode()
        return hashlib.sha256(head + self.pixels).digest()


class ImageEncoder(Protocol):
    """A model's vision projector. Encoding is long CPU work: the preparation thread alone
    calls it, never the event loop or the engine's step."""

    def encode(self, image: RgbImage) -> list[list[int] | Any]:
        """The image as prompt pieces, in order: token lists (the model's image markers, if
        it has any) and float32 embedding arrays of shape (positions, n_embd)."""
        ...


class KvOps(Protocol):
    """The llama.cpp memory operations the KV ledger mirrors."""

    def clear_sequence(self, seq_id: int) -> None: ...

    def copy_sequence(self, src: int, dst: int, length: int) -> None: ...

    def trim_sequence(self, seq_id: int, length: int) -> None:
        """Keeps only positions [0, length) of seq_id (attention KV only)."""
        ...

    def checkpoint(self, src: int, length: int) -> bytearray | None:
        """The state of src's first `length` positions (restorable whole), or None where src
        no longer holds the sliding window position `length` attends to."""
        ...

    def copy_own(self, src: int, dst: int, length: int) -> bytearray | None:
        """dst (empty) gets cells of its own holding src's first `length` positions; returns
        dst's state then (a checkpoint of the prefix), or None, dst left empty, when llama.cpp
        refused it."""
        ...

    def holds_window(self, seq_id: int, length: int) -> bool:
        """Whether seq_id still holds every position a copy of its first `length` needs to
        attend from position `length` on (always, on a model without a sliding window)."""
        ...

    def save_sequence(self, seq_id: int) -> bytearray | None:
        """seq_id's whole state (KV cells, recurrent state) as bytes; None if there is none."""
        ...

    def restore_sequence(self, seq_id: int, state: bytearray) -> bool:
        """Puts a saved state back as seq_id (which holds nothing); False, leaving seq_id
        empty, when llama.cpp refuses it (no room, or a state of another shape)."""
        ...


class AdapterFiles(Protocol):
    """A model's LoRA adapters, loaded and freed on the engine thread while it serves."""

    def load(self, path: str) -> int:
        """The next id, for this file; ModelLoadError when llama.cpp refuses it (not an
        adapter, or one of another base model)."""
        ...

    def unload(self, adapter_id: int) -> None:
        """Frees the adapter; its id is never given again."""
        ...


class Runner(KvOps, Protocol):
    """The model's context on the engine thread: decoding, sampling state, KV operations."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def adapters(self) -> AdapterFiles | None: ...

    @property
    def vocab(self) -> Vocabulary: ...

    def start_request(self, request_id: str, params: SamplingParams) -> None:
        """Sampling state for a request; ValueError when its grammar cannot be parsed."""
        ...

    def finish_request(self, request_id: str) -> None:
        """Frees the request's sampling state (a no-op for an unknown id)."""
        ...

    def execute(self, items: Sequence[BatchItem]) -> StepResult:
        """Decodes all items in one step and samples where an item asks."""
        ...
