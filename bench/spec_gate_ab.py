"""Two speculation gates side by side on the engine alone: the tree's and an earlier commit's,
with speculation off beside them, in one process.

A server benchmark measures a gate through HTTP, the event loop and a noisy host; stories are
long and few, so a few percent hide in its ranges. Here one engine (SmolLM2-135M-Instruct, 2
threads, no prefix cache, so every arm writes the same greedy tokens) serves every arm,
swapping the Speculator per request, and the arms alternate per prompt and round. Each
speculating arm keeps its own table of recent requests, which holds only its own earlier
answers, to other prompts (a story never follows its own earlier run).

Cells (`--cells`):
- `stories`: one client, 16 stories a round, each topic new to every arm.
- `burst4`, `burst8`: 4 or 8 stories at once, one burst per arm a round.
- `copy`: one client, the copy prompt of bench_speculation.py with the arm's recent table
  emptied first (cold), then again with its answer there (again).
Reported: the time from the first output token to the last (prefill is the same for every
arm), as ratios of speculation off to each arm, per round and over all.

The earlier gate (`--base REV`) is the file ferrum/engine/speculation/speculator.py (before
issue #38's rooms, ferrum/engine/speculation.py) at that commit, loaded beside the tree's; it
must still fit the tree's engine (its Speculator is driven by `plan` where it has one, else by
`draft` one request at a time).

    .venv/bin/python bench/spec_gate_ab.py --base 2f219d4 [--rounds 2] [--cells stories,copy]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_speculation import _chat, _prompt  # noqa: E402

from ferrum.config import EngineConfig  # noqa: E402
from ferrum.engine.engine import LLMEngine  # noqa: E402
from ferrum.engine.llama.runner import LlamaRunner  # noqa: E402
from ferrum.engine.request import SamplingParams  # noqa: E402
from ferrum.engine.speculation.ngram import RecentSequences  # noqa: E402
from ferrum.engine.speculation.speculator import SpecConfig  # noqa: E402
from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path  # noqa: E402

ADJECTIVES = ["an old", "a small", "a red", "a forgotten", "a brave", "a tired", "a golden",
              "a secret"]  # fmt: skip
NOUNS = ["sailor", "bakery", "kite", "mirror", "fox", "bridge", "garden", "letter", "piano",
         "tower", "lantern", "orchard"]  # fmt: skip
TOPICS = [f"{a} {n}" for n, a in itertools.product(NOUNS, ADJECTIVES)]  # 96, each told once
MAX_TOKENS = 200


def _load_base(rev: str) -> ModuleType:
    for name in ("speculation/speculator.py", "speculation.py"):  # the file moved (issue #38)
        shown = subprocess.run(["git", "show", f"{rev}:ferrum/engine/{name}"],
                               capture_output=True, text=True)  # fmt: skip
        if shown.returncode == 0:
            break
    shown.check_returncode()
    source = shown.stdout
    path = Path(tempfile.mkdtemp()) / "base_speculation.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("base_speculation", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def _base_speculator(module: ModuleType) -> Any:
    spec = module.Speculator(module.SpecConfig())
    if not hasattr(spec, "plan"):  # one request at a time, `decoding` in the step
        draft = spec.draft

        def plan(reqs, room, limit=None, decoding=None):  # type: ignore[no-untyped-def]
            width = max(len(reqs), decoding or 0)
            return [draft(req, room, width) for req in reqs]

        spec.plan = plan
    return spec


class Bench:
    def __init__(self, base: str) -> None:
        config = EngineConfig(ctx_size=8192, parallel=8, batch_size=512, threads=2,
                              no_prefix_cache=True)  # fmt: skip
        self.runner = LlamaRunner(config, builtin_path(DEFAULT_CHAT_MODEL))
        self.engine = LLMEngine(self.runner, block_size=16, speculation=SpecConfig())
        self.arms: dict[str, Any] = {"off": None, "tree": self.engine.speculator,
                                     "base": _base_speculator(_load_base(base))}  # fmt: skip
        self._n = 0

    def run(self, prompts: list[str], arm: str) -> float:
        """Seconds from the first output token to the last of `prompts` sent at once."""
        spec = self.arms[arm]
        if spec is not None:
            self.engine.speculator = self.engine.scheduler.speculator = spec
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, speculate=spec is not None)
        for prompt in prompts:
            self._n += 1
            tokens = self.runner.vocab.tokenize(prompt, True, True)
            self.engine.add_request(f"r{self._n}", tokens, params)
        first = None
        while self.engine.has_work:
            if self.engine.step() and first is None:
                first = time.perf_counter()
        assert first is not None
        return time.perf_counter() - first

    def forget_recent(self, arm: str) -> None:
        if self.arms[arm] is not None:
            self.arms[arm].recent = RecentSequences(max_sequences=SpecConfig().recent)


def _report(cell: str, times: dict[str, list[float]], per: str) -> None:
    off = times["off"]
    for arm in ("tree", "base"):
        ratios = [o / t for o, t in zip(off, times[arm], strict=True)]
        print(f"{cell:14} {arm}: x{sum(off) / sum(times[arm]):.3f} over all; per {per} "
              + ", ".join(f"{r:.2f}" for r in ratios), flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit whose gate to compare")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cells", default="stories,burst4,burst8,copy")
    args = ap.parse_args()
    bench = Bench(args.base)
    arms = list(bench.arms)
    for arm in arms[1:]:  # weights paged in; the decode sizes timed
        bench.run([_prompt("prose", 0)], arm)
    topics = iter(TOPICS)
    for cell in args.cells.split(","):
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        extra: dict[str, list[float]] = {arm: [] for arm in arms}
        for r in range(args.rounds):
            if cell == "stories":
                for i, topic in enumerate(itertools.islice(topics, 16)):
                    prompt = _chat(f"Write a short story about {topic}.")
                    for arm in arms if (i + r) % 2 == 0 else arms[::-1]:
                        times[arm].append(bench.run([prompt], arm))
            elif cell.startswith("burst"):
                width = int(cell.removeprefix("burst"))
                prompts = [_chat(f"Write a short story about {t}.")
                           for t in itertools.islice(topics, width)]  # fmt: skip
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    times[arm].append(bench.run(prompts, arm))
            else:
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    bench.forget_recent(arm)
                    times[arm].append(bench.run([_prompt("copy", 0)], arm))
                    extra[arm].append(bench.run([_prompt("copy", 0)], arm))
        _report(f"{cell}" + (" cold" if cell == "copy" else ""), times,
                "story" if cell == "stories" else "round")  # fmt: skip
        if cell == "copy":
            _report("copy again", extra, "round")


if __name__ == "__main__":
    main()
