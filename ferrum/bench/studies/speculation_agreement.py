"""How often n-gram speculation changes greedy output on the real default model, and why.

On the engine alone (no server, no HTTP), SmolLM2-135M-Instruct (or `--model`), `--threads`:
each prompt decoded greedy (no repetition penalty, ignore_eos, 200 tokens: `--set tokens=`)
once with `--spec-type none` and once with `ngram`, one request at a time, without prefix
reuse. Speculation keeps a guessed token only where the sampler picks it, so the tokens can
differ only where llama.cpp's logits differ, and they do: a verification decodes several
positions of the sequence in one batch, and llama.cpp's kernels may sum in another order for
another batch shape. Where the outputs part, the study states by how much each run's token led
the other's at that position in each run, and the same position decoded without speculation as
the end of one prefill batch: a small lead that flips with the batch shape alone is float
noise; a wide one would mean a bug.

Prompts: the speculation study's copy workload under four instructions and its eight prose
topics. No arms and no timing, so no rounds: one pass, written to results.md and
agreement.json. `--quick`: 64 tokens, and only the first copy and the first prose prompt.

    ferrum bench --study speculation-agreement [--set tokens=200]
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

from ferrum.bench.studies import Study, StudyRun
from ferrum.bench.studies.speculation import TOPICS, chat, passage

INSTRUCTIONS = [
    "Rewrite this code with type hints kept:",
    "Copy this code exactly:",
    "Add a docstring to every function of this code:",
    "Repeat this code, then say what it does:",
]


def prompts() -> list[tuple[str, str]]:
    """(name, templated text) of every prompt: copy 0..3, then prose 0..7."""
    copy = [(f"copy {i}", chat(f"{text}\n```python\n{passage()}```", "```python\n"))
            for i, text in enumerate(INSTRUCTIONS)]  # fmt: skip
    prose = [(f"prose {i}", chat(f"Write a short story about {topic}."))
             for i, topic in enumerate(TOPICS)]  # fmt: skip
    return copy + prose


def parting(plain: list[int], spec: list[int]) -> int | None:
    """The first position where the two outputs differ (a length difference counts at the
    shorter one's end); None when they are the same."""
    for i, (a, b) in enumerate(zip(plain, spec, strict=False)):
        if a != b:
            return i
    return None if len(plain) == len(spec) else min(len(plain), len(spec))


def lead(top: dict[int, float], a: int, b: int) -> float:
    """By how many nats token `a` led token `b` in one position's top log-probabilities."""
    return top.get(a, float("-inf")) - top.get(b, float("-inf"))


@dataclass
class Outcome:
    name: str
    tokens: int
    part: int | None  # None: the same tokens
    plain_lead: float | None = None  # the plain token's lead decoded one at a time
    spec_lead: float | None = None  # the speculating run's token's lead in the verification
    prefill_lead: float | None = None  # the plain token's lead as the end of a prefill

    def line(self, a: int | None = None, b: int | None = None) -> str:
        if self.part is None:
            return f"{self.name}: same {self.tokens} tokens"
        if self.plain_lead is None:
            return f"{self.name}: lengths differ after {self.part} tokens"
        return (f"{self.name}: parts at token {self.part} of {self.tokens}: {a} leads {b} by "
                f"{self.plain_lead:.4f} nats decoded one at a time, {b} leads {a} by "
                f"{self.spec_lead:.4f} in the verification batch; as the last position of a "
                f"prefill without speculation {a} leads {b} by "
                f"{self.prefill_lead:.4f}")  # fmt: skip


def summary(outcomes: list[Outcome], drafted: int, accepted: int) -> str:
    same = sum(o.part is None for o in outcomes)
    agreed = sum(o.tokens if o.part is None else o.part for o in outcomes)
    total = sum(o.tokens for o in outcomes)
    return (
        f"identical outputs: {same} of {len(outcomes)}; tokens before any parting: "
        f"{agreed} of {total}; drafts: {accepted} of {drafted} guessed tokens kept"
    )


class _Engines:
    """One engine without speculation and one with, each on its own runner."""

    def __init__(self, model: str, threads: int) -> None:
        from ferrum.config import EngineConfig
        from ferrum.engine.engine import LLMEngine
        from ferrum.engine.llama.runner import LlamaRunner
        from ferrum.engine.outputs import EngineObserver, StepStats
        from ferrum.engine.speculation.speculator import SpecConfig

        class Drafts(EngineObserver):
            drafted = accepted = 0

            def on_step(self, stats: StepStats) -> None:
                self.drafted += stats.draft_tokens
                self.accepted += stats.draft_accepted

        cfg = EngineConfig(ctx_size=4096, parallel=1, batch_size=512, threads=threads,
                           no_prefix_cache=True)  # fmt: skip
        self.runners = {kind: LlamaRunner(cfg, model) for kind in ("none", "ngram")}
        self.drafts = Drafts()
        self.engines = {
            kind: LLMEngine(
                runner,
                block_size=16,
                max_running=1,
                prefix_cache=False,
                speculation=SpecConfig(kind=kind),
                observer=self.drafts if kind == "ngram" else None,
            )  # fmt: skip
            for kind, runner in self.runners.items()
        }
        self.vocab = self.runners["none"].vocab

    def decode(self, kind: str, prompt: list[int], tokens: int) -> tuple[list[int], list[Any]]:
        from ferrum.engine.request import SamplingParams

        engine = self.engines[kind]
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=4)
        engine.add_request("q", prompt, params)
        out: list[int] = []
        logprobs: list[Any] = []
        while engine.has_work:
            for o in engine.step():
                out += o.token_ids
                logprobs += o.logprobs or []
        return out, logprobs

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()


