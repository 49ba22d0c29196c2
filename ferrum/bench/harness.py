"""Runs the rounds: one server at a time, arms alternated, every measurement recorded.

    for round in 1..R:                      round 1: warm-up, kept in the JSON, not summarised
      for workload in workloads:
        for arm in arms (reversed on even rounds):   ABBA: drift hits every arm alike
          wait for a quiet machine → start the server → warm-up request → workload
          → stop the server and wait for its port; re-run once if others used the CPUs

Each workload gets a freshly started server, so no workload sees what another left behind
(the burst's "cold" prefix is new text anyway). The `engine` workload starts no server: it
runs ferrum's decode loop and llama-batched-bench as child processes, alternated the same way.
"""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from ferrum.bench import engine_loop, machine
from ferrum.bench.arms import Arm, llama_cpp_build_dir, server_command
from ferrum.bench.client import Sample, served_model_id, stream_completion
from ferrum.bench.process import ServerProcess, log_tail, wait_port_free
from ferrum.bench.prompts import PromptSource
from ferrum.bench.settings import BenchSettings
from ferrum.bench.workloads import WORKLOADS, Context

# The engine workload's sides: ferrum's loop and llama.cpp's in each KV shape of CEILINGS.
ENGINE_ARMS = ("ferrum", *engine_loop.CEILINGS)
SEED = "ferrum-bench"


@dataclass
class Plan:
    settings: BenchSettings
    arms: list[Arm]
    workloads: list[str]
    model: str
    port: int
    out: Path
    notes: list[str] = field(default_factory=list)  # arms left out and why, etc.
    engine_sides: tuple[str, ...] = ENGINE_ARMS  # the engine workload's sides (or ferrum only)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def steps(self) -> int:
        sides = {
            w: len(self.engine_sides) if w == "engine" else len(self.arms) for w in self.workloads
        }
        per_round = sum(sides.values())
        return per_round * self.settings.rounds


class Reporter(Protocol):
    def begin(self, what: str) -> None: ...  # a measurement starts: "r2 burst llama-server"

    def update(self, record: dict) -> None: ...  # it ended (or failed): its record


def run(plan: Plan, report: Reporter) -> list[dict]:
    """All measurements of the plan. Ctrl-C or SIGTERM ends the run early: the server then
    running is stopped (`measure`'s finally) and the records so far are returned."""
    records: list[dict] = []
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        _run_rounds(plan, report, records)
    except KeyboardInterrupt:
        plan.notes.append(
            f"INTERRUPTED after {len(records)} of {plan.steps()} measurements: partial results"
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    return records


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run_rounds(plan: Plan, report: Reporter, records: list[dict]) -> None:
    journal = plan.out / "records.jsonl"  # survives a crash; removed once results.json exists
    for round_no in range(1, plan.settings.rounds + 1):
        for workload in plan.workloads:
            sides: list[Any] = list(plan.engine_sides if workload == "engine" else plan.arms)
            for side in sides if round_no % 2 else sides[::-1]:
                if workload == "engine":
                    fn = functools.partial(measure_engine, plan, side, round_no)
                else:
                    fn = functools.partial(measure, plan, side, workload, round_no)
                label = side if workload == "engine" else side.label
                report.begin(f"r{round_no} {workload} {label}")
                t0 = time.monotonic()
                record = _with_retries(fn, plan.settings.retries)
                # Whole cost incl. quiet wait, start, stop and re-runs: calibrates estimates.
                record["duration_s"] = time.monotonic() - t0
                records.append(record)
                with open(journal, "a", encoding="utf-8") as f:
                    f.write(json.dumps(jsonable(record)) + "\n")
                report.update(record)


def _with_retries(fn: Callable[[], dict], retries: int) -> dict:
    discarded: list[dict] = []
    while True:
        record = fn()
        if not record.get("contaminated") or len(discarded) >= retries:
            record["discarded_attempts"] = discarded
            return record
        discarded.append(record)


# ------------------------------------------------------------------ HTTP arms


def measure(plan: Plan, arm: Arm, workload: str, round_no: int) -> dict:
    s = plan.settings
    record: dict[str, Any] = {"workload": workload, "arm": arm.label, "kind": arm.kind}
    record["round"] = round_no
    server = None
    base = arm.url or plan.base
    try:
        if arm.kind != "url":
            wait_port_free(plan.port)
            record["quiet_check"] = machine.wait_quiet(s.quiet_threshold, s.quiet_wait_s)
            name = f"{workload}-{arm.label.replace('#', '_')}-r{round_no}"
            state_dir = plan.out / "kv" / name
            cmd = server_command(arm, s, plan.model, plan.port, state_dir)
            log = plan.out / "logs" / f"{name}.log"
            record.update(command=cmd, log=str(log))
            server = ServerProcess(cmd, log, plan.port, scratch=state_dir)
            record["startup_s"] = server.wait_ready(base, arm.ready_path)
        before = machine.snapshot(server.pid) if server else None
        try:
            raw, metrics = asyncio.run(
                asyncio.wait_for(
                    _measure(base, arm, workload, round_no, s), s.measurement_timeout_s
                )
            )
        finally:
            # A url server is not ours: its CPU would count as foreign, so no check there.
            after = machine.snapshot(server.pid) if server else None
            record["cpu"] = machine.usage(before, after)
        record.update(metrics=metrics, raw=raw)
    except Exception as exc:  # one failed measurement is reported, not fatal
        record["error"] = f"{type(exc).__name__}: {exc}".strip()
        if server is not None:
            record["log_tail"] = log_tail(server.log_path)
    finally:
        if server is not None:
            server.stop()
    _judge(record, s)
    return record


async def _measure(
    base: str, arm: Arm, workload: str, round_no: int, s: BenchSettings
) -> tuple[dict, dict]:
    # No keep-alive: a fresh connection per request, so no request races a server closing an
    # idle pooled connection (cpp-httplib drops them after 5 s). Localhost connect ~0.1 ms.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=base, timeout=s.request_timeout_s, limits=limits
    ) as client:
        model = await served_model_id(client)
        warm = PromptSource(SEED, round_no, "warm-up").unrelated()
        await stream_completion(client, model, warm, 4, arm.dialect)  # lazy init, not measured
        ctx = Context(client, model, arm.dialect, s, PromptSource(SEED, round_no, workload))
        return await WORKLOADS[workload](ctx)


