"""A model's projector with its recent encodings kept, keyed by the caller's cache scope and
the image's pixels.

The same image sent again (a new question about it, the next turn of a chat that carries it)
is not encoded again: its pieces are kept under (scope, digest) (`RgbImage.digest`, its size
and pixels), bounded in bytes. Its KV is reused by the prefix cache on its own (the image's
positions hold ids drawn from the same digest); this saves the encoder's run, which the
prompt needs before the prefix cache is even asked.

Rules:
- Reuse never crosses cache scopes (`ferrum.api.auth.cache_scope`, the scope the prefix
  cache gives the request's KV): a kept encoding answers faster than an encoder's run, so
  one key would otherwise learn by timing that another sent the same image. Callers that
  share a scope (`--share-prefix-cache`, a shared `cache_salt`, a server without keys) share
  encodings as they share KV. The LoRA set, which splits KV, does not split encodings: the
  projector's output does not depend on it, and the caller is the same.
- The byte bound is one for all scopes; past it, the entry to go is the least recently used
  of the scope holding the most bytes (ties: the one whose entry is oldest), the rule of the
  responses store (`ferrum.api.responses.store`). So a key sending a flood of images evicts
  its own once it holds the most, and a scope is trimmed only while no other holds more:
  another key's flood cannot empty it. A lone scope still has the whole budget (a cap per
  scope, say half, would halve a one-key server's cache). The rule is per scope, not per
  key: a key spreading images over many `cache_salt`s counts as many scopes, and at equal
  shares the oldest entry goes. What a key can still learn by timing is the volume others
  keep (whether its own image outlived a flood), never which images.

Only the preparation thread encodes; the lock keeps the cache whole if that ever changes.
Kept arrays are made read-only: every request of the scope that sends the image shares them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ferrum.engine.contracts import ImageEncoder, RgbImage

ENCODED_BYTES = 64 * 1024 * 1024  # per model: ~25 images of 256 rows × 2,560 floats

Pieces = list[list[int] | Any]


class EncodeObserver(Protocol):
    def on_encoded(self, seconds: float) -> None:
        """An image went through the projector, taking `seconds`."""

    def on_encoding_reused(self) -> None:
        """An image's kept encoding served instead."""


class EncodedImages:
    """Encodes each distinct image once per cache scope while its encoding is kept. Not an
    `ImageEncoder` itself: a request encodes through `scoped(its scope)`, so no caller can
    forget whose cache it reads."""

    def __init__(
        self, encoder: ImageEncoder, observer: EncodeObserver, max_bytes: int = ENCODED_BYTES
    ):
        self._encoder, self._observer, self.max_bytes = encoder, observer, max_bytes
        # (scope, digest) → (pieces, bytes), least recently used first across all scopes
        self._kept: OrderedDict[tuple[str, bytes], tuple[Pieces, int]] = OrderedDict()
        self._scope_bytes: dict[str, int] = {}  # only scopes holding some
        self.bytes = 0
        self._lock = threading.Lock()

    @property
    def kept(self) -> int:
        """How many images' encodings are kept (no `__len__`: an empty cache is no less an
        encoder, and `if model.images` must stay true)."""
        return len(self._kept)

    def scope_bytes(self, scope: str) -> int:
        return self._scope_bytes.get(scope, 0)

    def scoped(self, scope: str) -> ImageEncoder:
        """The encoder for requests of `scope`."""
        return ScopedEncoder(self, scope)

    def encode(self, image: RgbImage, scope: str) -> Pieces:
        key = (scope, image.digest)
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

    def _keep(self, key: tuple[str, bytes], pieces: Pieces) -> None:
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
            self._count(key[0], size)
            while self.bytes > self.max_bytes:
                self._evict_one()

    def _count(self, scope: str, size: int) -> None:
        self.bytes += size
        held = self._scope_bytes.get(scope, 0) + size
        if held:
            self._scope_bytes[scope] = held
        else:
            del self._scope_bytes[scope]

    def _evict_one(self) -> None:
        """The least recently used entry of the scope holding the most bytes."""
        most = max(self._scope_bytes.values())
        key = next(k for k in self._kept if self._scope_bytes[k[0]] == most)
        _, size = self._kept.pop(key)
        self._count(key[0], -size)


@dataclass(frozen=True)
class ScopedEncoder:
    """`EncodedImages` as one cache scope's `ImageEncoder`."""

    images: EncodedImages
    scope: str

    def encode(self, image: RgbImage) -> Pieces:
        return self.images.encode(image, self.scope)
