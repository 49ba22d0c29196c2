"""Many fine-tunes of one base model (issue #43): clients spread over LoRA adapters and the
base, multi-turn, ferrum against llama-server serving the same adapter files.

The adapters are random low-rank ones made for the model (`ferrum.bench.lora_files`, written
once into the bench cache), at `--set scale=` (default 0.1: the text changes, stays sane).
Each server gets every adapter: `ferrum serve --lora aN=FILE@SCALE` (a request names
`bench:aN`), `llama-server --lora FILE,...` (a request sends `lora: [{"id": N, "scale":
SCALE}]` with every other id at 0, a base request all at 0). Both: `--parallel 8`,
`--ctx-size 8192` (llama-server `-np 8 -c 8192 --kv-unified`), the default chat model.

Clients (`--set mix=base=1,a0=4,a1=1,a2=1,a3=1`: 8 clients, a0 the majority, a1-a3 one each)
all start at once; each holds a conversation of `turns` turns (ChatML through
/v1/completions, greedy, `tokens` answer tokens with ignore_eos). It opens with a document
of its own (`words` words, seeded by the round) and every turn adds the real answer and a
question, so later turns can reuse the conversation's own prefix under its own adapter.

Metrics per round: output tok/s over the whole run (all clients), TTFT p50 and p99 per
group (base, each adapter; few samples each, so p99 is close to the maximum), the pooled p99
of the minority adapters over the majority's (`minority_p99_over_majority`, the fairness
figure, goal ≤ 1.5), and the median TTFT of first and of later turns.

    ferrum bench --study lora [--rounds 4] [--set turns=4] [--set scale=0.1] [--set mix=...]
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import time
from dataclasses import dataclass, replace

import httpx

from ferrum.bench import lora_files
from ferrum.bench.client import Dialect, stream_completion
from ferrum.bench.process import ServerProcess
from ferrum.bench.rounds import Metric
from ferrum.bench.stats import percentile
from ferrum.bench.studies import Study, StudyRun
from ferrum.bench.studies.tiers import document, turn
from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

BASE = "base"
DEFAULT_MIX = "base=1,a0=4,a1=1,a2=1,a3=1"
PARALLEL, CTX = "8", "8192"
QUESTIONS = ("What is the main point?", "Which word comes up most?", "Say it more briefly.",
             "What would you ask next?", "Name one detail.", "What is missing?")  # fmt: skip


def mix(text: str) -> list[tuple[str, int]]:
    """`name=clients,...` in order; the adapters are every name but `base`."""
    groups: list[tuple[str, int]] = []
    for item in text.split(","):
        name, eq, count = item.strip().partition("=")
        if not eq or not name or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--set mix: {item!r}: expected NAME=CLIENTS (CLIENTS ≥ 1)")
        if name in (g for g, _ in groups):
            raise ValueError(f"--set mix: {name!r} given twice")
        groups.append((name, int(count)))
    if not any(name != BASE for name, _ in groups):
        raise ValueError("--set mix: no adapter among the groups")
    return groups


def adapters(groups: list[tuple[str, int]]) -> list[str]:
    """The adapter names in id order (llama-server numbers its `--lora` files from 0)."""
    return [name for name, _ in groups if name != BASE]


def clients(groups: list[tuple[str, int]]) -> list[str]:
    """Each client's group."""
    return [name for name, count in groups for _ in range(count)]


def server_flags(ferrum: bool, files: dict[str, str], scale: float) -> list[str]:
    """The adapter flags of either server (`files`: adapter name -> file, in id order).
    llama-server takes one `--lora` of comma-separated files: given twice, it keeps only
    the last (with a warning in its log)."""
    if not ferrum:
        return ["--lora", ",".join(files.values())]
    flags: list[str] = []
    for name, path in files.items():
        flags += ["--lora", f"{name}={path}@{scale:g}"]
    return flags


def request_fields(
    ferrum: bool, group: str, names: list[str], scale: float
) -> tuple[str, dict[str, object] | None]:
    """(model, extra body fields) of a request of `group`: ferrum by model name, llama-server
    by its `lora` field naming every adapter, the others at 0: without the field, or with an
    empty list, it applies every `--lora` file at scale 1."""
    if ferrum:
        return ("bench" if group == BASE else f"bench:{group}"), None
    chosen = [{"id": i, "scale": scale if n == group else 0.0} for i, n in enumerate(names)]
    return "bench", {"lora": chosen}


@dataclass(frozen=True)
class Turn:
    group: str
    index: int  # 0: the conversation's first turn
    ttft: float
    tokens: int


def majority_minority(groups: list[tuple[str, int]]) -> tuple[str, list[str]]:
    """The adapter with the most clients (the first of equals), and those with the fewest
    when they have fewer (none when every adapter has as many clients)."""
    counts = {n: c for n, c in groups if n != BASE}
    most, fewest = max(counts.values()), min(counts.values())
    major = next(n for n, c in counts.items() if c == most)
    return major, ([n for n, c in counts.items() if c == fewest] if fewest < most else [])


