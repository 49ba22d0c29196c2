"""A real server under hang-ups, SIGTERM and a short soak (the long one:
`ferrum bench --study soak`)."""

from __future__ import annotations

import contextlib
import json
import signal
import time

import httpx
import pytest

from ferrum.bench.process import ServerProcess, ferrum_command, free_port
from ferrum.bench.studies import StudyRun, soak


def _idle(url: str) -> dict:
    for _ in range(100):
        h = httpx.get(f"{url}/health").json()
        if h["active_requests"] == 0:
            return h
        time.sleep(0.05)
    return h


def test_hanging_up_mid_stream_frees_the_request(server):
    body = {
        "prompt": "Tell me a long story:",
        "max_tokens": 400,
        "stream": True,
        "extra": 1,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # leaving the block closes the connection
    h = _idle(server)
    assert h["active_requests"] == 0 and h["queue_depth"] == 0
    assert soak.held_blocks(h) == 0


def test_hanging_up_on_a_whole_request_frees_it(server):
    body = {"prompt": "Tell me a long story:", "max_tokens": 400, "ignore_eos": True}
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, timeout=0.5)
    h = _idle(server)
    assert h["active_requests"] == 0 and soak.held_blocks(h) == 0


def test_sigterm_lets_streams_finish_then_exits_zero(tmp_path):
    port = free_port()
    flags = ("--threads", "2", "--shutdown-grace", "20")
    server = ServerProcess(ferrum_command(port, *flags), tmp_path / "ferrum.log", port)
    server.wait_ready(server.url, "/health", timeout=120)
    proc, url = server.proc, server.url
    body = {"prompt": "Count to fifty:", "max_tokens": 60, "stream": True, "ignore_eos": True}
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    proc.send_signal(signal.SIGTERM)
    assert events[-1] == "[DONE]"
    finish = json.loads(events[-2])
    assert finish["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=60) == 0


@pytest.mark.slow
def test_short_soak_leaves_the_server_whole(tmp_path):
    # With a few faked "no KV slot" decodes: the split retry must absorb them (0 failures).
    # TTFT drift over 30 s on a shared 2-core CI host is timing noise (x4.2 seen once, with
    # no failure, no leak and the KV all returned): the bound only catches a collapse.
    knobs = {"minutes": "0.5", "workers": "4", "max_rss_growth": "0.2", "max_ttft_drift": "8",
             "inject_faults": "0.05"}  # fmt: skip
    run = StudyRun("soak", tmp_path, 2, 2, False, None, options=knobs, hygiene=None)
    assert soak.main(run) == 0
