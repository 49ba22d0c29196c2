"""The benchmark's pure parts: percentiles, spreads, verdicts, summaries and Markdown tables.
No servers, no llama.cpp; the harness itself is exercised by `ferrum bench --quick`."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrum.bench.client import Dialect, Sample, request_body
from ferrum.bench.engine_loop import parse_ceiling
from ferrum.bench.report import markdown_table, summarize
from ferrum.bench.settings import FULL, QUICK, estimate_seconds
from ferrum.bench.stats import (
    Answer,
    Spread,
    p99_rank,
    paired_ratio,
    percentile,
    rate_while_all_busy,
    verdict,
)


def test_the_studies_p99_is_a_rank_not_an_interpolation():
    assert p99_rank([]) is None and p99_rank([2.0]) == 2.0
    assert p99_rank(float(i) for i in range(200)) == 198.0  # index int(0.99 * 200)
    assert p99_rank([5.0, 1.0, 3.0]) == 5.0  # below 100 values: the maximum


def test_percentile_interpolates_between_ranks():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile(range(101), 99) == pytest.approx(99.0)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_spread_skips_missing_values():
    sp = Spread.of([3.0, None, 1.0, 2.0, float("nan")])
    assert (sp.median, sp.lo, sp.hi, sp.n) == (2.0, 1.0, 3.0, 3)
    assert Spread.of([None]) is None


@pytest.mark.parametrize(
    ("ours", "theirs", "higher", "expected"),
    [
        ([10, 11, 12], [5, 6, 7], True, "win"),
        ([10, 11, 12], [5, 6, 7], False, "loss"),
        ([1, 2, 3], [5, 6, 7], True, "loss"),
        ([1, 2, 3], [5, 6, 7], False, "win"),
        ([1, 5, 9], [4, 6, 8], True, "inconclusive"),
        ([1, 2, 5], [5, 6, 7], True, "inconclusive"),  # touching ranges overlap
        ([10], [5, 6], True, "inconclusive (n<2)"),
    ],
)
def test_verdict_needs_disjoint_ranges(ours, theirs, higher, expected):
    assert verdict(Spread.of(ours), Spread.of(theirs), higher) == expected


def test_verdict_without_data_is_na():
    assert verdict(None, Spread.of([1, 2]), True) == "n/a"


def test_paired_ratio_uses_common_rounds_only():
    sp = paired_ratio({2: 10.0, 3: 12.0, 4: 9.0}, {2: 5.0, 3: 6.0})
    assert (sp.median, sp.lo, sp.hi, sp.n) == (2.0, 2.0, 2.0, 2)


def _record(arm: str, round_no: int, metrics: dict, workload: str = "sweep") -> dict:
    return {"workload": workload, "arm": arm, "round": round_no, "metrics": metrics}


def test_summary_discards_round_one_and_failures_and_renders_markdown():
    s = QUICK.replace(sweep_levels=(1,))
    records = [
        _record("ferrum", 1, {"c1.tps": 1000.0}),  # warm-up: ignored
        _record("ferrum", 2, {"c1.tps": 40.0, "c1.ttft_p50": 0.10}),
        _record("ferrum", 3, {"c1.tps": 42.0, "c1.ttft_p50": 0.12}),
        _record("llama-server", 2, {"c1.tps": 30.0, "c1.ttft_p50": 0.11}),
        _record("llama-server", 3, {"c1.tps": 31.0, "c1.ttft_p50": 0.13}),
        {"workload": "sweep", "arm": "llama-server", "round": 4, "error": "boom"},
    ]
    rows = summarize(records, "sweep", ["ferrum", "llama-server"], s)
    by_key = {r["spec"].key: r for r in rows}
    tps = by_key["c1.tps"]
    assert tps["arms"]["ferrum"].median == 41.0 and tps["arms"]["ferrum"].n == 2
    assert tps["vs"]["llama-server"]["verdict"] == "win"
    assert tps["vs"]["llama-server"]["ratio"].lo == pytest.approx(40 / 30)
    assert by_key["c1.ttft_p50"]["vs"]["llama-server"]["verdict"] == "inconclusive"
    table = markdown_table(rows, ["ferrum", "llama-server"]).splitlines()
    assert table[0] == "| metric | ferrum | llama-server | ferrum / llama-server |"
    assert (
        table[2]
        == "| c=1: output tok/s | 41.0 [40.0, 42.0] | 30.5 [30.0, 31.0] | 1.34 [1.33, 1.35] win |"
    )
    assert "| c=1: inter-token p50 (ms) | n/a | n/a | n/a |" in table


def test_context_metrics_get_no_verdict():
    records = [
        _record(arm, r, {"cold.cached_tokens": c}, "burst")
        for arm, c in (("ferrum", 2000.0), ("llama-server", 0.0))
        for r in (2, 3)
    ]
    rows = summarize(records, "burst", ["ferrum", "llama-server"], QUICK)
    row = next(r for r in rows if r["spec"].key == "cold.cached_tokens")
    assert row["vs"]["llama-server"]["verdict"] == ""
    line = next(
        x
        for x in markdown_table(rows, ["ferrum", "llama-server"]).splitlines()
        if "cold: cached" in x
    )
    assert line.endswith("| 2000 [2000, 2000] | 0 [0, 0] |  |")


def test_request_body_asks_every_server_for_fixed_lengths_its_own_way():
    native = request_body("m", "p", 8, Dialect(), fixed=True)
    assert native["ignore_eos"] is True and native["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in request_body("m", "p", 8, Dialect(), fixed=False)
    lcp = Dialect(ignore_eos="logit_bias", eog_token_ids=(1, 106), usage_in_stream=False)
    body = request_body("m", "p", 8, lcp, fixed=True)
    assert body["logit_bias"] == {"1": -1e9, "106": -1e9}
    assert "ignore_eos" not in body and "stream_options" not in body


def test_sample_gaps_and_ttft():
    s = Sample(prompt="p", max_tokens=3, t_start=1.0, chunk_times=[1.5, 1.6, 1.9])
    assert s.ttft_s == 0.5
    assert s.gaps == pytest.approx([0.1, 0.3])


def test_parse_ceiling_reads_jsonl_rows_among_log_lines():
    out = (
        "llama_batched_bench: n_kv_max = 8192\n"
        '{"pp": 32, "tg": 64, "pl": 1, "speed_tg": 41.5}\n'
        "noise\n"
        '{"pp": 32, "tg": 64, "pl": 16, "speed_tg": 140.25}\n'
    )
    assert parse_ceiling(out) == {1: 41.5, 16: 140.25}


def test_quick_preset_is_much_shorter_than_full():
    workloads = ["sweep", "burst", "multiturn", "noisy", "engine"]
    arms = [False, False, True]  # ferrum, llama-server, llama-cpp-python (serial)
    full, quick = estimate_seconds(FULL, arms, workloads), estimate_seconds(QUICK, arms, workloads)
    assert quick * 4 < full <= 40 * 60


def test_llama_server_arms_run_their_own_builds(tmp_path, monkeypatch):
    """`llama-server` runs the build with ferrum's kernel flags, `llama-server-default` the one
    with cmake's defaults; a missing build names the command that makes it."""
    from ferrum.bench.arms import make_arm, server_command, unavailable_reason

    monkeypatch.setenv("FERRUM_BENCH_CACHE", str(tmp_path))
    assert "FLAVOR=default bench/build_llama_server.sh" in unavailable_reason(
        "llama-server-default"
    )
    same = unavailable_reason("llama-server")
    assert same is not None and "FLAVOR" not in same
    binaries = {}
    for kind in ("llama-server", "llama-server-default"):
        cmd = server_command(make_arm(kind, kind), FULL, "m.gguf", 8080)
        binaries[kind] = cmd[0]
        Path(cmd[0]).parent.mkdir(parents=True)
        Path(cmd[0]).touch()
        assert unavailable_reason(kind) is None
    assert Path(binaries["llama-server"]).parent.parent.name.startswith("build-")
    assert Path(binaries["llama-server-default"]).parent.parent.name.endswith("-default")
    assert binaries["llama-server"] != binaries["llama-server-default"]


