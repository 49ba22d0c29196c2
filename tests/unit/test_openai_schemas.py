"""Every answer of the OpenAI routes (Responses, chat completions, completions), whole and
streamed event by event, errors too, validated against the published schemas kept in
tests/schemas/, as a client generated from them would: on the fake app, so that the unit
loop catches a field gone missing. The e2e tests check the same on the real model."""

from __future__ import annotations

import json

import httpx2 as httpx
import openai
import openai.types.responses as oai_responses
import pytest
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from ferrum.models.presets import Preset
from ferrum.models.registry import ModelSpec
from tests import schemas
from tests.factories import FakeRunner, fake_app
from tests.schemas import checked
from tests.unit.test_api_tools import CALL, WEATHER, scripted

TOOL = {"type": "function", **WEATHER["function"]}
CHAT = [{"role": "user", "content": "hi"}]


def _events(http: TestClient, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def _response_both_ways(http: TestClient, body: dict) -> tuple[dict, list[dict]]:
    """A response answered whole and streamed, each validated (every event, the stored one)."""
    whole = http.post("/v1/responses", json={"model": "fake", **body})
    assert whole.status_code == 200, whole.text
    schemas.validate_response(whole.json())
    schemas.validate_response(http.get(f"/v1/responses/{whole.json()['id']}").json())
    events = _events(http, "/v1/responses", {"model": "fake", **body})
    for event in events:
        schemas.validate_response_event(event)
    return whole.json(), events


RESPONSES = {
    "cut by max_output_tokens": ("Hello there.", {"input": "hi", "max_output_tokens": 3}),
    "stopped": ("Hello there.", {"input": "hi", "instructions": "Be brief.", "user": "u1"}),
    "a function call": (CALL, {"input": "Weather in Paris?", "tools": [TOOL]}),
    "forced call": (CALL, {"input": "Paris?", "tools": [{**TOOL, "strict": True}],
                           "tool_choice": {"type": "function", "name": "get_weather"}}),
    "reasoning": ("<think>Hmm.</think>Yes.", {"input": "hi", "reasoning": {"effort": "low"}}),
    "json schema": ('{"a": 1}', {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "thing",
        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}),
}  # fmt: skip


@pytest.mark.parametrize("script, body", RESPONSES.values(), ids=RESPONSES.keys())
def test_every_response_and_event_validates(script, body):
    with TestClient(fake_app(FakeRunner(next_token=scripted(script)))) as http:
        _response_both_ways(http, body)


def test_a_response_echoes_the_sampling_used_after_the_preset():
    specs = [ModelSpec("fake", lambda: "", preset=Preset(
        sampling={"temperature": 0.3, "top_p": 0.8, "presence_penalty": 0.5}))]  # fmt: skip
    with TestClient(fake_app(registry={"specs": specs})) as http:
        whole, events = _response_both_ways(http, {"input": "hi", "max_output_tokens": 2,
                                                   "top_p": 0.5})  # fmt: skip
    for response in (whole, events[0]["response"], events[-1]["response"]):
        assert response["temperature"] == 0.3 and response["top_p"] == 0.5
        assert response["presence_penalty"] == 0.5 and response["frequency_penalty"] == 0.0


def test_a_response_echoes_tools_in_the_function_tool_shape():
    with TestClient(fake_app(FakeRunner(next_token=scripted(CALL)))) as http:
        whole, _ = _response_both_ways(http, {"input": "Paris?", "tools": [
            {"type": "function", "name": "now"}, TOOL]})  # fmt: skip
    assert whole["tools"][0] == {"type": "function", "name": "now", "description": None,
                                 "parameters": None, "strict": None}  # fmt: skip
    assert whole["tools"][1]["parameters"] == TOOL["parameters"]


def test_a_continuation_reports_the_cached_prefix_in_a_valid_usage():
    with TestClient(fake_app(FakeRunner(next_token=scripted("Fine.")))) as http:
        first = http.post("/v1/responses", json={"model": "fake", "input": "hi " * 40}).json()
        body = {"model": "fake", "input": "and?", "previous_response_id": first["id"]}
        second = http.post("/v1/responses", json=body).json()
    schemas.validate_response(second)
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_a_stream_that_fails_ends_with_a_valid_response_failed():
    runner = FakeRunner(step_delay_s=0.02)
    with TestClient(fake_app(runner, request_timeout=0.3)) as http:
        events = _events(http, "/v1/responses", {"model": "fake", "input": "hi",
                                                  "max_output_tokens": 200})  # fmt: skip
    for event in events:
        schemas.validate_response_event(event)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "server_error"


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"model": "fake", "input": 3}),
    ("/v1/responses", {"model": "fake", "input": "hi", "max_output_tokens": 0}),
    ("/v1/responses", {"model": "fake", "input": "hi", "background": True}),
    ("/v1/chat/completions", {"model": "fake", "messages": "hi"}),
    ("/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": -1}),
])  # fmt: skip
def test_errors_validate(http_fake, path, body):
    r = http_fake.post(path, json=body)
    assert 400 <= r.status_code < 500
    schemas.validate_error(r.json())