def report(turns: list[Turn], groups: list[tuple[str, int]], wall_s: float) -> dict[str, float]:
    out = {"tok_s": sum(t.tokens for t in turns) / wall_s}
    for name, _ in groups:
        ttfts = [t.ttft for t in turns if t.group == name]
        out[f"{name}_ttft_p50"] = statistics.median(ttfts)
        out[f"{name}_ttft_p99"] = percentile(ttfts, 99) or 0.0
    major, minor = majority_minority(groups)
    if minor:
        pooled = percentile([t.ttft for t in turns if t.group in minor], 99) or 0.0
        out["minority_p99_over_majority"] = pooled / out[f"{major}_ttft_p99"]
    out["turn1_ttft"] = statistics.median(t.ttft for t in turns if t.index == 0)
    later = [t.ttft for t in turns if t.index > 0]
    if later:
        out["later_ttft"] = statistics.median(later)
    return out


def metrics(groups: list[tuple[str, int]], turns: int) -> tuple[Metric, ...]:
    out = [Metric("tok_s", "tok/s", True, 1)]
    for name, _ in groups:
        out += [Metric(f"{name}_ttft_p50", "s", False), Metric(f"{name}_ttft_p99", "s", False)]
    if majority_minority(groups)[1]:
        out.append(Metric("minority_p99_over_majority", "x", False, 2))
    out.append(Metric("turn1_ttft", "s", False))
    return tuple(out + ([Metric("later_ttft", "s", False)] if turns > 1 else []))


async def _conversation(
    http: httpx.AsyncClient, seed: int, model: str, extra: dict[str, object] | None,
    turns: int, tokens: int, words: int,
) -> list[tuple[int, float, int]]:  # fmt: skip
    history = (f"<|im_start|>system\nYou answer questions about notes.<|im_end|>\n"
               f"<|im_start|>user\nNotes: {document(seed, words)}<|im_end|>\n"
               f"<|im_start|>assistant\nNoted.<|im_end|>\n")  # fmt: skip
    done = []
    for t in range(turns):
        prompt = turn(history, QUESTIONS[(seed + t) % len(QUESTIONS)])
        s = await stream_completion(http, model, prompt, tokens, Dialect(), extra=extra)
        done.append((t, s.ttft_s or 0.0, s.completion_tokens or len(s.chunk_times)))
        history = f"{prompt}{s.text}<|im_end|>\n"
    return done


async def _traffic(run: StudyRun, url: str, ferrum: bool, round_no: int) -> dict[str, float]:
    groups = mix(run.option("mix", DEFAULT_MIX))
    names, scale = adapters(groups), run.option("scale", 0.1)
    turns, tokens = run.option("turns", 2 if run.quick else 4), run.option("tokens", 32)
    words = run.option("words", 150 if run.quick else 400)
    who = clients(groups)
    limits = httpx.Limits(max_keepalive_connections=0)  # see tiers._client
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:
        start = time.perf_counter()
        done = await asyncio.gather(*(
            _conversation(http, round_no * 1000 + c, *request_fields(ferrum, g, names, scale),
                          turns, tokens, words)
            for c, g in enumerate(who)
        ))  # fmt: skip
        wall = time.perf_counter() - start
    flat = [Turn(who[c], t, ttft, n) for c, conv in enumerate(done) for t, ttft, n in conv]
    return report(flat, groups, wall)


async def _hello(url: str, extra: dict[str, object] | None) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        prompt = turn("", "Say hello.")
        await stream_completion(http, "bench", prompt, 4, Dialect(), extra=extra)


def _server(run: StudyRun, arm: str, model: str, files: dict[str, str]) -> ServerProcess:
    scale = run.option("scale", 0.1)
    if run.is_ferrum(arm):
        return run.ferrum(arm, "--models-dir", str(run.out / "m"), "--model", f"bench={model}",
                          "--parallel", PARALLEL, "--ctx-size", CTX, "--cache-dir",
                          str(run.out / "kv"), *server_flags(True, files, scale))  # fmt: skip
    flavor = "default" if arm == "llama-server-default" else "same"
    return run.llama_server(arm, model, "-np", PARALLEL, "-c", CTX, "--kv-unified",
                            *server_flags(False, files, scale), flavor=flavor)  # fmt: skip


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    model = run.model or builtin_path(DEFAULT_CHAT_MODEL)
    names = adapters(mix(run.option("mix", DEFAULT_MIX)))
    files = {n: str(lora_files.adapter(model, seed=i + 1)) for i, n in enumerate(names)}
    shutil.rmtree(run.out / "kv", ignore_errors=True)  # no disk tier left by another arm
    server = _server(run, arm, model, files)
    try:
        base = request_fields(run.is_ferrum(arm), BASE, names, 0.0)[1]
        asyncio.run(_hello(server.url, base))  # weights paged in
        return asyncio.run(_traffic(run, server.url, run.is_ferrum(arm), round_no))
    finally:
        server.stop()
        shutil.rmtree(run.out / "kv", ignore_errors=True)


def main(run: StudyRun) -> int:
    """The arms alternated over the rounds, with the metrics `--set mix=` gives."""
    from ferrum.bench.studies import run_study

    groups = mix(run.option("mix", DEFAULT_MIX))
    found = metrics(groups, run.option("turns", 2 if run.quick else 4))
    return run_study(run, replace(STUDY, metrics=found, measure=measure, main=None))


STUDY = Study(
    name="lora",
    title="LoRA adapters per request: 8 clients over 4 adapters and the base, multi-turn",
    arms=("ferrum", "llama-server-default"),
    main=main,
)
