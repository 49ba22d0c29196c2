"""The Anthropic Messages API end to end, as a Claude-style client meets it: Anthropic's own
SDK against `ferrum serve` on the default model (SmolLM2, served alone, so the Claude model
names the SDK sends answer with it), behind an API key that the SDK sends as x-api-key.
Greedy answers stream as they come whole; a forced tool call is held by its grammar to the
tool's input schema; bad bodies are 400s in Anthropic's shape."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest

from tests.e2e.conftest import running_server

KEY = "sk-test"
ASK = [{"role": "user", "content": "Name three colours."}]
# This SDK no longer sends sampling fields (newer Claude models ignore them); older clients do,
# and a greedy answer is the same whole and streamed.
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    flags = ("--api-key", KEY)
    with running_server(
        tmp_path_factory, "ferrum-anthropic", *flags, models=("smollm2-135m-instruct",)
    ) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)


def test_create_stream_and_count_tokens_agree(client):
    kw = {"model": "claude-haiku-4-5", "max_tokens": 32, "messages": ASK, "extra_body": GREEDY}
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.model == "smollm2-135m-instruct" and whole.id.startswith("msg_")
    (block,) = whole.content
    assert block.type == "text" and block.text.strip()
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert 0 < whole.usage.output_tokens <= 32
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == block.text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: from the cache
    counted = client.messages.count_tokens(model="claude-haiku-4-5", messages=ASK)
    usage = whole.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def test_a_forced_tool_call_meets_its_schema_whole_and_streamed(client):
    kw = {
        "model": "claude-haiku-4-5",
        "max_tokens": 64,
        "extra_body": GREEDY,
        "system": "You can look up the weather.",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    whole = client.messages.create(**kw)
    assert whole.stop_reason == "tool_use"
    (call,) = [b for b in whole.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (call.name, call.input)
    # The call answered: the conversation goes on with its result.
    turns = [
        *kw["messages"],
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]},
    ]  # fmt: skip
    after = client.messages.create(
        **{**kw, "max_tokens": 16, "tool_choice": {"type": "none"}, "messages": turns}
    )
    assert after.content and after.content[0].type == "text"


def test_bad_requests_are_400s_in_anthropic_shape(client, url):
    r = httpx.post(
        f"{url}/v1/messages",
        json={"model": "claude-x", "messages": ASK},
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
    )
    assert r.status_code == 400
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in error["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model="claude-x", max_tokens=8, messages=[{"role": "user", "content": [image]}]
        )
    assert "text models" in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as unauthorised:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="claude-x", max_tokens=8, messages=ASK
        )
    assert unauthorised.value.body["error"]["type"] == "authentication_error"
