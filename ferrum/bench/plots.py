"""PNG plots of the summary (matplotlib, headless). Each point is a median, each bar an
error range [min, max] over the kept rounds: the same numbers as the Markdown tables."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferrum.bench.settings import BenchSettings
from ferrum.bench.stats import Spread

Tables = dict[str, list[dict]]  # workload -> summary rows (report.summarize)
Labels = dict[str, list[str]]  # workload -> arm labels, reference first


def _pyplot() -> Any:
    # Imported late: matplotlib is in the optional `bench` extra only.
    import matplotlib

    matplotlib.use("Agg")  # no display on benchmark machines
    import matplotlib.pyplot as plt

    return plt


def _errors(spreads: list[Spread | None]) -> tuple[list[float], list[list[float]]]:
    med = [sp.median if sp else float("nan") for sp in spreads]
    lo = [sp.median - sp.lo if sp else 0.0 for sp in spreads]
    hi = [sp.hi - sp.median if sp else 0.0 for sp in spreads]
    return med, [lo, hi]


def _row(rows: list[dict], key: str) -> dict | None:
    return next((r for r in rows if r["spec"].key == key), None)


def _series(rows: list[dict], keys: list[str], arm: str) -> list[Spread | None]:
    return [(_row(rows, k) or {"arms": {}})["arms"].get(arm) for k in keys]


def write_plots(tables: Tables, arms: Labels, s: BenchSettings, out: Path) -> list[Path]:
    """Writes the PNGs whose workloads ran; returns their paths."""
    plt = _pyplot()
    # Only rows with at least one number (an interrupted or failed run may have none).
    tables = {
        w: [r for r in rows if any(r["arms"].values())]
        for w, rows in tables.items()
        if any(any(r["arms"].values()) for r in rows)
    }
    written = []
    for name, fn in (
        ("sweep_tps.png", _sweep),
        ("ttft.png", _ttft),
        ("multiturn_ttft.png", _multiturn),
        ("engine_tps.png", _engine),
    ):
        fig = fn(plt, tables, arms, s)
        if fig is not None:
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            written.append(out / name)
    return written


def _lines(
    plt: Any,
    rows: list[dict],
    labels: list[str],
    xs: list[int],
    key: Callable[[int], str],
    axes: tuple[str, str, str],
) -> tuple[Any, Any]:
    """One line per arm through the medians at `xs`, with [min, max] error bars; `axes` is
    (x label, y label, title)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in labels:
        med, err = _errors(_series(rows, [key(x) for x in xs], arm))
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=arm)
    xlabel, ylabel, title = axes
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig, ax


def _sweep(plt: Any, tables: Tables, arms: Labels, s: BenchSettings) -> Any:
    rows = tables.get("sweep")
    if not rows:
        return None
    levels = list(s.sweep_levels)
    fig, ax = _lines(
        plt, rows, arms["sweep"], levels, lambda c: f"c{c}.tps",
        ("concurrent requests (unique prompts)", "aggregate output tok/s",
         "Throughput vs concurrency (median, [min, max])"),
    )  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    return fig


def _ttft_series(s: BenchSettings) -> list[tuple[str, str, str]]:
    top = max(s.sweep_levels) if s.sweep_levels else 1
    return [
        ("sweep", "c1.ttft_p50", "sweep c=1\np50"),
        ("sweep", f"c{top}.ttft_p50", f"sweep c={top}\np50"),
        ("burst", "cold.ttft_p50", "burst cold\np50"),
        ("burst", "warm.ttft_p50", "burst warm\np50"),
        ("multiturn", "later.ttft_mean", "multi-turn\nlater turns"),
        ("noisy", "long.ttft", "noisy\nlong prompt"),
        ("fairness", "flood.ttft_p99", "chat beside\nan n-flood p99"),
    ]


def _ttft(plt: Any, tables: Tables, arms: Labels, s: BenchSettings) -> Any:
    series = [x for x in _ttft_series(s) if x[0] in tables and _row(tables[x[0]], x[1])]
    if not series:
        return None
    labels = sorted({a for w, _, _ in series for a in arms[w]}, key=_arm_order(arms))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(labels))
    for i, arm in enumerate(labels):
        spreads = [(_row(tables[w], k) or {"arms": {}})["arms"].get(arm) for w, k, _ in series]
        med, err = _errors(spreads)
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(series))]
        ax.bar(xs, med, width, yerr=err, capsize=2, label=arm)
    ax.set_xticks(range(len(series)), [t for _, _, t in series])
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s, log scale)")
    ax.set_title("TTFT per workload (median, [min, max])")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return fig


def _arm_order(arms: Labels) -> Callable[[str], int]:
    order = [a for labels in arms.values() for a in labels]
    return lambda a: order.index(a)


def _multiturn(plt: Any, tables: Tables, arms: Labels, s: BenchSettings) -> Any:
    rows = tables.get("multiturn")
    if not rows:
        return None
    turns = list(range(1, s.multiturn_turns + 1))
    fig, ax = _lines(
        plt, rows, arms["multiturn"], turns, lambda t: f"turn{t}.ttft",
        ("turn (history grows with the real replies)", "TTFT (s)",
         "Multi-turn TTFT by turn (median over conversations and rounds)"),
    )  # fmt: skip
    ax.set_xticks(turns)
    return fig


def _engine(plt: Any, tables: Tables, arms: Labels, s: BenchSettings) -> Any:
    rows = tables.get("engine")
    if not rows:
        return None
    fig, _ = _lines(
        plt, rows, arms["engine"], list(s.engine_batches), lambda b: f"b{b}.tps",
        ("sequences decoding at once", "decode tok/s",
         "Decode loop: ferrum engine vs llama-batched-bench"),
    )  # fmt: skip
    return fig
