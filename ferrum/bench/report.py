"""From raw round records to the summary and the Markdown report (pure: no I/O).

A record is one workload on one arm in one round: ``{"workload", "arm", "round", "metrics":
{key: value}, ...}``. Round 1 is a warm-up and never summarised. For every metric the report
gives each arm's median [min, max] over the kept rounds and, against the reference arm (the
first one), the paired ratio reference / other with a verdict from the reference's side.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferrum.bench.settings import BenchSettings
from ferrum.bench.stats import Spread, paired_ratio, verdict


@dataclass(frozen=True)
class MetricSpec:
    key: str
    label: str
    better: str  # "higher", "lower", or "" for context only (no verdict)
    digits: int = 3
    scale: float = 1.0  # shown value = value * scale (seconds shown as ms: 1000)


def metric_specs(workload: str, s: BenchSettings) -> list[MetricSpec]:
    if workload == "sweep":
        out = []
        for c in s.sweep_levels:
            out += [
                MetricSpec(f"c{c}.tps", f"c={c}: output tok/s", "higher", 1),
                MetricSpec(f"c{c}.ttft_p50", f"c={c}: TTFT p50 (s)", "lower"),
                MetricSpec(f"c{c}.ttft_p99", f"c={c}: TTFT p99 (s)", "lower"),
                MetricSpec(f"c{c}.itl_p50", f"c={c}: inter-token p50 (ms)", "lower", 1, 1000),
                MetricSpec(f"c{c}.itl_p99", f"c={c}: inter-token p99 (ms)", "lower", 1, 1000),
            ]
        return out
    if workload == "burst":
        out = []
        for phase in ("cold", "warm"):
            out += [
                MetricSpec(f"{phase}.ttft_p50", f"{phase}: TTFT p50 (s)", "lower"),
                MetricSpec(f"{phase}.ttft_p90", f"{phase}: TTFT p90 (s)", "lower"),
                MetricSpec(f"{phase}.wall_s", f"{phase}: whole burst (s)", "lower"),
                MetricSpec(f"{phase}.cached_tokens", f"{phase}: cached tokens (sum)", "", 0),
            ]
        return [*out, MetricSpec("prompt_tokens", "prompt tokens per client", "", 0)]
    if workload == "multiturn":
        out = [
            MetricSpec(f"turn{t}.ttft", f"turn {t}: TTFT (s)", "lower")
            for t in range(1, s.multiturn_turns + 1)
        ]
        return [
            *out,
            MetricSpec("later.ttft_mean", f"turns 2-{s.multiturn_turns}: mean TTFT (s)", "lower"),
            MetricSpec("last.prompt_tokens", "last turn: prompt tokens", "", 0),
            MetricSpec("cached_tokens", "cached tokens (sum)", "", 0),
        ]
    if workload in _FIXED:
        return _FIXED[workload](s)
    if workload == "engine":
        return [
            MetricSpec(f"b{b}.tps", f"batch {b}: decode tok/s", "higher", 1)
            for b in s.engine_batches
        ]
    raise ValueError(f"unknown workload {workload!r}")


def _noisy(s: BenchSettings) -> list[MetricSpec]:
    return [
        MetricSpec("before.itl_p50", "before: inter-token p50 (ms)", "lower", 1, 1000),
        MetricSpec("before.itl_p99", "before: inter-token p99 (ms)", "lower", 1, 1000),
        MetricSpec("during.itl_p50", "during: inter-token p50 (ms)", "lower", 1, 1000),
        MetricSpec("during.itl_p99", "during: inter-token p99 (ms)", "lower", 1, 1000),
        MetricSpec("during.gaps", "during: gaps measured", "", 0),
        MetricSpec("long.ttft", "long prompt: TTFT (s)", "lower"),
        MetricSpec("long.prompt_tokens", "long prompt: tokens", "", 0),
    ]


def _fairness(s: BenchSettings) -> list[MetricSpec]:
    return [
        MetricSpec("idle.ttft_p50", "idle server: chat TTFT p50 (s)", "lower"),
        MetricSpec("idle.ttft_p99", "idle server: chat TTFT p99 (s)", "lower"),
        MetricSpec("flood.ttft_p50", "beside the flood: chat TTFT p50 (s)", "lower"),
        MetricSpec("flood.ttft_p99", "beside the flood: chat TTFT p99 (s)", "lower"),
        MetricSpec("flood.p99_vs_idle", "beside the flood: TTFT p99 / idle p50", "lower", 2),
        MetricSpec("flood.chats", "chats sent while the flood ran", "", 0),
        MetricSpec("flood.wall_s", f"the flood ({s.parallel} choices): whole (s)", "lower"),
    ]


def _longctx(s: BenchSettings) -> list[MetricSpec]:
    return [
        MetricSpec("tps", "whole workload: output tok/s", "higher", 1),
        MetricSpec("wall_s", "whole workload: wall time (s)", "lower", 1),
        MetricSpec("ttft_p50", "TTFT p50 (s)", "lower"),
        MetricSpec("ttft_p99", "TTFT p99 (s)", "lower"),
        MetricSpec("itl_p50", "inter-token p50 (ms)", "lower", 1, 1000),
        MetricSpec("itl_p99", "inter-token p99 (ms)", "lower", 1, 1000),
        MetricSpec("prompt_tokens", "prompt tokens per client (median)", "", 0),
    ]


_FIXED = {"noisy": _noisy, "fairness": _fairness, "longctx": _longctx}


def kept(records: list[dict]) -> list[dict]:
    """Rounds after the warm-up, without failed measurements."""
    return [r for r in records if r["round"] > 1 and "metrics" in r]


def per_round(records: list[dict], workload: str, arm: str, key: str) -> dict[int, float]:
    return {
        r["round"]: r["metrics"][key]
        for r in records
        if r["workload"] == workload and r["arm"] == arm and r["metrics"].get(key) is not None
    }


def summarize(records: list[dict], workload: str, arms: list[str], s: BenchSettings) -> list[dict]:
    """One row per metric: each arm's spread, and the reference arm (first) against each other."""
    rows = []
    good = kept(records)
    ref = arms[0]
    for spec in metric_specs(workload, s):
        values = {a: per_round(good, workload, a, spec.key) for a in arms}
        spreads = {a: Spread.of(v.values()) for a, v in values.items()}
        vs = {}
        for other in arms[1:]:
            ratio = paired_ratio(values[ref], values[other])
            judged = verdict(spreads[ref], spreads[other], spec.better == "higher")
            vs[other] = {"ratio": ratio, "verdict": judged if spec.better else ""}
        rows.append({"spec": spec, "arms": spreads, "vs": vs})
    return rows


