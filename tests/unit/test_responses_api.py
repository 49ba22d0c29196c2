"""The Responses API over fake models, driven by the official `openai` SDK (its stream
accumulator checks the event sequence strictly) and by raw HTTP for what the SDK hides."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from tests.factories import FakeRunner, fake_app
from tests.unit.test_api_tools import CALL, WEATHER, scripted

# The weather tool in the Responses shape: the function's fields at the top.
TOOL = {"type": "function", **WEATHER["function"]}

@pytest.fixture
def http():
    with TestClient(fake_app()) as c:
        yield c


def _sdk(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client,
                         max_retries=0)  # fmt: skip


def _events(resp) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]


def test_a_response_whole_and_streamed_hold_the_same_output(http):
    client = _sdk(http)
    whole = client.responses.create(model="fake", input="hi", max_output_tokens=6,
                                    temperature=0)  # fmt: skip
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert len(whole.output_text) == 6 and whole.usage.output_tokens == 6
    assert whole.usage.total_tokens == whole.usage.input_tokens + 6
    with client.responses.stream(model="fake", input="hi", max_output_tokens=6,
                                 temperature=0) as stream:  # fmt: skip
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # Cut by max_output_tokens: OpenAI's stream ends with response.incomplete, not completed.
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.status == "incomplete"


def test_the_event_sequence_is_ordered_and_numbered(http):
    body = {"input": "hi", "max_output_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["usage"]["output_tokens"] == 3


def test_a_model_that_stops_completes():
    with TestClient(fake_app(FakeRunner(next_token=scripted("Hello there.")))) as http:
        r = _sdk(http).responses.create(model="fake", input="hi", max_output_tokens=50)
    assert r.status == "completed" and r.output_text == "Hello there."
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].annotations == []


def test_function_calls_are_items_and_their_outputs_continue_the_conversation():
    with TestClient(fake_app(FakeRunner(next_token=scripted(CALL)))) as http:
        client = _sdk(http)
        r = client.responses.create(model="fake", input="Weather in Paris?", tools=[TOOL],
                                    max_output_tokens=200)  # fmt: skip
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
        with client.responses.stream(model="fake", input="Weather in Paris?", tools=[TOOL],
                                     max_output_tokens=200) as stream:  # fmt: skip
            args = [e.delta for e in stream
                    if e.type == "response.function_call_arguments.delta"]  # fmt: skip
            streamed = stream.get_final_response()
        assert json.loads("".join(args)) == {"city": "Paris"}
        assert streamed.output[0].type == "function_call"
        # The call's output, sent on top of the stored response.
        follow = client.responses.create(
            model="fake",
            previous_response_id=r.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
            tools=[TOOL],
            max_output_tokens=200,
        )
        assert follow.previous_response_id == r.id
        # Stateless: the client sends the call back with its output.
        stateless = client.responses.create(
            model="fake",
            input=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city": "Paris"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],  # fmt: skip
            tools=[TOOL],
            store=False,
            max_output_tokens=200,
        )
        assert stateless.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(stateless.id)


def test_a_continuation_reuses_the_previous_turns_kv(http):
    client = _sdk(http)
    first = client.responses.create(
        model="fake", input="Tell me a story about a cat.", max_output_tokens=8
    )
    second = client.responses.create(model="fake", previous_response_id=first.id, input="And then?",
                                     max_output_tokens=8)  # fmt: skip
    # The second prompt starts with the first's prompt and output: all of that was parked.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + 8
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_retrieve_and_delete(http):
    client = _sdk(http)
    r = client.responses.create(model="fake", input="hi", max_output_tokens=2, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.metadata == {"k": "v"} and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="fake", previous_response_id=r.id, input="more")
    assert "previous_response_id" in str(err.value)


def test_the_store_is_bounded_and_can_be_off():
    with TestClient(fake_app(responses_store_bytes=6000)) as http:
        client = _sdk(http)
        ids = [
            client.responses.create(model="fake", input=f"hi {i}", max_output_tokens=2).id
            for i in range(12)
        ]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])  # the oldest went first
        assert client.responses.retrieve(ids[-1]).id == ids[-1]
    with TestClient(fake_app(responses_store_bytes=0)) as http:
        client = _sdk(http)
        r = client.responses.create(model="fake", input="hi", max_output_tokens=2)
        assert r.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r.id)


def test_a_continuation_whose_history_was_evicted_is_a_404():
    with TestClient(fake_app(responses_store_bytes=4000)) as http:
        client = _sdk(http)
        first = client.responses.create(model="fake", input="hi", max_output_tokens=2)
        second = client.responses.create(model="fake", previous_response_id=first.id, input="a",
                                         max_output_tokens=2)  # fmt: skip
        for i in range(10):  # push the first out, leaving the second
            client.responses.create(
                model="fake", input=f"other {i}", max_output_tokens=2, store=True
            )
        http.get(f"/v1/responses/{second.id}")
        r = http.post("/v1/responses", json={"previous_response_id": second.id, "input": "b"})
        assert r.status_code == 404, r.text


def test_instructions_become_the_system_turn():
    seen = []

    def next_token(cells):
        seen.append(bytes(t for t in cells if t < 256).decode())
        return 257  # EOS

    with TestClient(fake_app(FakeRunner(next_token=next_token))) as http:
        _sdk(http).responses.create(model="fake", input="hi", instructions="Be brief.")
    assert "<|im_start|>system\nBe brief.<|im_end|>" in seen[-1]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "computer_call", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
            "input[0].call_id",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
        (
            {"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]},
            "tool_choice",
        ),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": 5}, "input"),
        ({}, "input"),
    ],  # fmt: skip
)
def test_bad_input_is_a_400_naming_the_parameter(http, body, param):
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_bad_input_leaves_nothing_in_the_store(http):
    r = http.post("/v1/responses", json={"input": [{"type": "bogus"}]})
    assert r.status_code == 400
    assert http.app.state.ferrum is not None
    ok = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1}).json()
    assert http.get(f"/v1/responses/{ok['id']}").status_code == 200
    assert http.get("/v1/responses/resp_nope").status_code == 404
    assert http.delete("/v1/responses/resp_nope").status_code == 404


def test_thinking_comes_back_as_a_reasoning_item_whole_and_streamed():
    with TestClient(fake_app(FakeRunner(next_token=scripted("<think>Hmm.</think>Yes.")))) as http:
        client = _sdk(http)
        kw = {
            "model": "fake",
            "input": "?",
            "max_output_tokens": 50,
            "reasoning": {"effort": "low"},
        }
        r = client.responses.create(**kw)
        with client.responses.stream(**kw) as stream:
            kinds = [e.type for e in stream]
            streamed = stream.get_final_response()
        follow = client.responses.create(model="fake", previous_response_id=r.id, input="ok")
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Hmm."
    assert message.type == "message" and r.output_text == "Yes."
    assert r.reasoning.effort == "low"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert [o.type for o in streamed.output] == ["reasoning", "message"]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert follow.status == "completed"


def test_reasoning_items_in_the_input_reach_the_template_as_the_turns_reasoning():
    seen = []

    def next_token(cells):
        seen.append(bytes(t for t in cells if t < 256).decode())
        return 257  # EOS

    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "sunny"}]},
    ]  # fmt: skip
    with TestClient(fake_app(FakeRunner(next_token=next_token))) as http:
        r = http.post("/v1/responses", json={"input": items, "tools": [TOOL]})
    assert r.status_code == 200, r.text
    prompt = seen[-1]
    assert '"name": "get_weather"' in prompt and "sunny" in prompt
    asked = prompt.index("Weather?")  # the tools' listing in the system turn comes before
    assert asked < prompt.index('"name": "get_weather"', asked) < prompt.index("sunny")