def _judge(record: dict, s: BenchSettings) -> None:
    cpu, quiet = record.get("cpu"), record.get("quiet_check") or {"quiet": True}
    foreign = cpu["foreign_share"] if cpu else 0.0
    disturbed = foreign > s.max_foreign or not quiet["quiet"]
    record["contaminated"] = "error" not in record and disturbed


# ------------------------------------------------------------------ engine workload


def measure_engine(plan: Plan, side: str, round_no: int) -> dict:
    s = plan.settings
    record: dict[str, Any] = {"workload": "engine", "arm": side, "kind": side, "round": round_no}
    args = (plan.model, s.threads, s.ctx_size, list(s.engine_batches))
    shape = (s.engine_prompt_tokens, s.engine_tokens)
    if side == "ferrum":
        cmd = engine_loop.ferrum_command(*args, *shape)
        runner = engine_loop.run_ferrum
    else:
        binary = llama_cpp_build_dir() / "llama-batched-bench"
        cmd = engine_loop.ceiling_command(binary, *args, *shape, side)
        runner = engine_loop.run_ceiling
    record["command"] = cmd
    record["quiet_check"] = machine.wait_quiet(s.quiet_threshold, s.quiet_wait_s)
    before = machine.snapshot(None)
    try:
        tps = runner(cmd, s.measurement_timeout_s)
        record["metrics"] = {f"b{b}.tps": tps.get(b) for b in s.engine_batches}
        record["raw"] = {"decode_tps": tps}
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}".strip()
    record["cpu"] = machine.usage(before, machine.snapshot(None))
    _judge(record, s)
    return record


# ------------------------------------------------------------------ helpers


def jsonable(obj: Any) -> Any:
    if isinstance(obj, Sample):
        return jsonable(obj.as_dict())
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def capabilities(records: list[dict], arm: Arm) -> dict[str, str]:
    """What an arm did for fairness, as observed in its samples."""
    samples = [
        x
        for r in records
        if r["arm"] == arm.label and r["workload"] != "engine"
        for x in _samples(r.get("raw"))
    ]
    cached = any(x.cached_tokens is not None for x in samples)
    usage = all(x.counts_from == "usage" for x in samples) if samples else None
    eos = {"native": "yes (ignore_eos)", "logit_bias": "emulated (logit_bias -1e9 on EOG ids)"}
    return {
        "ignore_eos": eos.get(arm.dialect.ignore_eos, "no (may stop early)"),
        "cached_tokens": "reported" if cached else "not reported",
        "usage": "n/a" if usage is None else "in stream" if usage else "counted afterwards",
        "requests": "one at a time" if arm.serial else "concurrent",
    }


def _samples(raw: Any) -> list[Sample]:
    if isinstance(raw, Sample):
        return [raw]
    if isinstance(raw, dict):
        return [x for v in raw.values() for x in _samples(v)]
    if isinstance(raw, list):
        return [x for v in raw for x in _samples(v)]
    return []


def elapsed_since(t0: float) -> str:
    m, sec = divmod(int(time.monotonic() - t0), 60)
    return f"{m} min {sec} s"


def warn(msg: str) -> None:
    print(msg, file=sys.stderr)
