"""What one benchmark run does: workload sizes, rounds and server shape, as a frozen dataclass.

Two presets: `FULL` (sized to take about half an hour on a quiet 2-core machine for all arms and
workloads) and `QUICK` (a few minutes: a smoke test, not evidence). The CLI overrides a few
fields; everything else is fixed so that two runs of the same preset are comparable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

WORKLOADS = ("sweep", "burst", "multiturn", "noisy", "fairness", "longctx", "engine")


@dataclass(frozen=True)
class BenchSettings:
    rounds: int = 4  # round 1 is a discarded warm-up
    threads: int = 2  # CPU threads of every server and of the engine workload
    ctx_size: int = 8192  # total KV cells; every arm lets one sequence use all of them
    parallel: int = 16  # sequences decoding at once (the sweep's highest concurrency)
    # llama-server's cells: 1, one pool any slot may fill (`--kv-unified`, ferrum's shape);
    # 0, ctx/np cells per slot, each slot attending over its own (its default with -np)
    peer_kv_unified: int = 1
    # sweep: unique unrelated prompts, `sweep_tokens` output tokens each (ignore_eos)
    sweep_levels: tuple[int, ...] = (1, 2, 4, 8, 16)
    sweep_tokens: int = 64
    sweep_min_requests: int = 4  # waves at one level until at least this many requests
    # burst: N clients at once behind one shared prefix, cold then warm
    burst_clients: int = 8
    burst_prefix_rules: int = 20  # handbook lines in the shared prefix (~750 Gemma tokens)
    burst_tokens: int = 16
    # multiturn: K conversations x T turns, history grows with the real replies
    multiturn_conversations: int = 4
    multiturn_turns: int = 5
    multiturn_tokens: int = 32
    # noisy: a long prompt arrives while `noisy_streams` streams decode
    noisy_streams: int = 4
    noisy_stream_tokens: int = 128
    noisy_before_tokens: int = 24  # tokens each stream yields before the long prompt is sent
    noisy_long_rules: int = 80  # handbook lines in the long prompt (~3,000 Gemma tokens)
    noisy_long_tokens: int = 4
    # fairness: one client's requests take every slot (n choices each, long outputs) while
    # another sends short chats one after another; their TTFT against that on an idle server
    fair_chats: int = 8  # short chats on the idle server, and at most as many under the flood
    fair_chat_tokens: int = 8
    fair_flood_n: int = 8  # choices per flood request (the API's most); parallel / n requests
    fair_flood_tokens: int = 256  # per choice
    # longctx: `longctx_clients` at once, each its own long prompt (nothing shared beyond the
    # first few tokens: a RAG service's or a team of agents' work), `longctx_tokens` each
    longctx_clients: int = 8
    longctx_rules: int = 46  # handbook lines per prompt (~1,700 Gemma tokens)
    longctx_tokens: int = 64
    # engine: in-process decode loop vs llama-batched-bench
    engine_batches: tuple[int, ...] = (1, 4, 8, 16)
    engine_prompt_tokens: int = 32
    engine_tokens: int = 64
    # discipline
    quiet_threshold: float = 0.15  # wait before a server start until machine CPU use <= this
    quiet_wait_s: float = 60.0  # ... but no longer than this
    max_foreign: float = 0.05  # flag a measurement if other processes used more CPU than this
    retries: int = 1  # re-runs of a flagged measurement before it is kept anyway
    request_timeout_s: float = 300.0
    measurement_timeout_s: float = 600.0  # one workload on one server, all requests together

    def replace(self, **changes: Any) -> BenchSettings:
        return dataclasses.replace(self, **changes)

    def with_options(self, options: dict[str, str]) -> BenchSettings:
        """`--set KEY=VALUE` over these settings: a number or a comma-separated list of
        numbers, typed as the field's default."""
        changes: dict[str, Any] = {}
        for key, text in options.items():
            if key not in {f.name for f in dataclasses.fields(self)}:
                raise ValueError(f"--set {key}: no such setting of the workloads")
            default = getattr(self, key)
            try:
                if isinstance(default, tuple):
                    changes[key] = tuple(int(x) for x in text.split(",") if x.strip())
                else:
                    changes[key] = type(default)(text)
            except ValueError:
                raise ValueError(f"--set {key}={text!r}: not a valid value") from None
        return self.replace(**changes)


