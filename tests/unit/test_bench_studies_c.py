"""The pure parts of the lora, kvtypes and residency studies: the client mix, each server's
flags and request fields, the reports, the generated adapters' shapes and sizes, llama-server's
KV log line, the pairs table, the budget's cells and the residency count (no servers)."""

from __future__ import annotations

import asyncio

import gguf
import numpy as np
import pytest

from ferrum.bench import lora_files
from ferrum.bench.client import Sample
from ferrum.bench.studies import StudyRun, kvtypes, load, lora, residency
from tests.tiny_models import write_tiny_llama


def test_both_studies_are_registered():
    assert load("lora").name == "lora" and load("kvtypes").name == "kvtypes"
    assert load("kvtypes").arms[:2] == ("ferrum f16", "ferrum q8_0")


def test_lora_mix_gives_groups_adapters_in_id_order_and_clients():
    groups = lora.mix(lora.DEFAULT_MIX)
    assert groups == [("base", 1), ("a0", 4), ("a1", 1), ("a2", 1), ("a3", 1)]
    assert lora.adapters(groups) == ["a0", "a1", "a2", "a3"]
    assert lora.clients(groups) == ["base", "a0", "a0", "a0", "a0", "a1", "a2", "a3"]
    assert lora.majority_minority(groups) == ("a0", ["a1", "a2", "a3"])
    assert lora.majority_minority([("x", 2), ("y", 2)]) == ("x", [])
    for bad, what in [("a0=0", "CLIENTS"), ("a0", "NAME=CLIENTS"), ("a0=1,a0=2", "twice"),
                      ("base=3", "no adapter")]:  # fmt: skip
        with pytest.raises(ValueError, match=what):
            lora.mix(bad)


def test_lora_servers_get_every_file_and_requests_pick_theirs():
    files = {"a0": "/c/0.gguf", "a1": "/c/1.gguf"}
    assert lora.server_flags(True, files, 0.1) == [
        "--lora", "a0=/c/0.gguf@0.1", "--lora", "a1=/c/1.gguf@0.1",
    ]  # fmt: skip
    # llama-server keeps only the last of several --lora flags
    assert lora.server_flags(False, files, 0.1) == ["--lora", "/c/0.gguf,/c/1.gguf"]
    names = ["a0", "a1"]
    assert lora.request_fields(True, "a1", names, 0.1) == ("bench:a1", None)
    assert lora.request_fields(True, "base", names, 0.1) == ("bench", None)
    # llama-server applies every file at scale 1 to a request that does not list it
    assert lora.request_fields(False, "a1", names, 0.1) == (
        "bench", {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.1}]},
    )  # fmt: skip
    base = lora.request_fields(False, "base", names, 0.1)[1]
    assert base == {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]}


def test_lora_report_states_rate_tails_fairness_and_later_turns():
    groups = [("base", 1), ("a0", 2), ("a1", 1)]
    turns = [lora.Turn("a0", 0, 1.0, 10), lora.Turn("a0", 1, 0.2, 10),
             lora.Turn("a0", 0, 2.0, 10), lora.Turn("a0", 1, 0.4, 10),
             lora.Turn("a1", 0, 3.0, 10), lora.Turn("a1", 1, 0.6, 10),
             lora.Turn("base", 0, 1.5, 10), lora.Turn("base", 1, 0.3, 10)]  # fmt: skip
    got = lora.report(turns, groups, wall_s=4.0)
    assert got["tok_s"] == pytest.approx(20.0)
    assert got["a0_ttft_p50"] == pytest.approx(0.7)
    assert got["a0_ttft_p99"] == pytest.approx(1.97)  # 0.2 0.4 1.0 2.0: rank 2.97
    assert got["a1_ttft_p99"] == pytest.approx(0.6 + 0.99 * 2.4)
    fairness = got["a1_ttft_p99"] / got["a0_ttft_p99"]  # the one minority adapter's tail
    assert got["minority_p99_over_majority"] == pytest.approx(fairness)
    assert got["turn1_ttft"] == pytest.approx(1.75) and got["later_ttft"] == pytest.approx(0.35)
    keys = [m.key for m in lora.metrics(groups, turns=2)]
    assert set(keys) == set(got)
    assert "later_ttft" not in [m.key for m in lora.metrics(groups, turns=1)]


