"""N-gram speculation, side by side: ferrum with and without it, and llama.cpp's own server
without speculation and with its n-gram modes, on the default chat model.

Arms, one server at a time, same GGUF (SmolLM2-135M-Instruct, or `--model`) and threads. An
arm's words after its first say how it runs:
- `ferrum ngram` (the default, --spec-type ngram), `ferrum ngram own` (`--spec-recent 0`:
  guesses from a request's own tokens only, not from earlier requests'), `ferrum none`
  (`--spec-type none`), `ferrum ngram draft16 batch32` (`--spec-draft-max 16 --spec-batch-max
  32`); a trailing `alt` (`ferrum none alt`) runs it on the interpreter `--set
  alt-python=PATH` names (e.g. a venv with another llama.cpp build). A `--tree` arm reads its
  name the same way (`--tree "before none=/tmp/wt"`: the tree without speculation).
- `llama-server none|ngram-simple|ngram-mod` (their default sizes), built with ferrum's kernel
  flags, and `llama-server default none|ngram-simple|ngram-mod`, built as its users build it
  (cmake defaults, FLAVOR=default bench/build_llama_server.sh; by name only); `-np 8 -c 8192`.
ferrum runs without its disk tier (`--cache-disk 0`): like llama-server's, its prefix cache
then starts empty with each server instead of holding the prompts of earlier rounds.

Cells, through /v1/completions with the chat template already applied (every server sees the
same tokens), greedy without repetition penalty (both servers write the same text), 200
tokens (`--set tokens=`), at 1 and 4 clients (`--set clients=1,4`), each client sending its
requests one after another; one server serves every cell of a round, so a later request may
guess from any earlier one's answer, as on a server in use:
- copy: "rewrite this code" over a 30-line Python passage (bench/data); the model copies
  most of it, so its output repeats its input.
- prose: a short story on a topic of its own per request; nothing to copy.
Before the cells each server runs one client of the `--set warm=` workloads (default prose:
weights paged in); `--set warm=prose,copy` also caches the copy prompt (and its n-gram
tables), so the copy cells measure decoding alone.

Metrics per cell: output tokens per second over all clients and the whole run (`copy c=1`),
and at more than one client while every client still had a request out (`copy c=4 all busy`:
the rate at the concurrency the cell is named for). `--quick`: 64 tokens, clients 1,2.

    ferrum bench --study speculation [--arms "ferrum ngram,ferrum none"] [--set clients=1,4]
"""

from __future__ import annotations

import asyncio
import functools
import re
import sys
import time
from pathlib import Path

import httpx

from ferrum.bench.client import http_client
from ferrum.bench.process import ServerProcess
from ferrum.bench.rounds import Metric
from ferrum.bench.stats import Answer, rate_while_all_busy
from ferrum.bench.studies import Study, StudyRun
from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

REQUESTS_PER_CLIENT = 2
TOPICS = ["a lighthouse keeper", "a lost violin", "a city under snow", "a robot gardener",
          "an old map", "a night train", "a quiet library", "a river festival"]  # fmt: skip
# No repetition penalty on either server (ferrum's preset for this model has 1.1, llama-server
# none): both then write the same greedy text, so tokens per second compare like for like.
SAME_OUTPUT = {"repetition_penalty": 1.0, "repeat_penalty": 1.0}
LLAMA_SERVER_MODES = {"none": [], "ngram-simple": ["--spec-type", "ngram-simple"],
                      "ngram-mod": ["--spec-type", "ngram-mod"]}  # fmt: skip
ARMS = ("ferrum ngram", "ferrum ngram own", "ferrum none",
        *(f"llama-server {mode}" for mode in LLAMA_SERVER_MODES))  # fmt: skip
ALL_BUSY = " all busy"  # the key suffix of a cell's rate while every client had a request out
_PASSAGE_FILE = Path(__file__).resolve().parents[3] / "bench/data/speculation_passage.py.txt"


@functools.cache
def passage() -> str:
    """The 30-line Python passage of the copy workload (bench/data, in a checkout)."""
    try:
        return _PASSAGE_FILE.read_text()
    except OSError as exc:
        raise RuntimeError(f"the copy workload's passage: {exc} (run from a checkout)") from None


def chat(user: str, assistant_start: str = "") -> str:
    """One user turn in SmolLM2's chat template, the assistant's answer begun."""
    return (f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
            f"{assistant_start}")  # fmt: skip


def prompt(workload: str, i: int) -> str:
    """The i-th request's prompt of `workload`: copy (always the same) or prose (a topic)."""
    if workload == "copy":
        return chat(f"Rewrite this code with type hints kept:\n```python\n{passage()}```",
                    "```python\n")  # fmt: skip
    if workload == "prose":
        return chat(f"Write a short story about {TOPICS[i % len(TOPICS)]}.")
    raise ValueError(f"unknown workload {workload!r}; choose copy or prose")


