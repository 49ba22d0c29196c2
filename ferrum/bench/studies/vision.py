"""Images in chat requests (issue #45's benchmark): ferrum against llama-server serving the same
GGUF and the same projector.

No vision model can be downloaded here, so the projector is generated for the language model
(`ferrum.bench.vision_files`, shape `BENCH`: 224² images in 16² patches, 196 image positions,
a 6-block ViT of width 384, random f16 weights, written once into the bench cache); the model
is SmolLM2-135M-Instruct unless `--model`. Output is noise: every answer runs to its
max_tokens (ignore_eos, greedy). Both servers: 12 slots, 8192 cells (llama-server `-np 12 -c
8192 --kv-unified`; ferrum `--parallel 12 --ctx-size 8192 --cache-disk 0`), `--mmproj FILE`.
Requests are OpenAI chat with an `image_url` part holding a data-URI PNG (320×240 noise,
seeded by round and client, the same for every arm of a round) and a text part.

Per arm and round, on a fresh server after one unmeasured image request:
  same      8 clients at once, one image, 8 different questions: TTFT p50 and p99, and how
            many images the server encoded for them (`same_images_encoded`; goal: ferrum 1,
            and its TTFT p50 ≤ 0.5× llama-server's).
  distinct  8 clients at once, 8 different images: output tok/s over the whole burst (goal
            ≥ 1.0×), TTFT p50.
  encoder   ms per image encoded over the round (`encode_ms`): ferrum's
            `ferrum_image_encode_seconds` histogram on /metrics; llama-server's `image slice
            encoded in N ms` log lines (mtmd-helper) where it prints them: the pinned build
            does not at default verbosity. A server that states neither gets no figure, and
            no `same_images_encoded` either.
  stall     one text-only stream decodes (ignore_eos); its inter-token p99 over ≥ 1.5 s and
            `BASELINE_GAPS` gaps, then while 8 requests with 8 new images (max_tokens 1)
            arrive at once and until the last answer: the ratio (goal ≤ 1.5).

The arm "ferrum capped" runs ferrum with `--prefill-cap` (`--set cap=N`, 16): the same
measurements with a step's prompt positions capped while streams decode.

    ferrum bench --study vision [--quick] [--rounds 4] [--set tokens=64] [--arms ...]
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import replace
from typing import Any

import httpx

from ferrum.bench import vision_files
from ferrum.bench.arms import LLAMA_SERVER_FLAVORS
from ferrum.bench.client import Sample, http_client, stream_body
from ferrum.bench.process import ServerProcess
from ferrum.bench.rounds import Metric, per_round
from ferrum.bench.stats import Spread, paired_ratio, percentile
from ferrum.bench.studies import Study, StudyRun
from ferrum.bench.studies.stalls import p99_gap_ms
from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

ARMS = ("ferrum", "llama-server-default")
MODEL = "bench"  # ferrum serves the file under this name; llama-server takes any
CHAT = "/v1/chat/completions"
PARALLEL, CTX = 12, 8192  # 8 clients, and the stall's stream beside 8 image requests
CLIENTS = 8
IMAGE_SIZE = (320, 240)  # both servers resize to the projector's 224²
BASELINE_GAPS = 20
QUESTIONS = ("What is in this picture?", "Which colour is most common here?",
             "Describe the top left corner.", "Is there any text in the image?",
             "How many shapes can you see?", "What would you call this image?",
             "Is it a photograph or a drawing?", "Describe the lighting.")  # fmt: skip
METRICS = (
    Metric("same_ttft_p50", "s", False),
    Metric("same_ttft_p99", "s", False),
    Metric("same_images_encoded", "", False, 0),
    Metric("distinct_tok_s", "tok/s", True, 1),
    Metric("distinct_ttft_p50", "s", False),
    Metric("encode_ms", "ms", False, 1),
    Metric("stall_base_p99_ms", "ms", False, 1),
    Metric("stall_images_p99_ms", "ms", False, 1),
    Metric("stall_ratio", "x", False, 2),
)
_LLAMA_ENCODED = re.compile(r"image slice encoded in (\d+) ms")
_PHASES = {"warm": 0, "same": 1, "distinct": 10, "stall": 30}  # image seed offsets


def image_uri(round_no: int, phase: str, client: int = 0) -> str:
    """The data URI of a phase's image: seeded by round, phase and client."""
    seed = round_no * 100 + _PHASES[phase] + client
    return vision_files.data_uri(vision_files.image_bytes(seed, IMAGE_SIZE))


