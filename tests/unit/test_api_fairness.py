"""Fair shares over HTTP: one request with n = every slot does not make another user wait."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from tests.factories import FakeRunner, fake_app


def _completion(prompt: str, max_tokens: int, n: int = 1) -> dict:
    return {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "n": n, "temperature": 0}


def test_a_short_request_finishes_long_before_one_that_takes_every_slot_with_n():
    runner = FakeRunner(step_delay_s=0.004)  # ~1.2 s for the flood alone
    with TestClient(fake_app(runner)) as client:
        slots = 4  # fake_app's --parallel
        flood: dict = {}

        def send_flood() -> None:
            t0 = time.monotonic()
            flood["resp"] = client.post("/v1/completions", json=_completion("flood", 300, n=slots))
            flood["s"] = time.monotonic() - t0

        thread = threading.Thread(target=send_flood)
        thread.start()
        deadline = time.monotonic() + 5
        while len(runner.samplers) < slots and time.monotonic() < deadline:
            time.sleep(0.005)  # every slot taken by the flood's choices
        time.sleep(0.05)
        t0 = time.monotonic()
        short = client.post("/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        })  # fmt: skip
        short_s = time.monotonic() - t0
        flood_running = thread.is_alive()
        thread.join(timeout=30)
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 2
    assert flood_running, f"the short chat ({short_s:.2f} s) waited for the whole flood"
    assert short_s < flood["s"] / 4, (short_s, flood["s"])
    choices = flood["resp"].json()["choices"]
    assert len(choices) == slots and len({c["text"] for c in choices}) == 1  # greedy: alike
    assert all(c["finish_reason"] == "length" for c in choices)