def test_generated_adapter_fits_the_model_and_its_scale_is_the_relative_change(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    weights = {t.name: np.array(t.data) for t in gguf.GGUFReader(model).tensors}
    got = lora_files.factors(model, seed=3, rank=4)
    assert sorted(got) == sorted(
        n for n in weights if n.startswith("blk.") and n.split(".")[2] in lora_files.TARGETS
    )
    x = np.random.default_rng(0).normal(size=(weights["blk.0.attn_q.weight"].shape[1], 256))
    for name, (a, b) in got.items():
        w = weights[name]
        assert a.shape == (4, w.shape[1]) and b.shape == (w.shape[0], 4)
        delta = lora_files.ALPHA / 4 * b @ a  # what llama.cpp adds at scale 1
        ratio = np.linalg.norm(delta @ x) / np.linalg.norm(w @ x)
        assert 0.5 < ratio < 2.0, name  # B·A x about as large as W x
    assert lora_files.factors(model, seed=3, rank=4)["blk.0.attn_q.weight"][0].tolist() == (
        got["blk.0.attn_q.weight"][0].tolist()
    )  # seeded


def test_adapter_is_written_once_into_the_bench_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRUM_BENCH_CACHE", str(tmp_path / "cache"))
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    path = lora_files.adapter(str(model), seed=1, rank=4)
    assert path.parent == tmp_path / "cache" / "lora"
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["adapter.type"].contents() == "lora"
    names = {t.name for t in reader.tensors}
    assert "blk.1.ffn_up.weight.lora_a" in names and "blk.0.attn_v.weight.lora_b" in names
    stamp = path.stat().st_mtime_ns
    assert lora_files.adapter(str(model), seed=1, rank=4) == path
    assert path.stat().st_mtime_ns == stamp
    assert lora_files.adapter(str(model), seed=2, rank=4) != path
    assert not list(path.parent.glob("*.tmp"))


def test_kvtypes_arms_flags_and_names():
    assert kvtypes.arms("f16,q8_0") == ["ferrum f16", "ferrum q8_0", "llama-server-default f16",
                                        "llama-server-default q8_0"]  # fmt: skip
    assert kvtypes.parse_arm("llama-server-default q4_0") == ("llama-server-default", "q4_0")
    assert kvtypes.parse_arm("before q8_0") == ("before", "q8_0")  # a --tree arm
    with pytest.raises(ValueError, match="expected SERVER TYPE"):
        kvtypes.parse_arm("ferrum q3_k")
    with pytest.raises(ValueError, match="q3"):
        kvtypes.arms("f16,q3")
    assert kvtypes.server_flags(True, "q8_0") == [
        "--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "--flash-attn", "on",
    ]  # fmt: skip
    assert kvtypes.server_flags(False, "q4_0") == ["-ctk", "q4_0", "-ctv", "q4_0", "-fa", "on"]
    assert kvtypes.parse_arm("ferrum none f16") == ("ferrum none", "f16")
    assert kvtypes.server_flags(True, "f16", "ferrum none")[-2:] == ["--spec-type", "none"]
    assert "--spec-type" not in kvtypes.server_flags(True, "f16", "ferrum")


def test_kvtypes_reads_llama_servers_kv_line_and_counts_conversations():
    log = ("I llama_kv_cache: size =   23.91 MiB (  2048 cells,  30 layers,  2/1 seqs), "
           "K (q8_0):   11.95 MiB, V (q8_0):   11.95 MiB\n")  # fmt: skip
    per_token = kvtypes.llama_kv_bytes_per_token(log)
    assert per_token == pytest.approx(23.91 * 2**20 / 2048)
    assert per_token == pytest.approx(30 * 2 * 192 * 34 / 32, rel=1e-3)  # q8_0: 34 B per 32
    with pytest.raises(RuntimeError, match="llama_kv_cache"):
        kvtypes.llama_kv_bytes_per_token("nothing")
    assert kvtypes.conversations(23040, 256, 1000) == 11  # f16: 256 MiB / 23 MB
    assert kvtypes.conversations(23040 / 2, 256, 1000) == 23


def _sample(times: list[float]) -> Sample:
    return Sample("p", len(times), t_start=0.0, chunk_times=times)


def test_kvtypes_decode_rate_counts_while_every_stream_decodes():
    a = _sample([1.0, 2.0, 3.0, 4.0, 5.0])
    b = _sample([2.0, 2.5, 3.0, 3.5, 4.0, 4.5])
    # from 2.0 (b's first) to 4.5 (b's last): a's 3.0 and 4.0, b's 2.5 to 4.5
    assert kvtypes.decode_rate([a, b]) == pytest.approx(7 / 2.5)
    apart = [_sample([0.0, 1.0]), _sample([2.0, 3.0])]  # never together: the whole span
    assert kvtypes.decode_rate(apart) == pytest.approx(2 / 3.0)  # first chunks not counted
    # together for a sliver (4.9-5.0) holding 3 of 9 decoded chunks: not 30/s
    staggered = [_sample([0.0, 1.0, 2.0, 3.0, 4.0, 5.0]), _sample([4.9, 4.95, 5.0, 6.0, 6.5])]
    assert kvtypes.decode_rate(staggered) == pytest.approx(9 / 6.5)


def test_a_chunk_of_several_tokens_counts_them_all():
    """ferrum streams a step's kept guesses in one chunk: the rate counts tokens, not chunks
    (usage's tokens shared by characters), so speculation is not read as slower."""
    one_each = Sample("p", 6, chunk_times=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], completion_tokens=6,
                      chunk_chars=[4] * 6)  # fmt: skip
    grouped = Sample("p", 6, chunk_times=[1.0, 2.0, 4.0, 6.0], completion_tokens=6,
                     chunk_chars=[4, 8, 4, 8])  # fmt: skip
    assert grouped.tokens_within(1.0, 6.0) == pytest.approx(one_each.tokens_within(1.0, 6.0))
    assert grouped.tokens_within(1.0, 6.0) == pytest.approx(5.0)
    assert kvtypes.decode_rate([grouped]) == pytest.approx(kvtypes.decode_rate([one_each]))
    no_usage = Sample("p", 6, chunk_times=[1.0, 2.0, 4.0], chunk_chars=[4, 8, 4])
    assert no_usage.tokens_within(0.0, 9.0) == 3.0  # one a chunk