def test_llama_server_gets_one_cell_pool_unless_told_to_run_as_its_default():
    from ferrum.bench.arms import make_arm, server_command

    arm = make_arm("llama-server-default", "llama-server-default")
    assert "--kv-unified" in server_command(arm, FULL, "m.gguf", 8080)
    per_slot = server_command(arm, FULL.replace(peer_kv_unified=0), "m.gguf", 8080)
    assert "--kv-unified" not in per_slot and "-np" in per_slot


def test_rate_while_all_busy_counts_until_the_first_client_is_done():
    # Client a: two requests of 100 tokens over 0-1 s and 1-2 s; client b: one of 300
    # tokens over 0-3 s. Until 2 s both are busy: a's 200 tokens and two thirds of b's.
    a = [Answer(0.0, 1.0, 100), Answer(1.0, 2.0, 100)]
    b = [Answer(0.0, 3.0, 300)]
    assert rate_while_all_busy([a, b]) == pytest.approx((200 + 200) / 2.0)
    # The whole run's rate is lower: b decodes alone in its last second.
    assert rate_while_all_busy([a, b]) > (200 + 300) / 3.0
    # One client: its whole run.
    assert rate_while_all_busy([a]) == pytest.approx(100.0)
    # A client with no answer, or none at all: no window.
    assert rate_while_all_busy([a, []]) is None
    assert rate_while_all_busy([]) is None


def test_set_overrides_workload_settings_typed_and_refuses_unknown_ones():
    from ferrum.bench.settings import FULL

    s = FULL.with_options({"longctx_clients": "16", "sweep_levels": "1,8,32"})
    assert s.longctx_clients == 16 and s.sweep_levels == (1, 8, 32)
    with pytest.raises(ValueError, match="no such setting"):
        FULL.with_options({"nope": "1"})
    with pytest.raises(ValueError, match="not a valid value"):
        FULL.with_options({"longctx_rules": "many"})


