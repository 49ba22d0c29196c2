"""One model's LoRA adapter series: requests and generated tokens by adapter, steps by
adapter set, and switches of set; read at each scrape from plain counts that `Metrics`
keeps as it applies the engine's steps (under its lock).

Labels are adapter names, never scales: scales are the requests' own numbers, and a series
per value would let any client grow /metrics without bound. A request that decodes with
several adapters counts under each of them; the base is the adapter "". The `adapters` label
of the steps joins a set's names with "+"; past `MAX_SETS` distinct sets the rest count as
"other" (a client may combine the ids it likes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from ferrum.engine.outputs import StepStats
from ferrum.models.adapters import LoraAdapter

MAX_SETS = 64


class AdapterSeries(Collector):
    def __init__(self, registry: CollectorRegistry) -> None:
        self._adapters: tuple[LoraAdapter, ...] = ()
        self.requests: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        self.switches = 0
        registry.register(self)

    def name(self, adapters: Sequence[LoraAdapter]) -> None:
        """The model's adapters, in id order (at each load, and when one is added or
        removed while it serves)."""
        self._adapters = tuple(adapters)

    def _label(self, i: int) -> str:
        return self._adapters[i].name if 0 <= i < len(self._adapters) else f"#{i}"

    def count(self, stats: StepStats) -> None:
        if stats.num_tokens:
            label = "+".join(self._label(i) for i in stats.adapters)
            if label not in self.steps and len(self.steps) >= MAX_SETS:
                label = "other"
            self.steps[label] = self.steps.get(label, 0) + 1
        self.switches += stats.adapter_switches
        for f in stats.finished:
            for label in [self._label(i) for i in f.adapters] or [""]:
                self.requests[label] = self.requests.get(label, 0) + 1
                self.tokens[label] = self.tokens.get(label, 0) + f.completion_tokens

    def collect(self) -> Iterable[Metric]:
        if not self._adapters and not self.switches:
            return  # a model without adapters: no series to show
        families = (
            ("ferrum_adapter_requests", "Finished requests by LoRA adapter", self.requests),
            ("ferrum_adapter_tokens_generated", "Generated tokens by LoRA adapter", self.tokens),
        )
        for name, doc, counts in families:
            family = CounterMetricFamily(name, doc, labels=["adapter"])
            for label, n in list(counts.items()):
                family.add_metric([label], n)
            yield family
        steps = CounterMetricFamily(
            "ferrum_adapter_steps", "Engine steps by the LoRA set they decoded", labels=["adapters"]
        )
        for label, n in list(self.steps.items()):
            steps.add_metric([label], n)
        yield steps
        yield CounterMetricFamily(
            "ferrum_adapter_switches", "Steps whose LoRA set differed from the last step's",
            value=self.switches,
        )  # fmt: skip

    def snapshot(self) -> dict[str, Any]:
        """The model's adapters and their counts, for /health."""
        listed = [
            {
                "id": i,
                "name": a.name,
                "requests": self.requests.get(a.name, 0),
                "generated_tokens": self.tokens.get(a.name, 0),
            }
            for i, a in enumerate(self._adapters)
            if not a.removed
        ]
        base = {"requests": self.requests.get("", 0), "generated_tokens": self.tokens.get("", 0)}
        return {"adapters": listed, "base": base, "switches": self.switches}
