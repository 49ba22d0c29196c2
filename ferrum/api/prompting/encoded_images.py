"""A model's projector with its recent encodings kept, keyed by the image's pixels.

The same image sent again (a new question about it, the next turn of a chat that carries it)
is not encoded again: its pieces are kept under its digest (`RgbImage.digest`, its size and
pixels), least recently used first out, bounded in bytes. Its KV is reused by the prefix
cache on its own (the image's positions hold ids drawn from the same digest); this saves the
encoder's run, which the prompt needs before the prefix cache is even asked.

Only the preparation thread encodes; the lock keeps the cache whole if that ever changes.
Kept arrays are made read-only: every request that sends the image shares them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Protocol

import numpy as np

from ferrum.engine.contracts import ImageEncoder, RgbImage

ENCODED_BYTES = 64 * 1024 * 1024  # per model: ~25 images of 256 rows × 2,560 floats


class EncodeObserver(Protocol):
    def on_encoded(self, seconds: float) -> None:
        """An image went through the projector, taking `seconds`."""

    def on_encoding_reused(self) -> None:
        """An image's kept encoding served instead."""


class EncodedImages:
    """An `ImageEncoder` that encodes each distinct image once while its encoding is kept."""

    def __init__(
        self, encoder: ImageEncoder, observer: EncodeObserver, max_bytes: int = ENCODED_BYTES
    ):
        self._encoder, self._observer, self.max_bytes = encoder, observer, max_bytes
        self._kept: OrderedDict[bytes, tuple[list[list[int] | Any], int]] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    @property
    def kept(self) -> int:
        """How many images' encodings are kept (no `__len__`: an empty cache is no less an
        encoder, and `if model.images` must stay true)."""
        return len(self._kept)

    def encode(self, image: RgbImage) -> list[list[int] | Any]:
        key = image.digest
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
        if kept is not None:
            self._observer.on_encoding_reused()
            return list(kept[0])
        t0 = time.monotonic()
        pieces = self._encoder.encode(image)
        self._observer.on_encoded(time.monotonic() - t0)
        self._keep(key, pieces)
        return list(pieces)

    def _keep(self, key: bytes, pieces: list[list[int] | Any]) -> None:
        size = sum(p.nbytes if isinstance(p, np.ndarray) else 8 * len(p) for p in pieces)
        if size > self.max_bytes:
            return
        for p in pieces:
            if isinstance(p, np.ndarray):
                p.flags.writeable = False
        with self._lock:
            if key in self._kept:
                return  # encoded twice at once: one copy is enough
            self._kept[key] = (list(pieces), size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._kept.popitem(last=False)
                self.bytes -= dropped
