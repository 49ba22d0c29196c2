"""Two or more llama.cpp builds, kernels alone: milliseconds per `llama_decode` of k positions of
one sequence (k = 1: a plain decode step; k > 1: a step that verifies k - 1 guesses), with no
server, no sampling and no Python between decodes that is not the same for every build.

Each build is an interpreter whose llama-cpp-python was built with other flags (a venv, e.g.
scripts/install run with FERRUM_AVX512=0 into a copy of the checkout). Per round, each
interpreter in turn (the order alternating) runs this file as a child (`--child`): it loads
the default chat model with `--threads` threads, prefills 192 tokens, then for each k decodes
k positions at the end of the sequence `--reps` times, keeping one of them each time (as a
step that kept its first position does) and starting again from position 192 past 1,000;
the child prints the median milliseconds per k. Round 1 is dropped; median [min, max] of the
rest, and each build's ratio per round to the first.

Usage: bench/bench_kernels.py --python .venv/bin/python --python /tmp/avx2/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time


def child(model: str, ks: list[int], reps: int, threads: int) -> dict[int, float]:
    import llama_cpp as ll

    ll.llama_backend_init()
    model_ptr = ll.llama_model_load_from_file(model.encode(), ll.llama_model_default_params())
    params = ll.llama_context_default_params()
    params.n_ctx, params.n_batch = 4096, 512
    params.n_threads = params.n_threads_batch = threads
    ctx = ll.llama_init_from_model(model_ptr, params)
    memory = ll.llama_get_memory(ctx)
    batch = ll.llama_batch_init(64, 0, 1)

    def decode(tokens: list[int], pos: int) -> float:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, 1
        start = time.perf_counter()
        if ll.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - start

    base = 192
    for pos in range(0, base, 64):  # the prompt, 64 positions at a time
        decode([(p * 7919) % 40000 + 100 for p in range(pos, pos + 64)], pos)
    result = {}
    for k in ks:
        ll.llama_memory_seq_rm(memory, 0, base, -1)
        pos, times = base, []
        for _ in range(reps):
            times.append(decode([(pos * 31 + j) % 40000 + 100 for j in range(k)], pos))
            ll.llama_memory_seq_rm(memory, 0, pos + 1, -1)  # one position kept
            pos += 1
            if pos > 1000:
                ll.llama_memory_seq_rm(memory, 0, base, -1)
                pos = base
        result[k] = statistics.median(times) * 1e3
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", action="append", default=[], help="one per build")
    ap.add_argument("--k", default="1,4,8", help="positions per decode")
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", help="GGUF (default: the default chat model)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    if args.child:
        print(json.dumps(child(args.model, ks, args.reps, args.threads)))
        return
    if not args.python:
        ap.error("give each build's interpreter with --python")
    # Only the parent needs ferrum: a child's interpreter may be any venv with llama_cpp.
    from ferrum.bench.stats import Spread

    if args.model is None:
        from ferrum.models.builtin import DEFAULT_CHAT_MODEL, builtin_path

        args.model = builtin_path(DEFAULT_CHAT_MODEL)
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        row = {}
        for python in args.python if r % 2 == 0 else args.python[::-1]:
            cmd = [python, __file__, "--child", "--model", args.model, "--k", args.k,
                   "--reps", str(args.reps), "--threads", str(args.threads)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            row[python] = json.loads(out.strip().splitlines()[-1])
        rounds.append(row)
        print(f"round {r + 1}: {json.dumps(row)}", flush=True)
    kept = rounds[1:] if len(rounds) > 1 else rounds
    first = args.python[0]
    for k in map(str, ks):
        for python in args.python:
            ms = Spread.of(row[python][k] for row in kept)
            ratio = Spread.of(row[python][k] / row[first][k] for row in kept)
            assert ms is not None and ratio is not None  # every round has every build
            print(f"k={k} {python}: {ms.median:.2f} ms [{ms.lo:.2f}, {ms.hi:.2f}]"
                  f"  x{ratio.median:.3f} [{ratio.lo:.3f}, {ratio.hi:.3f}] of {first}")  # fmt: skip


if __name__ == "__main__":
    main()
