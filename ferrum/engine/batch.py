"""Contracts between the engine and a runner (llama.cpp or the tests' fake).

Plain data, no llama.cpp: the engine depends on this file, never on the runner module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class BatchItem:
    """Tokens of one sequence for one step; `sampler` set when the last token is sampled."""

    seq_id: int
    tokens: Sequence[int]
    start_pos: int
    sampler: Any = None  # the runner's sampler object


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The model's log-probabilities at one sampled position (before any sampler setting)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


@dataclass
class StepResult:
    sampled: dict[int, int] = field(default_factory=dict)  # item index → token
    failed: dict[int, str] = field(default_factory=dict)  # item index → reason
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # item index → logprobs
    decode_calls: int = 0
    faults_injected: int = 0  # "no KV slot" answers faked by --inject-faults


@dataclass(frozen=True)
class ModelInfo:
    path: str
    architecture: str
    description: str
    n_ctx: int
    n_ctx_train: int
    n_batch: int
    n_seq_max: int
    n_vocab: int
    n_swa: int
    threads: int
    is_recurrent: bool
    is_hybrid: bool
    chat_template: str | None
    bos_text: str
    eos_text: str
    add_bos: bool
