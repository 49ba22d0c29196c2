"""The server's metrics: every model's `Metrics` with a `model` label on each sample, beside
the model registry's own series (loaded models, loads, unloads by reason, load seconds); and
a cluster's replicas' /metrics merged with a `replica` label."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ferrum.metrics import Metrics

_LOAD_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class _Relabelled(Collector):
    """Families gathered from several sources, each sample labelled with its source's name:
    the models of this server (their registries) or the replicas of a cluster (their parsed
    /metrics text)."""

    def __init__(self, label: str, sources: Callable[[], Iterable[tuple[str, Iterable[Metric]]]]):
        self._label, self._sources = label, sources

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for source, found in self._sources():
            for family in found:
                out = families.get(family.name)
                if out is None:
                    out = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = out
                for sample in family.samples:
                    labels = {**sample.labels, self._label: source}
                    out.samples.append(sample._replace(labels=labels))
        yield from families.values()


def merge_replica_metrics(texts: dict[str, str]) -> bytes:
    """Several replicas' /metrics as one exposition, every sample labelled `replica`."""

    def parsed() -> Iterator[tuple[str, Iterable[Metric]]]:
        for name, text in texts.items():
            yield name, text_string_to_metric_families(text)

    registry = CollectorRegistry()
    registry.register(_Relabelled("replica", parsed))
    return generate_latest(registry)


class ServerMetrics:
    """The server's metrics: one `Metrics` per model and the registry's own series. It is
    the registry's observer (`ferrum.models.registry.RegistryObserver`)."""

    def __init__(self) -> None:
        self._models: dict[str, Metrics] = {}
        self.registry = CollectorRegistry()
        self.registry.register(_Relabelled("model", self._model_families))
        r = self.registry
        self.loaded = Gauge("ferrum_models_loaded", "Models loaded now", registry=r)
        self.loads = Counter("ferrum_model_loads", "Model loads", ["model"], registry=r)
        self.unloads = Counter(
            "ferrum_model_unloads",
            "Model unloads, by reason (expired, evicted, requested, deleted, shutdown)",
            ["model", "reason"],
            registry=r,
        )
        self.load_seconds = Histogram(
            "ferrum_model_load_seconds",
            "Seconds a model took to load",
            ["model"],
            buckets=_LOAD_BUCKETS,
            registry=r,
        )

    def _model_families(self) -> Iterator[tuple[str, Iterable[Metric]]]:
        for name, metrics in list(self._models.items()):
            yield name, metrics.collect()

    def for_model(self, name: str) -> Metrics:
        if name not in self._models:
            self._models[name] = Metrics()
        return self._models[name]

    def on_load(self, name: str, seconds: float) -> None:
        self.loads.labels(model=name).inc()
        self.load_seconds.labels(model=name).observe(seconds)

    def on_unload(self, name: str, reason: str) -> None:
        self.unloads.labels(model=name, reason=reason).inc()
        if name in self._models:
            self._models[name].idle()

    def on_loaded_count(self, n: int) -> None:
        self.loaded.set(n)

    def snapshot(self, name: str) -> dict[str, Any]:
        metrics = self.for_model(name)
        return {**metrics.snapshot(), "lora": metrics.adapters.snapshot()}

    def render(self) -> bytes:
        return generate_latest(self.registry)
