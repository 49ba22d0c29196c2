"""`max_token_bytes` on real vocabularies: no text tokenizes into fewer tokens than its bytes
divided by it (the bound the API refuses long texts by, before tokenizing them)."""

from __future__ import annotations

import pytest

from ferrum.engine.llama.vocab import VocabularyFile
from ferrum.models.builtin import BUILTINS, builtin_path

TEXTS = [
    "hello world " * 50,
    " " * 3000,  # runs of spaces: some vocabularies hold long whitespace tokens
    "\n" * 500 + "\t" * 500,
    "=" * 2000 + "-" * 2000,
    "Café naïve résumé Привет мир 🙂 ∞ " * 40,
    "<|im_start|>user\nhi<|im_end|>" * 20,  # special tokens, parsed
    "0123456789" * 300,
]


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_no_text_is_fewer_tokens_than_its_bytes_over_the_longest_token(name):
    vocab_file = VocabularyFile(str(builtin_path(name)))
    try:
        vocab = vocab_file.vocab
        longest = vocab.max_token_bytes()
        assert 1 < longest < 1024
        for text in TEXTS:
            tokens = vocab.tokenize(text, False, True)
            assert len(tokens) * longest >= len(text.encode()), text[:40]
    finally:
        vocab_file.close()
