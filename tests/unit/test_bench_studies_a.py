"""The pure parts of the stalls, soak, embeddings and models studies: request bodies, workloads
and the metrics computed from samples (no server is started here; structured has its own file,
test_bench_structured.py)."""

from __future__ import annotations

import random

import pytest

from ferrum.bench.client import Sample
from ferrum.bench.studies import StudyRun, embeddings, load, models, soak, stalls


def _run(tmp_path, **options: str) -> StudyRun:
    return StudyRun("x", tmp_path, 2, 2, False, None, options=options, hygiene=None)


# -- stalls ---------------------------------------------------------------------------------


def test_stall_schemas_are_all_different_so_no_grammar_is_reused():
    bodies = [b for n in range(3) for b in stalls.burst_bodies("schemas", n, "m")]
    schemas = [b["response_format"]["json_schema"]["schema"] for b in bodies]
    assert len(bodies) == 3 * stalls.BURST
    assert len({str(s) for s in schemas}) == len(schemas)
    assert all(len(s["properties"]) == 60 and len(s["required"]) == 30 for s in schemas)
    assert {b["max_tokens"] for b in bodies} == {1}


def test_refused_bodies_are_the_schema_bodies_with_a_bad_max_tokens():
    refused = stalls.burst_bodies("refused", 2, "m")
    schemas = stalls.burst_bodies("schemas", 2, "m")
    assert [b["max_tokens"] for b in refused] == [-5] * stalls.BURST
    assert [b["response_format"] for b in refused] == [b["response_format"] for b in schemas]


def test_prompt_bodies_are_long_and_distinct():
    bodies = stalls.burst_bodies("prompts", 0, "m")
    texts = [b["messages"][0]["content"] for b in bodies]
    assert len(set(texts)) == stalls.BURST and all(len(t.split()) > 1500 for t in texts)
    assert "response_format" not in bodies[0]


def test_stall_p99_counts_only_gaps_that_end_in_the_window():
    # Every stream ticks each 10 ms; one gap of 500 ms ends at t=2.0, inside the window.
    streams = [[i * 0.01 for i in range(100)] + [1.49, 2.0, 2.01, 2.02] for _ in range(2)]
    assert stalls.p99_gap_ms(streams, 1.9, 2.1) == pytest.approx(510.0)
    assert stalls.p99_gap_ms(streams, 0.0, 0.99) == pytest.approx(10.0)
    with pytest.raises(RuntimeError, match="only 0 gaps"):
        stalls.p99_gap_ms(streams, 5.0, 6.0)


def test_stalls_refuses_an_arm_that_is_no_ferrum_tree(tmp_path):
    with pytest.raises(ValueError, match="--tree"):
        stalls.measure(_run(tmp_path), "llama-server", 1)


# -- soak -----------------------------------------------------------------------------------


def test_soak_counters_sum_every_label_and_skip_the_rest():
    text = (
        "# HELP ferrum_decode_retries_total retries\n"
        "# TYPE ferrum_decode_retries_total counter\n"
        'ferrum_decode_retries_total{model="a"} 3.0\n'
        'ferrum_decode_retries_total{model="b"} 2.0\n'
        "ferrum_faults_injected_total 7.0\n"
        "ferrum_active_requests 4.0\n"
    )
    assert soak.counters(text) == {
        "ferrum_decode_retries_total": 5.0,
        "ferrum_faults_injected_total": 7.0,
    }


def test_soak_held_blocks_leave_parked_prefixes_out():
    health = {"kv_cache_usage_ratio": 0.25, "kv_blocks_total": 64, "prefix_cache": {"blocks": 16}}
    assert soak.held_blocks(health) == 0
    assert soak.held_blocks({**health, "kv_cache_usage_ratio": 0.5}) == 16


def test_soak_ttft_drift_compares_the_last_fifth_with_the_first_by_time_sent():
    # Sent in time order 0..9; the last two (by time sent) were 3x slower. Listed shuffled.
    ttfts = [(float(i), 0.3 if i >= 8 else 0.1) for i in range(10)]
    random.Random(1).shuffle(ttfts)
    assert soak.ttft_drift(ttfts) == pytest.approx(3.0)
    assert soak.ttft_drift([]) == 1.0


