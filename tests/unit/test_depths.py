"""The suite's own plumbing: every test file has a depth marker, and Hypothesis counts follow
the loaded profile (dev: a tenth) without changing what CI runs."""

from __future__ import annotations

import pytest
from hypothesis import settings

from tests.conftest import DEPTHS, TESTS, depth_of
from tests.profiles import examples


@pytest.mark.parametrize("depth", DEPTHS)
def test_a_test_file_takes_the_marker_of_its_folder(depth):
    assert depth_of(TESTS / depth / "deeper" / "test_x.py") == depth


def test_a_test_outside_the_depth_folders_is_refused_by_name():
    with pytest.raises(pytest.UsageError, match="misc/test_x.py"):
        depth_of(TESTS / "misc" / "test_x.py")


def test_this_test_was_marked_unit(request):
    assert request.node.get_closest_marker("unit") is not None
    assert all(request.node.get_closest_marker(d) is None for d in DEPTHS if d != "unit")


@pytest.fixture
def profile():
    before = settings.get_current_profile_name()
    try:
        yield settings.load_profile
    finally:
        settings.load_profile(before)


def test_default_and_ci_run_the_stated_counts_and_dev_a_tenth(profile):
    for name in ("default", "ci"):  # Hypothesis's own: what CI runs
        profile(name)
        assert [examples(n) for n in (200, 40, 15, 1)] == [200, 40, 15, 1]
    profile("dev")
    assert [examples(n) for n in (200, 40, 15, 1)] == [20, 4, 2, 1]


def test_hypothesis_own_ci_profile_is_kept():
    ci = settings.get_profile("ci")
    assert ci.derandomize and ci.deadline is None and ci.database is None
