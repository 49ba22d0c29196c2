"""Structured output side by side with llama-server (issue #41's benchmark): which schemas each
server takes, whether its finished answers validate, and what constraining costs.

Arms, one server at a time on the same GGUF (SmolLM2-135M-Instruct unless `--model`), greedy,
no repetition penalty on either: `ferrum` (`--parallel 12 --ctx-size 8192 --cache-disk 0`;
`ferrum none`: speculation off) and `llama-server-default` (llama.cpp's server built with cmake
defaults, `-np 12 -c 8192 --kv-unified`; `llama-server`: ferrum's kernel flags). Per server:
  cells    for each request kind and client count (`--set clients=1,8`), every client sends
           `reps` streamed chat requests in turn: `free` (unconstrained, ignore_eos), `schema`
           (the same request with a json_schema response_format whose array needs more items
           than `tokens` can hold, so both run to max_tokens) and `logprobs` (top 5).
           tok/s (completion tokens ÷ the cell's wall time), TTFT p50, and schema ÷ free
           (goal ≥ 0.95).
  stall    four streams decode; `bursts` bursts of 8 chat requests, each with a `props`-property
           schema of its own (max_tokens 1), arrive one after the other: the streams' p99
           inter-token gap before and during them.
  corpus   `schemas` schemas of ferrum's generated corpus (`ferrum/bench/schema_corpus.py`, a
           new draw every round, the same for every arm in a round) as response_format
           json_schema, 8 at a time, `corpus_tokens` tokens: shares accepted, finished,
           finished answers that validate (jsonschema, formats checked), and invalid answers
           (goal 0). Refusals and invalid answers: corpus-ARM-rROUND.json; totals over the kept
           rounds below the table.

    ferrum bench --study structured [--quick] [--rounds 4] [--set schemas=40] [--set tokens=128]
        [--set clients=1,8] [--set kinds=free,schema,logprobs] [--arms ferrum,llama-server]
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from ferrum.bench import schema_corpus
from ferrum.bench.arms import LLAMA_SERVER_FLAVORS
from ferrum.bench.client import Dialect, Sample, http_client, stream_body, stream_completion
from ferrum.bench.process import ServerProcess
from ferrum.bench.rounds import Metric
from ferrum.bench.studies import Study, StudyRun, run_study
from ferrum.bench.studies.speculation import SAME_OUTPUT, ferrum_flags
from ferrum.bench.studies.stalls import p99_gap_ms
from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

ARMS = ("ferrum", "llama-server-default")
KINDS = ("free", "schema", "logprobs")
CHAT = "/v1/chat/completions"
MODEL = "bench"  # ferrum serves the file under this name; llama-server takes any
PARALLEL, CTX = 12, 8192  # room for 8 clients, and for the stall's 4 streams beside 8 arrivals
STREAMS, BURST = 4, 8
BASELINE_GAPS = 20  # inter-token gaps the stall's baseline window holds at least
CORPUS_AT_ONCE = 8
PROMPT = "Fill in this JSON form with plausible values."


def long_schema(tokens: int) -> dict[str, Any]:
    """An object holding a list of at least `tokens` strings: more than `tokens` answer tokens
    can hold (an item and its comma take two at least), so a constrained answer runs to
    max_tokens, as long as the free one it is compared with."""
    items = {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": tokens}
    return {"type": "object", "properties": {"animals": items}, "required": ["animals"]}


@dataclasses.dataclass(frozen=True)
class Sizes:
    schemas: int  # corpus schemas per round
    corpus_tokens: int
    tokens: int  # max_tokens of the cells' requests
    clients: tuple[int, ...]
    kinds: tuple[str, ...]
    reps: int  # requests per client in a cell
    props: int  # properties of a stall schema
    bursts: int


def sizes(run: StudyRun) -> Sizes:
    """The run's sizes: `--set` knobs over the defaults (smaller under `--quick`)."""
    q = run.quick
    kinds = tuple(run.option("kinds", ",".join(KINDS)).split(","))
    if unknown := [k for k in kinds if k not in KINDS]:
        raise ValueError(f"--set kinds: unknown {unknown}; choose from {', '.join(KINDS)}")
    return Sizes(
        schemas=run.option("schemas", 6 if q else 40),
        corpus_tokens=run.option("corpus_tokens", 96 if q else 256),
        tokens=run.option("tokens", 32 if q else 128),
        clients=tuple(int(c) for c in run.option("clients", "1,8").split(",")),
        kinds=kinds,
        reps=run.option("reps", 1 if q else 2),
        props=run.option("props", 60),
        bursts=run.option("bursts", 1 if q else 3),
    )


def body(kind: str, tokens: int, tag: int) -> dict[str, Any]:
    """One chat request of `kind`; `tag` keeps the prompts apart (no prefix reuse)."""
    if kind not in KINDS:
        raise ValueError(f"unknown request kind {kind!r}; the kinds are {', '.join(KINDS)}")
    out: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"({tag}) List many animals as JSON."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
        **SAME_OUTPUT,
    }
    if kind == "schema":
        fmt = {"type": "json_schema", "json_schema": {"schema": long_schema(tokens)}}
        out["response_format"] = fmt
    else:
        out["ignore_eos"] = True
    if kind == "logprobs":
        out.update(logprobs=True, top_logprobs=5)
    return out


