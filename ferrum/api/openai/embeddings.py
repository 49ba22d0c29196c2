"""Embeddings and rerank: `POST /v1/embeddings` (OpenAI's shape), `POST /v1/rerank` and
`/rerank` (the Jina/Cohere shape llama.cpp's server answers).

Rules:
- `input`: a string, a list of strings, a token array or a list of token arrays; at most
  `MAX_INPUTS` inputs (a 400 naming `input`), none empty. Texts are tokenized in a worker
  thread with the model's special tokens (BERT: [CLS] … [SEP]).
- An input longer than the model takes (`max_tokens`: 512 for BERT-like encoders) is a 400
  naming its index, unless `truncate: true` (an extension, as llama.cpp's server and Ollama
  offer), which keeps its first tokens and its last one (the [SEP] an encoder expects).
- Vectors are L2-normalised, as OpenAI's are. `dimensions` equal to the model's size is
  accepted; any other value is a 400 naming it: a model not trained for shorter vectors
  (Matryoshka) loses meaning when cut, and a GGUF does not say whether it was.
- `encoding_format: base64` sends each vector as little-endian float32 bytes in base64.
- Rerank: a cross-encoder (pooling `rank`) scores each (query, document) pair; a plain
  embedding model ranks by the cosine of query and document vectors, and the response says
  so (`"scoring": "cosine"`). A chat model that does not embed is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Annotated, Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import Field

from ferrum.api.hangups import unless_gone
from ferrum.api.loaded import Embedder, EmbeddingModel, Loaded
from ferrum.api.openai.bodies import _Body
from ferrum.api.serving import (
    ServerState,
    acquire,
    check_token_ids,
    refuse_unfit_text,
    utf8_length,
)
from ferrum.engine.contracts import Vocabulary
from ferrum.errors import InvalidRequest
from ferrum.models.registry import Lease

MAX_INPUTS = 2048  # OpenAI's own limit per request
Vector = npt.NDArray[np.float32]


class EmbeddingRequest(_Body):
    model: str = ""
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    truncate: bool = False  # extension: cut over-long inputs instead of refusing them
    keep_alive: str | float | None = None  # extension (Ollama's)


class RerankDocument(_Body):
    text: str


class RerankRequest(_Body):
    model: str = ""
    query: str
    documents: Annotated[list[str | RerankDocument], Field(min_length=1, max_length=MAX_INPUTS)]
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = False
    truncate: bool = False
    keep_alive: str | float | None = None


def embedder_of(lease: Lease[Loaded]) -> Embedder:
    """The lease's embedder; a chat model that does not embed is a 400 naming it."""
    model = lease.model
    embedder = model.embedder
    if embedder is None:
        raise InvalidRequest(
            f"model {lease.name!r} does not serve embeddings: serve an embedding model, or "
            "start the server with --pooling to embed with chat models",
            param="model",
        )
    return embedder


def _vocab(model: Loaded) -> Vocabulary:
    return model.vocab


def tokenize_inputs(
    vocab: Vocabulary, embedder: Embedder, raw: str | list[str] | list[int] | list[list[int]],
    truncate: bool, param: str = "input", max_inputs: int = MAX_INPUTS,
) -> list[list[int]]:
    """Every input as tokens, checked against the model's limits (worker thread)."""
    items = _items(raw)
    if not items:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    if len(items) > max_inputs:
        raise InvalidRequest(
            f"at most {max_inputs} inputs per request; got {len(items)}", param=param
        )
    facts = embedder.info
    out = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"{where} is an empty string", param=where)
            tokens = vocab.tokenize(
                bounded(vocab, item, facts.max_tokens, truncate, where), True, False
            )
        else:
            if not item:
                raise InvalidRequest(f"{where} is an empty token array", param=where)
            tokens = check_token_ids(facts.n_vocab, item, where)
        out.append(_fit(tokens, facts.max_tokens, truncate, where))
    return out


