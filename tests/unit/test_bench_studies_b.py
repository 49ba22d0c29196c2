"""The pure parts of the speculation, tiers, cluster, kernels and router studies: prompts, arm
names to flags, summaries and the routing simulation (no servers, no models)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ferrum.bench.client import Sample
from ferrum.bench.studies import StudyRun, cluster, kernels, load, router, speculation, tiers
from ferrum.bench.studies import speculation_agreement as agreement
from ferrum.bench.studies import speculation_gate as gate
from ferrum.cluster.policy import Candidate


def _run(tmp_path: Path, quick: bool = False, **options: str) -> StudyRun:
    return StudyRun("x", tmp_path, 2, 2, quick, None, options=options, hygiene=None)


def test_speculation_prompts_template_the_copy_passage_and_a_topic_per_request():
    copy = speculation.prompt("copy", 5)
    assert copy.startswith("<|im_start|>user\nRewrite this code") and copy.endswith("```python\n")
    assert speculation.passage() in copy
    prose = [speculation.prompt("prose", i) for i in range(9)]
    assert "a lighthouse keeper" in prose[0] and prose[8] == prose[0]  # topics cycle
    assert len(set(prose[:8])) == 8
    with pytest.raises(ValueError, match="unknown workload"):
        speculation.prompt("poetry", 0)


def test_speculation_arm_names_give_the_servers_flags():
    assert speculation.ferrum_flags("ferrum ngram") == []
    assert speculation.ferrum_flags("ferrum none alt") == ["--spec-type", "none"]
    assert speculation.ferrum_flags("ferrum ngram own") == ["--spec-recent", "0"]
    assert speculation.ferrum_flags("ferrum ngram draft16 batch32") == [
        "--spec-draft-max", "16", "--spec-batch-max", "32"]  # fmt: skip
    assert speculation.ferrum_flags("before none") == ["--spec-type", "none"]  # a --tree arm
    assert speculation.llama_server_mode("llama-server none") == ("same", [])
    assert speculation.llama_server_mode("llama-server default ngram-mod") == (
        "default", ["--spec-type", "ngram-mod"],
    )  # fmt: skip
    with pytest.raises(ValueError, match="expected llama-server"):
        speculation.llama_server_mode("llama-server eagle")


def test_speculation_cells_and_metrics_follow_the_knobs(tmp_path):
    assert speculation.cells(_run(tmp_path)) == [("copy", 1), ("copy", 4), ("prose", 1),
                                                 ("prose", 4)]  # fmt: skip
    cells = speculation.cells(_run(tmp_path, quick=True, workloads="prose"))
    assert cells == [("prose", 1), ("prose", 2)]
    assert speculation.metric_keys(cells) == ["prose c=1", "prose c=2", "prose c=2 all busy"]


def test_agreement_finds_where_outputs_part_and_sums_them_up():
    assert agreement.parting([1, 2, 3], [1, 2, 3]) is None
    assert agreement.parting([1, 2, 3], [1, 5, 3]) == 1
    assert agreement.parting([1, 2, 3], [1, 2]) == 2
    assert agreement.lead({7: -0.1, 9: -0.3}, 7, 9) == pytest.approx(0.2)
    assert agreement.lead({7: -0.1}, 7, 9) == float("inf")
    outcomes = [agreement.Outcome("copy 0", 200, None), agreement.Outcome("prose 0", 200, 50)]
    assert agreement.summary(outcomes, drafted=40, accepted=30) == (
        "identical outputs: 1 of 2; tokens before any parting: 250 of 400; drafts: 30 of 40 "
        "guessed tokens kept"
    )
    names = [name for name, _ in agreement.prompts()]
    assert names[:4] == ["copy 0", "copy 1", "copy 2", "copy 3"] and len(names) == 12


def test_gate_ratios_are_offs_time_over_each_arms_and_stories_are_new():
    times = {"off": [2.0, 4.0], "tree": [1.0, 4.0], "base": [2.0, 2.0]}
    got = gate.ratios(times)
    assert got["tree"] == {"over_all": pytest.approx(6 / 5), "each": [2.0, 1.0]}
    assert got["base"]["over_all"] == pytest.approx(1.5)
    assert gate.report_lines("stories", times, "story")[0].startswith("stories        tree: x1.200")
    assert len(set(gate.TOPICS)) == 96


def test_tiers_documents_are_seeded_and_turns_are_chatml():
    assert tiers.document(3, 100) == tiers.document(3, 100) != tiers.document(4, 100)
    assert len(tiers.document(3, 650).split()) >= 650
    assert tiers.turn("H", "Q?") == "H<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    assert tiers.has_tiers("ferrum tiers") and not tiers.has_tiers("ferrum no tiers")


def test_cluster_arms_are_routers_or_one_server(tmp_path):
    single = cluster.command("single", 9000, tmp_path)
    assert "serve" in single and "--parallel" in single and "16" in single
    routed = cluster.command("text-prefix", 9000, tmp_path)
    assert routed[routed.index("--router") + 1] == "text-prefix" and "cluster" in routed
    with pytest.raises(ValueError, match="choose single or a router"):
        cluster.command("random", 9000, tmp_path)
    tally = cluster.Tally()
    tally.add(Sample("p", 3, prompt_tokens=10, completion_tokens=3, cached_tokens=4))
    tally.add(Sample("p", 3, prompt_tokens=10, completion_tokens=3))
    assert (tally.prompt, tally.cached, tally.answer) == (20, 4, 6)
    with pytest.raises(RuntimeError, match="without usage"):
        tally.add(Sample("p", 3))


def test_kernels_arms_are_interpreters_named_with_set(tmp_path):
    run = _run(tmp_path, **{"python.avx2": "/venvs/avx2/bin/python", "k": "1,8"})
    pythons = kernels.interpreters(run)
    assert list(pythons) == ["this", "avx2"] and pythons["avx2"] == "/venvs/avx2/bin/python"
    assert kernels.ks(run) == [1, 8]
    cmd = kernels.child_command("/p", "m.gguf", [1, 8], 50, 2)
    assert cmd[:4] == ["/p", "-P", "-m", "ferrum.engine.llama.kernel_timing"]
    assert cmd[cmd.index("--k") + 1] == "1,8"
    for bad in ("0", "1,x", "65"):
        with pytest.raises(ValueError, match="--set k="):
            kernels.ks(_run(tmp_path, k=bad))
    with pytest.raises(ValueError, match="--set python.none=PATH"):
        kernels.measure(run, "none", 1)


def test_router_replica_counts_its_cached_prefix_and_evicts_the_oldest():
    replica = router.Replica("r0", capacity=3)
    assert replica.serve([1, 2], 40, now=0.0) == (0, 0.0)
    cached, _ = replica.serve([1, 2, 5], 50, now=0.0)
    assert cached == 2 * router.BLOCK
    replica.serve([7], 16, now=0.0)  # holds 4 blocks: 1, the least recently used, goes
    assert list(replica.blocks) == [2, 5, 7]
    assert replica.serve([1, 2], 40, now=0.0)[0] == 0  # the prefix stops at the missing 1


def test_router_replica_queues_past_its_slots():
    replica = router.Replica("r0", capacity=100)
    for _ in range(router.SLOTS):
        assert replica.serve([], 0, now=0.0)[1] == 0.0
    _, delay = replica.serve([], 0, now=0.0)
    assert delay == pytest.approx(router.ANSWER / router.DECODE_TOK_S)


def test_router_traffic_is_seeded_ordered_and_turns_grow_their_history():
    events = router.traffic(5.0, 4.0, 10, seed=7)
    assert events == router.traffic(5.0, 4.0, 10, seed=7)
    assert [e[0] for e in events] == sorted(e[0] for e in events)
    first, second = router.tokens(3, 0, 2), router.tokens(3, 1, 2)
    assert second[: len(first)] == first and len(second) > len(first) + router.ANSWER


def test_router_simulation_scores_prefix_routing_above_random_choice():
    s = router.Settings(replicas=8, seconds=4.0, rate=3.0, prompts=5, kv_blocks=4096)
    prefix, pow2 = router.simulate("prefix", s), router.simulate("pow2", s)
    assert prefix["requests"] == pow2["requests"] > 0
    assert prefix["cache_share"] > pow2["cache_share"]
    assert prefix["summary_bytes_per_replica"] > 0 == pow2["summary_bytes_per_replica"]
    assert 1.0 <= pow2["busiest_vs_mean"] <= 8
    with pytest.raises(ValueError, match="unknown policy"):
        router.Router("random", s, random.Random(1))
    md = router.table({"prefix": prefix})
    assert md.splitlines()[0].startswith("| policy | requests | cache_share")


def test_router_settings_take_set_knobs_typed_and_quick_shrinks(tmp_path):
    s = router.Settings.of(_run(tmp_path, quick=True, **{"kv-blocks": "64", "seconds": "3"}))
    assert (s.replicas, s.kv_blocks, s.seconds) == (100, 64, 3.0)
    assert router.Settings.of(_run(tmp_path)).replicas == 1000


def test_router_chooses_a_candidate_and_learns_what_it_sent():
    s = router.Settings(replicas=4)
    r = router.Router("prefix", s, random.Random(1))
    candidates = [Candidate(f"r{i}", 0) for i in range(4)]
    first = r.choose([1] * 64, [11, 12, 13, 14], candidates, now=0.0)
    assert r.choose([1] * 64, [11, 12, 13, 14], candidates, now=0.1) == first


def test_every_study_of_this_batch_loads_by_its_name():
    for name in ("speculation", "speculation-agreement", "speculation-gate", "tiers", "cluster",
                 "kernels", "router"):  # fmt: skip
        study = load(name)
        assert study.name == name and (study.measure or study.main)