def ferrum_flags(arm: str) -> list[str]:
    """ferrum's speculation flags for an arm's name (`ferrum none`, `before ngram own`,
    `ferrum ngram draft16` ...)."""
    words = arm.split()[1:]
    flags = ["--spec-type", "none"] if "none" in words else []
    for word in words:
        if cap := re.fullmatch(r"(draft|batch)(\d+)", word):
            flags += [f"--spec-{cap[1]}-max", cap[2]]
    return flags + (["--spec-recent", "0"] if "own" in words else [])


def alt_python(run: StudyRun, arm: str) -> str | None:
    """The interpreter of a ferrum arm whose name holds the word `alt`: `--set alt-python=`
    (a venv with another llama.cpp build); None (this one) for any other arm."""
    return run.option("alt-python", sys.executable) if "alt" in arm.split() else None


def llama_server_mode(arm: str) -> tuple[str, list[str]]:
    """(build flavor, flags) of a `llama-server [default] MODE` arm."""
    words = arm.split()[1:]
    flavor = "default" if words[:1] == ["default"] else "same"
    mode = words[-1] if words else "none"
    if mode not in LLAMA_SERVER_MODES or len(words) > 2:
        raise ValueError(f"arm {arm!r}: expected llama-server [default] "
                         f"{'|'.join(LLAMA_SERVER_MODES)}")  # fmt: skip
    return flavor, LLAMA_SERVER_MODES[mode]


def cells(run: StudyRun) -> list[tuple[str, int]]:
    clients = run.option("clients", "1,2" if run.quick else "1,4")
    workloads = run.option("workloads", "copy,prose")
    return [(w, int(c)) for w in workloads.split(",") for c in clients.split(",")]


def metric_keys(cell_list: list[tuple[str, int]]) -> list[str]:
    """Every metric the cells give: the whole run's rate, and at more than one client the rate
    while all were busy."""
    keys = []
    for workload, clients in cell_list:
        keys.append(f"{workload} c={clients}")
        if clients > 1:
            keys.append(f"{workload} c={clients}{ALL_BUSY}")
    return keys


def _server(run: StudyRun, arm: str, model: str) -> ServerProcess:
    if run.is_ferrum(arm):
        return run.ferrum(arm, "--models-dir", str(run.out / "m"), "--model", f"bench={model}",
                          "--parallel", "8", "--ctx-size", "8192", "--cache-disk", "0",
                          *ferrum_flags(arm), python=alt_python(run, arm))  # fmt: skip
    flavor, flags = llama_server_mode(arm)
    return run.llama_server(arm, model, "-np", "8", "-c", "8192", *flags, flavor=flavor)


async def _run(url: str, workload: str, clients: int, tokens: int) -> tuple[float, float | None]:
    """Output tokens per second of `clients` clients, each sending its requests in turn: over
    the whole run, and while every client still had a request out (`rate_while_all_busy`)."""
    answers: list[list[Answer]] = [[] for _ in range(clients)]

    async def client(http: httpx.AsyncClient, c: int) -> None:
        for r in range(REQUESTS_PER_CLIENT):
            body = {"model": "bench", "prompt": prompt(workload, c * REQUESTS_PER_CLIENT + r),
                    "max_tokens": tokens, "temperature": 0, **SAME_OUTPUT}  # fmt: skip
            sent = time.perf_counter()
            resp = await http.post("/v1/completions", json=body)
            resp.raise_for_status()
            got = resp.json()["usage"]["completion_tokens"]
            answers[c].append(Answer(sent, time.perf_counter(), got))

    async with http_client(url, timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http, c) for c in range(clients)))
        whole = sum(a.tokens for client_answers in answers for a in client_answers)
        return whole / (time.perf_counter() - start), rate_while_all_busy(answers)


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    tokens = run.option("tokens", 64 if run.quick else 200)
    server = _server(run, arm, run.model or builtin_path(DEFAULT_CHAT_MODEL))
    metrics: dict[str, float] = {}
    try:
        for workload in run.option("warm", "prose").split(","):  # weights paged in
            asyncio.run(_run(server.url, workload, 1, tokens))
        for workload, clients in cells(run):
            whole, busy = asyncio.run(_run(server.url, workload, clients, tokens))
            metrics[f"{workload} c={clients}"] = whole
            if busy is not None and clients > 1:
                metrics[f"{workload} c={clients}{ALL_BUSY}"] = busy
    finally:
        server.stop()
    return metrics


def main(run: StudyRun) -> int:
    """The arms alternated over the rounds, with the metrics that `--set clients=` and
    `--set workloads=` give."""
    from dataclasses import replace

    from ferrum.bench.studies import run_study

    metrics = tuple(Metric(k, "tok/s", higher_is_better=True, digits=1)
                    for k in metric_keys(cells(run)))  # fmt: skip
    return run_study(run, replace(STUDY, metrics=metrics, measure=measure, main=None))


STUDY = Study(
    name="speculation",
    title="N-gram speculation: output tokens per second, ferrum and llama-server",
    arms=ARMS,
    main=main,
)