FULL = BenchSettings()

QUICK = BenchSettings(
    rounds=2,
    sweep_levels=(1, 4, 16),
    sweep_tokens=16,
    sweep_min_requests=2,
    burst_clients=4,
    burst_tokens=8,
    multiturn_conversations=2,
    multiturn_turns=3,
    multiturn_tokens=16,
    noisy_stream_tokens=48,
    noisy_before_tokens=8,
    noisy_long_rules=40,
    fair_chats=4,
    fair_flood_tokens=96,
    longctx_clients=4,
    longctx_rules=16,
    longctx_tokens=16,
    engine_batches=(1, 4, 16),
    engine_tokens=16,
    quiet_wait_s=2.0,
    retries=0,
    measurement_timeout_s=240.0,
)


# ------------------------------------------------------------------ time estimate
#
# A deliberately plain model of a quiet 2-core machine running Gemma 3 270M, calibrated on
# this project's runs: over HTTP ~30 tok/s for one stream, rising to ~105 tok/s at 16;
# prefill ~450 tok/s; a server start, its warm-up request, the quiet check and the stop ~5 s.
# A serial arm (llama-cpp-python) streams ~28 tok/s alone but ~18 tok/s while other requests
# wait on it. Printed before the run so nobody starts a 40-minute job by accident; the real
# elapsed time is printed after it.

_PREFILL_TPS = 450.0
_START_S = 5.0


def _decode_tps(concurrency: int, serial: bool) -> float:
    if serial:
        return 28.0 if concurrency == 1 else 18.0
    return 30.0 * min(concurrency, 16) ** 0.45


def _tokens(n: int, tokens: int, concurrency: int, serial: bool) -> float:
    return n * tokens / _decode_tps(concurrency, serial)


def _workload_seconds(s: BenchSettings, workload: str, serial: bool) -> float:
    if workload == "sweep":
        total = 0.0
        for c in s.sweep_levels:
            waves = -(-s.sweep_min_requests // c)
            total += _tokens(waves * c, s.sweep_tokens, c, serial)
        return total
    if workload == "burst":
        prefix = s.burst_prefix_rules * 37
        # serial arms and servers without shared prefill compute the prefix per client
        prefill = prefix * (1 if serial else s.burst_clients) * 2 / _PREFILL_TPS
        return prefill + 2 * _tokens(s.burst_clients, s.burst_tokens, s.burst_clients, serial)
    if workload == "multiturn":
        k, t = s.multiturn_conversations, s.multiturn_turns
        return t * _tokens(k, s.multiturn_tokens, k, serial) + k * t * 0.2
    if workload == "noisy":
        long_prefill = s.noisy_long_rules * 37 / _PREFILL_TPS
        streams = _tokens(s.noisy_streams, s.noisy_stream_tokens, s.noisy_streams, serial)
        return long_prefill + streams
    if workload == "fairness":
        chats = 2 * _tokens(s.fair_chats, s.fair_chat_tokens, 1, serial)
        return chats + _tokens(s.parallel, s.fair_flood_tokens, s.parallel, serial)
    if workload == "longctx":
        prefill = s.longctx_clients * s.longctx_rules * 37 / _PREFILL_TPS
        clients = s.longctx_clients
        return prefill + _tokens(clients, s.longctx_tokens, clients, serial)
    if workload == "engine":
        decode = sum(_tokens(b, s.engine_tokens, b, False) for b in s.engine_batches)
        return 4 * (decode + 3.0)  # ferrum's loop and three llama-batched-bench, each loads once
    raise ValueError(f"unknown workload {workload!r}")


def estimate_seconds(s: BenchSettings, serial_arms: list[bool], workloads: list[str]) -> float:
    """Seconds for the whole run on a quiet machine; `serial_arms`: one flag per HTTP arm."""
    per_round = 0.0
    for w in workloads:
        if w == "engine":
            per_round += _workload_seconds(s, w, serial=False)
            continue
        for serial in serial_arms:
            per_round += _START_S + _workload_seconds(s, w, serial)
    return per_round * s.rounds
