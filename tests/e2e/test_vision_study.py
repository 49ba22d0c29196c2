"""The vision study end to end on ferrum alone (the full comparison: `ferrum bench --study
vision`): a real server with the generated projector on the default chat model."""

from __future__ import annotations

import pytest

from ferrum.bench.studies import StudyRun, vision


@pytest.mark.slow  # a minute on 2 cores: 25 images through a 6-block encoder, a stall window
def test_one_round_on_ferrum_encodes_the_shared_image_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRUM_BENCH_CACHE", str(tmp_path / "cache"))
    run = StudyRun("vision", tmp_path / "out", rounds=2, threads=2, quick=True, arms=["ferrum"],
                   options={"tokens": "4"}, hygiene=None)  # fmt: skip
    got = vision.measure(run, "ferrum", 1)
    assert got["same_images_encoded"] == 1  # 8 questions on one image: one encoding
    assert got["encode_ms"] > 0 and got["distinct_tok_s"] > 0
    assert got["stall_base_p99_ms"] > 0 and got["stall_ratio"] > 0
    assert set(got) == {m.key for m in vision.METRICS}
