"""q8_0 and q4_0 KV cells against f16 on the default chat model (SmolLM2-135M-Instruct,
heads of 64 values): how far apart the first-token distributions are, beside what other
numerics of the same f16 cache give.

Measured over the 12 prompts below (2026-12-06, the AMD host; this test prints them): the
largest log-probability difference over the top-8 tokens both lists hold, median / max over
the prompts, and how many prompts keep the same most likely token, each against f16 with
flash attention on, each prompt decoded alone:

    f16, 4 prompts decoded in one batch     0.000 / 0.000   12 of 12  (batch shape: none here)
    f16, flash attention off                0.177 / 0.287   11 of 12  (another f16 kernel)
    q8_0, flash attention on                0.173 / 0.344   11 of 12
    q4_0, flash attention on                0.642 / 1.598   11 of 12

On this model and CPU a batch's shape moves nothing, so the noise q8_0 is measured against is
the other f16 attention kernel: q8_0 is as far from f16 as flash attention off is from on.
q4_0 is about four times as far (a user's trade of accuracy for room). The bounds below sit
above those figures with room for another host's kernels, and below what a broken quantized
path gives (a layout mix-up moves log-probabilities by whole nats).
"""

from __future__ import annotations

import statistics

import pytest

from ferrum.config import EngineConfig
from ferrum.engine.engine import LLMEngine
from ferrum.engine.llama.runner import LlamaRunner
from tests.factories import sampling

TOP = 8
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Q: How many legs does a spider have?\nA:",
    "<|im_start|>user\nWrite a haiku about rain.<|im_end|>\n<|im_start|>assistant\n",
    "The mitochondria is the powerhouse of",
    "1, 1, 2, 3, 5, 8, 13,",
    "SELECT name FROM users WHERE",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the first humans to walk on the Moon were",
    "The quick brown fox jumps over the lazy",
    "Dear hiring manager, I am writing to apply for the position of",
]


@pytest.fixture(scope="module")
def smollm2() -> str:
    from ferrum.models import DEFAULT_CHAT_MODEL, builtin_path

    return builtin_path(DEFAULT_CHAT_MODEL)


def _first_tokens(
    path: str, kv: str, together: int, flash_attn: str = "on"
) -> list[dict[int, float]]:
    """Top-`TOP` log-probabilities of each prompt's first generated token on a fresh cache of
    type `kv`, the prompts sent at once and `together` of them decoded in one batch (1: each
    prompt alone)."""
    config = EngineConfig(
        ctx_size=1024 * together, parallel=together, batch_size=512, threads=2,
        no_prefix_cache=True, cache_type_k=kv, cache_type_v=kv, flash_attn=flash_attn,
    )  # fmt: skip
    runner = LlamaRunner(config, path)
    engine = LLMEngine(runner, block_size=16, max_running=together, prefix_cache=False)
    found: dict[str, dict[int, float]] = {}
    try:
        for i, text in enumerate(PROMPTS):
            prompt = runner.vocab.tokenize(text, True, True)
            engine.add_request(f"p{i}", prompt, sampling(max_tokens=1, logprobs=TOP))
        while engine.has_work:
            for out in engine.step():
                if out.logprobs and out.request_id not in found:
                    found[out.request_id] = dict(out.logprobs[0].top)
    finally:
        engine.shutdown()
        runner.close()
    return [found[f"p{i}"] for i in range(len(PROMPTS))]


def _distance(a: dict[int, float], b: dict[int, float]) -> float:
    common = a.keys() & b.keys()
    assert len(common) >= TOP // 2, (a, b)
    return max(abs(a[t] - b[t]) for t in common)


def _argmax(top: dict[int, float]) -> int:
    return max(top, key=lambda t: top[t])


def _compare(ref: list[dict[int, float]], got: list[dict[int, float]]) -> tuple[float, float, int]:
    distances = [_distance(a, b) for a, b in zip(ref, got, strict=True)]
    same = sum(_argmax(a) == _argmax(b) for a, b in zip(ref, got, strict=True))
    return statistics.median(distances), max(distances), same


def test_quantized_kv_cells_stay_near_f16_on_the_default_model(smollm2: str) -> None:
    f16 = _first_tokens(smollm2, "f16", 1)
    figures = {
        "f16, 4 prompts a batch": _compare(f16, _first_tokens(smollm2, "f16", 4)),
        "f16, flash attn off": _compare(f16, _first_tokens(smollm2, "f16", 1, "off")),
        "q8_0": _compare(f16, _first_tokens(smollm2, "q8_0", 1)),
        "q4_0": _compare(f16, _first_tokens(smollm2, "q4_0", 1)),
    }
    for name, (median, worst, same) in figures.items():
        print(f"{name:24s} median {median:.3f} max {worst:.3f} same argmax {same}/{len(PROMPTS)}")
    kernel_median, kernel_worst, _ = figures["f16, flash attn off"]
    assert figures["f16, 4 prompts a batch"][1] <= kernel_worst, figures
    q8_median, q8_worst, q8_same = figures["q8_0"]
    assert q8_median <= max(2 * kernel_median, 0.1), figures
    assert q8_worst <= max(2 * kernel_worst, 0.2) and q8_same >= len(PROMPTS) - 2, figures
    q4_median, q4_worst, q4_same = figures["q4_0"]
    assert q4_median <= 1.2 and q4_worst <= 3.0 and q4_same >= len(PROMPTS) * 2 // 3, figures