def _items(raw: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The inputs one by one: a string or a token array is one input."""
    if isinstance(raw, str):
        return [raw]
    ints = [x for x in raw if isinstance(x, int)]
    if raw and len(ints) == len(raw):
        return [ints]
    return [x for x in raw if not isinstance(x, int)]


def bounded(vocab: Vocabulary, text: str, limit: int, truncate: bool, where: str) -> str:
    """The text, or as much of it as `limit` tokens can come from, before it is tokenized:
    a text too long to fit is refused unless `truncate`, which cuts it instead (tokenizing
    megabytes to keep 512 tokens would take seconds). The cut keeps twice the bytes `limit`
    tokens can stand for (counted in characters, at least as many bytes), so the tokens kept
    from it are those the whole text begins with."""
    if not truncate:
        refuse_unfit_text(vocab, utf8_length(text), limit, where)
        return text
    return text[: 2 * limit * vocab.max_token_bytes()]


def _fit(tokens: list[int], limit: int, truncate: bool, where: str) -> list[int]:
    if len(tokens) <= limit:
        return tokens
    if not truncate:
        raise InvalidRequest(
            f"{where} has {len(tokens)} tokens, more than the model's {limit} "
            "(send truncate: true to cut it)",
            param=where,
            code="context_length_exceeded",
        )
    return tokens[: limit - 1] + tokens[-1:]  # keep the closing special token


def deadline(state: ServerState) -> float | None:
    """An embedding's deadline: the server's --request-timeout (0: none)."""
    return state.request_timeout if state.request_timeout > 0 else None


def normalised(v: Vector) -> Vector:
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


def _encode(v: Vector, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in v]


async def embed_texts(
    lease: Lease[Loaded],
    raw: str | list[str] | list[int] | list[list[int]],
    truncate: bool,
    http: Any,
    deadline: float | None,
    max_inputs: int = MAX_INPUTS,
) -> tuple[list[Vector], int]:
    """Normalised vectors for every input, and the number of tokens they took. A client that
    hangs up, or a passed `deadline` (seconds; a 408), cancels the embedding: the engine
    drops the inputs not yet decoded."""
    embedder = embedder_of(lease)
    tokens = await asyncio.to_thread(
        tokenize_inputs, _vocab(lease.model), embedder, raw, truncate, "input", max_inputs
    )
    vectors = await unless_gone(http, embedder.embed(tokens), deadline)
    _count(lease.model, len(tokens), sum(map(len, tokens)))
    return [normalised(v) for v in vectors], sum(map(len, tokens))


def _count(model: Loaded, inputs: int, tokens: int) -> None:
    model.metrics.on_embedding_request(inputs, tokens)


async def embeddings(state: ServerState, http: Any, body: EmbeddingRequest) -> dict[str, Any]:
    lease = await acquire(state, http, body.model, body.keep_alive)
    try:
        n_embd = embedder_of(lease).info.n_embd
        if body.dimensions is not None and body.dimensions != n_embd:
            raise InvalidRequest(
                f"model {lease.name!r} makes {n_embd}-dimensional vectors and was not trained "
                "for shorter ones; leave dimensions out or set it to "
                f"{n_embd}",
                param="dimensions",
            )
        vectors, n_tokens = await embed_texts(
            lease, body.input, body.truncate, http, deadline(state)
        )
    finally:
        lease.release()
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": lease.name,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }


async def rerank(state: ServerState, http: Any, body: RerankRequest) -> dict[str, Any]:
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    lease = await acquire(state, http, body.model, body.keep_alive)
    try:
        embedder = embedder_of(lease)
        if embedder.info.pooling == "rank":
            scores, n_tokens = await _cross_scores(
                lease, embedder, texts, body, http, deadline(state)
            )
            scoring = "cross-encoder"
        else:
            # The query rides along: MAX_INPUTS documents are one input more.
            vectors, n_tokens = await embed_texts(
                lease, [body.query, *texts], body.truncate, http, deadline(state), MAX_INPUTS + 1
            )
            scores = [float(np.dot(vectors[0], v)) for v in vectors[1:]]
            scoring = "cosine"
    finally:
        lease.release()
    order = sorted(range(len(texts)), key=lambda i: scores[i], reverse=True)
    results = []
    for i in order[: body.top_n or len(order)]:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": texts[i]}
        results.append(item)
    return {
        "object": "list",
        "model": lease.name,
        "scoring": scoring,
        "results": results,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }


async def _cross_scores(
    lease: Lease[Loaded],
    embedder: Embedder,
    texts: list[str],
    body: RerankRequest,
    http: Any,
    limit_s: float | None,
) -> tuple[list[float], int]:
    """One score per (query, document) pair, from a cross-encoder's rank pooling. A pair is
    the query with its special tokens, then the document without them, closed by the query's
    closing token ([CLS] query [SEP] document [SEP] for BERT-like rerankers)."""
    vocab = _vocab(lease.model)

    def pairs() -> list[list[int]]:
        limit = embedder.info.max_tokens
        q = vocab.tokenize(bounded(vocab, body.query, limit, body.truncate, "query"), True, False)
        out = []
        for i, text in enumerate(texts):
            text = bounded(vocab, text, limit, body.truncate, f"documents[{i}]")
            pair = q + vocab.tokenize(text, False, False) + q[-1:]
            out.append(_fit(pair, limit, body.truncate, f"documents[{i}]"))
        return out

    tokens = await asyncio.to_thread(pairs)
    outputs = await unless_gone(http, embedder.embed(tokens), limit_s)
    _count(lease.model, len(tokens), sum(map(len, tokens)))
    return [float(o[0]) for o in outputs], sum(map(len, tokens))


__all__ = ["EmbeddingModel", "EmbeddingRequest", "RerankRequest", "embeddings", "rerank"]
