"""Tiny random-weight GGUF models for engine tests.

The engine tests need real llama.cpp models (tokenizer, KV cache, recurrent
state, chat template) but must never download anything. These helpers write
deterministic, sub-megabyte GGUF files that llama.cpp loads and decodes in
milliseconds:

* ``write_tiny_llama`` - a dense 2-layer llama (GQA attention) with a ChatML
  chat template.
* ``write_tiny_mamba`` - a 2-layer Mamba-1 recurrent model, no chat template.
* ``write_tiny_lora`` - a LoRA adapter of the tiny llama (rank 4 on q, v and ffn_up), and
  ``write_tiny_llama(path, merge=...)`` the same llama with an adapter's scaled B·A added to
  its weights: the oracle an adapter applied at decode time must equal.
* ``write_tiny_gemma3`` - a 2-layer Gemma 3 whose first layer has a sliding window of
  8 positions (the real one: 512 on 5 of 6 layers), so window cells are recycled within
  a few dozen tokens.

Both share a byte-level BPE ("gpt2") tokenizer, so any UTF-8 text round-trips
through tokenize/detokenize. The weights are random, so the generated text is
gibberish; only its mechanics are meaningful.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from functools import lru_cache
from itertools import pairwise

import gguf
import numpy as np

SEED = 1234
N_EMBD = 64
N_LAYER = 2
CONTEXT_LENGTH = 2048
RMS_EPS = 1e-5

PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(5)
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Merges are derived from these words (with and without a leading space), so
# common English text compresses a little instead of falling back to bytes.
COMMON_WORDS = """
the of and to in is it that was for on are as with his they at be this have
from or one had by word but not what all were we when your can said there use
an each which she do how their if will up other about out many then them these
so some her would make like him into time has look two more write go see number
no way could people my than first water been call who oil its now find long
down day did get come made may part hello world test token model text chat
ing ed er es ly tion ment ness able
"""


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table, as llama.cpp expects."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _encode(text: str) -> list[str]:
    """Split text into byte-level symbols (one mapped character per byte)."""
    table = _byte_to_unicode()
    return [table[b] for b in text.encode("utf-8")]


def _apply_merges(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Plain BPE: repeatedly merge the adjacent pair with the lowest rank."""
    while True:
        pairs = [(ranks[pair], i) for i, pair in enumerate(pairwise(symbols)) if pair in ranks]
        if not pairs:
            return symbols
        _, i = min(pairs)
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]


@lru_cache(maxsize=1)
def _build_vocab() -> tuple[list[str], list[int], list[str]]:
    """Return (tokens, token_types, merges) for the shared BPE tokenizer."""
    tokens = list(SPECIAL_TOKENS)
    types = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
    # GPT-2 byte tokens are NORMAL, not BYTE: for BPE vocabs llama.cpp
    # expects BYTE tokens to be spelled SPM-style ("<0x41>").
    tokens += [_byte_to_unicode()[b] for b in range(256)]
    types += [gguf.TokenType.NORMAL] * 256

    # Each word ends up as a single token: tokenize it with the merges so far,
    # then chain-merge the leftover pieces. New merges rank after all older
    # ones, so they never change how earlier words tokenize.
    ranks: dict[tuple[str, str], int] = {}
    known = set(tokens)
    for word in COMMON_WORDS.split():
        for variant in (" " + word, word):
            left, *rest = _apply_merges(_encode(variant), ranks)
            for right in rest:
                ranks[(left, right)] = len(ranks)
                left += right
                if left not in known:
                    tokens.append(left)
                    types.append(gguf.TokenType.NORMAL)
                    known.add(left)
    merges = [f"{left} {right}" for left, right in ranks]
    return tokens, [int(t) for t in types], merges


