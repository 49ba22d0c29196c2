"""How often n-gram speculation changes greedy output on the real default model, and why.

On the engine alone (no HTTP), SmolLM2-135M-Instruct, 2 threads: each prompt decoded greedy
(no repetition penalty, ignore_eos, 200 tokens) once with `--spec-type none` and once with
`ngram`, one request at a time, without prefix reuse. Speculation keeps a guessed token only
where the sampler picks it, so the tokens can differ only where llama.cpp's logits differ,
and they do: a verification decodes several positions of the sequence in one batch, and
llama.cpp's kernels may sum in another order for another batch shape. Where the outputs
part, the script prints by how much each run's token led the other's at that position in
each run, and the same position decoded without speculation as the end of one prefill
batch: a small lead that flips with the batch shape alone is float noise; a wide one would
mean a bug.

Prompts: the copy workload of bench_speculation.py under four instructions and its eight
prose topics.

    .venv/bin/python bench/spec_agreement.py [--tokens 200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_speculation import PASSAGE, TOPICS, _chat  # noqa: E402

from ferrum.config import EngineConfig  # noqa: E402
from ferrum.engine.engine import LLMEngine  # noqa: E402
from ferrum.engine.llama.runner import LlamaRunner  # noqa: E402
from ferrum.engine.outputs import EngineObserver, StepStats  # noqa: E402
from ferrum.engine.request import SamplingParams  # noqa: E402
from ferrum.engine.speculation.speculator import SpecConfig  # noqa: E402
from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path  # noqa: E402

INSTRUCTIONS = [
    "Rewrite this code with type hints kept:",
    "Copy this code exactly:",
    "Add a docstring to every function of this code:",
    "Repeat this code, then say what it does:",
]


class _Drafts(EngineObserver):
    def __init__(self) -> None:
        self.drafted = self.accepted = 0

    def on_step(self, stats: StepStats) -> None:
        self.drafted += stats.draft_tokens
        self.accepted += stats.draft_accepted


def _prompts() -> list[tuple[str, str]]:
    copy = [(f"copy {i}", _chat(f"{text}\n```python\n{PASSAGE}```", "```python\n"))
            for i, text in enumerate(INSTRUCTIONS)]  # fmt: skip
    prose = [(f"prose {i}", _chat(f"Write a short story about {topic}."))
             for i, topic in enumerate(TOPICS)]  # fmt: skip
    return copy + prose


def _decode(engine: LLMEngine, prompt: list[int], tokens: int) -> tuple[list[int], list]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=4)
    engine.add_request("q", prompt, params)
    out: list[int] = []
    logprobs: list = []
    while engine.has_work:
        for o in engine.step():
            out += o.token_ids
            logprobs += o.logprobs or []
    return out, logprobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    cfg = EngineConfig(ctx_size=4096, parallel=1, batch_size=512, threads=2, no_prefix_cache=True)
    runners = {kind: LlamaRunner(cfg, builtin_path(DEFAULT_CHAT_MODEL))
               for kind in ("none", "ngram")}  # fmt: skip
    drafts = _Drafts()
    engines = {
        kind: LLMEngine(runner, block_size=16, max_running=1, prefix_cache=False,
                        speculation=SpecConfig(kind=kind),
                        observer=drafts if kind == "ngram" else None)  # fmt: skip
        for kind, runner in runners.items()
    }
    vocab = runners["none"].vocab
    same = 0
    agreed_tokens = total_tokens = 0
    for name, text in _prompts():
        prompt = vocab.tokenize(text, True, True)
        plain, plain_lp = _decode(engines["none"], prompt, args.tokens)
        spec, spec_lp = _decode(engines["ngram"], prompt, args.tokens)
        total_tokens += len(plain)
        split = next((i for i, (a, b) in enumerate(zip(plain, spec, strict=False)) if a != b),
                     None)  # fmt: skip
        if split is None and len(plain) == len(spec):
            same += 1
            agreed_tokens += len(plain)
            print(f"{name}: same {len(plain)} tokens")
            continue
        agreed_tokens += split or 0
        if split is None:
            print(f"{name}: lengths differ")
            continue
        a, b = plain[split], spec[split]
        alone, guessed = dict(plain_lp[split].top), dict(spec_lp[split].top)
        print(f"{name}: parts at token {split} of {len(plain)}: {a} leads {b} by "
              f"{alone[a] - alone.get(b, float('-inf')):.4f} nats decoded one at a time, "
              f"{b} leads {a} by {guessed[b] - guessed.get(a, float('-inf')):.4f} in the "
              f"verification batch")  # fmt: skip
        # The same position without speculation, computed inside a prefill batch instead.
        _, batch_lp = _decode(engines["none"], prompt + plain[:split], 1)
        batched = dict(batch_lp[0].top)
        lead = batched.get(a, float("-inf")) - batched.get(b, float("-inf"))
        print(f"  without speculation, as the last position of a prefill: {a} leads {b} by "
              f"{lead:.4f}")  # fmt: skip
    prompts = len(_prompts())
    print(f"identical outputs: {same} of {prompts}; tokens before any parting: "
          f"{agreed_tokens} of {total_tokens}; drafts: {drafts.accepted} of {drafts.drafted} "
          f"guessed tokens kept")  # fmt: skip
    for runner in runners.values():
        runner.close()


if __name__ == "__main__":
    main()
