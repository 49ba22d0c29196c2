"""Schemathesis fuzzes ferrum's own OpenAPI schema, in process, over the fake runner.

Every operation gets valid bodies (positive: they must never fail on the server side) and, for
operations with a body, invalid ones (negative: they must be refused with a 4xx). Every 4xx must
carry OpenAI's error shape, every response must come within a timeout (a hang fails the test),
and afterwards the server must be whole: healthy, no request held, the KV ledger intact and only
parked prefixes holding blocks. Streams the fuzzer stops reading are hang-ups, so the disconnect
path is fuzzed too.

FERRUM_FUZZ_EXAMPLES sets the examples per operation and mode (default 40 under the ci profile,
~15 s; a tenth under dev: tests/profiles.py).
"""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import (
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.factories import fake_app
from tests.profiles import examples

EXAMPLES = int(os.environ.get("FERRUM_FUZZ_EXAMPLES", examples(40)))
RESPONSE_TIMEOUT_S = 20  # the fake model answers in milliseconds: longer is a hang
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]


def _openai_error_shape(response) -> None:
    if 400 <= response.status_code < 500:
        error = response.json().get("error")
        assert isinstance(error, dict), response.text[:300]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and isinstance(error["type"], str), error


def _fuzz(op, mode: GenerationMode, tally: Counter) -> None:
    checks = CHECKS + ([negative_data_rejection] if mode.is_negative else [])

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case) -> None:
        response = case.call(timeout=RESPONSE_TIMEOUT_S)
        tally[(op.label, mode.value, response.status_code)] += 1
        case.validate_response(response, checks=checks)
        _openai_error_shape(response)

    run()


def _wait_idle(client, state) -> dict:
    """/health once the engine has taken in the last hang-ups (aborts cross a queue)."""
    deadline = time.monotonic() + 10
    while True:
        health = client.get("/health", timeout=RESPONSE_TIMEOUT_S).json()
        engine = _engine(state)
        idle = not engine._streams and not engine.core.has_work
        if (idle and health["active_requests"] == 0) or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def _engine(state):
    (served,) = state.models.loaded()
    return served.model.engine


@pytest.fixture
def app():
    app = fake_app()
    try:
        yield app
    finally:
        asgi.shutdown_lifespans()  # stops the engine thread the fuzzer's client started


@pytest.mark.slow
def test_the_api_survives_fuzzing_of_its_own_schema(app, capsys):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    tally: Counter = Counter()
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()
        _fuzz(op, GenerationMode.POSITIVE, tally)
        if op.body:
            _fuzz(op, GenerationMode.NEGATIVE, tally)
    elapsed = time.monotonic() - t0

    state = app.state.ferrum
    with asgi.get_client(app) as client:
        # A fuzzed keep_alive (0, or a few microseconds) may have unloaded the model, as
        # Ollama's idiom says it should: the next request loads it again, and keeps it.
        body = {"model": "fake", "prompt": "hi", "max_tokens": 2, "keep_alive": -1}
        r = client.post("/v1/completions", json=body, timeout=RESPONSE_TIMEOUT_S)
        assert r.status_code == 200, r.text[:300]
        health = _wait_idle(client, state)
    assert health["status"] == "ok" and _engine(state).alive
    assert health["active_requests"] == 0 and health["queue_depth"] == 0
    assert not _engine(state)._streams, "requests still held after the fuzzing"
    assert state.models.loaded()[0].in_flight == 0, "a request still holds its model"
    engine = _engine(state).core
    engine.check_integrity()  # safe here: the engine thread is idle, waiting for commands
    held = engine.kv_manager.blocks.num_blocks - engine.kv_manager.blocks.num_free
    assert held == engine.kv_manager.parked.num_blocks, "KV blocks held outside parked prefixes"

    cases = sum(tally.values())
    statuses = Counter(status for (_, _, status) in tally.elements())
    summary = dict(sorted(statuses.items()))
    with capsys.disabled():
        print(f"\nAPI fuzzing: {cases} cases in {elapsed:.1f} s, statuses {summary}")
    assert statuses[200] > 0 and not any(s >= 500 for s in statuses)
