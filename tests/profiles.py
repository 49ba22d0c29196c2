"""Hypothesis profiles: `ci`, the counts every test states (what CI runs), and `dev`, a tenth
of them for the everyday loop. tests/conftest.py loads one: `--hypothesis-profile NAME`, else
$FERRUM_HYPOTHESIS_PROFILE, else `ci`.

A test's own `settings(max_examples=...)` overrides any profile, so tests write their count
through `examples(n)`: `n` is the count at CI's scale and the loaded profile scales it."""

from __future__ import annotations

from hypothesis import settings

CI_EXAMPLES = 100  # Hypothesis's own default: what an unmarked @given ran before profiles

settings.register_profile("ci", max_examples=CI_EXAMPLES)
settings.register_profile("dev", max_examples=CI_EXAMPLES // 10)


def examples(n: int) -> int:
    """`n` examples under `ci`; under another profile, `n` scaled as its max_examples is to
    CI's (dev: a tenth), never below one. Read where the test is defined, so the profile must
    be loaded first (conftest and Hypothesis's pytest plugin load it before collection)."""
    current = settings.default
    scale = (current.max_examples if current is not None else CI_EXAMPLES) / CI_EXAMPLES
    return max(1, round(n * scale))
