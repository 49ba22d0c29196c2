"""The run's folder: results.json (every raw sample), results.md (tables) and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from ferrum.bench.harness import Plan, capabilities, jsonable
from ferrum.bench.report import markdown_table, rows_as_json, summarize
from ferrum.bench.settings import BenchSettings


def describe(workload: str, s: BenchSettings) -> str:
    """One sentence per workload: what was sent, as it was configured for this run."""
    if workload == "sweep":
        levels = ", ".join(map(str, s.sweep_levels))
        return (
            f"unique unrelated prompts at concurrency {levels} (at least "
            f"{s.sweep_min_requests} requests per level), {s.sweep_tokens} output tokens each "
            f"with ignore_eos; tok/s = completion tokens / wall time of the waves."
        )
    if workload == "burst":
        return (
            f"{s.burst_clients} clients at once, each a shared handbook prefix "
            f"({s.burst_prefix_rules} rules) plus its own question, {s.burst_tokens} output "
            f"tokens; first a prefix no server has seen (cold), then the same prefix (warm)."
        )
    if workload == "multiturn":
        return (
            f"{s.multiturn_conversations} conversations at once, {s.multiturn_turns} turns "
            f"each; every turn resends the whole history including the server's real replies "
            f"(up to {s.multiturn_tokens} tokens, ending naturally)."
        )
    if workload == "noisy":
        return (
            f"{s.noisy_streams} streams of {s.noisy_stream_tokens} tokens decode; after "
            f"~{s.noisy_before_tokens} tokens each a long prompt ({s.noisy_long_rules} rules) "
            f"arrives. Their inter-token gaps before it was sent and during its prefill (until "
            f"its first token)."
        )
    if workload == "fairness":
        return (
            f"{s.fair_chats} short chats ({s.fair_chat_tokens} tokens) one after another on the "
            f"idle server; then requests with n={s.fair_flood_n} taking all {s.parallel} slots, "
            f"{s.fair_flood_tokens} tokens per choice and, once each choice streams, short chats "
            f"(new prompts) one after another while they run. Their TTFT beside it against idle."
        )
    if workload == "longctx":
        return (
            f"{s.longctx_clients} clients at once, each its own long prompt (a handbook of "
            f"{s.longctx_rules} rules, nothing shared beyond the first tokens), "
            f"{s.longctx_tokens} output tokens each; tok/s = all output tokens / wall time."
        )
    if workload == "engine":
        batches = ", ".join(map(str, s.engine_batches))
        return (
            f"no HTTP: ferrum's LLMEngine + LlamaRunner stepping B requests of "
            f"{s.engine_prompt_tokens} random prompt tokens for {s.engine_tokens} decode steps, "
            f"against llama.cpp's llama-batched-bench (S_TG, same model, threads and KV shape) "
            f"at B = {batches}. The ceiling samples nothing; ferrum / ceiling is what sampling, "
            f"scheduling and text cost. `llama-batched-bench streams` keeps a cache per "
            f"sequence instead of ferrum's one pool: the pool's own cost; `llama-batched-bench "
            f"windows` keeps the pool with the window layers sized to their windows (no "
            f"`swa_full`): what ferrum's full-sized window cache costs."
        )
    raise ValueError(workload)


def arm_labels(plan: Plan, workload: str) -> list[str]:
    return list(plan.engine_sides) if workload == "engine" else [a.label for a in plan.arms]


def write(plan: Plan, records: list[dict], meta: dict) -> dict[str, Path]:
    s = plan.settings
    tables = {w: summarize(records, w, arm_labels(plan, w), s) for w in plan.workloads}
    meta["capabilities"] = {a.label: capabilities(records, a) for a in plan.arms}
    payload = {
        "meta": meta,
        "summary": {w: rows_as_json(rows) for w, rows in tables.items()},
        "records": records,
    }
    files = {"json": plan.out / "results.json", "md": plan.out / "results.md"}
    files["json"].write_text(json.dumps(jsonable(payload), indent=1), encoding="utf-8")
    plots: list[Path] = []
    try:
        from ferrum.bench.plots import write_plots

        labels = {w: arm_labels(plan, w) for w in plan.workloads}
        plots = write_plots(tables, labels, s, plan.out)
    except ImportError:
        meta["notes"].append("no plots: matplotlib is not installed (pip install 'ferrum[bench]')")
    except Exception as exc:  # a plot must not cost the tables of a 30-minute run
        meta["notes"].append(f"plots failed: {type(exc).__name__}: {exc}")
    files["md"].write_text(render(plan, records, meta, tables, plots), encoding="utf-8")
    journal = plan.out / "records.jsonl"
    journal.unlink(missing_ok=True)  # results.json now holds every record
    return files


def render(
    plan: Plan, records: list[dict], meta: dict, tables: dict[str, list[dict]], plots: list[Path]
) -> str:
    s = plan.settings
    ref = plan.arms[0].label if plan.arms else "ferrum"
    lines = [
        f"# ferrum bench: {meta['preset']} run, {meta['date']}",
        "",
        f"{s.rounds} rounds (round 1 discarded as warm-up); elapsed {meta['elapsed']} "
        f"(estimated {meta['estimate_min']:.0f} min). Machine: {meta['machine']}.",
        f"Model `{Path(plan.model).name}`; every server: {s.threads} threads, {_cells(s)}, "
        f"up to {s.parallel} sequences at once; prompts are raw Gemma-formatted text "
        f"through `/v1/completions`, temperature 0.",
        "",
        "Cells: median [min, max] over the kept rounds. Ratio columns: "
        f"`{ref}` / other, median [min, max] of the per-round ratios, then the verdict from "
        f"`{ref}`'s side: win or loss only when the two [min, max] ranges are disjoint, else "
        "inconclusive. TTFT: request sent to first text chunk received. Inter-token: gap "
        "between successive text chunks of one stream.",
        "",
        "## Arms",
        "",
        "| arm | ignore_eos | cached_tokens | usage | requests |",
        "|---|---|---|---|---|",
    ]
    for label, cap in meta["capabilities"].items():
        lines.append(
            f"| {label} | {cap['ignore_eos']} | {cap['cached_tokens']} | {cap['usage']} | "
            f"{cap['requests']} |"
        )
    lines += ["", *(f"- {n}" for n in meta["notes"])]
    for w in plan.workloads:
        lines += ["", f"## {w}", "", describe(w, s), ""]
        lines.append(markdown_table(tables[w], arm_labels(plan, w)))
    if plots:
        lines += ["", "## Plots", "", *(f"![{p.stem}]({p.name})" for p in plots)]
    lines += ["", "## Measurement hygiene", "", *_hygiene(records, s)]
    lines += ["", "Commands:", ""]
    lines += [f"- {label}: `{' '.join(cmd)}`" for label, cmd in meta["commands"].items()]
    return "\n".join(lines) + "\n"


def _hygiene(records: list[dict], s: BenchSettings) -> list[str]:
    out = []
    bad = [r for r in records if r["round"] > 1 and r.get("contaminated")]
    if bad:
        listed = ", ".join(
            f"r{r['round']} {r['workload']} {r['arm']} "
            f"({(r.get('cpu') or {}).get('foreign_share', 0):.0%})"
            for r in bad
        )
        out.append(
            f"- WARNING: {len(bad)} kept measurement(s) ran while other processes used more "
            f"than {s.max_foreign:.0%} of the CPUs (or the machine never went quiet): {listed}."
        )
    else:
        out.append(f"- No kept measurement saw other processes use > {s.max_foreign:.0%} of CPUs.")
    retried = sum(len(r.get("discarded_attempts") or ()) for r in records)
    if retried:
        out.append(f"- {retried} disturbed measurement(s) were re-run (kept in results.json).")
    for r in records:
        if "error" in r:
            first = r["error"].splitlines()[0]
            out.append(f"- FAILED: round {r['round']} {r['workload']} {r['arm']}: {first}")
    return out


def _cells(s: BenchSettings) -> str:
    pool = f"one pool of {s.ctx_size} KV cells any single sequence may fill"
    if s.peer_kv_unified:
        return pool
    return f"{pool} (llama-server: {s.ctx_size // s.parallel} cells per slot, its default)"
