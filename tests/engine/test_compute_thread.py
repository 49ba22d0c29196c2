"""Every llama.cpp graph of the process runs on one thread (compute.py): whichever thread loads
a model or steps an engine, `llama_decode` is called from the compute thread only."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import llama_cpp as ll
import pytest

from ferrum.config import EngineConfig
from ferrum.engine.compute import ComputeThread
from ferrum.engine.engine import LLMEngine
from ferrum.engine.llama.embedding_runner import EmbeddingRunner
from ferrum.engine.llama.runner import LlamaRunner
from tests.factories import run_to_completion, sampling


def _on_thread(fn: Callable[[], Any]) -> Any:
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()))
    t.start()
    t.join()
    return box["out"]


def test_jobs_run_in_order_on_one_thread_whoever_sends_them():
    worker = ComputeThread()
    seen: list[tuple[int, str]] = []

    def job(i: int) -> Callable[[], int]:
        def run() -> int:
            seen.append((i, threading.current_thread().name))
            return i * i

        return run

    assert [worker.run(job(i)) for i in range(3)] == [0, 1, 4]
    assert _on_thread(lambda: worker.run(job(3))) == 9
    assert [i for i, _ in seen] == [0, 1, 2, 3]
    assert {name for _, name in seen} == {"ferrum-compute"}


def test_an_error_reaches_the_caller_and_the_thread_goes_on():
    worker = ComputeThread()

    def fail() -> None:
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        worker.run(fail)
    assert worker.run(lambda: 7) == 7


def test_a_job_that_runs_another_runs_it_in_place():
    worker = ComputeThread()
    assert worker.run(lambda: worker.run(lambda: 5) + 1) == 6  # no deadlock


@pytest.fixture
def decode_threads(monkeypatch) -> list[str]:
    """The name of the thread of every llama_decode call made while the test runs."""
    names: list[str] = []
    real = ll.llama_decode

    def recording(ctx: Any, batch: Any) -> int:
        names.append(threading.current_thread().name)
        return int(real(ctx, batch))

    monkeypatch.setattr(ll, "llama_decode", recording)
    return names


def test_models_loaded_and_stepped_on_other_threads_decode_on_the_compute_thread(
    decode_threads, tiny_gemma3, tiny_llama
):
    cfg = EngineConfig(ctx_size=512, parallel=2, batch_size=64, threads=2)
    # The sliding-window probe decodes at load: here on a loader thread of its own.
    runner = _on_thread(lambda: LlamaRunner(cfg, tiny_gemma3))
    embedder = _on_thread(lambda: EmbeddingRunner(tiny_llama, threads=2, pooling="mean"))
    try:
        engine = LLMEngine(runner, block_size=16)
        engine.add_request("a", [1, 5, 9, 13], sampling(max_tokens=4))
        out = _on_thread(lambda: run_to_completion(engine))
        assert len(out["a"]["tokens"]) == 4
        vectors = _on_thread(lambda: embedder.embed_batch([[1, 5, 9], [1, 7]]))
        assert len(vectors) == 2
    finally:
        runner.close()
        embedder.close()
    assert len(decode_threads) >= 6  # the probe's, the prefill's, 3 decodes, the embeddings'
    assert set(decode_threads) == {"ferrum-compute"}
