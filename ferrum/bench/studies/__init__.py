"""Studies: the measurements of one question each (`ferrum bench --study NAME`), beside the
harness's workloads (`--workloads`).

A study names its arms ("ferrum", "llama-server", "ferrum ngram", a code tree given with
`--tree NAME=PATH` ...), the metrics it reports and a `measure(run, arm, round)` that starts
what the arm needs, measures and stops it; `ferrum.bench.rounds` alternates the arms, keeps
round 1 out and writes the results. A study that is no comparison of arms (a soak, a routing
simulation) gives `main(run)` instead. Study modules load only when their study runs, so that
`ferrum --help` needs none of their libraries.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ferrum.bench.process import ServerProcess, ferrum_command, free_port
from ferrum.bench.rounds import Hygiene, Metric

# study name -> module under ferrum.bench.studies (loaded on use).
STUDIES = {
    "burst": "burst",
    "stalls": "stalls",
    "soak": "soak",
    "embeddings": "embeddings",
    "structured": "structured",
    "models": "models",
    "speculation": "speculation",
    "speculation-agreement": "speculation_agreement",
    "speculation-gate": "speculation_gate",
    "tiers": "tiers",
    "cluster": "cluster",
    "kernels": "kernels",
    "router": "router",
    "lora": "lora",
    "kvtypes": "kvtypes",
    "residency": "residency",
    "vision": "vision",
    "prefill": "prefill",
}

T = TypeVar("T", int, float, str, bool)


@dataclass
class StudyRun:
    """What the command line gave a study."""

    name: str
    out: Path
    rounds: int
    threads: int
    quick: bool
    arms: list[str] | None  # --arms, else the study's own
    trees: dict[str, Path] = field(default_factory=dict)  # --tree NAME=PATH: ferrum from PATH
    options: dict[str, str] = field(default_factory=dict)  # --set KEY=VALUE
    model: str | None = None  # --model
    hygiene: Hygiene | None = Hygiene()

    def is_ferrum(self, arm: str) -> bool:
        """A ferrum arm: this package ("ferrum", "ferrum ngram" ...) or a `--tree`."""
        return arm in self.trees or arm.split()[0] == "ferrum"

    def option(self, key: str, default: T) -> T:
        """A study knob from `--set KEY=VALUE`, typed as its default."""
        text = self.options.get(key)
        if text is None:
            return default
        if isinstance(default, bool):
            return text.lower() in ("1", "true", "yes", "on")
        try:
            return type(default)(text)
        except ValueError:
            raise ValueError(f"--set {key}={text!r}: expected {type(default).__name__}") from None

    def ferrum(
        self, arm: str, *flags: str, env: dict[str, str] | None = None, python: str | None = None
    ) -> ServerProcess:
        """`ferrum serve` for `arm`, from the code tree `--tree` names for it (PYTHONPATH) or
        this package, on `python` (another interpreter: another llama.cpp build) or this one;
        ready when /health answers."""
        port = free_port()
        env = {**os.environ, **(env or {})}
        if arm in self.trees:
            env["PYTHONPATH"] = str(self.trees[arm])
        # A disk tier of its own unless the study names one: the default folder outlives the
        # server, and a study's seeded prompts would meet an earlier run's saved states there.
        scratch = None
        if "--cache-dir" not in flags and "--cache-disk" not in flags:
            scratch = self.out / "kv" / f"{arm.replace(' ', '_')}-{port}"
            flags = (*flags, "--cache-dir", str(scratch))
        cmd = ferrum_command(port, "--threads", str(self.threads), *flags)
        cmd[0] = python or cmd[0]
        server = ServerProcess(
            cmd,
            self.out / f"{arm.replace(' ', '_')}.log", port, env=env, scratch=scratch,
        )  # fmt: skip
        return _ready(server)

    def llama_server(
        self, arm: str, model: str, *flags: str, flavor: str = "same"
    ) -> ServerProcess:
        """llama.cpp's server (bench/build_llama_server.sh builds it) on `model`."""
        from ferrum.bench.arms import llama_cpp_build_dir

        binary = llama_cpp_build_dir(flavor) / "llama-server"
        if not binary.is_file():
            raise RuntimeError(f"{binary} not built: run bench/build_llama_server.sh")
        port = free_port()
        cmd = [str(binary), "-m", model, "-t", str(self.threads), "--port", str(port), *flags]
        return _ready(ServerProcess(cmd, self.out / f"{arm.replace(' ', '_')}.log", port))


def _ready(server: ServerProcess) -> ServerProcess:
    try:
        server.wait_ready(server.url, "/health", timeout=300)
    except BaseException:
        server.stop()
        raise
    return server


@dataclass(frozen=True)
class Study:
    name: str
    title: str  # one line: the question it answers
    arms: tuple[str, ...] = ()  # default arms, reference first
    metrics: tuple[Metric, ...] = ()
    measure: Callable[[StudyRun, str, int], dict[str, float]] | None = None
    main: Callable[[StudyRun], int] | None = None  # a study that is no comparison of arms
    default_rounds: int = 4
    quick_rounds: int = 2


def load(name: str) -> Study:
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; choose from {', '.join(STUDIES)}")
    module = importlib.import_module(f"ferrum.bench.studies.{STUDIES[name]}")
    study: Study = module.STUDY
    return study


def parse_pairs(items: list[str], flag: str) -> dict[str, str]:
    """`NAME=VALUE` items of a repeatable flag."""
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {item!r}: expected NAME=VALUE")
        pairs[key.strip()] = value
    return pairs


def run_study(run: StudyRun, study: Study) -> int:
    """The study's main, or its arms alternated over the rounds; 1 when a measurement failed."""
    from ferrum.bench import rounds

    if study.main is not None:
        return study.main(run)
    measure = study.measure
    if measure is None:
        raise ValueError(f"study {study.name} has neither measure nor main")
    arms = run.arms or list(study.arms) + [t for t in run.trees if t not in study.arms]
    if not arms:
        raise ValueError(f"study {study.name} needs arms: --arms or --tree NAME=PATH")
    records = rounds.alternate(arms, run.rounds, lambda arm, r: measure(run, arm, r), run.hygiene)
    rows = rounds.summarize(records, arms, study.metrics, reference=arms[0])
    meta: dict[str, Any] = {"study": study.name, "arms": arms, "rounds": run.rounds,
                            "threads": run.threads, "options": run.options,
                            "trees": {k: str(v) for k, v in run.trees.items()}}  # fmt: skip
    md = rounds.write(run.out, study.title, records, rows, arms[0], meta)
    print(md.read_text(), end="")
    return 1 if any("error" in r for r in records) else 0
