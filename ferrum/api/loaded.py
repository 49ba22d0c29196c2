"""What a loaded model is, as the API sees it: a chat model (`ServedModel`: its generation
engine, template and grammars, maybe an embedder too) or an embedding model
(`EmbeddingModel`). The registry holds either (`Loaded`); each route asks for the kind it
serves and refuses the other with a 400 naming the model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ferrum.api.prompting.chat_template import ChatFormatter
from ferrum.api.prompting.encoded_images import EncodedImages
from ferrum.api.prompting.grammar import GrammarBuilder
from ferrum.api.prompting.preparation import Preparer
from ferrum.engine.async_engine import AsyncEngine
from ferrum.engine.contracts import ModelInfo, Vocabulary
from ferrum.metrics import Metrics
from ferrum.models.adapters import LoraAdapter


@dataclass
class ServedModel:
    """One loaded model as the API sees it: its engine and what prepares its requests."""

    name: str
    engine: AsyncEngine
    vocab: Vocabulary  # read-only: safe in the worker threads that prepare requests
    info: ModelInfo
    formatter: ChatFormatter
    metrics: Metrics
    default_max_tokens: int = -1  # --n-predict: max_tokens when a request gives none
    sampling: dict[str, float | int] = dataclasses.field(default_factory=dict)  # preset's
    system: str = ""  # the preset's system prompt, for chats that bring none
    close_runner: Callable[[], None] = lambda: None  # after the engine has stopped
    embedder: Embedder | None = None  # a chat model that embeds too (--pooling)
    # Where its requests are prepared: the server's one preparer, in turns with its engines.
    preparer: Preparer = dataclasses.field(default_factory=lambda: Preparer(None))
    adapters: tuple[LoraAdapter, ...] = ()  # its LoRA adapters, in id order
    images: EncodedImages | None = None  # its vision projector; None: it takes no images
    grammars: GrammarBuilder = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.grammars = GrammarBuilder(self.vocab, self.metrics.structured)
        self.metrics.adapters.name(self.adapters)

    def set_adapters(self, adapters: tuple[LoraAdapter, ...]) -> None:
        """Its adapters after one was loaded, unloaded or rescaled while it serves."""
        self.adapters = adapters
        self.metrics.adapters.name(adapters)

    @property
    def alive(self) -> bool:
        return self.engine.alive and (self.embedder is None or self.embedder.alive)


class EmbeddingFacts(Protocol):
    """What the API needs to know of an embedding model."""

    @property
    def n_embd(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...  # the longest input
    @property
    def pooling(self) -> str: ...  # mean, cls, last, rank or none
    @property
    def n_vocab(self) -> int: ...
    @property
    def architecture(self) -> str: ...
    @property
    def description(self) -> str: ...


class Embedder(Protocol):
    """An embedding engine: inputs of many requests batched into the same decodes, on the
    thread that owns its llama.cpp context (`ferrum.engine.embedding.EmbeddingEngine`)."""

    @property
    def info(self) -> EmbeddingFacts: ...
    @property
    def alive(self) -> bool: ...
    def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def embed(self, inputs: list[list[int]]) -> list[npt.NDArray[np.float32]]: ...


@dataclass
class EmbeddingModel:
    """A loaded embedding model (an encoder, or a model whose GGUF states its pooling): it
    answers /v1/embeddings, /v1/rerank and /api/embed, never a chat."""

    name: str
    embedder: Embedder
    vocab: Vocabulary
    metrics: Metrics
    close_runner: Callable[[], None] = lambda: None

    @property
    def alive(self) -> bool:
        return self.embedder.alive


Loaded = ServedModel | EmbeddingModel


def context_length(model: Loaded) -> int:
    """The context one request may fill, as every API reports it: a chat model's per request
    (a stream with --kv-streams), an embedding model's longest input."""
    if isinstance(model, ServedModel):
        return model.info.request_ctx
    return model.embedder.info.max_tokens
