"""The pure parts of the vision study: its requests and images, the encoder figures read from
ferrum's /metrics and llama-server's log, the burst metrics, the goals table, and the
generated projector's tensors and cache file (no servers)."""

from __future__ import annotations

import base64
import io
from dataclasses import replace

import gguf
import numpy as np
import pytest
from PIL import Image

from ferrum.bench import vision_files
from ferrum.bench.client import Sample
from ferrum.bench.studies import StudyRun, load, vision
from ferrum.bench.vision_files import BENCH, TINY
from tests.tiny_models import write_tiny_llama


def test_the_study_is_registered_with_ferrum_first():
    study = load("vision")
    assert study.name == "vision" and study.arms == ("ferrum", "llama-server-default")
    assert {m.key for m in study.metrics} >= {"same_ttft_p50", "distinct_tok_s", "stall_ratio"}


def test_the_capped_arm_passes_its_prefill_cap_and_the_plain_one_none(tmp_path):
    run = StudyRun("vision", tmp_path, 2, 2, False, None, options={"cap": "8"})
    assert vision._capped(run, "ferrum capped") == ("--prefill-cap", "8")
    assert vision._capped(run, "ferrum") == ()
    assert vision._capped(replace(run, options={}), "ferrum capped")[1] == "16"


def test_chat_bodies_put_the_image_first_and_run_to_max_tokens():
    body = vision.chat_body("data:image/png;base64,AAAA", "What is it?", 16)
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text"]  # the shared prefix first
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["max_tokens"] == 16
    assert body["stream_options"] == {"include_usage": True}
    text = vision.chat_body(None, "Tell a story.", 4000, stream=False)
    assert text["messages"][0]["content"] == [{"type": "text", "text": "Tell a story."}]
    assert "stream_options" not in text and text["stream"] is False


def _decode(uri: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))


def test_images_are_seeded_by_round_phase_and_client():
    assert vision.image_uri(2, "same") == vision.image_uri(2, "same")  # every arm, one round
    seen = {vision.image_uri(r, p, c) for r in (1, 2) for p in ("same", "distinct", "stall")
            for c in range(vision.CLIENTS)}  # fmt: skip
    assert len(seen) == 2 * 3 * vision.CLIENTS  # no image is reused across phases or rounds
    assert _decode(vision.image_uri(1, "warm")).size == vision.IMAGE_SIZE


def test_encoder_totals_from_ferrums_metrics_and_llama_servers_log():
    text = """# HELP ferrum_images_encoded_total Images run through the vision projector
# TYPE ferrum_images_encoded_total counter
ferrum_images_encoded_total{model="bench"} 3.0
ferrum_images_encoded_created{model="bench"} 1.7e9
ferrum_images_encoded_total{model="other"} 1.0
ferrum_image_encode_seconds_bucket{le="0.1",model="bench"} 2.0
ferrum_image_encode_seconds_count{model="bench"} 3.0
ferrum_image_encode_seconds_sum{model="bench"} 0.45
ferrum_image_encode_seconds_sum 0.05
"""
    assert vision.ferrum_encoder_totals(text) == (4.0, pytest.approx(0.5))
    log = ("srv  process_chun: processing image...\nencoding image slice...\n"
           "image slice encoded in 120 ms\nimage decoded (batch 1/1) in 30 ms\n"
           "image slice encoded in 80 ms\n")  # fmt: skip
    assert vision.llama_encoder_totals(log) == (2.0, pytest.approx(0.2))
    assert vision.llama_encoder_totals("no such lines") is None


def _sample(start: float, first: float, end: float, tokens: int) -> Sample:
    return Sample("p", tokens, t_start=start, chunk_times=[first, end], t_end=end,
                  completion_tokens=tokens)  # fmt: skip


