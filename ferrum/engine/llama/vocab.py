"""The model's vocabulary: tokenizer, token bytes, end-of-generation tokens, grammars.

Read-only once the model is loaded, so any thread may use it: the API tokenizes and checks
grammars in worker threads while the engine thread decodes (llama.cpp's tokenizer and grammar
parser only read the vocabulary). The runner that loaded the model owns it and frees it after
this object.

Grammars are parsed once: `check_grammar` keeps the parsed grammar (least recently used
first out, bounded by count and by an estimate of their bytes), and each request's sampler is
a copy of it (`llama_sampler_clone`, no parsing), taken on the engine thread. The lock guards
only the cache.

What one grammar may cost is bounded here, whoever asks: the converter stops (ValueError) once
its rules pass MAX_GRAMMAR_BYTES or it has run MAX_BUILD_SECONDS, and no text over
MAX_GRAMMAR_BYTES reaches llama.cpp's parser. The API checks schemas first
(api/schema_limits.py), so these are the backstop for what those checks cannot foresee.
"""

from __future__ import annotations

import ctypes
import json
import re
import threading
import time
from typing import Any

import llama_cpp as ll
from llama_cpp.llama_grammar import SchemaConverter

from ferrum.engine.lru import SizedLRU
from ferrum.errors import ModelLoadError

# GBNF text one grammar may have. The schema checks keep a real schema's grammar well under
# it (60 strings of maxLength 256: 126 KB; 2,000 properties: 128 KB); llama.cpp parses 880 KB
# in ~17 ms and 126 KB of nested repetitions in ~35 ms (measured, SmolLM2's vocabulary).
MAX_GRAMMAR_BYTES = 1024 * 1024
# Python time one conversion may take (the GIL is held: every other request waits). A
# 60-property object converts in 1-9 ms, the costliest schemas the checks admit (128 optional
# properties, 2,000 subschemas) in ~40 ms on a loaded 2-core machine: a wide margin.
MAX_BUILD_SECONDS = 0.5
# Parentheses nested in one grammar: llama.cpp's parser recurses per level and crashed the
# process (a segfault, an 8 MB thread stack) between 10,000 and 20,000 levels; the converter
# nests at most MAX_REPEAT (1,000) for a schema the API admits.
MAX_GRAMMAR_NESTING = 2_000
# Parsed grammars kept: by count, and by an estimate of their memory. llama.cpp keeps a
# grammar as 8-byte elements, one per literal character or rule reference: 8 bytes per
# character bounds it (measured 1-8 by RSS). 64 MiB holds eight of the largest grammars, or
# the 64 entries at ~100 KB of text each.
_GRAMMARS_KEPT = 64
_PARSED_BYTES_PER_CHAR = 8
_PARSED_KEPT_BYTES = 64 * 1024 * 1024
# What nests in GBNF text: parentheses, outside "literals" and [classes].
_NESTING_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[()]')


class _TooCostly(ValueError):
    """The conversion passed a bound; its message names which."""


class _BoundedConverter(SchemaConverter):
    """llama-cpp-python's converter, stopped at the first rule past MAX_GRAMMAR_BYTES or
    MAX_BUILD_SECONDS: every rule it writes passes through `_add_rule`, so a runaway
    conversion ends at its next rule, not when it is done. One rule is written whole first:
    its size is the schema checks' to bound (a count of n is n copies in one rule)."""

    def __init__(self) -> None:
        # llama-cpp-python's converter has no type annotations, hence the ignores.
        super().__init__(  # type: ignore[no-untyped-call]
            prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False
        )
        self._deadline = time.monotonic() + MAX_BUILD_SECONDS
        self._sizes: dict[str, int] = {}
        self._bytes = 0

    def _add_rule(self, name: str, rule: str) -> str:
        key: str = super()._add_rule(name, rule)  # type: ignore[no-untyped-call]
        size = len(key) + len(rule) + 5  # as format_grammar writes it: "key ::= rule\n"
        self._bytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        if self._bytes > MAX_GRAMMAR_BYTES:
            raise _TooCostly(
                f"the grammar would be over {MAX_GRAMMAR_BYTES} bytes, the most allowed"
            )
        if time.monotonic() > self._deadline:
            raise _TooCostly(
                f"converting the JSON schema took over {MAX_BUILD_SECONDS} s, the most allowed"
            )
        return key


