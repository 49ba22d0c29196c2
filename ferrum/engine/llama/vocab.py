"""The model's vocabulary: tokenizer, token bytes, end-of-generation tokens, grammars.

Read-only once the model is loaded, so any thread may use it: the API tokenizes and checks
grammars in worker threads while the engine thread decodes (llama.cpp's tokenizer and grammar
parser only read the vocabulary). The runner that loaded the model owns it and frees it after
this object.

Grammars are llguidance's (`engine/constraint.py`): its tokenizer is built from this
vocabulary once, the first time a grammar is checked (~1 s on a 150k vocabulary, in the
preparation thread), and `Constraints` keeps each compiled grammar, which each request's
sampler copies on the engine thread.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import llama_cpp as ll
from llguidance.llamacpp import lltokenizer_from_vocab

from ferrum.engine.constraint import Constraint, Constraints
from ferrum.errors import ModelLoadError


class LlamaVocab:
    def __init__(self, model: Any):
        self._vocab = ll.llama_model_get_vocab(model)
        self.n_vocab: int = ll.llama_vocab_n_tokens(self._vocab)
        self._piece_cache: dict[int, bytes] = {}
        self._eog_cache: dict[int, bool] = {}
        self._end_tokens: list[int] | None = None
        self._max_token_bytes = 0  # 0: not yet measured
        self._constraints: Constraints | None = None
        self._lock = threading.Lock()

    # -- text -------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(
                self._vocab, data, len(data), buf, cap, add_special, parse_special
            )
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def token_bytes(self, token: int) -> bytes:
        """The token's bytes as output text: control tokens render as nothing."""
        piece = self._piece_cache.get(token)
        if piece is None:
            if not 0 <= token < self.n_vocab:
                return b""
            buf = ctypes.create_string_buffer(64)
            n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = buf.raw[:n]
            self._piece_cache[token] = piece
        return piece

    def token_text(self, token: int) -> str:
        """A token's text as the vocabulary spells it (control tokens included)."""
        if token < 0:
            return ""
        text: bytes = ll.llama_vocab_get_text(self._vocab, token)
        return text.decode("utf-8", "replace")

    def max_token_bytes(self) -> int:
        """The longest token, as its piece or its spelling (a special token is its text when
        parsed, a byte token `<0x0A>` spells longer than its byte): one scan, then kept. The
        pieces are measured outside `token_bytes`, whose cache would keep every token."""
        if not self._max_token_bytes:
            buf = ctypes.create_string_buffer(256)
            longest = 1
            for token in range(self.n_vocab):
                n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
                text = ll.llama_vocab_get_text(self._vocab, token) or b""
                longest = max(longest, abs(n), len(text))
            self._max_token_bytes = longest
        return self._max_token_bytes

    def is_eog(self, token: int) -> bool:
        eog = self._eog_cache.get(token)
        if eog is None:
            eog = self._eog_cache[token] = bool(ll.llama_vocab_is_eog(self._vocab, token))
        return eog

    def end_tokens(self) -> list[int]:
        """Every end-of-generation token, the vocabulary's EOS first (one scan, then kept)."""
        if self._end_tokens is None:
            eos = ll.llama_vocab_eos(self._vocab)
            eog = [t for t in range(self.n_vocab) if ll.llama_vocab_is_eog(self._vocab, t)]
            self._end_tokens = sorted(eog, key=lambda t: t != eos)
        return self._end_tokens

    @property
    def bos(self) -> int:
        return int(ll.llama_vocab_bos(self._vocab))

    @property
    def eos(self) -> int:
        return int(ll.llama_vocab_eos(self._vocab))

    @property
    def add_bos(self) -> bool:
        return bool(ll.llama_vocab_get_add_bos(self._vocab))

    # -- grammars ---------------------------------------------------------------------------

    def constraints(self) -> Constraints:
        """The model's compiled grammars, on llguidance's tokenizer for this vocabulary (built
        on first use: one pass over every token)."""
        with self._lock:
            if self._constraints is None:
                end = self.end_tokens()
                tokenizer = lltokenizer_from_vocab(self._vocab, eos_token=end or None)
                self._constraints = Constraints(tokenizer, end)
            return self._constraints

    def check_grammar(self, grammar: str) -> None:
        """ValueError naming why llguidance cannot compile the grammar text; else kept."""
        self.constraints().check(grammar)

    def constraint(self, grammar: str) -> Constraint:
        """A matcher at the grammar's start for one request's sampler."""
        return self.constraints().constraint(grammar)

    def close(self) -> None:
        with self._lock:
            if self._constraints is not None:
                self._constraints.clear()


class VocabularyFile:
    """A model file's vocabulary and chat facts without its weights or a context
    (llama.cpp's vocab-only load: milliseconds, a few MB). A cluster's ingress tokenizes
    prompts with it to route them, exactly as the replicas' engines will see them."""

    def __init__(self, path: str):
        ll.llama_backend_init()
        params = ll.llama_model_default_params()
        params.vocab_only = True
        self._model = ll.llama_model_load_from_file(path.encode(), params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not read the vocabulary of {path}")
        self.vocab = LlamaVocab(self._model)
        template = ll.llama_model_chat_template(self._model, None)
        self.chat_template: str | None = template.decode("utf-8", "replace") if template else None
        buf = ctypes.create_string_buffer(128)
        n = ll.llama_model_meta_val_str(self._model, b"general.architecture", buf, len(buf))
        self.architecture = buf.value.decode("utf-8", "replace") if n >= 0 else "unknown"
        self.bos_text = self.vocab.token_text(self.vocab.bos)
        self.eos_text = self.vocab.token_text(self.vocab.eos)
        self.add_bos = self.vocab.add_bos

    def close(self) -> None:
        if self._model is not None:
            self.vocab.close()
            ll.llama_model_free(self._model)
            self._model = None
