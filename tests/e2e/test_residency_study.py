"""The residency study end to end on ferrum alone (the comparison with llama-server: `ferrum
bench --study residency`): real servers on the default chat model with a pool of a few hundred
cells, so that conversations are evicted within seconds."""

from __future__ import annotations

import pytest

from ferrum.bench.studies import StudyRun, residency


@pytest.mark.slow  # ~30 s on 2 cores: two servers, a dozen short conversations
def test_q8_0_cells_keep_more_conversations_than_f16_in_the_same_bytes(tmp_path):
    options = {"budget_mib": "16", "own_words": "60", "shared_words": "40", "answer_tokens": "4"}
    run = StudyRun("residency", tmp_path, rounds=2, threads=2, quick=True, arms=None,
                   options=options, hygiene=None)  # fmt: skip
    f16 = residency.measure(run, "ferrum f16", 1)
    q8_0 = residency.measure(run, "ferrum q8_0", 1)
    assert (f16["cells"], q8_0["cells"]) == (512, 1280)  # 16 MiB at 23,040 and 12,240 B a cell
    # a later turn missed before the most allowed: the pool, not the count, ended each run
    assert 1 <= f16["resident"] < f16["conversations"]
    assert q8_0["resident"] < q8_0["conversations"]
    assert q8_0["resident"] >= 2 * f16["resident"]  # 2.5x the cells
    assert 0 < f16["later_ttft"] < f16["first_ttft"]  # a resident history is not prefilled