def _add_tokenizer(writer: gguf.GGUFWriter, chat_template: str | None) -> None:
    tokens, types, merges = _build_vocab()
    writer.add_tokenizer_model("gpt2")
    # "qwen2" pre-tokenization keeps clean_up_tokenization_spaces off, so
    # detokenize(tokenize(text)) == text ("default" would turn " ," into ",").
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_eot_token_id(IM_END_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def _normal(rng: np.random.Generator, *shape: int, std: float) -> np.ndarray:
    return rng.normal(0.0, std, size=shape).astype(np.float32)


def _common_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Embeddings, final norm and output head.

    Shapes are numpy order, i.e. reversed w.r.t. llama.cpp's {ne0, ne1}.
    """
    n_vocab = len(_build_vocab()[0])
    # The head is untied (a tied one mostly predicts the input token, hiding
    # context bugs) and large, so logits are peaked and greedy decoding is not
    # decided by float noise between batched and unbatched runs.
    return {
        "token_embd.weight": _normal(rng, n_vocab, N_EMBD, std=1.0),
        "output_norm.weight": np.ones(N_EMBD, dtype=np.float32),
        "output.weight": _normal(rng, n_vocab, N_EMBD, std=0.5),
    }


def _llama_layer(
    rng: np.random.Generator, i: int, n_head_kv: int, n_ff: int, head_dim: int
) -> dict[str, np.ndarray]:
    std = N_EMBD**-0.5
    n_kv = n_head_kv * head_dim
    return {
        f"blk.{i}.attn_norm.weight": np.ones(N_EMBD, dtype=np.float32),
        f"blk.{i}.attn_q.weight": _normal(rng, N_EMBD, N_EMBD, std=std),
        f"blk.{i}.attn_k.weight": _normal(rng, n_kv, N_EMBD, std=std),
        f"blk.{i}.attn_v.weight": _normal(rng, n_kv, N_EMBD, std=std),
        f"blk.{i}.attn_output.weight": _normal(rng, N_EMBD, N_EMBD, std=std),
        f"blk.{i}.ffn_norm.weight": np.ones(N_EMBD, dtype=np.float32),
        f"blk.{i}.ffn_gate.weight": _normal(rng, n_ff, N_EMBD, std=std),
        f"blk.{i}.ffn_up.weight": _normal(rng, n_ff, N_EMBD, std=std),
        f"blk.{i}.ffn_down.weight": _normal(rng, N_EMBD, n_ff, std=n_ff**-0.5),
    }


def _gemma3_layer(
    rng: np.random.Generator, i: int, n_head: int, n_head_kv: int, n_ff: int, head_dim: int
) -> dict[str, np.ndarray]:
    tensors = _llama_layer(rng, i, n_head_kv, n_ff, head_dim)
    tensors[f"blk.{i}.attn_q.weight"] = _normal(rng, n_head * head_dim, N_EMBD, std=N_EMBD**-0.5)
    tensors[f"blk.{i}.attn_output.weight"] = _normal(
        rng, N_EMBD, n_head * head_dim, std=(n_head * head_dim) ** -0.5
    )
    for norm in ("attn_q_norm", "attn_k_norm"):
        tensors[f"blk.{i}.{norm}.weight"] = np.ones(head_dim, dtype=np.float32)
    for norm in ("post_attention_norm", "post_ffw_norm"):
        tensors[f"blk.{i}.{norm}.weight"] = np.ones(N_EMBD, dtype=np.float32)
    return tensors


def _mamba_layer(
    rng: np.random.Generator, i: int, d_inner: int, d_state: int, d_conv: int, dt_rank: int
) -> dict[str, np.ndarray]:
    # Slow decay (A = -[1..d_state] / d_state), small steps and large B/C
    # projections give the state a long memory: early prompt tokens visibly
    # change later logits, so tests can catch per-sequence state mix-ups.
    # GGUF stores A itself, not A_log.
    a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32) / d_state, (d_inner, 1))
    dt = np.exp(rng.uniform(np.log(1e-2), np.log(1e-1), size=d_inner))
    return {
        f"blk.{i}.attn_norm.weight": np.ones(N_EMBD, dtype=np.float32),
        f"blk.{i}.ssm_in.weight": _normal(rng, 2 * d_inner, N_EMBD, std=N_EMBD**-0.5),
        f"blk.{i}.ssm_conv1d.weight": _normal(rng, d_inner, d_conv, std=d_conv**-0.5),
        f"blk.{i}.ssm_conv1d.bias": np.zeros(d_inner, dtype=np.float32),
        f"blk.{i}.ssm_x.weight": _normal(
            rng, dt_rank + 2 * d_state, d_inner, std=3 * d_inner**-0.5
        ),
        f"blk.{i}.ssm_dt.weight": _normal(rng, d_inner, dt_rank, std=dt_rank**-0.5),
        f"blk.{i}.ssm_dt.bias": np.log(np.expm1(dt)).astype(np.float32),  # softplus^-1(dt)
        f"blk.{i}.ssm_a": a,
        f"blk.{i}.ssm_d": np.ones(d_inner, dtype=np.float32),
        f"blk.{i}.ssm_out.weight": _normal(rng, N_EMBD, d_inner, std=d_inner**-0.5),
    }


def _new_writer(path: pathlib.Path, arch: str) -> gguf.GGUFWriter:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}-test")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    return writer


def _write_weights(
    writer: gguf.GGUFWriter,
    layer: Callable[[np.random.Generator, int], dict[str, np.ndarray]],
    deltas: dict[str, np.ndarray] | None = None,
) -> None:
    """Seeded random weights: the shared tensors, then `layer(rng, i)` for every layer; each
    of `deltas` is added to the weight of its name (a merged adapter)."""
    rng = np.random.default_rng(SEED)
    tensors = _common_tensors(rng)
    for i in range(N_LAYER):
        tensors |= layer(rng, i)
    for name, delta in (deltas or {}).items():
        tensors[name] = (tensors[name] + delta).astype(np.float32)
    _save(writer, tensors)


def _save(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray]) -> None:
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_LLAMA_HEADS, _LLAMA_KV_HEADS, _LLAMA_FF = 4, 2, 128


def write_tiny_llama(
    path: pathlib.Path, merge: tuple[int, float] | None = None, n_head: int = _LLAMA_HEADS
) -> pathlib.Path:
    """Write a 2-layer llama (4 heads of 16 values, 2 KV heads) with a ChatML template.
    `merge`: (seed, scale) of a `write_tiny_lora` adapter whose scaled B·A is added to the
    weights; `n_head=2`: heads of 32 values, one KV head, which quantized KV blocks (32) divide."""
    n_head_kv, n_ff = n_head // 2, _LLAMA_FF
    head_dim = N_EMBD // n_head
    path = pathlib.Path(path)
    writer = _new_writer(path, "llama")
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    _add_tokenizer(writer, CHATML_TEMPLATE)

    deltas = None
    if merge is not None:
        seed, scale = merge
        factor = scale * LORA_ALPHA / LORA_RANK  # llama.cpp's scale for an adapter with alpha
        deltas = {name: factor * (b @ a) for name, (a, b) in lora_factors(seed).items()}
    layer = lambda rng, i: _llama_layer(rng, i, n_head_kv, n_ff, head_dim)  # noqa: E731
    _write_weights(writer, layer, deltas)
    return path


LORA_RANK, LORA_ALPHA = 4, 8.0


def lora_factors(seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The tiny llama's adapter of this seed: weight name -> (A, B) in numpy order, A of shape
    (rank, in) and B of shape (out, rank), so that B @ A has the weight's shape. Large enough
    that the adapter changes greedy output."""
    rng = np.random.default_rng(seed)
    n_kv = _LLAMA_KV_HEADS * (N_EMBD // _LLAMA_HEADS)
    outs = {"attn_q": N_EMBD, "attn_v": n_kv, "ffn_up": _LLAMA_FF}
    factors = {}
    for i in range(N_LAYER):
        for target, n_out in outs.items():
            a = _normal(rng, LORA_RANK, N_EMBD, std=N_EMBD**-0.5)
            b = _normal(rng, n_out, LORA_RANK, std=1.0)
            factors[f"blk.{i}.{target}.weight"] = (a, b)
    return factors


def write_tiny_lora(
    path: pathlib.Path, seed: int = 1, arch: str = "llama", base: str | None = None
) -> pathlib.Path:
    """Write a LoRA adapter GGUF of the tiny llama, as llama.cpp's loader reads one:
    general.type "adapter", adapter.type "lora", adapter.lora.alpha, and per weight W the
    tensors `W.lora_a` (ggml {in, rank}) and `W.lora_b` (ggml {rank, out}). `base`: the Hub
    repository ("org/repo") written as its base model, as convert_lora_to_gguf.py does."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    if base is not None:
        org, _, name = base.rpartition("/")
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, name)
        writer.add_base_model_organization(0, org)
        writer.add_base_model_repo_url(0, f"https://huggingface.co/{base}")
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, LORA_ALPHA)
    tensors = {}
    for name, (a, b) in lora_factors(seed).items():
        tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"] = a, b
    _save(writer, tensors)
    return path


def write_tiny_mamba(path: pathlib.Path) -> pathlib.Path:
    """Write a 2-layer Mamba-1 recurrent model (no chat template)."""
    d_inner, d_state, d_conv = 2 * N_EMBD, 16, 4  # llama.cpp requires d_inner == 2 * n_embd
    dt_rank = -(-N_EMBD // 16)
    path = pathlib.Path(path)
    writer = _new_writer(path, "mamba")
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(dt_rank)
    writer.add_ssm_dt_b_c_rms(False)
    _add_tokenizer(writer, chat_template=None)

    _write_weights(writer, lambda rng, i: _mamba_layer(rng, i, d_inner, d_state, d_conv, dt_rank))
    return path


def write_tiny_gemma3(path: pathlib.Path, sliding_window: int = 8) -> pathlib.Path:
    """Write a 2-layer Gemma 3: layer 0 attends to the last `sliding_window` positions only,
    layer 1 to all of them (Gemma 3's pattern, 1 dense layer in 6, shrunk to 1 in 2)."""
    n_head, n_head_kv, n_ff, head_dim = 4, 1, 128, 16
    path = pathlib.Path(path)
    writer = _new_writer(path, "gemma3")
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_sliding_window(sliding_window)
    writer.add_uint32("gemma3.attention.sliding_window_pattern", 2)
    _add_tokenizer(writer, CHATML_TEMPLATE)

    _write_weights(writer, lambda rng, i: _gemma3_layer(rng, i, n_head, n_head_kv, n_ff, head_dim))
    return path