def corpus_body(schema: dict[str, Any], tokens: int) -> dict[str, Any]:
    fmt = {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}}
    messages = [{"role": "user", "content": PROMPT}]
    return {"model": MODEL, "messages": messages, "max_tokens": tokens, "temperature": 0,
            "response_format": fmt, **SAME_OUTPUT}  # fmt: skip


def stall_bodies(burst_no: int, props: int) -> list[dict[str, Any]]:
    """One burst's chat requests, each with a wide schema of its own, one answer token."""
    out = []
    for i in range(BURST):
        tag = burst_no * 100 + i
        fmt = {"type": "json_schema", "json_schema": {"schema": schema_corpus.wide(tag, props)}}
        out.append({"model": MODEL, "max_tokens": 1, "temperature": 0, "response_format": fmt,
                    "messages": [{"role": "user", "content": f"Fill record {tag}."}]})  # fmt: skip
    return out


def cell_metrics(kind: str, clients: int, samples: list[Sample], wall: float) -> dict[str, float]:
    """tok/s (completion tokens from usage, else chunks) over the cell's wall time, TTFT p50."""
    tokens = sum(s.completion_tokens or len(s.chunk_times) for s in samples)
    ttfts = [t for s in samples if (t := s.ttft_s) is not None]
    out = {f"c={clients} {kind} tok/s": tokens / wall}
    if ttfts:
        out[f"c={clients} {kind} ttft"] = statistics.median(ttfts)
    return out


def with_ratios(metrics: dict[str, float], clients: tuple[int, ...]) -> dict[str, float]:
    """`metrics` and, where both kinds were measured, schema tok/s ÷ free tok/s per clients."""
    out = dict(metrics)
    for c in clients:
        free, schema = metrics.get(f"c={c} free tok/s"), metrics.get(f"c={c} schema tok/s")
        if free and schema is not None:
            out[f"c={c} schema/free"] = schema / free
    return out


def metric_list(s: Sizes) -> tuple[Metric, ...]:
    out = [Metric(f"corpus {k}", "share", True) for k in ("accepted", "finished", "valid")]
    out.append(Metric("corpus invalid", "answers", False, 0))
    for c in s.clients:
        for kind in s.kinds:
            out += [Metric(f"c={c} {kind} tok/s", "tok/s", True, 1),
                    Metric(f"c={c} {kind} ttft", "s", False)]  # fmt: skip
        if {"free", "schema"} <= set(s.kinds):
            out.append(Metric(f"c={c} schema/free", "x", True, 2))
    out += [Metric("stall baseline p99", "ms", False, 1),
            Metric("stall burst p99", "ms", False, 1),
            Metric("stall burst/baseline", "x", False, 2),
            Metric("stall burst", "s", False)]  # fmt: skip
    return tuple(out)


async def _cell(http: httpx.AsyncClient, kind: str, clients: int, s: Sizes) -> dict[str, float]:
    async def client() -> list[Sample]:
        bodies = [body(kind, s.tokens, random.getrandbits(30)) for _ in range(s.reps)]
        return [await stream_body(http, CHAT, b) for b in bodies]

    t0 = time.perf_counter()
    per_client = await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    return cell_metrics(kind, clients, [x for c in per_client for x in c], wall)


async def _wait(tasks: list[asyncio.Task], done: Callable[[], bool], what: str) -> None:
    """Poll until `done()`; a stream that ended before, or a minute and a half, is an error."""
    deadline = time.perf_counter() + 90
    while not done():
        if ended := [t for t in tasks if t.done()]:
            await ended[0]  # its error, if it had one
            raise RuntimeError("a stall stream ended early")
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the stall's streams: {what} not within 90 s")
        await asyncio.sleep(0.05)