def _report(**changes) -> dict:
    whole = {"failures": 0, "decode_failures": 0, "faults_injected": 4,
             "kv_held_blocks_after": 0, "active_after": 0, "queue_after": 0,
             "rss_growth": 0.01, "ttft_drift": 1.1, "served": 100}  # fmt: skip
    return {**whole, **changes}


def test_soak_check_names_every_broken_bound():
    bounds = soak.Bounds(max_rss_growth=0.05, max_ttft_drift=2.0, inject_faults=0.05)
    assert soak.check(_report(), bounds) == []
    assert soak.check(_report(failures=2), bounds) == ["2 failures, 0 in decode"]
    assert soak.check(_report(faults_injected=0), bounds) == [
        "inject_faults was set but no fault was injected"
    ]
    assert soak.check(_report(queue_after=1), bounds) == ["the server did not return to idle"]
    assert soak.check(_report(rss_growth=0.2), bounds) == ["RSS grew 20.0%"]
    assert soak.check(_report(ttft_drift=2.5), bounds) == ["TTFT drifted x2.50"]
    assert soak.check(_report(served=0), bounds) == ["nothing was served"]
    assert soak.check(_report(faults_injected=0), soak.Bounds()) == []  # none asked for


def test_soak_bodies_follow_the_seed():
    one, two = soak.chat_body(random.Random(3), True), soak.chat_body(random.Random(3), True)
    assert one == two and one["stream"] is True and 4 <= one["max_tokens"] <= 40
    assert soak.chat_body(random.Random(3), False, "P: ")["messages"][0]["content"].startswith("P")


def test_soak_on_a_url_needs_its_pid_and_cannot_inject_faults(tmp_path):
    with pytest.raises(ValueError, match="pid"):
        soak.main(_run(tmp_path, url="http://127.0.0.1:9"))
    with pytest.raises(ValueError, match="inject_faults"):
        soak.main(_run(tmp_path, url="http://127.0.0.1:9", pid="1", inject_faults="0.1"))


# -- embeddings -----------------------------------------------------------------------------


def test_embedding_sentences_are_short_and_repeat_by_seed():
    a = embeddings.sentences(4, 300)
    assert a == embeddings.sentences(4, 300) and a != embeddings.sentences(5, 300)
    assert len(a) == 300 and all(5 <= len(s.split()) <= 12 and s.endswith(".") for s in a)


def test_embedding_p99_needs_gaps():
    assert embeddings.p99([float(i) for i in range(200)]) == 198.0
    with pytest.raises(RuntimeError, match="no inter-token gaps"):
        embeddings.p99([])


# -- models ---------------------------------------------------------------------------------


def test_models_counts_the_tokens_inside_the_window():
    a = Sample(prompt="p", max_tokens=4, chunk_times=[0.5, 1.0, 1.5, 2.0])
    b = Sample(prompt="p", max_tokens=4, chunk_times=[1.2, 1.4, 3.5])
    got = models.per_model([a, b], 1.0, 2.0)
    assert got["tok_s"] == pytest.approx(4.0)  # 1.2 1.4 1.5 2.0 in (1.0, 2.0]
    assert got["p99_gap_s"] == pytest.approx(2.1)  # b's 1.4 -> 3.5, the longest of all


def test_models_reads_each_models_load_seconds():
    text = (
        'ferrum_model_load_seconds_sum{model="gemma3-270m"} 1.5\n'
        'ferrum_model_load_seconds_count{model="gemma3-270m"} 1.0\n'
        'ferrum_model_load_seconds_sum{model="smollm2-135m-instruct"} 0.75\n'
    )
    assert models.load_seconds(text) == {"gemma3-270m": 1.5, "smollm2-135m-instruct": 0.75}


def test_models_refuses_an_unknown_arm_before_starting_anything(tmp_path):
    with pytest.raises(ValueError, match="both, switch, gemma, smollm2"):
        models.measure(_run(tmp_path), "ferrum", 1)


def test_the_migrated_studies_load_with_their_arms():
    assert load("stalls").arms == ()  # code trees, given with --tree
    assert load("embeddings").arms == ("ferrum", "ferrum turns-off", "llama-server")
    assert load("structured").arms == ("ferrum", "llama-server-default")
    assert load("models").arms == ("both", "switch", "gemma", "smollm2")
    assert load("soak").main is not None and load("structured").main is not None
