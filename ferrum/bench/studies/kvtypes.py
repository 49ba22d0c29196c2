"""Quantized KV cache (issue #42): f16, q8_0 and q4_0 cells, ferrum against llama-server with
the same flags, on the default chat model.

Arms `SERVER TYPE`, one server at a time: `ferrum serve --cache-type-k T --cache-type-v T
--flash-attn on --parallel P --ctx-size 8192` and `llama-server -ctk T -ctv T -fa on -np P
-c 8192 --kv-unified` (P: 8, or `clients` where more; `llama-server-default`: the
cmake-default build). The default arms are every `--set types=` (default f16,q8_0,q4_0)
on ferrum, then on llama-server-default; the first is the reference of results.md's
table, and `pairs.md` (appended to it) pairs ferrum against llama-server at each type and
each type against f16 on ferrum.

Per arm and round, on a fresh server (after one unmeasured request):
- prefill: one prompt of `prefill_words` words (seeded by the round, the same for every
  arm of a round), one output token: prompt tokens (the server's usage) / TTFT.
- decode: `clients` clients (default 8, at most 64) at once, each a short prompt of its own
  and `tokens` output tokens (ignore_eos); tokens per second while every stream was
  decoding (from the last first token to the first last token; `decode_rate`).
- capacity: KV bytes per token as the server states it: ferrum's /health (the model's
  `kv_cache_bytes_total` over the cells, its `kv_cache_types` checked against the arm),
  llama-server's `llama_kv_cache: size = … MiB (N cells …)` log line (printed only at
  `-lv 4`, so a second, short start of the same command reads it). From it, how many
  conversations of `conv_tokens` tokens (default 1,000) fit in `budget_mib` MiB of KV
  (default 256): arithmetic on the measured figure, not a residency test.

An arm `ferrum none TYPE` is ferrum with speculation off (`--spec-type none`), as
llama-server runs by default; `ferrum alt TYPE` runs on the interpreter `--set
alt-python=PATH` names (a venv with another llama.cpp build).

    ferrum bench --study kvtypes [--rounds 4] [--set types=f16,q8_0] [--set clients=8]
"""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ferrum.bench.client import Dialect, Sample, http_client, stream_completion
from ferrum.bench.process import ServerProcess
from ferrum.bench.rounds import Metric, per_round
from ferrum.bench.stats import Spread, paired_ratio, verdict
from ferrum.bench.studies import Study, StudyRun
from ferrum.bench.studies.burst import WORDS
from ferrum.bench.studies.speculation import alt_python, ferrum_flags
from ferrum.bench.studies.tiers import document, turn
from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
SERVERS = ("ferrum", "llama-server-default")
PARALLEL, CTX, MAX_CLIENTS = 8, "8192", 64
MIB = 1 << 20
METRICS = (
    Metric("decode_tok_s", "tok/s", True, 1),
    Metric("prefill_tok_s", "tok/s", True, 1),
    Metric("kv_bytes_per_token", "B", False, 0),
    Metric("conversations_in_budget", "", True, 0),
)


def parse_arm(arm: str) -> tuple[str, str]:
    """(server, KV type) of `SERVER TYPE` (`ferrum q8_0`, `llama-server-default q4_0`)."""
    server, _, kv = arm.rpartition(" ")
    if not server or kv not in KV_TYPES:
        raise ValueError(f"arm {arm!r}: expected SERVER TYPE, TYPE one of {', '.join(KV_TYPES)}")
    return server, kv


def arms(types: str) -> list[str]:
    kinds = [t.strip() for t in types.split(",") if t.strip()]
    for kv in kinds:
        if kv not in KV_TYPES:
            raise ValueError(f"--set types: {kv!r} is none of {', '.join(KV_TYPES)}")
    return [f"{server} {kv}" for server in SERVERS for kv in kinds]


def server_flags(ferrum: bool, kv: str, server: str = "ferrum") -> list[str]:
    """The KV flags; a ferrum arm's speculation words as the speculation study reads them
    ("ferrum none TYPE": speculation off)."""
    if ferrum:
        kv_flags = ["--cache-type-k", kv, "--cache-type-v", kv, "--flash-attn", "on"]
        return kv_flags + ferrum_flags(server)
    return ["-ctk", kv, "-ctv", kv, "-fa", "on"]