async def _stall(http: httpx.AsyncClient, round_no: int, s: Sizes) -> dict[str, float]:
    streams = [Sample(prompt=f"Story {round_no * 10 + i}: once upon a time", max_tokens=2000)
               for i in range(STREAMS)]  # fmt: skip
    tasks = [asyncio.create_task(stream_completion(http, MODEL, x.prompt, x.max_tokens, Dialect(),
                                                   sample=x)) for x in streams]  # fmt: skip

    def since(t: float) -> int:
        return sum(c >= t for x in streams for c in x.chunk_times)

    try:  # a baseline of 1.5 s at least, and of BASELINE_GAPS gaps (a busy machine is slow)
        await _wait(tasks, lambda: all(len(x.chunk_times) >= 2 for x in streams), "decoding")
        t0 = time.perf_counter()
        await asyncio.sleep(1.5)
        await _wait(tasks, lambda: since(t0) >= BASELINE_GAPS, f"{BASELINE_GAPS} gaps")
        t1 = time.perf_counter()
        for b in range(s.bursts):
            bodies = stall_bodies(round_no * s.bursts + b, s.props)
            replies = await asyncio.gather(*(http.post(CHAT, json=x)
                                             for x in bodies))  # fmt: skip
            if bad := [r.text[:200] for r in replies if r.status_code != 200]:
                raise RuntimeError(f"a stall schema was refused: {bad[0]}")
        t2 = time.perf_counter()
        await asyncio.sleep(0.3)  # a gap the bursts stretched ends after them
    finally:
        for t in tasks:
            t.cancel()
        ended = await asyncio.gather(*tasks, return_exceptions=True)
    if failed := [e for e in ended if isinstance(e, Exception)]:
        raise RuntimeError(f"a stall stream failed: {failed[0]!r}")
    stamps = [x.chunk_times for x in streams]
    base, burst = p99_gap_ms(stamps, t0, t1), p99_gap_ms(stamps, t1, t2 + 0.3)
    return {"stall baseline p99": base, "stall burst p99": burst,
            "stall burst/baseline": burst / base, "stall burst": t2 - t1}  # fmt: skip


async def _corpus(http: httpx.AsyncClient, round_no: int, s: Sizes) -> schema_corpus.CorpusTally:
    gate = asyncio.Semaphore(CORPUS_AT_ONCE)

    async def one(schema: dict[str, Any]) -> tuple[int, Any]:
        async with gate:
            try:
                request = corpus_body(schema, s.corpus_tokens)
                r = await http.post(CHAT, json=request)
            except httpx.HTTPError as exc:
                return 0, f"{type(exc).__name__}: {exc}"
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    schemas = schema_corpus.generate(s.schemas, seed=41 + round_no)
    tally = schema_corpus.CorpusTally()
    for schema, (status, reply) in zip(schemas, await asyncio.gather(*map(one, schemas)),
                                       strict=True):  # fmt: skip
        tally.add(schema, status, reply)
    return tally


async def _measure(url: str, round_no: int, s: Sizes) -> tuple[dict[str, float], Any]:
    async with http_client(url) as http:
        await stream_body(http, CHAT, body("free", 8, -round_no))  # warm-up
        metrics: dict[str, float] = {}
        for c in s.clients:
            for kind in s.kinds:
                metrics |= await _cell(http, kind, c, s)
        metrics |= await _stall(http, round_no, s)
        tally = await _corpus(http, round_no, s)
    return with_ratios(metrics | tally.metrics(), s.clients), tally


def _server(run: StudyRun, arm: str, model: str) -> ServerProcess:
    if run.is_ferrum(arm):
        return run.ferrum(arm, "--models-dir", str(run.out / "m"), "--model", f"{MODEL}={model}",
                          "--parallel", str(PARALLEL), "--ctx-size", str(CTX),
                          "--cache-disk", "0", *ferrum_flags(arm))  # fmt: skip
    if arm not in LLAMA_SERVER_FLAVORS:
        raise ValueError(f"arm {arm!r}: expected ferrum [none], a --tree, or one of "
                         f"{', '.join(LLAMA_SERVER_FLAVORS)}")  # fmt: skip
    return run.llama_server(arm, model, "-np", str(PARALLEL), "-c", str(CTX), "--kv-unified",
                            "--no-webui", flavor=LLAMA_SERVER_FLAVORS[arm])  # fmt: skip


def tally_path(out: Path, arm: str, round_no: int) -> Path:
    return out / f"corpus-{arm.replace(' ', '_')}-r{round_no}.json"


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    s = sizes(run)
    server = _server(run, arm, run.model or builtin_path(DEFAULT_CHAT_MODEL))
    try:
        metrics, tally = asyncio.run(_measure(server.url, round_no, s))
    finally:
        server.stop()
    record = {"arm": arm, "round": round_no, **tally.counts(),
              "refusals": tally.refusals, "invalid": tally.invalid}  # fmt: skip
    tally_path(run.out, arm, round_no).write_text(json.dumps(record, indent=1))
    return metrics


def main(run: StudyRun) -> int:
    """The arms alternated over the rounds with the metrics the knobs give; then the corpus
    totals over the kept rounds appended to results.md."""
    study = dataclasses.replace(STUDY, metrics=metric_list(sizes(run)), measure=measure, main=None)
    run.out.mkdir(parents=True, exist_ok=True)
    code = run_study(run, study)
    records = [json.loads(p.read_text()) for p in sorted(run.out.glob("corpus-*-r*.json"))]
    arms = run.arms or list(STUDY.arms) + list(run.trees)
    totals = ("\n## The corpus over the kept rounds\n\n"
              + schema_corpus.totals_markdown(records, arms))  # fmt: skip
    with (run.out / "results.md").open("a") as f:
        f.write(totals)
    print(totals, end="")
    return code


STUDY = Study(
    name="structured",
    title="Structured output against llama-server: schemas accepted, answers valid, "
    "constrained tok/s and TTFT, stalls while large schemas arrive",
    arms=ARMS,
    main=main,
)