def test_kvtypes_pairs_ferrum_with_the_peer_at_each_type_and_with_f16():
    arms = kvtypes.arms("f16,q8_0")

    def rec(r: int, arm: str, tok: float) -> dict:
        return {"round": r, "arm": arm, "metrics": {"decode_tok_s": tok}}

    records = [rec(r, a, t * r) for r in (1, 2, 3) for a, t in zip(
        arms, (10.0, 9.0, 8.0, 8.0), strict=True)]  # fmt: skip
    table = kvtypes.pairs(records, arms)
    assert "| decode_tok_s | ferrum f16 ÷ llama-server-default f16 | 1.25 [1.25, 1.25] | " in table
    assert "| decode_tok_s | ferrum q8_0 ÷ ferrum f16 | 0.90 [0.90, 0.90] |" in table
    assert "ferrum q8_0 ÷ llama-server-default q8_0 | 1.12" in table
    assert "prefill" not in table  # no rounds of it: no row
    assert "llama-server-default q8_0 ÷" not in table


def test_study_knobs_are_typed(tmp_path):
    run = StudyRun("x", tmp_path, 2, 2, True, None, options={"scale": "0.2"}, hygiene=None)
    assert run.option("scale", 0.1) == 0.2


def test_kvtypes_gives_every_client_a_slot_past_eight(tmp_path):
    def run(clients: str | None) -> StudyRun:
        options = {"clients": clients} if clients else {}
        return StudyRun("kvtypes", tmp_path, 2, 2, True, None, options=options, hygiene=None)

    assert kvtypes._parallel(run(None)) == "8"
    assert kvtypes._parallel(run("1")) == "8"
    assert kvtypes._parallel(run("32")) == "32"


