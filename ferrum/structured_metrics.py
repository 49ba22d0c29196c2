"""One model's structured-output series (a room of their own: `metrics.py` is at its size
limit). Constrained requests and refusals are counted by the API as it builds each request's
grammar (a worker thread); masks arrive with the engine's step statistics (`Metrics.apply`).
prometheus_client is thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

_MASK_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)


class StructuredMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "ferrum_structured_requests",
            "Requests constrained by a grammar, by kind (json_schema, regex, choice, grammar, "
            "tool_call)",
            ["kind"],
            registry=r,
        )
        self.refusals = Counter(
            "ferrum_structured_refusals",
            "Constraints refused with a 400 before any decode, by reason",
            ["reason"],
            registry=r,
        )
        self.masks = Counter(
            "ferrum_structured_masks",
            "Token masks computed for structured output (a pick the grammar refused, or "
            "logprobs asked)",
            registry=r,
        )
        self.mask_seconds = Histogram(
            "ferrum_structured_mask_seconds",
            "Time to compute one structured-output token mask",
            buckets=_MASK_BUCKETS,
            registry=r,
        )

    def on_constraint(self, kind: str) -> None:
        """A request accepted with a grammar of this kind."""
        self.requests.labels(kind=kind).inc()

    def on_refusal(self, reason: str) -> None:
        """A constraint refused (the request got a 400) for this reason."""
        self.refusals.labels(reason=reason).inc()

    def count_masks(self, seconds: Sequence[float]) -> None:
        if seconds:
            self.masks.inc(len(seconds))
            for t in seconds:
                self.mask_seconds.observe(t)
