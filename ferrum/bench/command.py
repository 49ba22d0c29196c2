"""`ferrum bench`: its flags, the plan (arms, workloads, estimate) and the run.

Imports nothing beyond the standard library at module level, so `ferrum --help` works
without the optional `bench` extra; the harness (httpx, tqdm, matplotlib) loads in `run`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from ferrum.bench.settings import FULL, QUICK, WORKLOADS, estimate_seconds

HELP = "side-by-side benchmark: ferrum vs llama-server, llama-cpp-python or any URL"
EPILOG = """
arms: ferrum (this package), llama-server and llama-batched-bench (llama.cpp's own, built by
bench/build_llama_server.sh from the pinned llama-cpp-python sdist with ferrum's kernel flags),
llama-server-default (the same server as its users build it, cmake defaults: built by
FLAVOR=default bench/build_llama_server.sh), llama-cpp-python (its server; needs the bench
extra), url (any OpenAI-compatible server given with --url).
"auto" = ferrum plus every other arm available here. The first arm is the reference that
ratios and verdicts are stated for. The engine workload always compares ferrum's decode loop
with llama-batched-bench, whatever --arms says: with ferrum's KV pool, with a cache per
sequence ("llama-batched-bench streams": what the pool costs), and with the window layers
sized to their windows ("llama-batched-bench windows": what swa_full costs).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help=HELP,
        description=HELP,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--arms", default="auto", help="comma-separated arms, reference first")
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"any of {', '.join(WORKLOADS)}"
    )
    p.add_argument("--rounds", type=int, help="rounds incl. the discarded warm-up (default 4)")
    p.add_argument("--out", help="output folder (default bench/results/<timestamp>)")
    p.add_argument("--model", help="GGUF model (default: Gemma 3 270M Q4_K_M)")
    p.add_argument("--threads", type=int, help="CPU threads of every arm (default: physical cores)")
    p.add_argument("--url", help="base URL of an OpenAI-compatible server (the url arm)")
    p.add_argument("--quick", action="store_true", help="a few minutes: a smoke test")
    p.add_argument("--port", type=int, default=18093, help="port the started servers listen on")
    p.add_argument(
        "--study",
        help="run one study instead of the workloads: burst, stalls, soak, embeddings, "
        "structured, models, speculation, speculation-agreement, speculation-gate, tiers, "
        "cluster, kernels, router, lora, kvtypes, residency",
    )
    p.add_argument(
        "--tree", action="append", default=[], metavar="NAME=PATH",
        help="(studies) an arm NAME: ferrum from the code tree PATH, e.g. a worktree of an "
        "older commit (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="options",
        help="a study's own knob (--set bursts=2) or a workload setting "
        "(--set longctx_clients=16, --set sweep_levels=1,8,32) (repeatable)",
    )  # fmt: skip


def _parse_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _arms(args: argparse.Namespace, notes: list[str], model: str) -> list:
    from ferrum.bench.arms import ARM_KINDS, make_arm, unavailable_reason
    from ferrum.bench.engine_loop import eog_token_ids

    if args.arms == "auto":
        kinds = ["ferrum"]
        for kind in ("llama-server", "llama-server-default", "llama-cpp-python"):
            reason = unavailable_reason(kind)
            if reason:
                notes.append(f"arm {kind} left out: {reason}")
            else:
                kinds.append(kind)
        kinds += ["url"] if args.url else []
    else:
        kinds = _parse_list(args.arms)
    arms: list[Any] = []
    for kind in kinds:
        if kind not in ARM_KINDS:
            raise ValueError(f"unknown arm {kind!r}; choose from {', '.join(ARM_KINDS)}")
        if kind == "url" and not args.url:
            raise ValueError("the url arm needs --url http://host:port")
        reason = unavailable_reason(kind)
        if reason:
            raise ValueError(f"arm {kind} cannot run: {reason}")
        same = sum(a.kind == kind for a in arms)
        label = kind if same == 0 else f"{kind}#{same + 1}"
        eog = eog_token_ids(model) if kind == "llama-cpp-python" else ()
        arms.append(make_arm(kind, label, url=args.url or "", eog=eog))
    if not arms:
        raise ValueError("--arms is empty")
    return arms


def _probe_url_arms(arms: list) -> list:
    """An unknown server keeps `ignore_eos` only if it accepts the field."""
    import asyncio

    import httpx

    from ferrum.bench.client import probe_ignore_eos, served_model_id

    async def probe(base: str) -> bool:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            return await probe_ignore_eos(client, await served_model_id(client))

    out = []
    for arm in arms:
        if arm.kind == "url" and not asyncio.run(probe(arm.url)):
            dialect = dataclasses.replace(arm.dialect, ignore_eos="none")
            arm = dataclasses.replace(arm, dialect=dialect)
        out.append(arm)
    return out


def _machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}, {os.cpu_count()} CPUs {model}".strip()


def run(args: argparse.Namespace) -> int:
    try:
        return _run_study(args) if args.study else _run(args)
    except ValueError as exc:
        print(f"ferrum bench: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(
            f"ferrum bench: {exc}; install the extra: pip install 'ferrum[bench]'", file=sys.stderr
        )
        return 2