def test_residency_buys_cells_by_the_types_bytes_and_counts_a_turn_resident():
    assert residency.budget_cells(23040, 256) == 11520  # SmolLM2 f16, multiple of 256
    assert residency.budget_cells(12240, 256) == 21760  # q8_0
    with pytest.raises(ValueError, match="KV size"):
        residency.budget_cells(0, 256)
    assert residency.how_many(11520, 1130) == 11520 // 1506 + 3
    assert residency.resident(2000, 2000 - residency.SLACK)
    assert not residency.resident(2000, 2000 - residency.SLACK - 1)
    assert load("residency").arms == ("ferrum f16", "ferrum q8_0", "llama-server-default f16",
                                      "llama-server-default q8_0")  # fmt: skip


class _Pool:
    """A server whose KV pool keeps the `room` most recently used conversations whole."""

    def __init__(self, room: int) -> None:
        self.room, self.kept = room, []  # least recently used first

    async def ask(self, http, prompt: str, max_tokens: int) -> Sample:
        hit = next((k for k in self.kept if prompt.startswith(k)), "")
        if hit:
            self.kept.remove(hit)
        answer = "Fine."
        self.kept = (self.kept + [prompt + answer])[-self.room :]
        words, cached = len(prompt.split()), len(hit.split())
        return Sample(prompt, max_tokens, chunk_times=[0.1], text=answer, prompt_tokens=words,
                      cached_tokens=cached)  # fmt: skip


@pytest.mark.parametrize("room", [1, 3, 5])
def test_residency_counts_conversations_until_a_later_turn_misses(tmp_path, monkeypatch, room):
    """Conversations are added one at a time, each followed by a later turn of all so far:
    the count is the pool's room, and `most` when the room is never exceeded."""

    class NoClient:
        async def __aenter__(self):
            return None

        async def __aexit__(self, *exc):
            return False

    pool = _Pool(room)
    monkeypatch.setattr(residency, "ask", pool.ask)
    monkeypatch.setattr(residency, "http_client", lambda url, timeout: NoClient())
    options = {"own_words": "40", "shared_words": "10"}
    run = StudyRun("residency", tmp_path, 2, 2, True, None, options=options, hygiene=None)
    got = asyncio.run(residency._conversations(run, "http://x", 4, seed=1))
    assert got["resident"] == min(room, 4)
    assert got["first_ttft"] == pytest.approx(0.1)


def test_an_arm_named_alt_runs_on_the_other_interpreter(tmp_path):
    from ferrum.bench.studies.speculation import alt_python

    run = StudyRun("kvtypes", tmp_path, 2, 2, True, None, options={"alt-python": "/v/bin/python"},
                   hygiene=None)  # fmt: skip
    assert alt_python(run, "ferrum none alt f16") == "/v/bin/python"
    assert alt_python(run, "ferrum ngram alt") == "/v/bin/python"
    assert alt_python(run, "ferrum f16") is None
    assert alt_python(run, "ferrum alternate f16") is None  # a word, not a substring
    assert kvtypes.parse_arm("ferrum alt q8_0") == ("ferrum alt", "q8_0")
