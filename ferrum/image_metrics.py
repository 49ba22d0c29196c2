"""One model's image series (a room of their own: `metrics.py` is at its size limit).

Encodings are counted by the API as it prepares each request (the preparation thread,
`api/prompting/encoded_images.py`); image positions served from the prefix cache arrive
with the engine's finished requests (`Metrics.apply`). prometheus_client is thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from ferrum.engine.outputs import StepStats

_ENCODE_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30)


class ImageMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.encoded = Counter(
            "ferrum_images_encoded", "Images run through the vision projector", registry=r
        )
        self.encode_seconds = Histogram(
            "ferrum_image_encode_seconds",
            "Time the vision projector took to encode one image",
            buckets=_ENCODE_BUCKETS,
            registry=r,
        )
        self.encodings_reused = Counter(
            "ferrum_image_encodings_reused",
            "Images served a kept encoding of the same pixels instead of the projector",
            registry=r,
        )
        self.tokens_reused = Counter(
            "ferrum_image_tokens_reused",
            "Image positions of prompts whose KV came from the prefix cache (not decoded)",
            registry=r,
        )

    def on_encoded(self, seconds: float) -> None:
        self.encoded.inc()
        self.encode_seconds.observe(seconds)

    def on_encoding_reused(self) -> None:
        self.encodings_reused.inc()

    def count(self, stats: StepStats) -> None:
        reused = sum(f.cached_image_tokens for f in stats.finished)
        if reused:
            self.tokens_reused.inc(reused)