def _run_study(args: argparse.Namespace) -> int:
    from ferrum.bench.studies import StudyRun, load, parse_pairs, run_study
    from ferrum.cores import physical_cores

    study = load(args.study)
    rounds = args.rounds or (study.quick_rounds if args.quick else study.default_rounds)
    trees = {k: Path(v).resolve() for k, v in parse_pairs(args.tree, "--tree").items()}
    for name, path in trees.items():
        if not (path / "ferrum").is_dir():
            raise ValueError(f"--tree {name}={path}: no ferrum package there")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run = StudyRun(
        name=study.name,
        out=Path(args.out or Path("bench") / "results" / f"{study.name}-{stamp}"),
        rounds=rounds,
        threads=args.threads or physical_cores(),
        quick=args.quick,
        arms=_parse_list(args.arms) if args.arms != "auto" else None,
        trees=trees,
        options=parse_pairs(args.options, "--set"),
        model=args.model,
    )
    print(f"ferrum bench --study {study.name}: {study.title}; {rounds} rounds -> {run.out}",
          file=sys.stderr)  # fmt: skip
    return run_study(run, study)


def _plan(args: argparse.Namespace) -> Any:
    from ferrum.bench.arms import build_hint, llama_cpp_build_dir
    from ferrum.bench.harness import Plan
    from ferrum.bench.studies import parse_pairs
    from ferrum.cores import physical_cores
    from ferrum.models import BENCH_MODEL, builtin_path

    settings = QUICK if args.quick else FULL
    if args.rounds is not None:
        if args.rounds < 2:
            raise ValueError("--rounds must be at least 2 (round 1 is a discarded warm-up)")
        settings = settings.replace(rounds=args.rounds)
    settings = settings.replace(threads=args.threads or physical_cores())
    settings = settings.with_options(parse_pairs(args.options, "--set"))
    workloads = _parse_list(args.workloads)
    for w in workloads:
        if w not in WORKLOADS:
            raise ValueError(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    model = args.model or builtin_path(BENCH_MODEL)
    if not os.path.isfile(model):
        raise ValueError(f"model file not found: {model}")
    notes: list[str] = []
    arms = _probe_url_arms(_arms(args, notes, model))
    out = Path(args.out or Path("bench") / "results" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    plan = Plan(settings, arms, workloads, model, args.port, out, notes)
    if "engine" in workloads and not (llama_cpp_build_dir() / "llama-batched-bench").is_file():
        plan.engine_sides = ("ferrum",)
        notes.append(f"engine workload: no llama-batched-bench ceiling; {build_hint()}")
    return plan


def _run(args: argparse.Namespace) -> int:
    from ferrum.bench import harness, output
    from ferrum.bench.progress import Progress

    plan = _plan(args)
    preset = "quick" if args.quick else "full"
    estimate = estimate_seconds(plan.settings, [a.serial for a in plan.arms], plan.workloads)
    print(
        f"ferrum bench ({preset}): arms {', '.join(a.label for a in plan.arms)}; workloads "
        f"{', '.join(plan.workloads)}; {plan.settings.rounds} rounds; {plan.settings.threads} "
        f"threads; estimated ~{estimate / 60:.0f} min on a quiet machine -> {plan.out}",
        file=sys.stderr,
    )
    for note in plan.notes:
        print(f"  {note}", file=sys.stderr)
    t0 = time.monotonic()
    with Progress(plan.steps()) as progress:
        records = harness.run(plan, progress)
    meta = _meta(plan, preset)
    meta.update(
        elapsed=harness.elapsed_since(t0),
        elapsed_s=time.monotonic() - t0,
        estimate_min=estimate / 60,
    )
    files = output.write(plan, records, meta)
    print(files["md"].read_text(), end="")
    print(f"\nresults: {files['md']} (raw samples: {files['json']})", file=sys.stderr)
    return 1 if any("error" in r for r in records) else 0


def _meta(plan: Any, preset: str) -> dict:
    from ferrum.bench import engine_loop
    from ferrum.bench.arms import llama_cpp_build_dir, server_command

    commands = {
        a.label: [a.url]
        if a.kind == "url"
        else server_command(a, plan.settings, plan.model, plan.port, Path("OUT/kv/RUN"))
        for a in plan.arms
    }
    if "engine" in plan.workloads:
        s = plan.settings
        args = (plan.model, s.threads, s.ctx_size, list(s.engine_batches))
        shape = (s.engine_prompt_tokens, s.engine_tokens)
        commands["engine: ferrum"] = engine_loop.ferrum_command(*args, *shape)
        binary = llama_cpp_build_dir() / "llama-batched-bench"
        for side in plan.engine_sides[1:]:
            commands[f"engine: {side}"] = engine_loop.ceiling_command(binary, *args, *shape, side)
    return {
        "preset": preset,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": _machine(),
        "python": sys.version.split()[0],
        "versions": _versions(),
        "model": plan.model,
        "settings": dataclasses.asdict(plan.settings),
        "arms": [{"label": a.label, "kind": a.kind, "url": a.url} for a in plan.arms],
        "commands": commands,
        "notes": plan.notes,
    }


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("ferrum", "llama-cpp-python"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out