def test_burst_metrics_are_ttfts_and_tokens_over_the_bursts_wall_time():
    samples = [_sample(0.0, 1.0, 3.0, 10), _sample(0.0, 2.0, 4.0, 10), _sample(0.5, 3.5, 5.0, 20)]
    got = vision.burst_metrics("same", samples)
    assert got["same_ttft_p50"] == pytest.approx(2.0)
    assert got["same_ttft_p99"] == pytest.approx(2.0 + 0.98 * 1.0)
    assert got["same_tok_s"] == pytest.approx(40 / 5.0)
    assert "distinct_ttft_p99" not in vision.burst_metrics("distinct", samples)


def test_goals_are_met_or_missed_only_when_the_whole_range_is_on_one_side():
    assert vision.judge(None, 1.0, True) == "no figure"
    spread = vision.Spread(0.4, 0.3, 0.6, 3)
    assert vision.judge(spread, 0.5, at_most=True).startswith("not shown")
    assert vision.judge(spread, 0.7, at_most=True) == "met"
    assert vision.judge(spread, 0.2, at_most=True) == "missed"
    assert vision.judge(spread, 0.3, at_most=False) == "met"
    assert vision.judge(spread, 0.8, at_most=False) == "missed"


def test_goals_table_pairs_ferrum_with_the_peer_per_round():
    def rec(r: int, arm: str, **m: float) -> dict:
        return {"round": r, "arm": arm, "metrics": m}

    records = [rec(r, "ferrum", same_ttft_p50=0.2 * r, distinct_tok_s=30.0 * r,
                   same_images_encoded=1.0, stall_ratio=1.2)
               for r in (1, 2, 3)] + [
              rec(r, "llama-server-default", same_ttft_p50=1.0 * r, distinct_tok_s=25.0 * r)
               for r in (1, 2, 3)]  # fmt: skip
    table = vision.goals(records, "ferrum", "llama-server-default")
    assert "| ferrum: images encoded for 8 questions on one image | 1 [1, 1] | ≤ 1 | met |" in table
    peer = "ferrum ÷ llama-server-default"
    assert f"| one image, TTFT p50, {peer} | 0.20 [0.20, 0.20] | ≤ 0.5 | met |" in table
    assert f"| 8 images, tok/s, {peer} | 1.20 [1.20, 1.20] | ≥ 1 | met |" in table
    assert "| 1.20 [1.20, 1.20] | ≤ 1.5 | met |" in table  # the stall ratio
    assert "llama-server" not in vision.goals(records, "ferrum", None)  # alone: its own goals


def test_projector_tensors_fit_the_model_width_and_the_bench_shape_is_f16():
    got = vision_files.tensors(576, BENCH, seed=1)
    assert got["mm.2.weight"].shape == (576, BENCH.mm_hidden)
    assert got["v.position_embd.weight"].shape == (BENCH.image_tokens, BENCH.embd)
    assert BENCH.image_tokens == 196 and TINY.image_tokens == 16
    assert got["v.blk.0.attn_q.weight"].dtype == np.float16
    assert got["v.position_embd.weight"].dtype == np.float32
    assert got["v.blk.0.ln1.bias"].dtype == np.float32
    assert f"v.blk.{BENCH.layers - 1}.ffn_down.weight" in got
    tiny = vision_files.tensors(64, TINY, seed=1)
    assert all(t.dtype == np.float32 for t in tiny.values())
    again = vision_files.tensors(64, TINY, seed=1)
    assert np.array_equal(tiny["mm.0.weight"], again["mm.0.weight"])  # seeded


def test_projector_is_written_once_into_the_bench_cache_for_the_models_width(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRUM_BENCH_CACHE", str(tmp_path / "cache"))
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    assert vision_files.model_width(model) == 64
    path = vision_files.projector(str(model), TINY)
    assert path.parent == tmp_path / "cache" / "vision"
    reader = gguf.GGUFReader(path)
    assert reader.fields["clip.vision.projection_dim"].contents() == 64
    assert reader.fields["clip.projector_type"].contents() == "mlp"
    stamp = path.stat().st_mtime_ns
    assert vision_files.projector(str(model), TINY) == path
    assert path.stat().st_mtime_ns == stamp
    assert vision_files.projector(str(model), TINY, seed=2) != path
    assert not list(path.parent.glob("*.tmp"))
