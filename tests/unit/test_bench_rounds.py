"""The one alternating-rounds loop every study measures through, and the study command's
plumbing, with a fake measurement (no servers)."""

from __future__ import annotations

import pytest

from ferrum.bench import rounds
from ferrum.bench.rounds import Metric
from ferrum.bench.studies import STUDIES, Study, StudyRun, load, parse_pairs, run_study


def test_arms_alternate_and_round_one_is_left_out_of_the_summary():
    seen: list[tuple[str, int]] = []

    def measure(arm: str, r: int) -> dict[str, float]:
        seen.append((arm, r))
        # Round 1 is a wild warm-up; afterwards b takes twice a's time.
        return {"t": 100.0 if r == 1 else (1.0 if arm == "a" else 2.0) * r}

    records = rounds.alternate(["a", "b"], 4, measure)
    assert seen == [("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3), ("b", 3), ("b", 4), ("a", 4)]
    rows = rounds.summarize(records, ["a", "b"], [Metric("t", "s", False)], reference="a")
    a, b = rows
    assert a["spread"].median == 3.0 and a["spread"].n == 3  # rounds 2-4 only
    assert b["ratio"].median == pytest.approx(0.5) and b["ratio"].lo == b["ratio"].hi
    assert b["verdict"] == "inconclusive"  # [2, 4] and [4, 8] touch: not disjoint


def test_a_failed_measurement_is_recorded_and_the_run_goes_on():
    def measure(arm: str, r: int) -> dict[str, float]:
        if arm == "b" and r == 2:
            raise RuntimeError("server exited")
        return {"t": 1.0}

    records = rounds.alternate(["a", "b"], 3, measure)
    assert len(records) == 6
    assert [r["error"] for r in records if "error" in r] == ["RuntimeError: server exited"]


def test_one_round_is_refused():
    with pytest.raises(ValueError, match="warm-up"):
        rounds.alternate(["a"], 1, lambda arm, r: {})


def test_a_study_writes_its_table_and_fails_when_a_measurement_failed(tmp_path):
    def measure(run: StudyRun, arm: str, r: int) -> dict[str, float]:
        if arm == "before" and r == 3:
            raise RuntimeError("boom")
        return {"tok_s": 10.0 if arm == "ferrum" else 5.0}

    study = Study("fake", "a fake study", ("ferrum",), (Metric("tok_s", "tok/s", True),), measure)
    run = StudyRun("fake", tmp_path, 4, 2, False, None, trees={"before": tmp_path}, hygiene=None)
    assert run.is_ferrum("before") and run.is_ferrum("ferrum ngram")
    assert not run.is_ferrum("llama-server")
    assert run_study(run, study) == 1
    md = (tmp_path / "results.md").read_text()
    assert "| tok_s (tok/s) | before | 5.000 [5.000, 5.000] | 2.00 [2.00, 2.00] | win |" in md
    assert "round 3 before: RuntimeError: boom" in md
    assert (tmp_path / "rounds.json").is_file()


def test_study_options_and_pairs_are_typed_and_checked(tmp_path):
    run = StudyRun("x", tmp_path, 2, 2, False, None, options={"n": "8", "on": "yes"})
    assert run.option("n", 6) == 8 and run.option("on", False) is True
    assert run.option("missing", 1.5) == 1.5
    with pytest.raises(ValueError, match="expected int"):
        StudyRun("x", tmp_path, 2, 2, False, None, options={"n": "x"}).option("n", 1)
    assert parse_pairs(["a=1", "b=x=y"], "--set") == {"a": "1", "b": "x=y"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_pairs(["nope"], "--tree")


def test_every_named_study_loads():
    for name in STUDIES:
        try:
            study = load(name)
        except ModuleNotFoundError:
            continue  # migrated study by study; the ones present must load and match
        assert study.name == name and (study.measure or study.main)
    with pytest.raises(ValueError, match="unknown study"):
        load("nope")
