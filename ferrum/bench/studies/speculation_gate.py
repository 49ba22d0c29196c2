"""Two speculation gates side by side on the engine alone: the tree's and an earlier commit's,
with speculation off beside them, in one process.

A server benchmark measures a gate through HTTP, the event loop and a noisy host; stories are
long and few, so a few percent hide in its ranges. Here one engine (SmolLM2-135M-Instruct or
`--model`, `--threads`, no prefix cache, so every arm writes the same greedy tokens) serves
every arm, swapping the Speculator per request, and the arms (off, tree, base) alternate per
prompt and round (`rounds.order`). Each speculating arm keeps its own table of recent
requests, which holds only its own earlier answers, to other prompts.

Cells (`--set cells=stories,burst4,burst8,copy`):
- `stories`: one client, 16 stories a round (`--quick`: 4), each topic new to every arm.
- `burst4`, `burst8`: 4 or 8 stories at once, one burst per arm a round.
- `copy`: one client, the speculation study's copy prompt with the arm's recent table
  emptied first (cold), then again with its answer there (again).
Reported: the time from the first output token to the last (prefill is the same for every
arm), as ratios of speculation off to each arm, over all and per story or round. Every round
counts (a warm-up request per arm runs before them). `--rounds` (default 2).

The earlier gate (`--set base=REV`, required) is ferrum/engine/speculation/speculator.py
(before issue #38's rooms, ferrum/engine/speculation.py) at that commit, loaded beside the
tree's; it must still fit the tree's engine (its Speculator is driven by `plan` where it has
one, else by `draft` one request at a time).

    ferrum bench --study speculation-gate --set base=2f219d4 [--rounds 2] [--set cells=stories]
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from ferrum.bench.rounds import order
from ferrum.bench.studies import Study, StudyRun
from ferrum.bench.studies.speculation import chat, prompt

ADJECTIVES = ["an old", "a small", "a red", "a forgotten", "a brave", "a tired", "a golden",
              "a secret"]  # fmt: skip
NOUNS = ["sailor", "bakery", "kite", "mirror", "fox", "bridge", "garden", "letter", "piano",
         "tower", "lantern", "orchard"]  # fmt: skip
TOPICS = [f"{a} {n}" for n, a in itertools.product(NOUNS, ADJECTIVES)]  # 96, each told once
ARMS = ("off", "tree", "base")
MAX_TOKENS = 200


def story(topic: str) -> str:
    return chat(f"Write a short story about {topic}.")


def ratios(times: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Per speculating arm: off's time over the arm's, over all and per measurement."""
    off = times["off"]
    return {
        arm: {
            "over_all": sum(off) / sum(times[arm]),
            "each": [o / t for o, t in zip(off, times[arm], strict=True)],
        }  # fmt: skip
        for arm in ARMS[1:]
    }


def report_lines(cell: str, times: dict[str, list[float]], per: str) -> list[str]:
    return [f"{cell:14} {arm}: x{r['over_all']:.3f} over all; per {per} "
            + ", ".join(f"{x:.2f}" for x in r["each"])
            for arm, r in ratios(times).items()]  # fmt: skip


