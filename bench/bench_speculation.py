"""N-gram speculation, side by side: ferrum with and without it, and llama.cpp's own server
without speculation and with its n-gram modes, on the default chat model.

Arms, one server at a time, same GGUF (SmolLM2-135M-Instruct, or `--model`) and threads:
`ferrum serve` (--spec-type ngram, the default), the same with `--spec-recent 0` (guesses
from a request's own tokens only, not from earlier requests') and `--spec-type none`, and
either on `--alt-python` (arms ending in "alt", chosen by name only);
`llama-server` built with ferrum's own kernel flags (bench/build_llama_server.sh) with
`--spec-type none`, `ngram-simple` and `ngram-mod` (their default sizes), `-np 8 -c 8192`;
and `llama-server default none`, `default ngram-simple` and `default ngram-mod`,
llama-server built the way its users build it (cmake defaults, FLAVOR=default
bench/build_llama_server.sh; chosen by name only).
ferrum runs without its disk tier (`--cache-disk 0`): like llama-server's, its prefix cache
then starts empty with each server instead of holding the prompts of earlier rounds.

Workloads, through /v1/completions with the chat template already applied (so every server
sees the same tokens), greedy without repetition penalty (both servers write the same
text), 200 tokens, at 1 and 4 clients (each client sends its
requests one after another; one server serves every cell of a round, so a later request may
guess from any earlier one's answer, as on a server in use):
- copy: "rewrite this code" over a 30-line Python passage (bench/data); the model copies
  most of it, so its output repeats its input.
- prose: a short story on a topic of its own per request; nothing to copy.

Before the measured cells, each server runs one client of the `--warm` workloads (default
prose: weights paged in). `--warm prose,copy` also caches the copy prompt in every server (and
in the n-gram tables that learn from earlier requests), so its cells measure decoding alone,
as a user who sends the same document again sees it.

Per round and arm: output tokens per second over all clients, over the whole run and (at
more than one client) while every client still had a request out ("all busy": the rate at
the concurrency the cell is named for; the whole run's rate also holds its tail, where the
clients done first have left the batch narrower). Rounds alternate the arm order; round 1
is a warm-up and is dropped; median [min, max] over the rest, and ratios to ferrum without
speculation per round.

    .venv/bin/python bench/bench_speculation.py [--rounds 4] [--threads 2] [--clients 1,4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

from ferrum.bench.arms import LLAMA_SERVER_FLAVORS, llama_cpp_build_dir
from ferrum.bench.process import ServerProcess, ferrum_command, free_port
from ferrum.bench.stats import Answer, Spread, rate_while_all_busy
from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

ALT_PYTHON = sys.executable  # --alt-python
MODEL = ""  # --model: the GGUF every arm serves (default: the default chat model)
MAX_TOKENS = 200
REQUESTS_PER_CLIENT = 2
PASSAGE = (Path(__file__).parent / "data" / "speculation_passage.py.txt").read_text()
TOPICS = ["a lighthouse keeper", "a lost violin", "a city under snow", "a robot gardener",
          "an old map", "a night train", "a quiet library", "a river festival"]  # fmt: skip
# No repetition penalty on either server (ferrum's preset for this model has 1.1, llama-server
# none): both then write the same greedy text, so tokens per second compare like for like.
SAME_OUTPUT = {"repetition_penalty": 1.0, "repeat_penalty": 1.0}
ARMS: dict[str, tuple[str, list[str], dict[str, str]]] = {
    "ferrum ngram": ("ferrum", [], {}),
    # ferrum with speculation on another interpreter or tree (--alt-python: a before arm).
    "ferrum ngram alt": ("ferrum", [], {}),
    # Guesses from the request's own tokens only, not from earlier requests' (--spec-recent 0).
    "ferrum ngram own": ("ferrum", ["--spec-recent", "0"], {}),
    "ferrum none": ("ferrum", ["--spec-type", "none"], {}),
    # ferrum on another interpreter (--alt-python: e.g. a venv with another llama.cpp build,
    # or a wrapper that puts an older tree on PYTHONPATH).
    "ferrum none alt": ("ferrum", ["--spec-type", "none"], {}),
}
# llama-server without speculation and with its n-gram modes (their default sizes), built
# with ferrum's kernel flags ("llama-server ...") and as its users build it, cmake defaults
# with -march=native ("llama-server default ...").
LLAMA_SERVER_MODES = {"none": [], "ngram-simple": ["--spec-type", "ngram-simple"],
                      "ngram-mod": ["--spec-type", "ngram-mod"]}  # fmt: skip
ARMS.update({f"{name} {mode}": (kind, flags, {})
             for kind, name in (("llama-server", "llama-server"),
                                ("llama-server-default", "llama-server default"))
             for mode, flags in LLAMA_SERVER_MODES.items()})  # fmt: skip
BY_NAME_ONLY = (" alt", "llama-server default")  # arms with these in their names
ALL_BUSY = ", all busy"  # the key suffix of a cell's rate while every client had a request out


def _chat(user: str, assistant_start: str = "") -> str:
    return (f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
            f"{assistant_start}")  # fmt: skip


def _prompt(workload: str, i: int) -> str:
    if workload == "copy":
        return _chat(f"Rewrite this code with type hints kept:\n```python\n{PASSAGE}```",
                     "```python\n")  # fmt: skip
    return _chat(f"Write a short story about {TOPICS[i % len(TOPICS)]}.")


def _server(arm: str, threads: int, folder: Path) -> ServerProcess:
    kind, extra, env = ARMS[arm]
    python = ALT_PYTHON if arm.endswith(" alt") else sys.executable
    port = free_port()
    model = MODEL or builtin_path(DEFAULT_CHAT_MODEL)
    if kind == "ferrum":
        cmd = ferrum_command(port, "--threads", str(threads), "--models-dir", str(folder / "m"),
                             "--model", f"bench={model}", "--parallel", "8", "--ctx-size",
                             "8192", "--cache-disk", "0", *extra)  # fmt: skip
        cmd[0] = python
    else:
        binary = llama_cpp_build_dir(LLAMA_SERVER_FLAVORS[kind]) / "llama-server"
        cmd = [str(binary), "-m", model, "-np", "8",
               "-c", "8192", "-t", str(threads), "--port", str(port), *extra]  # fmt: skip
    server = ServerProcess(cmd, folder / f"{arm.replace(' ', '-')}.log", port,
                           env={**os.environ, **env} if env else None)  # fmt: skip
    try:
        server.wait_ready(server.url, "/health", timeout=300)
    except RuntimeError:
        server.stop()
        raise
    return server


async def _run(url: str, workload: str, clients: int) -> tuple[float, float | None]:
    """Output tokens per second of `clients` clients, each sending its requests in turn: over
    the whole run, and while every client still had a request out (`rate_while_all_busy`)."""
    answers: list[list[Answer]] = [[] for _ in range(clients)]

    async def client(http: httpx.AsyncClient, c: int) -> None:
        for r in range(REQUESTS_PER_CLIENT):
            body = {"model": "bench", "prompt": _prompt(workload, c * REQUESTS_PER_CLIENT + r),
                    "max_tokens": MAX_TOKENS, "temperature": 0, **SAME_OUTPUT}  # fmt: skip
            sent = time.perf_counter()
            resp = await http.post("/v1/completions", json=body)
            resp.raise_for_status()
            tokens = resp.json()["usage"]["completion_tokens"]
            answers[c].append(Answer(sent, time.perf_counter(), tokens))

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http, c) for c in range(clients)))
        whole = sum(a.tokens for client_answers in answers for a in client_answers)
        return whole / (time.perf_counter() - start), rate_while_all_busy(answers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--workloads", default="copy,prose")
    ap.add_argument("--warm", default="prose",
                    help="workloads run once before the cells (copy: its prompt then cached)")
    ap.add_argument("--alt-python", default=sys.executable,
                    help="interpreter of the 'ferrum none alt' arm (another llama.cpp build)")
    usual = [a for a in ARMS if not any(n in a for n in BY_NAME_ONLY)]
    ap.add_argument("--arms", default=",".join(usual))
    ap.add_argument("--model", default="",
                    help="GGUF every arm serves (default: the default chat model); e.g. the "
                         "same model in another quantisation, whose kernels verify guesses "
                         "cheaper or dearer")
    ap.add_argument("--out", default="bench/results/speculation")
    args = ap.parse_args()
    global ALT_PYTHON, MODEL
    ALT_PYTHON, MODEL = args.alt_python, args.model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = args.arms.split(",")
    cells = [(w, int(c)) for w in args.workloads.split(",") for c in args.clients.split(",")]
    rounds = []
    failed: set[str] = set()  # arms that did not start
    for r in range(args.rounds):
        row: dict[str, float] = {}
        for arm in arms if r % 2 == 0 else arms[::-1]:
            if arm in failed:
                continue
            try:
                server = _server(arm, args.threads, out)
            except RuntimeError as exc:  # e.g. a build whose kernels fault on this CPU
                failed.add(arm)
                print(f"{arm} left out: it did not start: {exc}", flush=True)
                continue
            try:
                for workload in args.warm.split(","):  # weights paged in (and prompts cached)
                    asyncio.run(_run(server.url, workload, 1))
                for workload, clients in cells:
                    whole, busy = asyncio.run(_run(server.url, workload, clients))
                    row[f"{workload} c={clients} {arm}"] = whole
                    if busy is not None and clients > 1:
                        row[f"{workload} c={clients} {arm}{ALL_BUSY}"] = busy
            finally:
                server.stop()
        rounds.append(row)
        print(f"round {r + 1}: {json.dumps({k: round(v, 1) for k, v in row.items()})}", flush=True)
    (out / "rounds.json").write_text(json.dumps(rounds, indent=1))
    kept = rounds[1:] if len(rounds) > 1 else rounds
    for workload, clients in cells:
        for arm in arms:
            if arm in failed:
                print(f"{workload} c={clients} {arm}: did not start (see its log)")
                continue
            key, base = f"{workload} c={clients} {arm}", f"{workload} c={clients} ferrum none"
            for metric in ("", ALL_BUSY) if clients > 1 else ("",):
                print(_line(kept, key + metric, base + metric))


def _line(kept: list[dict[str, float]], key: str, base: str) -> str:
    """One arm's rate in one cell over the kept rounds, and its ratio per round to `base`."""
    s = Spread.of(row.get(key) for row in kept)
    if s is None:
        return f"{key}: n/a"
    line = f"{key}: {s.median:.1f} tok/s [{s.lo:.1f}, {s.hi:.1f}]"
    ratio = Spread.of(row[key] / row[base] for row in kept if key in row and base in row)
    if ratio:
        line += f"  ×{ratio.median:.2f} [{ratio.lo:.2f}, {ratio.hi:.2f}] vs ferrum none"
    return line


if __name__ == "__main__":
    main()
