"""The Anthropic Messages API end to end, as a Claude-style client meets it: Anthropic's own
SDK against `ferrum serve` on the default model (SmolLM2, served alone under a Claude name
with llama-server's `--alias`, so the Claude model names the SDK sends answer with it),
behind an API key that the SDK sends as x-api-key. Greedy answers stream as they come whole;
a forced tool call is held by its grammar to the tool's input schema; bad bodies are 400s in
Anthropic's shape. Every answer the SDK receives, whole, streamed event by event, or
refused, is checked against the published schema kept in `tests/schemas/`."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx2
import jsonschema
import pytest

from tests.e2e.conftest import running_server
from tests.schema_check import anthropic_event, conforms

KEY = "sk-test"
ALIAS = "claude-haiku-4-5"
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
    flags = ("--api-key", KEY, "--alias", ALIAS)
    with running_server(
        tmp_path_factory, "ferrum-anthropic", *flags, models=("smollm2-135m-instruct",)
    ) as base:
        yield base


def _conforms(response: httpx2.Response) -> None:
    """An answer on the Messages paths against the published schema: each event of a stream,
    else the message, the token count or the error."""
    path = response.request.url.path
    if not path.startswith("/v1/messages"):
        return
    response.read()  # the SDK reads the same bytes again
    if response.headers["content-type"].startswith("text/event-stream"):
        for chunk in response.text.split("\n\n"):
            if chunk.strip():
                name, data = chunk.split("\n")
                event = json.loads(data.removeprefix("data: "))
                assert name == f"event: {event['type']}"
                anthropic_event(event)
        return
    component = "MessageTokensCount" if path.endswith("/count_tokens") else "Message"
    conforms("anthropic-messages", component if response.is_success else "ErrorResponse",
             response.json())  # fmt: skip


def _checked() -> httpx2.Client:
    return httpx2.Client(event_hooks={"response": [_conforms]}, timeout=120)


@pytest.fixture(scope="module")
def client(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, http_client=_checked())


def test_create_stream_and_count_tokens_agree(client):
    kw = {"model": "claude-haiku-4-5", "max_tokens": 32, "messages": ASK, "extra_body": GREEDY}
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.model == ALIAS and whole.id.startswith("msg_")
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
    r = _checked().post(
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
    assert "messages[0].content[0]: model" in refused.value.body["error"]["message"]
    assert "does not take images" in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as unauthorised:
        wrong = anthropic.Anthropic(
            base_url=url, api_key="wrong", max_retries=0, http_client=_checked()
        )
        wrong.messages.create(model="claude-x", max_tokens=8, messages=ASK)
    assert unauthorised.value.body["error"]["type"] == "authentication_error"


def test_the_default_model_is_listed_under_its_alias_and_unknown_routes_are_404s(url):
    """`--model smollm2-135m-instruct --alias claude-haiku-4-5`, as llama-server's -m and -a:
    the one model is listed, and answers, by the alias alone."""
    http = _checked()
    headers = {"x-api-key": KEY}
    listed = http.get(f"{url}/v1/models", headers=headers).json()
    assert [m["id"] for m in listed["data"]] == [ALIAS]
    r = http.post(f"{url}/v1/messages/whatever", json={}, headers=headers)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
