"""Conversations resident in a fixed KV budget (issue #42): how many multi-turn conversations
of ~2,000 tokens a KV pool of `budget_mib` MiB (256) keeps, so that their later turns skip the
re-prefill, at f16 and q8_0 cells, ferrum against llama-server in the same bytes.

Arms `SERVER TYPE` as in the kvtypes study (default: ferrum f16, ferrum q8_0,
llama-server-default f16, llama-server-default q8_0). Each server gets the cells the budget
buys at its type (the model's K and V bytes per token, rounded down to a multiple of 256),
flash attention on, and no store beside the pool:
- ferrum: `--ctx-size CELLS --parallel 8 --cache-ram 0 --cache-disk 0`;
- llama-server: `-c CELLS --kv-unified -np C --cache-ram 0 -sps 0.5`: a slot per
  conversation. Its default `--cache-ram` (8 GiB of host RAM) saves every idle slot there
  and clears it from the pool when a request starts, so nothing would stay in the pool; at
  its default `-sps 0.1` a new conversation whose shared header is over a tenth of its
  prompt takes an idle conversation's slot and overwrites it, where 0.5 sends it to a free
  slot and a later turn still finds its own.

Workload, through /v1/completions with ChatML prompts (the same tokens for both), greedy,
one request at a time: conversations that share a header (system prompt and example notes,
`shared_words`, ~500 tokens) and each hold notes of their own (`own_words`, ~1,500 tokens),
answers of `answer_tokens` (8). They are added one at a time; after each addition every
conversation so far takes a later turn (the answer kept, a question added), oldest first,
the order in which conversations come back to a server. The count stops at the first later
turn that did not find its history in the pool (cached tokens more than 64 short of its
prompt), or at `conversations` (default: the cells over one conversation's own tokens,
plus 3). Histories grow ~20 tokens a pass, so the oldest of 14 is ~13% past its start.

Metrics: `resident`, conversations that all found their histories before the first miss;
`later_ttft` (those later turns) and `first_ttft`, medians; `conversations`, the most
allowed; `cells`, the pool.

`--quick`: 48 MiB, ~130-token header, ~400 tokens of notes each (a few minutes).

    ferrum bench --study residency [--rounds 4] [--set types=f16,q8_0] [--set budget_mib=256]
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from statistics import median

from ferrum.bench.client import http_client
from ferrum.bench.process import ServerProcess
from ferrum.bench.rounds import Metric
from ferrum.bench.studies import Study, StudyRun
from ferrum.bench.studies.kvtypes import MIB, llama, main_of, parse_arm, server_flags
from ferrum.bench.studies.speculation import alt_python
from ferrum.bench.studies.tiers import WORDS, ask, document, turn
from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path
from ferrum.models.memory import kv_bytes_per_token

TOKENS_PER_WORD = 4 / 3  # the seeded notes on SmolLM2's vocabulary (1,200 words: ~1.6k tokens)
SLACK = 64  # cached tokens this far short of the prompt still count as resident
FERRUM_PARALLEL = "8"
METRICS = (
    Metric("resident", "", True, 0),
    Metric("later_ttft", "s", False),
    Metric("first_ttft", "s", False),
    Metric("conversations", "", True, 0),
    Metric("cells", "", True, 0),
)


def budget_cells(bytes_per_token: int, budget_mib: float) -> int:
    """KV cells `budget_mib` MiB buy, down to a multiple of 256."""
    if bytes_per_token <= 0:
        raise ValueError("the model's GGUF does not say its KV size per token")
    return int(budget_mib * MIB // bytes_per_token) // 256 * 256


def how_many(cells: int, own_words: int) -> int:
    """Most conversations to add: more than fit even if the header took no room (+3)."""
    return cells // int(own_words * TOKENS_PER_WORD) + 3


def resident(prompt_tokens: int, cached_tokens: int) -> bool:
    """A later turn found its history in the pool: all but its new words were cached."""
    return cached_tokens >= prompt_tokens - SLACK


def header(words: int) -> str:
    """The opening every conversation shares (a system prompt and example notes)."""
    return (
        "<|im_start|>system\nYou answer questions about the user's notes, briefly. An example "
        f"of notes: {document(999_999, words)}<|im_end|>\n"
    )


def _server(run: StudyRun, arm: str, model: str, kv: str, cells: int, count: int) -> ServerProcess:
    if run.is_ferrum(arm):
        kv_flags = server_flags(True, kv, parse_arm(arm)[0])
        return run.ferrum(arm, "--models-dir", str(run.out / "m"), "--model", f"bench={model}",
                          "--parallel", FERRUM_PARALLEL, "--ctx-size", str(cells),
                          "--cache-ram", "0", "--cache-disk", "0", "--cache-dir",
                          str(run.out / "kv"), *kv_flags, python=alt_python(run, arm))  # fmt: skip
    return llama(run, arm, model, kv, "--cache-ram", "0", "-sps", "0.5", slots=str(count),
                 cells=str(cells))  # fmt: skip


def _own_words(run: StudyRun) -> int:
    return run.option("own_words", 300 if run.quick else 1130)


def _opening(run: StudyRun, seed: int, c: int) -> str:
    """Conversation `c`'s history before its first question: the shared header, its notes."""
    notes = document(seed * 1000 + c, _own_words(run))
    shared = header(run.option("shared_words", 100 if run.quick else 380))
    return (
        f"{shared}<|im_start|>user\nMy notes {seed}.{c}: "
        f"{notes}<|im_end|>\n<|im_start|>assistant\nNoted.<|im_end|>\n"
    )