def _load_base(rev: str) -> ModuleType:
    for name in ("speculation/speculator.py", "speculation.py"):  # the file moved (issue #38)
        shown = subprocess.run(["git", "show", f"{rev}:ferrum/engine/{name}"],
                               capture_output=True, text=True)  # fmt: skip
        if shown.returncode == 0:
            break
    else:
        raise ValueError(f"--set base={rev}: no speculation gate at that commit "
                         f"({shown.stderr.strip()})")  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "base_speculation.py"
    path.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location("base_speculation", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def _base_speculator(module: ModuleType) -> Any:
    spec = module.Speculator(module.SpecConfig())
    if not hasattr(spec, "plan"):  # one request at a time, `decoding` in the step
        draft = spec.draft

        def plan(reqs, room, limit=None, decoding=None):
            width = max(len(reqs), decoding or 0)
            return [draft(req, room, width) for req in reqs]

        spec.plan = plan
    return spec


class Bench:
    def __init__(self, base: str, model: str, threads: int, tokens: int) -> None:
        from ferrum.config import EngineConfig
        from ferrum.engine.engine import LLMEngine
        from ferrum.engine.llama.runner import LlamaRunner
        from ferrum.engine.speculation.speculator import SpecConfig

        config = EngineConfig(ctx_size=8192, parallel=8, batch_size=512, threads=threads,
                              no_prefix_cache=True)  # fmt: skip
        self.runner = LlamaRunner(config, model)
        self.engine = LLMEngine(self.runner, block_size=16, speculation=SpecConfig())
        self.arms: dict[str, Any] = {"off": None, "tree": self.engine.speculator,
                                     "base": _base_speculator(_load_base(base))}  # fmt: skip
        self.tokens, self._n = tokens, 0

    def run(self, prompts: list[str], arm: str) -> float:
        """Seconds from the first output token to the last of `prompts` sent at once."""
        from ferrum.engine.request import SamplingParams

        spec = self.arms[arm]
        if spec is not None:
            self.engine.speculator = self.engine.scheduler.speculator = spec
        params = SamplingParams(max_tokens=self.tokens, temperature=0.0, speculate=spec is not None)
        for text in prompts:
            self._n += 1
            self.engine.add_request(f"r{self._n}", self.runner.vocab.tokenize(text, True, True),
                                    params)  # fmt: skip
        first = None
        while self.engine.has_work:
            if self.engine.step() and first is None:
                first = time.perf_counter()
        if first is None:
            raise RuntimeError("the engine wrote no token")
        return time.perf_counter() - first

    def forget_recent(self, arm: str) -> None:
        from ferrum.engine.speculation.ngram import RecentSequences
        from ferrum.engine.speculation.speculator import SpecConfig

        if self.arms[arm] is not None:
            self.arms[arm].recent = RecentSequences(max_sequences=SpecConfig().recent)


def _cell(bench: Bench, cell: str, rounds: int, topics: Any, stories: int) -> list[str]:
    """One cell's rounds, the arms' order alternating (per story in `stories`); its lines."""
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    again: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(1, rounds + 1):
        if cell == "stories":
            for i, topic in enumerate(itertools.islice(topics, stories)):
                for arm in order(ARMS, r + i):
                    times[arm].append(bench.run([story(topic)], arm))
        elif cell.startswith("burst"):
            width = int(cell.removeprefix("burst"))
            prompts = [story(t) for t in itertools.islice(topics, width)]
            for arm in order(ARMS, r):
                times[arm].append(bench.run(prompts, arm))
        elif cell == "copy":
            for arm in order(ARMS, r):
                bench.forget_recent(arm)
                times[arm].append(bench.run([prompt("copy", 0)], arm))
                again[arm].append(bench.run([prompt("copy", 0)], arm))
        else:
            raise ValueError(f"unknown cell {cell!r}: stories, burst4, burst8 or copy")
    if cell == "copy":
        return report_lines("copy cold", times, "round") + report_lines("copy again", again,
                                                                          "round")  # fmt: skip
    return report_lines(cell, times, "story" if cell == "stories" else "round")


def main(run: StudyRun) -> int:
    from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

    base = run.option("base", "")
    if not base:
        raise ValueError("--study speculation-gate needs --set base=REV (the earlier gate)")
    tokens = run.option("tokens", 64 if run.quick else MAX_TOKENS)
    bench = Bench(base, run.model or builtin_path(DEFAULT_CHAT_MODEL), run.threads, tokens)
    for arm in ARMS[1:]:  # weights paged in; the decode sizes timed
        bench.run([prompt("prose", 0)], arm)
    topics = iter(TOPICS)
    stories = run.option("stories", 4 if run.quick else 16)
    lines: list[str] = []
    for cell in run.option("cells", "stories,burst4,burst8,copy").split(","):
        for line in _cell(bench, cell, run.rounds, topics, stories):
            print(line, file=sys.stderr, flush=True)
            lines.append(line)
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / "gate.json").write_text(json.dumps({"base": base, "lines": lines}, indent=1))
    text = (f"# {STUDY.title}\n\nbase {base}, {run.rounds} rounds, {tokens} tokens; off's "
            f"time ÷ the arm's (above 1: faster than speculation off)\n\n```\n"
            + "\n".join(lines) + "\n```\n")  # fmt: skip
    (run.out / "results.md").write_text(text)
    print(text, end="")
    return 0


STUDY = Study(
    name="speculation-gate",
    title="The tree's speculation gate against an earlier commit's, on the engine alone",
    main=main,
    default_rounds=2,
    quick_rounds=2,
)
