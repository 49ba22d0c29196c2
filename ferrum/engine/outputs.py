"""What the engine reports: per-request output deltas and per-step statistics.

Plain dataclasses, so the API and metrics layers depend on this file and not on the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum.engine.kv.tiers import TierStats
from ferrum.engine.request import FinishReason
from ferrum.errors import EngineError


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """One output token: its share of the output text and the model's log-probabilities."""

    token: int
    text: str
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


@dataclass(slots=True)
class RequestOutput:
    """One step's news for one request. `finished` outputs are always the last."""

    request_id: str
    content: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: EngineError | None = None  # why an ERROR finish happened
    stop_string: str | None = None  # the stop string that ended a STOP finish, if one did
    logprobs: list[LogprobEntry] | None = None  # None unless the request asked for them


@dataclass(slots=True)
class FinishedRequest:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    ttft_s: float | None
    cached_tokens: int = 0
    adapters: tuple[int, ...] = ()  # the ids of the LoRA adapters it decoded with
    cached_image_tokens: int = 0  # of cached_tokens, those at image positions


@dataclass(slots=True)
class StepStats:
    num_tokens: int = 0
    num_sequences: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    decode_failures: int = 0
    decode_retries: int = 0  # extra llama_decode calls after "no KV slot" split a batch
    faults_injected: int = 0  # "no KV slot" answers faked by --inject-faults (testing aid)
    draft_sequences: int = 0  # sequences that carried a guess this step (speculation)
    draft_tokens: int = 0  # guessed tokens verified this step
    draft_accepted: int = 0  # of those, the ones kept
    step_s: float = 0.0
    kv_usage: float = 0.0
    kv_blocks_total: int = 0
    kv_bytes_used: int = 0  # cells of the blocks in use × bytes per cell at the KV types
    kv_bytes_total: int = 0
    parked_sequences: int = 0
    parked_blocks: int = 0
    evictions_total: int = 0
    window_fallbacks_total: int = 0  # copies refused for a sliding window with holes
    tiers: TierStats | None = None  # saved prefixes in RAM and on disk (None: no tiers)
    queue_depth: int = 0
    active_requests: int = 0
    ttfts: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    mask_seconds: list[float] = field(default_factory=list)  # structured output's token masks
    finished: list[FinishedRequest] = field(default_factory=list)
    adapters: tuple[int, ...] = ()  # the ids of the LoRA set this step decoded with
    adapter_switches: int = 0  # 1 when that set differs from the last step's


class EngineObserver:
    """Receives statistics on the engine thread; the default does nothing."""

    def on_step(self, stats: StepStats) -> None:  # pragma: no cover - interface
        pass
