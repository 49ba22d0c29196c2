"""Milliseconds per `llama_decode` of k positions of one sequence, llama.cpp alone: no
sampling, no scheduler, no Python between decodes that is not the same for every build. The
child that `ferrum bench --study kernels` runs in each build's interpreter
(``python -m ferrum.engine.llama.kernel_timing MODEL --k 1,4,8 --reps 400 --threads 2``);
it prints one JSON line {k: ms}.

k = 1 is a plain decode step; k > 1 a step that verifies k - 1 guesses. The model's first 192
positions are prefilled 64 at a time; then for each k, k positions at the end of the sequence
are decoded `reps` times, one of them kept each time (as a step that kept its first position
does), starting again from position 192 past 1,000. Only `llama_cpp` is imported, so the
interpreter may be any venv whose llama-cpp-python is the build to time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import llama_cpp as ll

PROMPT = 192


def _decoder(ctx: Any, batch: Any) -> Callable[[list[int], int], float]:
    def decode(tokens: list[int], pos: int) -> float:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, 1
        start = time.perf_counter()
        if ll.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - start

    return decode


def time_decodes(model: str, ks: list[int], reps: int, threads: int) -> dict[int, float]:
    ll.llama_backend_init()
    model_ptr = ll.llama_model_load_from_file(model.encode(), ll.llama_model_default_params())
    if not model_ptr:
        raise RuntimeError(f"cannot load {model}")
    params = ll.llama_context_default_params()
    params.n_ctx, params.n_batch = 4096, 512
    params.n_threads = params.n_threads_batch = threads
    ctx = ll.llama_init_from_model(model_ptr, params)
    memory = ll.llama_get_memory(ctx)
    decode = _decoder(ctx, ll.llama_batch_init(64, 0, 1))
    for pos in range(0, PROMPT, 64):  # the prompt, 64 positions at a time
        decode([(p * 7919) % 40000 + 100 for p in range(pos, pos + 64)], pos)
    result = {}
    for k in ks:
        ll.llama_memory_seq_rm(memory, 0, PROMPT, -1)
        pos, times = PROMPT, []
        for _ in range(reps):
            times.append(decode([(pos * 31 + j) % 40000 + 100 for j in range(k)], pos))
            ll.llama_memory_seq_rm(memory, 0, pos + 1, -1)  # one position kept
            pos += 1
            if pos > 1000:
                ll.llama_memory_seq_rm(memory, 0, PROMPT, -1)
                pos = PROMPT
        result[k] = statistics.median(times) * 1e3
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--k", default="1,4,8", help="positions per decode")
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    if not all(1 <= k <= 64 for k in ks):
        ap.error("--k: positions per decode from 1 to 64 (the batch's size)")
    print(json.dumps(time_decodes(args.model, ks, args.reps, args.threads)))


if __name__ == "__main__":
    main()
