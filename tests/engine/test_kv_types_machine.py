"""The engine state machine on a quantized KV cache: q8_0 K and V, flash attention on, on the
tiny llama with heads of 32 values (`test_kv_types_llama.llama32`).

The same random traffic and oracle as the sliding-window machine (prompts that repeat, extend
and branch off earlier ones; n > 1; hang-ups; preemption in a context of 128 cells): greedy
output equals the prompt decoded alone on the same q8_0 cache without prefix reuse.
"""

from __future__ import annotations

import pytest

from tests.engine.test_kv_types_llama import Q8, llama32  # noqa: F401 - the fixture
from tests.engine.test_sliding_window_machine import SlidingWindowMachine, _Oracle, run_machine


class QuantizedCacheMachine(SlidingWindowMachine):
    kv = Q8


@pytest.mark.slow  # minutes: flash attention over q8_0 cells costs more on a CPU than f16
def test_quantized_cache_state_machine(llama32: str) -> None:  # noqa: F811 - the fixture
    run_machine(QuantizedCacheMachine, llama32, 20, _Oracle(llama32, **Q8))
