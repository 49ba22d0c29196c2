"""Hypothesis profiles. Without a choice a run keeps what Hypothesis loads itself (its `default`,
or its built-in `ci` where a CI variable is set): what CI runs. `dev` is the same at a tenth of
the examples, for the everyday loop. tests/conftest.py loads one: `--hypothesis-profile NAME`,
else $FERRUM_HYPOTHESIS_PROFILE, else none.

A test's own `settings(max_examples=...)` overrides any profile, so tests write their count
through `examples(n)`: `n` is the count at Hypothesis's default scale, and the loaded profile
scales it."""

from __future__ import annotations

from hypothesis import settings

CI_EXAMPLES = 100  # Hypothesis's default max_examples, which its `ci` profile keeps

# Parented on what Hypothesis loaded (default or ci), so dev changes only the counts.
settings.register_profile("dev", max_examples=CI_EXAMPLES // 10)


def examples(n: int) -> int:
    """`n` examples under Hypothesis's default or ci profile; under another, `n` scaled as its
    max_examples is to theirs (dev: a tenth), never below one. Read where the test is defined,
    so the profile must be loaded first (conftest and Hypothesis's pytest plugin load it
    before collection)."""
    current = settings.default
    scale = (current.max_examples if current is not None else CI_EXAMPLES) / CI_EXAMPLES
    return max(1, round(n * scale))
