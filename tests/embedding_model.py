"""all-MiniLM-L6-v2 for embedding tests: its GGUF (ferrum/bench/minilm.py converts the real
weights) and an independent numpy oracle.

* `write_minilm_gguf` - the model as llama.cpp's "bert" architecture loads it.
* `reference_embeddings` - the oracle: the HF tokenizer (`tokenizers`, from tokenizer.json)
  and a numpy forward pass of the encoder, mean-pooled and L2-normalised, as
  sentence-transformers runs this model (modules: Transformer, Pooling(mean), Normalize).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ferrum.bench.minilm import read, read_json, weights, write_minilm_gguf

__all__ = ["reference_embeddings", "reference_token_ids", "write_minilm_gguf"]


# -- numpy reference -------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _tokenizer():  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(read("tokenizer.json").decode())
    # tokenizer.json pads and truncates to 128 tokens; the oracle must see every token.
    tok.no_padding()
    tok.no_truncation()
    return tok


def reference_token_ids(text: str) -> list[int]:
    """The HF tokenizer's ids for text, with [CLS] and [SEP]."""
    return list(_tokenizer().encode(text).ids)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz & Stegun 7.1.26, |error| < 1.5e-7: HF's "gelu" is the exact (erf) GELU.
    a = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (a[0] + t * (a[1] + t * (a[2] + t * (a[3] + t * a[4]))))
    return np.sign(x) * (1.0 - poly * np.exp(-x * x))


def _dense(x: np.ndarray, name: str) -> np.ndarray:
    w = weights()
    return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]


def _norm(x: np.ndarray, name: str, eps: float) -> np.ndarray:
    w = weights()
    return _layer_norm(x, w[f"{name}.weight"], w[f"{name}.bias"], eps)


def _attention(x: np.ndarray, layer: str, n_head: int) -> np.ndarray:
    """Bidirectional multi-head self-attention over one sequence (no mask: no padding)."""
    n = len(x)
    q, k, v = (
        _dense(x, f"{layer}attention.self.{m}").reshape(n, n_head, -1).transpose(1, 0, 2)
        for m in ("query", "key", "value")
    )
    scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return _dense((probs @ v).transpose(1, 0, 2).reshape(n, -1), f"{layer}attention.output.dense")


def _encode(ids: list[int]) -> np.ndarray:
    """The BERT encoder's last hidden state for one sequence, shape (tokens, hidden)."""
    cfg, w = read_json("config.json"), weights()
    eps = cfg["layer_norm_eps"]
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][: len(ids)]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = _norm(x, "embeddings.LayerNorm", eps)
    for i in range(cfg["num_hidden_layers"]):
        layer = f"encoder.layer.{i}."
        x = _attention(x, layer, cfg["num_attention_heads"]) + x
        x = _norm(x, f"{layer}attention.output.LayerNorm", eps)
        h = _dense(x, f"{layer}intermediate.dense")
        h = 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))
        x = _norm(_dense(h, f"{layer}output.dense") + x, f"{layer}output.LayerNorm", eps)
    return x


def reference_embeddings(texts: list[str]) -> np.ndarray:
    """sentence-transformers' embeddings of texts, shape (len(texts), 384), unit length:
    the mean of the last hidden state over every token (no padding: one text at a time)."""
    pooled = np.stack([_encode(reference_token_ids(t)).mean(0) for t in texts])
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
