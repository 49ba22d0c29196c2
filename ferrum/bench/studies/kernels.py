"""Two or more llama.cpp builds, kernels alone: milliseconds per `llama_decode` of k positions
of one sequence (k = 1: a plain decode step; k > 1: a step that verifies k - 1 guesses), with
no server, no sampling and no Python between decodes that is not the same for every build.

An arm is a build, and a build is an interpreter whose llama-cpp-python was built with other
flags (a venv, e.g. scripts/install run with FERRUM_AVX512=0 into a copy of the checkout):
- `this`: the interpreter running `ferrum bench`;
- NAME: the interpreter `--set python.NAME=PATH` names (every such NAME is an arm when
  `--arms` is not given: `this` first, then the rest in the order given).
Per measurement the arm's interpreter runs `ferrum.engine.llama.kernel_timing` (from this code
tree, on PYTHONPATH) as a child: it loads the default chat model (or `--model`) with
`--threads` threads, prefills 192 positions, then for each k (`--set k=1,4,8`) decodes k
positions at the end of the sequence `--set reps=400` times (`--quick`: 50), keeping one each
time, and reports the median milliseconds per k. The arms alternate through
`rounds.alternate` (default 6 rounds, round 1 left out), the first arm the reference.

    ferrum bench --study kernels --set python.avx2=/tmp/avx2/bin/python [--set k=1,4,8]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from ferrum.bench.rounds import Metric
from ferrum.bench.studies import Study, StudyRun, run_study

THIS = "this"
PREFIX = "python."
# The tree this module belongs to: the child imports its kernel_timing from there.
TREE = Path(__file__).resolve().parents[3]


def interpreters(run: StudyRun) -> dict[str, str]:
    """Arm name -> interpreter: `this` and every `--set python.NAME=PATH`."""
    named = {k[len(PREFIX) :]: v for k, v in run.options.items() if k.startswith(PREFIX)}
    return {THIS: sys.executable, **named}


def ks(run: StudyRun) -> list[int]:
    text = run.option("k", "1,4,8")
    try:
        values = [int(k) for k in text.split(",")]
    except ValueError:
        raise ValueError(f"--set k={text!r}: expected positions per decode, e.g. 1,4,8") from None
    if not values or not all(1 <= k <= 64 for k in values):
        raise ValueError(f"--set k={text!r}: positions per decode from 1 to 64")
    return values


def metric_key(k: int) -> str:
    return f"k={k}"


def child_command(python: str, model: str, k: list[int], reps: int, threads: int) -> list[str]:
    return [python, "-P", "-m", "ferrum.engine.llama.kernel_timing", model, "--k",
            ",".join(map(str, k)), "--reps", str(reps), "--threads", str(threads)]  # fmt: skip


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

    pythons = interpreters(run)
    if arm not in pythons:
        raise ValueError(f"arm {arm!r} has no interpreter: --set {PREFIX}{arm}=PATH")
    reps = run.option("reps", 50 if run.quick else 400)
    cmd = child_command(pythons[arm], run.model or builtin_path(DEFAULT_CHAT_MODEL), ks(run),
                        reps, run.threads)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(TREE)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    ms = json.loads(done.stdout.strip().splitlines()[-1])
    return {metric_key(int(k)): v for k, v in ms.items()}


def main(run: StudyRun) -> int:
    """The builds alternated over the rounds, one metric per k."""
    ks(run)  # a bad --set k= is refused before any build runs
    arms = run.arms or list(interpreters(run))
    metrics = tuple(Metric(metric_key(k), "ms", higher_is_better=False, digits=2)
                    for k in ks(run))  # fmt: skip
    study = replace(STUDY, metrics=metrics, measure=measure, main=None)
    return run_study(replace(run, arms=arms), study)


STUDY = Study(
    name="kernels",
    title="llama.cpp builds, kernels alone: ms per llama_decode of k positions",
    arms=(THIS,),
    main=main,
    default_rounds=6,
    quick_rounds=2,
)
