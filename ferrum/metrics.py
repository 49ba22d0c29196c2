"""Prometheus metrics of one model, fed by its engine's per-step statistics.

One `Metrics` per model name (kept across its loads and unloads, so counters never go back);
`ferrum.server_metrics` renders them all with a `model` label. No module-level globals, so
tests can run several servers in one process. `Metrics.on_step` runs on an engine thread;
prometheus_client is thread-safe.

An engine steps every few milliseconds. Putting each step into prometheus_client (a lock per
series, label lookups, histogram buckets) took ~0.1 ms of Python right after each decode, when
little of it is left in the CPU's caches: 1% of a one-stream step on this project's host. So
`on_step` only queues a step, and the queue is applied in one go: when a request finishes,
every quarter second, and before anything reads the metrics (a scrape, /health), which
therefore never see less than what the engine has published.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from ferrum.adapter_metrics import AdapterSeries
from ferrum.engine.kv.tiers import TierStats
from ferrum.engine.outputs import EngineObserver, StepStats
from ferrum.engine.turns import Party
from ferrum.image_metrics import ImageMetrics
from ferrum.structured_metrics import StructuredMetrics

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)

CONTENT_TYPE = CONTENT_TYPE_LATEST
_APPLY_S = 0.25  # longest a published step waits to reach the series
_TIER_EVENTS = ("saves", "restores", "restored_tokens", "failures", "write_failures",
                "files_dropped")  # fmt: skip


def _tier_snapshot(tiers: TierStats | None) -> dict[str, Any]:
    """The tiers as /health shows them (zeros when the model has none: /health adds up the
    snapshots of every loaded model)."""
    tiers = tiers or TierStats()
    out: dict[str, Any] = {event: getattr(tiers, event) for event in _TIER_EVENTS}
    for tier in ("ram", "disk"):
        c = getattr(tiers, tier)
        out[tier] = {
            "entries": c.entries,
            "bytes": c.bytes,
            "hits": c.hits,
            "restore_seconds": round(c.restore_seconds, 6),
        }
    return out


class _TurnTotals(Collector):
    """A model's engines' turns at the cores (`turns.Party`'s running totals), read at each
    scrape rather than counted a step: the engine thread pays nothing for them. A reload
    brings new parties; the old ones' totals are kept, so the counters never go back."""

    _FAMILIES = (
        ("ferrum_engine_turns", "Turns taken at the cores (a turn's laps count as turns)"),
        ("ferrum_engine_turn_seconds", "Seconds the engine held the cores"),
        ("ferrum_engine_turn_wait_seconds", "Seconds the engine waited for another's turn"),
    )

    def __init__(self) -> None:
        self._parties: dict[str, Party] = {}
        self._before: dict[str, tuple[float, float, float]] = {}

    def watch(self, engine: str, party: Party) -> None:
        old = self._parties.get(engine)
        if old is not None and old is not party:
            self._before[engine] = self._totals(engine)
        self._parties[engine] = party

    def _totals(self, engine: str) -> tuple[float, float, float]:
        p = self._parties[engine]
        before = self._before.get(engine, (0, 0.0, 0.0))
        return before[0] + p.turns_taken, before[1] + p.held_s, before[2] + p.waited_s

    def collect(self) -> Iterable[Metric]:
        if not self._parties:
            return
        families = [CounterMetricFamily(n, doc, labels=["engine"]) for n, doc in self._FAMILIES]
        for engine in list(self._parties):
            for family, value in zip(families, self._totals(engine), strict=True):
                family.add_metric([engine], value)
        yield from families


class Metrics(EngineObserver):
    def __init__(self) -> None:
        self._last = StepStats()
        self._kv_types: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pending: list[StepStats] = []
        self._apply_at = 0.0
        # Plain copies of three counters for /health (prometheus_client has no public getter).
        self._prefix_totals = {"hits": 0, "misses": 0, "saved_tokens": 0}
        self._spec_totals = {"verifications": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self.registry = CollectorRegistry()
        self._add_request_metrics(self.registry)
        self._add_engine_metrics(self.registry)
        self._add_prefix_metrics(self.registry)
        self._add_embedding_metrics(self.registry)
        self.structured = StructuredMetrics(self.registry)
        self.images = ImageMetrics(self.registry)
        self._turns = _TurnTotals()
        self.registry.register(self._turns)
        self.adapters = AdapterSeries(self.registry)  # by LoRA adapter

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "ferrum_requests", "Finished requests", ["finish_reason"], registry=r
        )
        self.tokens_generated = Counter(
            "ferrum_tokens_generated", "Generated (output) tokens", registry=r
        )
        self.prompt_tokens = Counter(
            "ferrum_prompt_tokens", "Prompt tokens prefilled by the engine", registry=r
        )
        self.latency = Histogram(
            "ferrum_request_latency_seconds",
            "Arrival to finish",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "ferrum_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "ferrum_inter_token_latency_seconds",
            "Gap between a request's tokens",
            buckets=_ITL_BUCKETS,
            registry=r,
        )

    def _add_engine_metrics(self, r: CollectorRegistry) -> None:
        self.step_tokens = Histogram(
            "ferrum_step_tokens",
            "Tokens decoded per llama_decode step (batching at work)",
            buckets=_STEP_TOKEN_BUCKETS,
            registry=r,
        )
        self.step_sequences = Histogram(
            "ferrum_step_sequences",
            "Sequences per llama_decode step",
            buckets=_STEP_TOKEN_BUCKETS[:8],
            registry=r,
        )
        self.kv_usage = Gauge("ferrum_kv_cache_usage_ratio", "KV blocks in use / total", registry=r)
        self.kv_bytes = Gauge(
            "ferrum_kv_cache_bytes",
            "Bytes of the KV blocks in use, at the cache's cell types",
            registry=r,
        )
        self.kv_types = Gauge(
            "ferrum_kv_cache_type_info",
            "The KV cache's cell types and flash attention (1 for the current ones)",
            ["type_k", "type_v", "flash_attn"],
            registry=r,
        )
        self.queue_depth = Gauge("ferrum_queue_depth", "Requests waiting for admission", registry=r)
        self.active = Gauge("ferrum_active_requests", "Requests admitted and running", registry=r)
        self.preemptions = Counter(
            "ferrum_preemptions", "Requests preempted for KV space (recomputed later)", registry=r
        )
        self.decode_failures = Counter(
            "ferrum_decode_failures", "Requests failed by llama_decode errors", registry=r
        )
        self.decode_retries = Counter(
            "ferrum_decode_retries",
            "Extra llama_decode calls after a batch found no KV slot",
            registry=r,
        )
        self.faults_injected = Counter(
            "ferrum_faults_injected",
            "'No KV slot' answers faked by --inject-faults (a testing aid)",
            registry=r,
        )
        self._add_spec_metrics(r)

    def _add_spec_metrics(self, r: CollectorRegistry) -> None:
        self.spec_verifications = Counter(
            "ferrum_spec_verifications",
            "Decodes of a sequence that carried guessed tokens (n-gram speculation)",
            registry=r,
        )
        self.spec_drafted = Counter("ferrum_spec_draft_tokens", "Guessed tokens verified",
                                    registry=r)  # fmt: skip
        self.spec_accepted = Counter(
            "ferrum_spec_accepted_tokens",
            "Guessed tokens kept (acceptance rate: this over draft tokens; tokens per "
            "verification: (this + verifications) over verifications)",
            registry=r,
        )

    def _add_prefix_metrics(self, r: CollectorRegistry) -> None:
        self.prefix_hits = Counter(
            "ferrum_prefix_cache_hits", "Requests that reused a resident prefix", registry=r
        )
        self.prefix_misses = Counter(
            "ferrum_prefix_cache_misses", "Requests that prefilled from scratch", registry=r
        )
        self.prefix_saved = Counter(
            "ferrum_prefix_cache_saved_tokens",
            "Prompt tokens reused instead of computed",
            registry=r,
        )
        self.prefix_evictions = Counter(
            "ferrum_prefix_cache_evictions", "Parked sequences evicted for room", registry=r
        )
        self.window_fallbacks = Counter(
            "ferrum_prefix_cache_window_fallbacks",
            "Admissions that could not copy their longest match: its donor had lost part of "
            "the sliding window (another owner or a fresh prefill served them)",
            registry=r,
        )
        self.parked = Gauge(
            "ferrum_prefix_cache_parked_sequences",
            "Finished sequences kept for reuse",
            registry=r,
        )
        self.parked_blocks = Gauge(
            "ferrum_prefix_cache_blocks", "KV blocks held by parked sequences", registry=r
        )
        self._add_tier_metrics(r)

    def _add_tier_metrics(self, r: CollectorRegistry) -> None:
        self.tier_entries = Gauge(
            "ferrum_prefix_tier_entries", "Saved prefix states per tier", ["tier"], registry=r
        )
        self.tier_bytes = Gauge(
            "ferrum_prefix_tier_bytes", "Bytes of saved prefix states per tier", ["tier"],
            registry=r,
        )  # fmt: skip
        self.tier_hits = Counter(
            "ferrum_prefix_tier_hits",
            "Admissions that restored a saved state, by the tier it came from",
            ["tier"],
            registry=r,
        )
        self.tier_restore_seconds = Counter(
            "ferrum_prefix_tier_restore_seconds",
            "Seconds spent reading states from disk (disk) and putting them back (ram)",
            ["tier"],
            registry=r,
        )
        self.tier_events = Counter(
            "ferrum_prefix_tier_events",
            "saves (evicted states kept), restores, restored_tokens, failures (a load or "
            "restore refused: prefilled instead), write_failures (kept in RAM only), files_dropped "
            "(disk files of another model, build or KV settings, deleted at start)",
            ["event"],
            registry=r,
        )

    def watch_turns(self, engine: str, party: Party) -> None:
        """Shows `party`'s turns as this model's `engine` ("chat", "embeddings")."""
        self._turns.watch(engine, party)

    def on_step(self, stats: StepStats) -> None:
        """Queues one engine step's statistics; they reach the series at the next `apply`:
        when a request finishes, every _APPLY_S, and before the metrics are read."""
        with self._lock:
            self._pending.append(stats)
        if stats.finished or time.monotonic() >= self._apply_at:
            self.apply()

    def apply(self) -> None:
        """Puts the queued steps into the series: each one's counts and observations, the
        gauges as of the last one."""
        with self._lock:
            pending, self._pending = self._pending, []
            for stats in pending:
                self._count(stats)
            if pending:
                self._gauges(pending[-1])
            self._apply_at = time.monotonic() + _APPLY_S

    def collect(self) -> Iterable[Metric]:
        """The series, every queued step applied."""
        self.apply()
        return self.registry.collect()

    def _count(self, stats: StepStats) -> None:
        self.adapters.count(stats)
        if stats.num_tokens:
            self.step_tokens.observe(stats.num_tokens)
            self.step_sequences.observe(stats.num_sequences)
        if stats.generated_tokens:
            self.tokens_generated.inc(stats.generated_tokens)
        if stats.prompt_tokens_computed:
            self.prompt_tokens.inc(stats.prompt_tokens_computed)
        if stats.preemptions:
            self.preemptions.inc(stats.preemptions)
        if stats.decode_retries:
            self.decode_retries.inc(stats.decode_retries)
        if stats.decode_failures:
            self.decode_failures.inc(stats.decode_failures)
        if stats.faults_injected:
            self.faults_injected.inc(stats.faults_injected)
        if stats.draft_sequences:
            self.spec_verifications.inc(stats.draft_sequences)
            self.spec_drafted.inc(stats.draft_tokens)
            self.spec_accepted.inc(stats.draft_accepted)
            spec = self._spec_totals
            spec["verifications"] += stats.draft_sequences
            spec["draft_tokens"] += stats.draft_tokens
            spec["accepted_tokens"] += stats.draft_accepted
        for t in stats.ttfts:
            self.ttft.observe(t)
        for t in stats.inter_token_latencies:
            self.itl.observe(t)
        self.structured.count_masks(stats.mask_seconds)
        self.images.count(stats)
        for f in stats.finished:
            self.requests.labels(finish_reason=f.finish_reason.value).inc()
            self.latency.observe(f.latency_s)
            totals = self._prefix_totals
            if f.cached_tokens:
                self.prefix_hits.inc()
                self.prefix_saved.inc(f.cached_tokens)
                totals["hits"] += 1
                totals["saved_tokens"] += f.cached_tokens
            else:
                self.prefix_misses.inc()
                totals["misses"] += 1

    def set_kv_types(self, type_k: str, type_v: str, flash_attn: str) -> None:
        """The types the model's KV cache was created with (at each load)."""
        self.kv_types.clear()
        self.kv_types.labels(type_k=type_k, type_v=type_v, flash_attn=flash_attn).set(1)
        self._kv_types = {"type_k": type_k, "type_v": type_v, "flash_attn": flash_attn}

    def _gauges(self, stats: StepStats) -> None:
        self.kv_usage.set(stats.kv_usage)
        self.kv_bytes.set(stats.kv_bytes_used)
        self.queue_depth.set(stats.queue_depth)
        self.active.set(stats.active_requests)
        self.parked.set(stats.parked_sequences)
        self.parked_blocks.set(stats.parked_blocks)
        if stats.evictions_total > self._last.evictions_total:
            self.prefix_evictions.inc(stats.evictions_total - self._last.evictions_total)
        if stats.window_fallbacks_total > self._last.window_fallbacks_total:
            self.window_fallbacks.inc(
                stats.window_fallbacks_total - self._last.window_fallbacks_total
            )
        if stats.tiers is not None:
            self._tiers(stats.tiers, self._last.tiers or TierStats())
        self._last = stats

    def _tiers(self, now: TierStats, before: TierStats) -> None:
        for tier in ("ram", "disk"):
            counts, old = getattr(now, tier), getattr(before, tier)
            self.tier_entries.labels(tier=tier).set(counts.entries)
            self.tier_bytes.labels(tier=tier).set(counts.bytes)
            if counts.hits > old.hits:
                self.tier_hits.labels(tier=tier).inc(counts.hits - old.hits)
            if counts.restore_seconds > old.restore_seconds:
                seconds = counts.restore_seconds - old.restore_seconds
                self.tier_restore_seconds.labels(tier=tier).inc(seconds)
        for event in _TIER_EVENTS:
            grew = getattr(now, event) - getattr(before, event)
            if grew > 0:
                self.tier_events.labels(event=event).inc(grew)

    def snapshot(self) -> dict[str, Any]:
        """The gauges as of the last engine step, for /health."""
        self.apply()
        last = self._last
        return {
            "kv_cache_usage_ratio": round(last.kv_usage, 6),
            "kv_blocks_total": last.kv_blocks_total,
            "kv_cache_bytes": last.kv_bytes_used,
            "kv_cache_bytes_total": last.kv_bytes_total,
            "kv_cache_types": dict(self._kv_types),
            "queue_depth": last.queue_depth,
            "active_requests": last.active_requests,
            "prefix_cache": {
                "parked_sequences": last.parked_sequences,
                "blocks": last.parked_blocks,
                "evictions": last.evictions_total,
                "window_fallbacks": last.window_fallbacks_total,
                **self._prefix_totals,
                "tiers": _tier_snapshot(last.tiers),
            },
            "speculation": dict(self._spec_totals),
        }

    def render(self) -> bytes:
        self.apply()
        return generate_latest(self.registry)

    def _add_embedding_metrics(self, r: CollectorRegistry) -> None:
        self.embedding_requests = Counter(
            "ferrum_embedding_requests", "Embedding and rerank requests answered", registry=r
        )
        self.embedding_inputs = Counter(
            "ferrum_embedding_inputs", "Inputs embedded (texts, token arrays, pairs)", registry=r
        )
        self.embedding_tokens = Counter(
            "ferrum_embedding_tokens", "Tokens of the inputs embedded", registry=r
        )
        self.embedding_batch_inputs = Histogram(
            "ferrum_embedding_batch_inputs",
            "Inputs per embedding decode (batching across requests at work)",
            buckets=_STEP_TOKEN_BUCKETS,
            registry=r,
        )
        self.embedding_batch_seconds = Histogram(
            "ferrum_embedding_batch_seconds",
            "Seconds one embedding decode took",
            buckets=_ITL_BUCKETS,
            registry=r,
        )

    def on_embedding_request(self, inputs: int, tokens: int) -> None:
        self.embedding_requests.inc()
        self.embedding_inputs.inc(inputs)
        self.embedding_tokens.inc(tokens)

    def on_embedding_batch(self, inputs: int, tokens: int, seconds: float) -> None:
        """Called on the embedding engine's thread after each decode."""
        self.embedding_batch_inputs.observe(inputs)
        self.embedding_batch_seconds.observe(seconds)

    def idle(self) -> None:
        """The gauges of a model that was unloaded: nothing running, nothing held."""
        self.on_step(StepStats())