class LlamaVocab:
    def __init__(self, model: Any, kept_grammar_bytes: int = _PARSED_KEPT_BYTES):
        self._vocab = ll.llama_model_get_vocab(model)
        self.n_vocab: int = ll.llama_vocab_n_tokens(self._vocab)
        self._piece_cache: dict[int, bytes] = {}
        self._eog_cache: dict[int, bool] = {}
        self._end_tokens: list[int] | None = None
        self._max_token_bytes = 0  # 0: not yet measured
        self._grammars: SizedLRU[str, Any] = SizedLRU(
            _GRAMMARS_KEPT, kept_grammar_bytes, on_evict=ll.llama_sampler_free
        )
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

    @staticmethod
    def json_schema_grammar(schema: dict[str, Any]) -> str:
        """JSON Schema → GBNF, with llama-cpp-python's converter (ValueError when it cannot,
        or when the grammar would cost more than the bounds above)."""
        converter = _BoundedConverter()
        try:
            # A copy: resolving $refs rewrites them in place.
            resolved = converter.resolve_refs(json.loads(json.dumps(schema)), "stdin")
            converter.visit(resolved, "")  # type: ignore[no-untyped-call]
            return str(converter.format_grammar())  # type: ignore[no-untyped-call]
        except _TooCostly:
            raise
        except (ValueError, KeyError, TypeError, RecursionError, AssertionError) as exc:
            # The converter asserts what it cannot convert (e.g. a pattern without ^...$).
            raise ValueError(f"the JSON schema cannot be converted to a grammar: {exc}") from exc

    def check_grammar(self, grammar: str) -> None:
        """ValueError when llama.cpp cannot parse the GBNF text, or when it is over
        MAX_GRAMMAR_BYTES or MAX_GRAMMAR_NESTING (checked before parsing); else it is kept
        parsed."""
        with self._lock:
            if self._grammars.get(grammar) is not None:
                return
        if len(grammar) > MAX_GRAMMAR_BYTES:
            raise ValueError(
                f"the grammar is {len(grammar)} bytes; at most {MAX_GRAMMAR_BYTES} are allowed"
            )
        if _nesting(grammar) > MAX_GRAMMAR_NESTING:
            raise ValueError(
                f"the grammar nests parentheses more than {MAX_GRAMMAR_NESTING} deep, the most "
                "allowed"
            )
        parsed = self._parse(grammar)  # outside the lock: parsing a large grammar takes time
        with self._lock:
            if grammar in self._grammars:
                ll.llama_sampler_free(parsed)
                return
            self._grammars.put(grammar, parsed, _PARSED_BYTES_PER_CHAR * len(grammar))

    @property
    def kept_grammar_bytes(self) -> int:
        """The estimated memory of the parsed grammars kept."""
        with self._lock:
            return self._grammars.total_bytes

    def grammar_sampler(self, grammar: str) -> Any:
        """A fresh grammar sampler (at the grammar's start) that the caller owns and frees."""
        self.check_grammar(grammar)
        with self._lock:
            parsed = self._grammars.get(grammar)
            if parsed is not None:
                return ll.llama_sampler_clone(parsed)
        return self._parse(grammar)  # pushed out by other grammars in between

    def _parse(self, grammar: str) -> Any:
        sampler = ll.llama_sampler_init_grammar(self._vocab, grammar.encode("utf-8"), b"root")
        if not sampler:
            raise ValueError("llama.cpp could not parse the grammar")
        return sampler

    def close(self) -> None:
        with self._lock:
            self._grammars.clear()


def _nesting(grammar: str) -> int:
    """How deep the grammar nests parentheses (one scan; none when it has too few)."""
    if grammar.count("(") <= MAX_GRAMMAR_NESTING:
        return 0
    depth = deepest = 0
    for token in _NESTING_TOKENS.findall(grammar):
        if token == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif token == ")":
            depth -= 1
    return deepest


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
