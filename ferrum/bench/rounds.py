"""The one alternating-rounds loop of every study (`ferrum bench --study …`).

    for round in 1..R:                      round 1: warm-up, recorded, not summarised
      for arm in arms (reversed on even rounds):   ABBA: drift hits every arm alike
        wait for a quiet machine → measure(arm, round) → CPU others used meanwhile

A study gives `measure(arm, round) -> {metric: value}` (it starts and stops its own servers);
this module orders the arms, keeps the hygiene figures beside every measurement, and states
each metric as median [min, max] over the kept rounds, with the reference arm's (the first's)
ratio to each other arm paired per round (one round's machine state and prompts shared) and a
verdict only where the ranges do not overlap. The `--workloads` harness keeps its own loop
(its workloads share servers and prompts); everything else measures through this one.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferrum.bench import machine
from ferrum.bench.stats import Spread, paired_ratio, verdict

Measure = Callable[[str, int], dict[str, float]]


@dataclass(frozen=True)
class Metric:
    key: str
    unit: str  # "s", "tok/s", "x", "" ...
    higher_is_better: bool
    digits: int = 3


@dataclass(frozen=True)
class Hygiene:
    quiet_threshold: float = 0.15  # wait before a measurement until machine CPU use <= this
    quiet_wait_s: float = 60.0  # ... but no longer than this
    max_foreign: float = 0.05  # flag a measurement if other processes used more CPU than this


def order(arms: Sequence[str], round_no: int) -> list[str]:
    """The arms of round `round_no` (1-based): as given on odd rounds, reversed on even ones."""
    return list(arms) if round_no % 2 == 1 else list(arms)[::-1]


def alternate(
    arms: Sequence[str], rounds: int, measure: Measure, hygiene: Hygiene | None = None
) -> list[dict[str, Any]]:
    """Every measurement of the run as a record: round, arm, metrics (or error), hygiene."""
    if rounds < 2:
        raise ValueError("--rounds must be at least 2 (round 1 is a discarded warm-up)")
    records: list[dict[str, Any]] = []
    for r in range(1, rounds + 1):
        for arm in order(arms, r):
            records.append(_one(arm, r, measure, hygiene))
            _print_record(records[-1])
    return records


def _one(arm: str, r: int, measure: Measure, hygiene: Hygiene | None) -> dict[str, Any]:
    record: dict[str, Any] = {"round": r, "arm": arm}
    if hygiene is not None:
        record["quiet"] = machine.wait_quiet(hygiene.quiet_threshold, hygiene.quiet_wait_s)
    before = machine.snapshot(None)
    try:
        record["metrics"] = measure(arm, r)
    except Exception as exc:  # one failed measurement must not lose the run's others
        record["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    use = machine.usage(before, machine.snapshot(None))
    if use is not None:
        record["usage"] = use
        record["flagged"] = hygiene is not None and use["foreign_share"] > hygiene.max_foreign
    return record


def _print_record(record: dict[str, Any]) -> None:
    what = record.get("error") or json.dumps(
        {k: round(v, 4) for k, v in record.get("metrics", {}).items()}
    )
    print(f"round {record['round']} {record['arm']}: {what}", file=sys.stderr, flush=True)


def per_round(records: list[dict[str, Any]], arm: str, key: str) -> dict[int, float]:
    """One metric of one arm by round, warm-up round left out."""
    return {
        rec["round"]: rec["metrics"][key]
        for rec in records
        if rec["arm"] == arm and rec["round"] > 1 and key in rec.get("metrics", {})
    }


def summarize(
    records: list[dict[str, Any]], arms: Sequence[str], metrics: Sequence[Metric], reference: str
) -> list[dict[str, Any]]:
    """One row per metric and arm: spread, and for every other arm the reference's paired
    ratio to it and the reference's verdict over the ranges (the harness's convention)."""
    rows = []
    for m in metrics:
        ref = per_round(records, reference, m.key)
        for arm in arms:
            mine = per_round(records, arm, m.key)
            row: dict[str, Any] = {"metric": m, "arm": arm, "spread": Spread.of(mine.values())}
            if arm != reference:
                row["ratio"] = paired_ratio(ref, mine)
                row["verdict"] = verdict(Spread.of(ref.values()), row["spread"], m.higher_is_better)
            rows.append(row)
    return rows


def _fmt(sp: Spread | None, digits: int) -> str:
    if sp is None:
        return "n/a"
    return f"{sp.median:.{digits}f} [{sp.lo:.{digits}f}, {sp.hi:.{digits}f}]"


def markdown(rows: list[dict[str, Any]], reference: str) -> str:
    ratio, judged = f"{reference} ÷ arm, per round", f"{reference}'s verdict"
    lines = [
        f"| metric | arm | median [min, max] | {ratio} | {judged} |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        m: Metric = row["metric"]
        ratio = _fmt(row.get("ratio"), 2) if "ratio" in row else "reference"
        name = f"{m.key} ({m.unit})" if m.unit else m.key
        spread = _fmt(row["spread"], m.digits)
        lines.append(f"| {name} | {row['arm']} | {spread} | {ratio} | {row.get('verdict', '')} |")
    return "\n".join(lines) + "\n"


def write(
    out: Path, title: str, records: list[dict[str, Any]], rows: list[dict[str, Any]],
    reference: str, meta: dict[str, Any],
) -> Path:  # fmt: skip
    """rounds.json (every record and the run's facts) and results.md; the latter's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "rounds.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    flagged = sum(1 for r in records if r.get("flagged"))
    failed = [f"round {r['round']} {r['arm']}: {r['error']}" for r in records if "error" in r]
    text = [f"# {title}\n", f"{meta.get('command', '')}\n", markdown(rows, reference)]
    text.append(f"\nRound 1 is a warm-up and left out; {flagged} measurement(s) flagged for "
                f"other processes' CPU use.\n")  # fmt: skip
    text += [f"- failed: {f}\n" for f in failed]
    md = out / "results.md"
    md.write_text("".join(text))
    return md
