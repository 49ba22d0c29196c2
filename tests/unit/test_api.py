"""The HTTP API over the fake runner: shapes, streaming, and every error as OpenAI's 4xx."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fastapi.testclient import TestClient

from ferrum.api.auth import Keys
from tests.factories import FakeRunner, fake_app, model_info


@pytest.fixture
def client():
    with TestClient(fake_app()) as c:
        yield c


def _chat(**kw):
    body = {"model": "anything", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body.update(kw)
    return body


def _events(resp) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_completion_shape(client):
    r = client.post("/v1/chat/completions", json=_chat())
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "fake"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"]) == 4
    # Required by OpenAI's schema (refusal nullable), checked by conformance clients.
    assert choice["message"]["refusal"] is None and choice["message"]["annotations"] == []
    assert choice["finish_reason"] == "length"
    u = body["usage"]
    assert u["completion_tokens"] == 4 and u["total_tokens"] == u["prompt_tokens"] + 4
    assert u["prompt_tokens_details"] == {"cached_tokens": 0}


def test_routes_answer_without_v1_prefix(client):
    assert client.post("/chat/completions", json=_chat()).status_code == 200
    assert client.get("/models").json()["data"][0]["id"] == "fake"


def test_stream_role_first_usage_last_then_done(client):
    body = _chat(stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = _events(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] == "[DONE]"
    finish = events[-3]
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["usage"]["completion_tokens"] == 4
    assert events[-2]["choices"] == [] and events[-2]["usage"] == finish["usage"]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-3])
    whole = client.post("/v1/chat/completions", json=_chat()).json()
    assert text == whole["choices"][0]["message"]["content"]


def test_completions_stream_and_whole_agree(client):
    body = {"prompt": "abc", "max_tokens": 6, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()
    assert whole["object"] == "text_completion"
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = _events(r)
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == whole["choices"][0]["text"] and len(text) == 6
    assert events[-2]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": "hi"}, "messages"),
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"n": 9}, "n"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"9999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"stop_token_ids": [9999]}, "stop_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    # llguidance cannot enforce uniqueItems (it honours minimum now)
                    "json_schema": {"schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_parameter(client, body, param):
    r = client.post("/v1/chat/completions", json=_chat(**body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert set(err) == {"message", "type", "param", "code"}


def test_invalid_json_and_missing_body_are_400(client):
    r = client.post(
        "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={}).status_code == 400


def test_unknown_route_is_an_openai_404(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert client.get("/v1/models/other").status_code == 404


def test_prompt_longer_than_context_is_context_length_exceeded():
    with TestClient(fake_app(FakeRunner(info=model_info(n_ctx=64)))) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 100})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert c.post("/v1/completions", json={"prompt": [1, 999999]}).status_code == 400


def test_extra_fields_are_tolerated(client):
    assert (
        client.post("/v1/chat/completions", json=_chat(user="u", foo={"x": 1})).status_code == 200
    )


def test_api_key_is_required_except_for_health():
    with TestClient(fake_app(keys=Keys(("k1", "k2")))) as c:
        r = c.post("/v1/chat/completions", json=_chat())
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        bad = {"Authorization": "Bearer nope"}
        assert c.post("/v1/chat/completions", json=_chat(), headers=bad).status_code == 401
        ok = {"Authorization": "Bearer k2"}
        assert c.post("/v1/chat/completions", json=_chat(), headers=ok).status_code == 200
        assert c.get("/health").status_code == 200


def test_tokenize_detokenize_round_trip(client):
    toks = client.post("/tokenize", json={"content": "héllo"}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": toks}).json()["content"] == "héllo"


def test_health_and_metrics(client):
    client.post("/v1/chat/completions", json=_chat())
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["active_requests"] == 0
    assert h["prefix_cache"]["parked_sequences"] == 1  # the finished request, kept for reuse
    assert h["kv_cache_usage_ratio"] > 0 and h["prefix_cache"]["misses"] == 1
    m = client.get("/metrics").text
    for name in (
        'ferrum_requests_total{finish_reason="length",model="fake"} 1.0',
        'ferrum_tokens_generated_total{model="fake"} 4.0',
        "ferrum_request_latency_seconds_bucket",
        "ferrum_kv_cache_usage_ratio",
        "ferrum_queue_depth",
        "ferrum_active_requests",
        "ferrum_prefix_cache_hits_total",
        "ferrum_prefix_cache_misses_total",
        "ferrum_time_to_first_token_seconds_bucket",
        "ferrum_inter_token_latency_seconds_bucket",
        "ferrum_prompt_tokens_total",
        "ferrum_step_tokens_bucket",
        "ferrum_prefix_cache_saved_tokens_total",
        "ferrum_prefix_cache_evictions_total",
        'ferrum_prefix_cache_parked_sequences{model="fake"} 1.0',
        "ferrum_prefix_cache_blocks",
    ):
        assert name in m, name


def test_window_fallbacks_reach_health_and_metrics():
    """A prefix whose donor lost part of its sliding window is recomputed, and said so."""
    runner = FakeRunner()
    with TestClient(fake_app(runner)) as c:
        body = _chat(messages=[{"role": "user", "content": "a question long enough " * 3}])
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        runner.lost_windows.update(range(runner.info.n_seq_max))
        again = c.post("/v1/chat/completions", json=body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert c.get("/health").json()["prefix_cache"]["window_fallbacks"] == 1
        metrics = c.get("/metrics").text
        assert 'ferrum_prefix_cache_window_fallbacks_total{model="fake"} 1.0' in metrics


def test_engine_fault_mid_request_is_an_error_not_an_empty_200():
    runner = FakeRunner()
    runner.fail_seqs.add(0)
    with TestClient(fake_app(runner)) as c:
        r = c.post("/v1/chat/completions", json=_chat())
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        runner.fail_seqs.add(0)
        with c.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as r:
            events = _events(r)
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_error"
        assert c.post("/v1/chat/completions", json=_chat()).status_code == 200


def test_n_choices_share_one_prompt(client):
    r = client.post("/v1/chat/completions", json=_chat(n=3, temperature=0)).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    texts = {c["message"]["content"] for c in r["choices"]}
    assert len(texts) == 1  # greedy: every choice says the same
    assert r["usage"]["completion_tokens"] == 12
    single = client.post("/v1/chat/completions", json=_chat()).json()
    assert r["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]  # counted once
    body = _chat(n=2, temperature=0, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        events = _events(resp)
    finishes = [
        e["choices"][0]["index"]
        for e in events[:-1]
        if e["choices"] and e["choices"][0]["finish_reason"]
    ]
    assert sorted(finishes) == [0, 1]
    for i in (0, 1):
        text = "".join(
            e["choices"][0]["delta"].get("content", "")
            for e in events[:-1]
            if e["choices"] and e["choices"][0]["index"] == i
        )
        assert text in texts
    assert events[-2]["usage"]["completion_tokens"] == 8


def test_queue_full_is_a_429_with_retry_after():
    with TestClient(fake_app(max_queue=0)) as c:  # 4 may run, none may wait
        r = c.post("/v1/chat/completions", json=_chat(n=5))
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert c.post("/v1/chat/completions", json=_chat(n=4)).status_code == 200


def test_limits_on_body_size_messages_and_parts(client):
    big = {"content-length": str(64 * 1024 * 1024), "content-type": "application/json"}
    r = client.post("/v1/chat/completions", content=b"{}", headers=big)
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"
    many = [{"role": "user", "content": "x"}] * 5000
    assert client.post("/v1/chat/completions", json=_chat(messages=many)).status_code == 400
    parts = [{"type": "text", "text": "x"}] * 2000
    msgs = [{"role": "user", "content": parts}]
    assert client.post("/v1/chat/completions", json=_chat(messages=msgs)).status_code == 400
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert client.post("/v1/chat/completions", json=_chat(messages=image)).status_code == 400
    nan = b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    r = client.post(
        "/v1/chat/completions", content=nan, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400


def test_deadline_ends_the_request_and_frees_it():
    runner = FakeRunner(step_delay_s=0.02)
    with TestClient(fake_app(runner)) as c:
        r = c.post("/v1/chat/completions", json=_chat(max_tokens=200, timeout=0.3))
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
        with c.stream(
            "POST", "/v1/chat/completions", json=_chat(max_tokens=200, timeout=0.3, stream=True)
        ) as resp:
            events = _events(resp)
        assert events[-2]["error"]["code"] == "request_timeout" and events[-1] == "[DONE]"
        for _ in range(50):
            if c.get("/health").json()["active_requests"] == 0:
                break
            time.sleep(0.05)
        assert c.get("/health").json()["active_requests"] == 0


def test_metrics_can_be_public_while_the_api_needs_a_key():
    with TestClient(fake_app(keys=Keys(("k",)), public_metrics=True)) as c:
        assert c.get("/metrics").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    with TestClient(fake_app(keys=Keys(("k",)))) as c:
        assert c.get("/metrics").status_code == 401


def test_a_deadline_during_a_slow_send_still_ends_with_an_error_and_done():
    """The deadline passes while the client is still being sent an event: the stream must
    still close with the timeout error and [DONE], not be cut off mid-send."""
    from ferrum.api.hangups import guard_stream

    aborted = []

    async def engine_events():
        for i in range(100):
            await asyncio.sleep(0.01)
            yield f"data: {i}\n\n"

    async def slow_client() -> list[str]:
        got = []
        async for event in guard_stream(engine_events(), 0.2, lambda: aborted.append(1)):
            got.append(event)
            await asyncio.sleep(0.15)  # sending over a slow connection
        return got

    got = asyncio.run(slow_client())
    assert got[-1] == "data: [DONE]\n\n"
    assert json.loads(got[-2].removeprefix("data: "))["error"]["code"] == "request_timeout"
    assert 1 <= len(got) - 2 <= 3 and aborted == [1]


def test_a_client_gone_from_a_whole_response_is_a_typed_error_not_a_cancellation():
    """A non-streamed request whose client hangs up ends through the error path (one log
    line), not a CancelledError that Starlette logs as a crash with a traceback."""
    from ferrum.api.hangups import unless_gone
    from ferrum.errors import ClientGone

    class _Gone:
        async def is_disconnected(self) -> bool:
            return True

    async def forever() -> None:
        await asyncio.sleep(60)

    with pytest.raises(ClientGone):
        asyncio.run(unless_gone(_Gone(), forever(), None))  # type: ignore[arg-type]