async def _conversations(run: StudyRun, url: str, most: int, seed: int) -> dict[str, float]:
    """Conversations added one at a time, each addition followed by a later turn of every
    conversation so far, oldest first; the count kept before the first later turn that did
    not find its history (`most` when none missed)."""
    answer = run.option("answer_tokens", 8)
    histories: list[str] = []
    first: list[float] = []
    later: list[float] = []
    async with http_client(url, timeout=900) as http:
        await ask(http, turn("", "Say hello."), 4)  # weights paged in
        for k in range(most):
            prompt = turn(_opening(run, seed, k), "What are these notes about?")
            sample = await ask(http, prompt, answer)
            first.append(sample.ttft_s or 0.0)
            histories.append(f"{prompt}{sample.text}<|im_end|>\n")
            for c in range(k + 1):
                prompt = turn(histories[c], f"And the {WORDS[(k + c) % len(WORDS)]}?")
                sample = await ask(http, prompt, answer)
                if sample.prompt_tokens is None or sample.cached_tokens is None:
                    raise RuntimeError(
                        "the server's usage did not say its prompt and cached tokens"
                    )
                if not resident(sample.prompt_tokens, sample.cached_tokens):
                    return {"resident": k, "later_ttft": median(later or [0.0]),
                            "first_ttft": median(first)}  # fmt: skip
                later.append(sample.ttft_s or 0.0)
                histories[c] = f"{prompt}{sample.text}<|im_end|>\n"
    return {"resident": most, "later_ttft": median(later), "first_ttft": median(first)}


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    model = run.model or builtin_path(DEFAULT_CHAT_MODEL)
    kv = parse_arm(arm)[1]
    budget = run.option("budget_mib", 48.0 if run.quick else 256.0)
    cells = budget_cells(kv_bytes_per_token(model, kv, kv), budget)
    count = run.option("conversations", 0) or how_many(cells, _own_words(run))
    server = _server(run, arm, model, kv, cells, count)
    try:
        got = asyncio.run(_conversations(run, server.url, count, round_no))
    finally:
        server.stop()
    if got["resident"] == count:
        print(f"  {arm}: all {count} conversations stayed; allow more (--set conversations=)")
    return got | {"conversations": count, "cells": cells}


STUDY = Study(
    name="residency",
    title="Conversations of ~2,000 tokens kept in a 256 MiB KV pool, f16 and q8_0 cells",
    arms=("ferrum f16", "ferrum q8_0", "llama-server-default f16", "llama-server-default q8_0"),
    metrics=METRICS,
)
STUDY = replace(STUDY, main=main_of(STUDY, measure, "f16,q8_0"))
