"""One model's metrics (`ferrum.metrics`): engine steps are queued on the engine thread and
reach the Prometheus series together.

Oracles: whatever reads the metrics (a scrape, /health, the server-wide exposition) sees every
step published before it; a finished request is in the series at once, without a read; the
series hold the same totals as if each step had been applied on its own.
"""

from __future__ import annotations

import threading
import time

import pytest

from ferrum import metrics as metrics_module
from ferrum.engine.outputs import FinishedRequest, StepStats
from ferrum.engine.request import FinishReason
from ferrum.engine.turns import Turns
from ferrum.metrics import Metrics
from ferrum.server_metrics import ServerMetrics


def _step(tokens: int, active: int, finished: int = 0) -> StepStats:
    done = [FinishedRequest(FinishReason.STOP, 4, tokens, 0.5, 0.1) for _ in range(finished)]
    return StepStats(num_tokens=tokens, num_sequences=1, generated_tokens=tokens,
                     active_requests=active, finished=done)  # fmt: skip


def _generated(m: Metrics) -> float | None:
    return m.registry.get_sample_value("ferrum_tokens_generated_total")  # no apply first


def test_steps_wait_in_a_queue_until_something_reads_them(monkeypatch):
    monkeypatch.setattr(metrics_module, "_APPLY_S", 60.0)
    m = Metrics()
    m.on_step(_step(1, active=1))  # the first applies at once (nothing applied yet)
    for _ in range(4):
        m.on_step(_step(2, active=2))
    assert _generated(m) == 1.0  # queued, not yet in the series
    text = m.render().decode()
    assert "ferrum_tokens_generated_total 9.0" in text
    assert "ferrum_active_requests 2.0" in text
    assert "ferrum_step_tokens_count 5.0" in text  # one observation per step
    m.on_step(_step(3, active=0))
    assert m.snapshot()["active_requests"] == 0  # /health reads the latest step too
    server = ServerMetrics()
    served = server.for_model("m")
    served.on_step(_step(1, active=1))
    served.on_step(_step(5, active=1))
    assert 'ferrum_tokens_generated_total{model="m"} 6.0' in server.render().decode()


def test_a_finished_request_or_a_quarter_second_applies_the_queue(monkeypatch):
    monkeypatch.setattr(metrics_module, "_APPLY_S", 60.0)
    m = Metrics()
    m.on_step(_step(1, active=1))
    m.on_step(_step(2, active=1))
    m.on_step(_step(3, active=0, finished=1))
    assert _generated(m) == 6.0
    assert m.registry.get_sample_value("ferrum_requests_total", {"finish_reason": "stop"}) == 1
    monkeypatch.setattr(metrics_module, "_APPLY_S", 0.05)
    m.on_step(_step(1, active=0, finished=1))  # applied at once; the next apply in 0.05 s
    m.on_step(_step(1, active=1))
    assert _generated(m) == 7.0
    time.sleep(0.06)
    m.on_step(_step(1, active=1))  # the time for the next apply has come
    assert _generated(m) == 9.0


@pytest.mark.parametrize("n", [1, 7])
def test_queued_steps_add_up_to_the_same_series_as_steps_applied_one_by_one(monkeypatch, n):
    one_by_one, queued = Metrics(), Metrics()
    steps = [_step(t % 5 + 1, active=t % 3, finished=int(t % 4 == 0)) for t in range(1, 3 * n)]
    monkeypatch.setattr(metrics_module, "_APPLY_S", 0.0)
    for s in steps:
        one_by_one.on_step(s)
    monkeypatch.setattr(metrics_module, "_APPLY_S", 60.0)
    for s in steps:
        queued.on_step(s)
    assert _series(queued) == _series(one_by_one)


def _series(m: Metrics) -> list[str]:
    return [line for line in m.render().decode().splitlines() if "_created" not in line]


def test_engine_turns_show_turns_held_and_waited_per_engine_and_never_go_back():
    turns = Turns()
    server = ServerMetrics()
    chat, embeddings = turns.join("m chat"), turns.join("m embeddings")
    server.for_model("m").watch_turns("chat", chat)
    server.for_model("m").watch_turns("embeddings", embeddings)
    holding = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with embeddings.turn():
            holding.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait(5)
    threading.Timer(0.05, release.set).start()
    with chat.turn():  # waits for the embeddings' turn to end
        pass
    holder.join()

    def value(name: str, engine: str) -> float:
        labels = {"model": "m", "engine": engine}
        found = server.registry.get_sample_value(name, labels)
        return -1.0 if found is None else found

    assert value("ferrum_engine_turns_total", "chat") == 1
    assert value("ferrum_engine_turns_total", "embeddings") == 1
    assert value("ferrum_engine_turn_wait_seconds_total", "chat") >= 0.04
    assert value("ferrum_engine_turn_wait_seconds_total", "embeddings") == 0
    assert value("ferrum_engine_turn_seconds_total", "embeddings") >= 0.04
    # A reload: the model's new engine has a new seat; its counts add to the old ones.
    again = turns.join("m chat")
    server.for_model("m").watch_turns("chat", again)
    with again.turn():
        pass
    assert value("ferrum_engine_turns_total", "chat") == 2
    assert value("ferrum_engine_turn_wait_seconds_total", "chat") >= 0.04