def compare(engines: _Engines, name: str, text: str, tokens: int) -> tuple[Outcome, str]:
    """One prompt decoded with and without speculation; where they part, the leads."""
    prompt = engines.vocab.tokenize(text, True, True)
    plain, plain_lp = engines.decode("none", prompt, tokens)
    spec, spec_lp = engines.decode("ngram", prompt, tokens)
    outcome = Outcome(name, len(plain), parting(plain, spec))
    split = outcome.part
    if split is None or split >= min(len(plain), len(spec)):
        return outcome, outcome.line()
    a, b = plain[split], spec[split]
    outcome.plain_lead = lead(dict(plain_lp[split].top), a, b)
    outcome.spec_lead = lead(dict(spec_lp[split].top), b, a)
    # The same position without speculation, computed inside a prefill batch instead.
    _, batch_lp = engines.decode("none", prompt + plain[:split], 1)
    outcome.prefill_lead = lead(dict(batch_lp[0].top), a, b)
    return outcome, outcome.line(a, b)


def main(run: StudyRun) -> int:
    from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

    tokens = run.option("tokens", 64 if run.quick else 200)
    engines = _Engines(run.model or builtin_path(DEFAULT_CHAT_MODEL), run.threads)
    outcomes, lines = [], []
    try:
        for name, text in prompts():
            if run.quick and name not in ("copy 0", "prose 0"):
                continue
            outcome, line = compare(engines, name, text, tokens)
            outcomes.append(outcome)
            lines.append(line)
            print(line, file=sys.stderr, flush=True)
    finally:
        engines.close()
    total = summary(outcomes, engines.drafts.drafted, engines.drafts.accepted)
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / "agreement.json").write_text(json.dumps(
        {"tokens": tokens, "outcomes": [asdict(o) for o in outcomes], "summary": total}, indent=1
    ))  # fmt: skip
    text = f"# {STUDY.title}\n\n" + "".join(f"- {line}\n" for line in lines) + f"\n{total}\n"
    (run.out / "results.md").write_text(text)
    print(text, end="")
    return 0


STUDY = Study(
    name="speculation-agreement",
    title="Does n-gram speculation change greedy output, and by how much where it does?",
    main=main,
)
