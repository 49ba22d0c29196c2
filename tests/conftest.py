"""Depth markers by folder and the Hypothesis profile of the run.

Every test gets the marker of its folder (pyproject.toml registers them), so a run can pick a
depth: `unit` (pure: the fake runner and byte tokenizer), `engine` (tiny generated GGUFs on
llama.cpp), `models` (the model store and pulls on a fake hub), `e2e` (a real server on the
default model) and `cluster` (Ray). The few tests that dominate a depth's time carry `slow`
themselves; the everyday command is `pytest -m "unit and not slow"` with the dev profile."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

import tests.profiles  # noqa: F401  (registers the profiles before one is loaded)

DEPTHS = ("unit", "engine", "models", "e2e", "cluster")
TESTS = Path(__file__).parent

# Unset: Hypothesis's own choice stays (default, or ci on a CI machine). `--hypothesis-profile`
# still wins: Hypothesis's plugin loads it later, in pytest_configure.
if profile := os.environ.get("FERRUM_HYPOTHESIS_PROFILE"):
    settings.load_profile(profile)


def depth_of(path: Path) -> str:
    """The depth marker of a test file: the name of its folder directly under tests/."""
    folder = path.relative_to(TESTS).parts[0]
    if folder not in DEPTHS:
        # A test without a depth would silently leave every -m selection: name it instead.
        raise pytest.UsageError(f"{path}: tests live in one of tests/{{{','.join(DEPTHS)}}}/")
    return folder


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(depth_of(item.path))
