"""all-MiniLM-L6-v2 through llama.cpp's low-level API, against a numpy forward pass.

Oracles: llama.cpp's token ids == the HF tokenizer's; each pooled embedding == the numpy
reference (cosine ≥ 0.999); an input embeds the same alone as batched with others; and the
similarities that sentence-transformers' documentation prints for this model. Together they
pin the GGUF layout (ferrum/bench/minilm.py) and the context parameters an embeddings path
runs on:

    one llama_decode, every input its own sequence, every token flagged for output:
      index:  0     1   2   3   4      5     6   7      ...
      token:  [CLS] a   man ... [SEP] | [CLS] hi [SEP]  | ...
      seq:    0     0   0   0   0     | 1     1  1      | 2 ...
      pos:    0     1   2   3   4     | 0     1  2      | 0 ...
    → llama_get_embeddings_seq(ctx, s): the mean over sequence s's tokens (not normalised)
"""

from __future__ import annotations

from typing import Any

import llama_cpp as ll
import numpy as np
import pytest

from ferrum.engine.llama.vocab import LlamaVocab
from tests.embedding_model import reference_embeddings, reference_token_ids, write_minilm_gguf

LONG = (
    "The history of computing is longer than the history of computing hardware and modern "
    "computing technology and includes the history of methods intended for pen and paper or "
    "for chalk and slate, with or without the aid of tables. Digital computing is intimately "
    "tied to the representation of numbers, but long before abstractions like the number "
    "arose, there were mathematical concepts to serve the purposes of civilization. These "
    "concepts are implicit in concrete practices such as one-to-one correspondence, the "
    "basis of counting, comparison to a standard, used for measurement, and the 3-4-5 right "
    "triangle, a device for assuring a right angle. Mechanical aids such as the abacus and "
    "the slide rule came later, and electronic machines later still."
)  # ~150 tokens: past the 128 that tokenizer.json truncates to, inside the model's 512
TEXTS = [
    "A man is eating food.",
    "Hi",
    "Hello, world! How are you -- really?! (I'd like to know...)",
    "Café naïve résumé: Ünïcödé façade, Straße, 東京は日本にあります, Привет мир.",
    "In 2024, 3.14159 × 2 = 6.28318; the price rose 12% to $1,234.56 on 2024-05-01.",
    "  leading,  doubled   spaces\tand\ttabs\nand newlines  ",
    "emoji 🙂 and symbols ~ ^ | < > © ® ™ → ∞ unbelievably antidisestablishmentarianism",
    LONG,
]


class Embedder:
    """One model and one embeddings context; `embed` runs all its texts in one llama_decode."""

    def __init__(self, path: str, n_tokens: int = 1024, n_seq: int = 16, threads: int = 2):
        ll.llama_backend_init()
        mparams = ll.llama_model_default_params()
        self.model: Any = ll.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = LlamaVocab(self.model)
        self.n_embd = ll.llama_model_n_embd(self.model)
        self.n_tokens, self.n_seq = n_tokens, n_seq
        self.n_positions = ll.llama_model_n_ctx_train(self.model)
        cparams = ll.llama_context_default_params()
        cparams.embeddings = True
        cparams.pooling_type = ll.LLAMA_POOLING_TYPE_MEAN
        cparams.n_ctx = n_tokens
        # BERT attends both ways, so llama.cpp cannot split a decode into micro-batches: a
        # decode of more than n_ubatch tokens aborts the process (GGML_ASSERT in encode()).
        cparams.n_batch = n_tokens
        cparams.n_ubatch = n_tokens
        cparams.n_seq_max = n_seq
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx: Any = ll.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create an embeddings context")
        self.batch = ll.llama_batch_init(n_tokens, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        return self.vocab.tokenize(text, True, False)

    def embed(self, texts: list[str]) -> np.ndarray:
        """Unit-length embeddings of texts, shape (len(texts), n_embd)."""
        seqs = [self.tokenize(t) for t in texts]
        total = sum(map(len, seqs))
        # Past any of these llama.cpp does not return an error but aborts the process:
        # more tokens than n_ubatch (GGML_ASSERT in encode), or a position past the trained
        # 512 (GGML_ASSERT in get_rows of position_embd). Too many sequences returns -1.
        if len(seqs) > self.n_seq or total > self.n_tokens:
            raise ValueError(f"{len(seqs)} inputs of {total} tokens exceed one decode")
        if max(map(len, seqs)) > self.n_positions:
            raise ValueError(f"an input is longer than {self.n_positions} tokens")
        b, n = self.batch, 0
        for seq, ids in enumerate(seqs):
            for pos, token in enumerate(ids):
                b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, pos, 1, 1
                b.seq_id[n][0] = seq
                n += 1
        b.n_tokens = n
        rc = ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        out = np.array(
            [
                np.ctypeslib.as_array(ll.llama_get_embeddings_seq(self.ctx, s), (self.n_embd,))
                for s in range(len(seqs))
            ]
        )
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    def close(self) -> None:
        ll.llama_batch_free(self.batch)
        ll.llama_free(self.ctx)
        self.vocab.close()
        ll.llama_model_free(self.model)


@pytest.fixture(scope="session")
def minilm_gguf(tmp_path_factory) -> str:
    return str(write_minilm_gguf(tmp_path_factory.mktemp("models") / "all-minilm-l6-v2.gguf"))


@pytest.fixture(scope="module")
def embedder(minilm_gguf):
    e = Embedder(minilm_gguf)
    try:
        yield e
    finally:
        e.close()


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    return reference_embeddings(TEXTS)


def test_loads_as_a_mean_pooled_bert(embedder):
    assert embedder.n_embd == 384
    assert ll.llama_pooling_type(embedder.ctx) == ll.LLAMA_POOLING_TYPE_MEAN
    assert ll.llama_vocab_type(ll.llama_model_get_vocab(embedder.model)) == ll.LLAMA_VOCAB_TYPE_WPM


@pytest.mark.parametrize("text", TEXTS)
def test_tokens_match_the_hf_tokenizer(embedder, text):
    assert embedder.tokenize(text) == reference_token_ids(text)


def test_embeddings_match_the_reference(embedder, reference):
    cosines = np.sum(embedder.embed(TEXTS) * reference, axis=1)
    assert cosines.min() >= 0.999, dict(zip(TEXTS, cosines.round(5), strict=True))


def test_an_input_embeds_the_same_alone_and_batched(embedder):
    batched = embedder.embed(TEXTS)
    alone = np.concatenate([embedder.embed([t]) for t in TEXTS])
    cosines = np.sum(batched * alone, axis=1)
    assert cosines.min() >= 0.9999, cosines


# The semantic-search example in sentence-transformers' documentation, run with this model,
# prints these scores: an anchor for the oracle itself, outside anything computed here, and a
# ranking that only a working embedder gets right.
QUERY = "A man is eating pasta."
PUBLISHED_SCORES = {
    "A man is eating food.": 0.7035,
    "A man is eating a piece of bread.": 0.5272,
    "A man is riding a horse.": 0.1889,
    "A man is riding a white horse on an enclosed ground.": 0.1047,
}


@pytest.mark.parametrize("source", ["llama.cpp", "reference"])
def test_similarities_match_the_published_ones(embedder, source):
    texts = [QUERY, *PUBLISHED_SCORES]
    e = embedder.embed(texts) if source == "llama.cpp" else reference_embeddings(texts)
    np.testing.assert_allclose(e[0] @ e[1:].T, list(PUBLISHED_SCORES.values()), atol=1e-3)