def chat_body(image: str | None, question: str, tokens: int, stream: bool = True) -> dict:
    """An OpenAI chat request: the image part first (a prefix every question about it
    shares), then the question; greedy, `tokens` answer tokens whatever the model says."""
    content: list[dict[str, Any]] = [{"type": "text", "text": question}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": content}],
                            "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                            "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def ferrum_encoder_totals(metrics_text: str) -> tuple[float, float]:
    """(images encoded, seconds encoding) so far, from ferrum's /metrics (every model's)."""
    count = seconds = 0.0
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{")[0]
        if name == "ferrum_images_encoded_total":
            count += float(value)
        elif name == "ferrum_image_encode_seconds_sum":
            seconds += float(value)
    return count, seconds


def llama_encoder_totals(log: str) -> tuple[float, float] | None:
    """(images encoded, seconds encoding) so far from llama-server's log; None without any
    `image slice encoded in N ms` line (a build or verbosity that does not print it)."""
    found = [int(ms) for ms in _LLAMA_ENCODED.findall(log)]
    return (float(len(found)), sum(found) / 1000) if found else None


async def _encoder(http: httpx.AsyncClient, server: ServerProcess, ferrum: bool) -> Any:
    if ferrum:
        reply = await http.get("/metrics")
        reply.raise_for_status()
        return ferrum_encoder_totals(reply.text)
    return llama_encoder_totals(server.log_path.read_text(errors="replace"))


def tokens_of(s: Sample) -> int:
    return s.completion_tokens or len(s.chunk_times)


def burst_metrics(phase: str, samples: list[Sample]) -> dict[str, float]:
    ttfts = [s.ttft_s or 0.0 for s in samples]
    wall = max(s.t_end for s in samples) - min(s.t_start for s in samples)
    out = {f"{phase}_ttft_p50": percentile(ttfts, 50) or 0.0,
           f"{phase}_tok_s": sum(map(tokens_of, samples)) / wall}  # fmt: skip
    if phase == "same":
        out["same_ttft_p99"] = percentile(ttfts, 99) or 0.0
    return out


async def _burst(http: httpx.AsyncClient, phase: str, round_no: int, tokens: int) -> list[Sample]:
    same = phase == "same"
    bodies = [chat_body(image_uri(round_no, phase, 0 if same else c), QUESTIONS[c], tokens)
              for c in range(CLIENTS)]  # fmt: skip
    return list(await asyncio.gather(*(stream_body(http, CHAT, b) for b in bodies)))


async def _wait(task: asyncio.Task, done: Any, what: str) -> None:
    deadline = time.perf_counter() + 90
    while not done():
        if task.done():
            await task  # its error, if it had one
            raise RuntimeError("the stall's text stream ended early")
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the stall's text stream: {what} not within 90 s")
        await asyncio.sleep(0.05)


async def _stall(http: httpx.AsyncClient, round_no: int) -> dict[str, float]:
    body = chat_body(None, f"Tell story {round_no} about a lighthouse.", 4000)
    stream = Sample(prompt="", max_tokens=4000)
    task = asyncio.create_task(stream_body(http, CHAT, body, sample=stream))
    since = lambda t: sum(c >= t for c in stream.chunk_times)  # noqa: E731
    try:
        await _wait(task, lambda: len(stream.chunk_times) >= 2, "decoding")
        t0 = time.perf_counter()
        await asyncio.sleep(1.5)
        await _wait(task, lambda: since(t0) >= BASELINE_GAPS, f"{BASELINE_GAPS} gaps")
        t1 = time.perf_counter()
        bodies = [chat_body(image_uri(round_no, "stall", c), QUESTIONS[c], 1, stream=False)
                  for c in range(CLIENTS)]  # fmt: skip
        replies = await asyncio.gather(*(http.post(CHAT, json=b) for b in bodies))
        if bad := [r.text[:200] for r in replies if r.status_code != 200]:
            raise RuntimeError(f"an image request of the stall failed: {bad[0]}")
        t2 = time.perf_counter()
        await asyncio.sleep(0.3)  # a gap the images stretched ends after them
    finally:
        task.cancel()
        ended = await asyncio.gather(task, return_exceptions=True)
    if isinstance(ended[0], Exception):
        raise RuntimeError(f"the stall's text stream failed: {ended[0]!r}")
    base = p99_gap_ms([stream.chunk_times], t0, t1)
    images = p99_gap_ms([stream.chunk_times], t1, t2 + 0.3)
    return {"stall_base_p99_ms": base, "stall_images_p99_ms": images, "stall_ratio": images / base}


def _encoded(before: Any, after: Any) -> tuple[float, float] | None:
    if before is None and after is None:
        return None
    b = before or (0.0, 0.0)
    return after[0] - b[0], after[1] - b[1]


async def _measure(server: ServerProcess, ferrum: bool, round_no: int, tokens: int) -> dict:
    async with http_client(server.url, timeout=900) as http:
        await stream_body(http, CHAT, chat_body(image_uri(round_no, "warm"), "Hello?", 4))
        start = await _encoder(http, server, ferrum)
        got = burst_metrics("same", await _burst(http, "same", round_no, tokens))
        after_same = await _encoder(http, server, ferrum)
        got |= burst_metrics("distinct", await _burst(http, "distinct", round_no, tokens))
        got |= await _stall(http, round_no)
        end = await _encoder(http, server, ferrum)
    got.pop("same_tok_s")
    if (same := _encoded(start, after_same)) is not None:
        got["same_images_encoded"] = same[0]
    if (whole := _encoded(start, end)) is not None and whole[0] > 0:
        got["encode_ms"] = 1000 * whole[1] / whole[0]
    return got


def _capped(run: StudyRun, arm: str) -> tuple[str, ...]:
    """ "ferrum capped": `--prefill-cap` from `--set cap=N` (16 positions)."""
    if arm.split()[1:] == ["capped"]:
        return ("--prefill-cap", str(run.option("cap", 16)))
    return ()


def _server(run: StudyRun, arm: str, model: str, mmproj: str) -> ServerProcess:
    if run.is_ferrum(arm):
        return run.ferrum(arm, "--models-dir", str(run.out / "m"), "--model", f"{MODEL}={model}",
                          "--mmproj", mmproj, "--parallel", str(PARALLEL), "--ctx-size",
                          str(CTX), "--cache-disk", "0", *_capped(run, arm))  # fmt: skip
    if arm not in LLAMA_SERVER_FLAVORS:
        raise ValueError(f"arm {arm!r}: expected ferrum, a --tree, or one of "
                         f"{', '.join(LLAMA_SERVER_FLAVORS)}")  # fmt: skip
    return run.llama_server(arm, model, "--mmproj", mmproj, "-np", str(PARALLEL), "-c",
                            str(CTX), "--kv-unified", "--no-webui",
                            flavor=LLAMA_SERVER_FLAVORS[arm])  # fmt: skip


def measure(run: StudyRun, arm: str, round_no: int) -> dict[str, float]:
    model = run.model or builtin_path(DEFAULT_CHAT_MODEL)
    mmproj = str(vision_files.projector(model))
    server = _server(run, arm, model, mmproj)
    try:
        tokens = run.option("tokens", 16 if run.quick else 64)
        return asyncio.run(_measure(server, run.is_ferrum(arm), round_no, tokens))
    finally:
        server.stop()


def judge(spread: Spread | None, goal: float, at_most: bool) -> str:
    """Whether a range meets a goal: met or missed only when the whole range is on one side."""
    if spread is None:
        return "no figure"
    if (spread.hi <= goal) if at_most else (spread.lo >= goal):
        return "met"
    if (spread.lo > goal) if at_most else (spread.hi < goal):
        return "missed"
    return "not shown (the range spans the goal)"


def goals(records: list[dict[str, Any]], ours: str, peer: str | None) -> str:
    """Issue #45's goals over the kept rounds, as Markdown lines."""

    def line(what: str, sp: Spread | None, goal: float, at_most: bool, d: int = 2) -> str:
        span = "n/a" if sp is None else f"{sp.median:.{d}f} [{sp.lo:.{d}f}, {sp.hi:.{d}f}]"
        sign = "≤" if at_most else "≥"
        return f"| {what} | {span} | {sign} {goal:g} | {judge(sp, goal, at_most)} |"

    mine = lambda key: per_round(records, ours, key)  # noqa: E731
    rows = ["| goal | median [min, max] | target | verdict |", "|---|---|---|---|",
            line(f"{ours}: images encoded for 8 questions on one image",
                 Spread.of(mine("same_images_encoded").values()), 1, True, 0),
            line(f"{ours}: text stream p99 gap with images ÷ alone",
                 Spread.of(mine("stall_ratio").values()), 1.5, True)]  # fmt: skip
    if peer is not None:
        theirs = lambda key: per_round(records, peer, key)  # noqa: E731
        rows += [line(f"one image, TTFT p50, {ours} ÷ {peer}",
                      paired_ratio(mine("same_ttft_p50"), theirs("same_ttft_p50")), 0.5, True),
                 line(f"8 images, tok/s, {ours} ÷ {peer}",
                      paired_ratio(mine("distinct_tok_s"), theirs("distinct_tok_s")), 1.0,
                      False)]  # fmt: skip
    return "\n".join(rows) + "\n"


def main(run: StudyRun) -> int:
    """The arms alternated over the rounds, then the goals appended to results.md."""
    import json

    from ferrum.bench.studies import run_study

    chosen = run.arms or list(ARMS) + [t for t in run.trees if t not in ARMS]
    code = run_study(replace(run, arms=chosen), replace(STUDY, measure=measure, main=None))
    records = json.loads((run.out / "rounds.json").read_text())["records"]
    peers = [a for a in chosen if not run.is_ferrum(a)]
    ours = [a for a in chosen if run.is_ferrum(a)] or chosen[:1]
    table = "\n".join(goals(records, arm, peers[0] if peers else None) for arm in ours)
    with open(run.out / "results.md", "a") as md:
        md.write(f"\n## Goals (issue #45)\n\n{table}")
    print(f"\n{table}", end="")
    return code


STUDY = Study(
    name="vision",
    title="Images: 8 questions on one image, 8 images, encoder ms, a text stream's p99 gap",
    arms=ARMS,
    metrics=METRICS,
    main=main,
)