CHATS = {
    "plain": ("Hello.", {"messages": CHAT, "max_tokens": 3}),
    "tools": (CALL, {"messages": CHAT, "tools": [WEATHER]}),
    "logprobs, n": ("Hi.", {"messages": CHAT, "logprobs": True, "top_logprobs": 2, "n": 2}),
    "reasoning": ("<think>Hmm.</think>Yes.", {"messages": CHAT}),
}


@pytest.mark.parametrize("script, body", CHATS.values(), ids=CHATS.keys())
def test_every_chat_completion_and_chunk_validates(script, body):
    body = {"model": "fake", **body}
    with TestClient(fake_app(FakeRunner(next_token=scripted(script)))) as http:
        schemas.validate_chat(http.post("/v1/chat/completions", json=body).json())
        streamed = {**body, "stream_options": {"include_usage": True}}
        for chunk in _events(http, "/v1/chat/completions", streamed):
            schemas.validate_chat(chunk, chunk=True)


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"n": 2}])
def test_every_completion_and_chunk_validates(http_fake, extra):
    body = {"model": "fake", "prompt": "hi", "max_tokens": 3, **extra}
    schemas.validate_completion(http_fake.post("/v1/completions", json=body).json())
    streamed = {**body, "stream_options": {"include_usage": True}}
    for chunk in _events(http_fake, "/v1/completions", streamed):
        schemas.validate_completion(chunk, chunk=True)


def test_a_strictly_typed_client_parses_every_response_and_event():
    """The `openai` SDK's types, generated from OpenAI's published schema, in pydantic's
    strict mode (no coercion), with the settings a typed client reads as numbers."""
    body = {"model": "fake", "input": "Paris?", "tools": [TOOL]}
    with TestClient(fake_app(FakeRunner(next_token=scripted(CALL)))) as http:
        whole = http.post("/v1/responses", json=body).json()
        events = _events(http, "/v1/responses", body)
    parsed = oai_responses.Response.model_validate(whole, strict=True)
    assert isinstance(parsed.temperature, float) and isinstance(parsed.top_p, float)
    assert parsed.tools[0].strict is None and parsed.tools[0].parameters == TOOL["parameters"]
    assert isinstance(parsed.usage.input_tokens_details.cached_tokens, int)
    for event in events:
        typed = TypeAdapter(oai_responses.ResponseStreamEvent).validate_python(event, strict=True)
        assert typed.type == event["type"]


def test_the_checking_client_checks_every_answer_the_sdk_reads():
    seen = checked.Checked()
    with TestClient(fake_app()) as http:
        # The test client's own transport, under the checks, as the network is in the e2e tests.
        transport = checked.CheckingTransport(seen, inner=http._transport)
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="k", max_retries=0,
                            http_client=httpx.Client(transport=transport))  # fmt: skip
        sdk.responses.create(model="fake", input="hi", max_output_tokens=4)
        with sdk.responses.stream(model="fake", input="hi", max_output_tokens=4) as stream:
            assert list(stream)[-1].type == "response.incomplete"
        list(sdk.chat.completions.create(model="fake", messages=CHAT, max_tokens=3, stream=True))
        list(sdk.completions.create(model="fake", prompt="hi", max_tokens=3, stream=True))
        with pytest.raises(openai.BadRequestError):
            sdk.responses.create(model="fake", input="hi", max_output_tokens=0)
    assert seen.answers == 5 and seen.events >= 10


def test_the_checking_client_refuses_an_answer_off_the_schema():
    whole = {"id": "resp_1", "object": "response", "created_at": 1, "model": "m",
             "output": [], "temperature": None}  # fmt: skip
    event = {"type": "response.output_text.delta", "sequence_number": 0, "delta": "x"}

    def answer(request: httpx.Request) -> httpx.Response:
        if b'"stream":true' in request.content.replace(b" ", b""):
            sse = f"event: x\ndata: {json.dumps(event)}\n\n".encode()
            return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=whole)

    transport = checked.CheckingTransport(checked.Checked(), inner=httpx.MockTransport(answer))
    sdk = openai.OpenAI(base_url="http://x/v1", api_key="k", max_retries=0,
                        http_client=httpx.Client(transport=transport))  # fmt: skip
    with pytest.raises(schemas.SchemaViolation, match="temperature|required"):
        sdk.responses.create(model="m", input="hi")
    with pytest.raises(schemas.SchemaViolation, match="item_id"):
        list(sdk.responses.create(model="m", input="hi", stream=True))


@pytest.fixture
def http_fake():
    with TestClient(fake_app()) as c:
        yield c
