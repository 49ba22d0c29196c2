"""Tool calls and structured output through the HTTP API, over a fake model with a script."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from fastapi.testclient import TestClient

from tests.factories import EOS, FakeRunner, fake_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def scripted(text: str):
    """A fake model that answers every chat prompt with `text`, then EOS."""
    script = list(text.encode()) + [EOS]
    marker = list(b"<|im_start|>assistant\n")

    def next_token(cells: Sequence[int]) -> int:
        cells = list(cells)
        start = max(
            i + len(marker) for i in range(len(cells)) if cells[i : i + len(marker)] == marker
        )
        return script[min(len(cells) - start, len(script) - 1)]

    return next_token


def _client(text: str) -> TestClient:
    return TestClient(fake_app(FakeRunner(next_token=scripted(text))))


def _chat(**kw):
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 200,
        "temperature": 0,
        "tools": [WEATHER],
    }
    return {**body, **kw}


def _events(resp) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("prefix", ["", "Let me check. "])
def test_a_tool_call_is_parsed_whole_and_streamed(prefix):
    with _client(prefix + CALL) as client:
        whole = client.post("/v1/chat/completions", json=_chat()).json()
        choice = whole["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert choice["message"]["content"] == (prefix.strip() or None)
        with client.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as r:
            events = _events(r)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    streamed_calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [tc["function"] for tc in streamed_calls] == [call["function"]]
    assert streamed_calls[0]["index"] == 0
    assert "".join(d.get("content") or "" for d in deltas) == prefix.strip()
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_tools_the_same_text_is_plain_content():
    with _client(CALL) as client:
        body = _chat()
        del body["tools"]
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["content"] == CALL and choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]


def test_tool_choice_none_leaves_output_unparsed():
    with _client(CALL) as client:
        choice = client.post("/v1/chat/completions", json=_chat(tool_choice="none")).json()
    assert choice["choices"][0]["message"]["content"] == CALL


def test_tool_turns_round_trip():
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "It said sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    with _client("You're welcome.") as client:
        r = client.post("/v1/chat/completions", json=_chat(messages=history))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "You're welcome."


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required", "tools": []}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]},
            "messages[0].tool_calls[0].function",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_parameter(extra, param):
    with _client("x") as client:
        r = client.post("/v1/chat/completions", json=_chat(**extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "schema",
    [
        {"type": 5},
        {"type": "object", "properties": {"a": {"type": "strin"}}},
        {"type": "object", "required": "a"},
        {"type": "string", "pattern": "(unclosed"},
        {"type": "array", "uniqueItems": True},  # not enforceable
        {"not": {"type": "integer"}},  # not enforceable: a number that is not whole
    ],
)
def test_a_bad_or_unenforceable_schema_is_a_400_naming_it(schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with TestClient(fake_app()) as client:
        r = client.post("/v1/chat/completions", json=_chat(response_format=fmt))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"


def test_an_unenforceable_keyword_is_named_with_its_place_in_the_schema():
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with TestClient(fake_app()) as client:
        r = client.post("/v1/chat/completions", json=_chat(response_format=fmt))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("response_format.json_schema.schema.properties.tags: "), message
    assert "uniqueItems" in message