def fmt(sp: Spread | None, digits: int, scale: float = 1.0) -> str:
    if sp is None:
        return "n/a"
    m, lo, hi = sp.median * scale, sp.lo * scale, sp.hi * scale
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def markdown_table(rows: list[dict], arms: list[str], titles: dict[str, str] | None = None) -> str:
    titles = titles or {}
    ref = arms[0]
    head = ["metric", *(titles.get(a, a) for a in arms)]
    head += [f"{titles.get(ref, ref)} / {titles.get(o, o)}" for o in arms[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        spec: MetricSpec = row["spec"]
        cells = [spec.label]
        cells += [fmt(row["arms"][a], spec.digits, spec.scale) for a in arms]
        for other in arms[1:]:
            cmp_ = row["vs"][other]
            if not spec.better:
                cells.append("")
            elif cmp_["ratio"] is None:
                cells.append("n/a")
            else:
                cells.append(f"{fmt(cmp_['ratio'], 2)} {cmp_['verdict']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rows_as_json(rows: list[dict]) -> list[dict]:
    return [
        {
            "key": r["spec"].key,
            "label": r["spec"].label,
            "better": r["spec"].better,
            "arms": {a: sp.as_dict() if sp else None for a, sp in r["arms"].items()},
            "vs": {
                o: {"ratio": c["ratio"].as_dict() if c["ratio"] else None, "verdict": c["verdict"]}
                for o, c in r["vs"].items()
            },
        }
        for r in rows
    ]