def llama_kv_bytes_per_token(log: str) -> float:
    """From llama-server's `llama_kv_cache: size =   23.91 MiB (  2048 cells, …` line."""
    found = re.search(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells", log)
    if found is None:
        raise RuntimeError("no `llama_kv_cache: size = … MiB (N cells` line in the log")
    return float(found.group(1)) * MIB / int(found.group(2))


def conversations(bytes_per_token: float, budget_mib: float, conv_tokens: int) -> int:
    """Whole conversations of `conv_tokens` tokens in `budget_mib` MiB of KV."""
    return int(budget_mib * MIB // (bytes_per_token * conv_tokens))


def decode_rate(samples: list[Sample]) -> float:
    """Tokens per second while every stream was decoding: from the last stream's first chunk
    to the first stream's last chunk (tokens by `Sample.tokens_within`: a ferrum chunk holds
    every token of a step, several where guesses were kept). When that window holds under
    half of the tokens that followed a first chunk (short or staggered streams: a few tokens
    over a sliver of time would read as any rate at all), those tokens over the whole span
    instead."""
    start = max(s.chunk_times[0] for s in samples)
    end = min(s.chunk_times[-1] for s in samples)
    decoded = sum(s.tokens_within(s.chunk_times[0], s.chunk_times[-1]) for s in samples)
    inside = sum(s.tokens_within(start, end) for s in samples)
    if end > start and 2 * inside >= decoded:
        return inside / (end - start)
    span = max(s.chunk_times[-1] for s in samples) - min(s.chunk_times[0] for s in samples)
    return decoded / span


def prompt(seed: int, words: int) -> str:
    return turn("", f"Summarise these notes: {document(seed, words)}")


async def _measure(run: StudyRun, url: str, round_no: int) -> tuple[dict[str, float], dict]:
    """The speed metrics, and /health's answer afterwards (ferrum's KV bytes and types)."""
    clients, tokens = run.option("clients", 8), run.option("tokens", 32 if run.quick else 128)
    words = run.option("prefill_words", 300 if run.quick else 1200)
    if not 1 <= clients <= MAX_CLIENTS:
        raise ValueError(f"--set clients={clients}: from 1 to {MAX_CLIENTS}")
    async with http_client(url, timeout=900) as http:
        await stream_completion(http, "bench", turn("", "Say hello."), 4, Dialect())
        long = await stream_completion(http, "bench", prompt(round_no, words), 1, Dialect())
        if not long.prompt_tokens or not long.ttft_s:
            raise RuntimeError("the long prompt's usage or first token did not come back")
        shorts = [turn("", f"Write about the {WORDS[i % len(WORDS)]} {round_no}.{i}.")
                  for i in range(clients)]  # fmt: skip
        samples = await asyncio.gather(
            *(stream_completion(http, "bench", p, tokens, Dialect()) for p in shorts)
        )
        health = (await http.get("/health")).json()
    speed = {"prefill_tok_s": long.prompt_tokens / long.ttft_s,
             "decode_tok_s": decode_rate(samples)}  # fmt: skip
    return speed, health


def _parallel(run: StudyRun) -> str:
    """Decode slots: 8, or one per client where there are more."""
    return str(max(PARALLEL, run.option("clients", PARALLEL)))


def _ferrum(run: StudyRun, arm: str, model: str, kv: str) -> ServerProcess:
    return run.ferrum(arm, "--models-dir", str(run.out / "m"), "--model", f"bench={model}",
                      "--parallel", _parallel(run), "--ctx-size", CTX, "--cache-dir",
                      str(run.out / "kv"), *server_flags(True, kv, parse_arm(arm)[0]),
                      python=alt_python(run, arm))  # fmt: skip


def llama(
    run: StudyRun, arm: str, model: str, kv: str, *more: str, slots: str = "", cells: str = CTX
) -> ServerProcess:
    """llama-server for a `SERVER TYPE` arm: one KV pool of `cells`, `slots` slots (default:
    `_parallel`), the arm's cell type."""
    flavor = "default" if arm.startswith("llama-server-default") else "same"
    pool = ["-np", slots or _parallel(run), "-c", cells, "--kv-unified"]
    return run.llama_server(arm, model, *pool, *server_flags(False, kv), *more, flavor=flavor)


def _ferrum_bytes(health: dict[str, Any], kv: str) -> float:
    """Bytes per cell from /health's figures of the model (its `models` entry: the top
    level adds up every model served and leaves the types out)."""
    health = health["models"]["bench"]
    types = health.get("kv_cache_types") or {}
    if (types.get("type_k"), types.get("type_v")) != (kv, kv):
        raise RuntimeError(f"/health says the KV types are {types}, not {kv}")
    return float(health["kv_cache_bytes_total"]) / int(CTX)


def _llama_bytes(run: StudyRun, arm: str, model: str, kv: str) -> float:
    server = llama(run, f"{arm} kv-size", model, kv, "-lv", "4")
    try:
        return llama_kv_bytes_per_token(server.log_path.read_text(errors="replace"))
    finally:
        server.stop()


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    model = run.model or builtin_path(DEFAULT_CHAT_MODEL)
    server_kind, kv = parse_arm(arm)
    ferrum = run.is_ferrum(server_kind)
    shutil.rmtree(run.out / "kv", ignore_errors=True)
    server = _ferrum(run, arm, model, kv) if ferrum else llama(run, arm, model, kv)
    try:
        got, health = asyncio.run(_measure(run, server.url, round_no))
    finally:
        server.stop()
        shutil.rmtree(run.out / "kv", ignore_errors=True)
    per_token = _ferrum_bytes(health, kv) if ferrum else _llama_bytes(run, arm, model, kv)
    got["kv_bytes_per_token"] = per_token
    got["conversations_in_budget"] = conversations(
        per_token, run.option("budget_mib", 256.0), run.option("conv_tokens", 1000)
    )
    return got


def pairs(
    records: list[dict[str, Any]], arm_list: list[str], metrics: tuple[Metric, ...] = METRICS
) -> str:
    """Each ferrum arm against each other server at its type, and against `ferrum f16`: the
    paired ratio per round and the verdict over the ranges, as a Markdown table."""
    lines = ["| metric | A ÷ B | A ÷ B, per round | A's verdict |", "|---|---|---|---|"]
    for m in metrics:
        for a in arm_list:
            server, kv = parse_arm(a)
            if server != "ferrum":
                continue
            peers = [b for b in arm_list if parse_arm(b)[1] == kv and parse_arm(b)[0] != server]
            peers += ["ferrum f16"] if kv != "f16" and "ferrum f16" in arm_list else []
            for b in peers:
                ours, theirs = per_round(records, a, m.key), per_round(records, b, m.key)
                ratio = paired_ratio(ours, theirs)
                if ratio is None:
                    continue
                won = verdict(Spread.of(ours.values()), Spread.of(theirs.values()),
                              m.higher_is_better)  # fmt: skip
                span = f"{ratio.median:.2f} [{ratio.lo:.2f}, {ratio.hi:.2f}]"
                lines.append(f"| {m.key} | {a} ÷ {b} | {span} | {won} |")
    return "\n".join(lines) + "\n"


def main_of(
    study: Study, measure_arm: Callable[[StudyRun, str, int], dict[str, float]], types: str
) -> Callable[[StudyRun], int]:
    """A study's main over `SERVER TYPE` arms: the arms of `--set types=` (default `types`) or
    `--arms`, alternated over the rounds by `measure_arm`, then the pairs (ferrum ÷
    llama-server at each type, each type ÷ f16) appended to results.md."""

    def main(run: StudyRun) -> int:
        import json

        from ferrum.bench.studies import run_study

        chosen = run.arms or arms(run.option("types", types))
        for arm in chosen:
            parse_arm(arm)
        code = run_study(replace(run, arms=chosen), replace(study, measure=measure_arm, main=None))
        records = json.loads((run.out / "rounds.json").read_text())["records"]
        table = pairs(records, chosen, study.metrics)
        (run.out / "pairs.md").write_text(table)
        with open(run.out / "results.md", "a") as md:
            md.write(f"\n## Pairs\n\n{table}")
        print(f"\n{table}", end="")
        return code

    return main


STUDY = Study(
    name="kvtypes",
    title="KV cache types f16, q8_0, q4_0: decode, prefill, KV bytes per token",
    arms=tuple(arms("f16,q8_0,q4_0")),
    metrics=METRICS,
)
STUDY = replace(STUDY, main=main_of(STUDY, measure, "f16,q8_0,q4_0"))