def test_longctx_sends_unrelated_long_prompts_at_once_and_reports_the_whole_workload():
    import asyncio

    import httpx

    from ferrum.bench.client import Dialect
    from ferrum.bench.prompts import PromptSource
    from ferrum.bench.settings import QUICK
    from ferrum.bench.workloads import Context, longctx
    from tests.factories import fake_app

    async def scenario() -> tuple[dict, dict]:
        transport = httpx.ASGITransport(app=fake_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            small = QUICK.replace(longctx_rules=4)  # the fake model's context: 1,024 bytes
            ctx = Context(client, "fake", Dialect(), small, PromptSource("s", 2, "longctx"))
            return await longctx(ctx)

    raw, metrics = asyncio.run(scenario())
    prompts = [x.prompt for x in raw["samples"]]
    assert len(prompts) == QUICK.longctx_clients == len(set(prompts))
    assert metrics["tps"] > 0 and metrics["wall_s"] > 0 and metrics["prompt_tokens"] > 300


def test_the_ceiling_runs_with_ferrums_pool_and_with_a_cache_per_sequence():
    from ferrum.bench.engine_loop import ceiling_command

    args = (Path("bin/llama-batched-bench"), "m.gguf", 2, 4096, [1, 8], 32, 16)
    pooled = ceiling_command(*args)
    streams = ceiling_command(*args, "llama-batched-bench streams")
    windows = ceiling_command(*args, "llama-batched-bench windows")
    assert "-kvu" in windows and "--swa-full" not in windows and "-no-kvu" not in windows
    assert "-kvu" in pooled and "--swa-full" in pooled and "-no-kvu" not in pooled
    assert "-no-kvu" in streams and "-kvu" not in streams and "--swa-full" not in streams
    assert [a for a in pooled if a not in ("-kvu", "--swa-full")] == [
        a for a in streams if a != "-no-kvu"
    ]


def test_every_ferrum_start_gets_an_empty_disk_tier_of_its_own(tmp_path, monkeypatch):
    """The prompts are the same in every run (seeded by round): a ferrum arm started on the
    default disk tier would restore what an earlier run saved. Each start gets its own folder,
    empty, which the server process removes when it stops."""
    from ferrum.bench import harness
    from ferrum.bench.arms import make_arm

    seen = []

    class FakeServer:
        pid = None

        def __init__(self, cmd, log_path, port, scratch=None):
            folder = Path(cmd[cmd.index("--cache-dir") + 1])
            assert scratch == folder
            folder.mkdir(parents=True)  # what ferrum would write there
            seen.append((folder, sorted(p.name for p in folder.iterdir())))
            (folder / "state.bin").write_bytes(b"x")

        def wait_ready(self, base, path):
            return 0.0

        def stop(self):
            pass

    async def fake_measure(*args):
        return {}, {"tps": 1.0}

    monkeypatch.setattr(harness, "ServerProcess", FakeServer)
    monkeypatch.setattr(harness, "_measure", fake_measure)
    monkeypatch.setattr(harness, "wait_port_free", lambda port: None)
    monkeypatch.setattr(harness.machine, "wait_quiet", lambda *a: {"quiet": True})
    plan = harness.Plan(FULL, [make_arm("ferrum", "ferrum")], ["sweep"], "m.gguf", 1, tmp_path)
    for round_no in (1, 2):
        record = harness.measure(plan, plan.arms[0], "sweep", round_no)
        assert "error" not in record, record
    (first, first_files), (second, second_files) = seen
    assert first != second and first_files == second_files == []


def test_a_server_process_removes_its_scratch_folder_when_stopped(tmp_path):
    from ferrum.bench.process import ServerProcess, free_port

    scratch = tmp_path / "kv"
    scratch.mkdir()
    (scratch / "state.bin").write_bytes(b"x")
    server = ServerProcess(["sleep", "30"], tmp_path / "log", free_port(), scratch=scratch)
    server.stop()
    assert server.proc.poll() is not None and not scratch.exists()


def test_a_study_server_gets_its_own_disk_tier_unless_the_study_names_one(tmp_path, monkeypatch):
    from ferrum.bench import studies

    commands = []

    class FakeServer:
        def __init__(self, cmd, log_path, port, env=None, scratch=None):
            commands.append((cmd, scratch))

    monkeypatch.setattr(studies, "ServerProcess", FakeServer)
    monkeypatch.setattr(studies, "_ready", lambda server: server)
    run = studies.StudyRun("s", tmp_path, rounds=1, threads=2, quick=True, arms=["ferrum"])
    run.ferrum("ferrum", "--parallel", "4")
    run.ferrum("ferrum", "--cache-disk", "0")
    (own, scratch), (named, none) = commands
    assert own[own.index("--cache-dir") + 1] == str(scratch) and none is None
    assert scratch.parent == tmp_path / "kv" and "--cache-dir" not in named
