"""The Anthropic Messages API over fake models: whole and streamed answers agree, every
stop_reason, tool_use and thinking blocks, conversations translated into exactly the prompt
of the same OpenAI chat, every bad input refused in Anthropic's error shape, x-api-key, and
Anthropic's own SDK reading all of it."""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import pydantic
import pytest
from fastapi.testclient import TestClient

from ferrum.api.auth import Keys
from tests.factories import FakeRunner, fake_app, model_info
from tests.schema_check import anthropic_event, conforms
from tests.unit.test_api_tools import CALL, scripted

HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
THOUGHT = "<think>The user greets me.</think>Hello there, friend."


def _client(text: str | None = None, **kw) -> TestClient:
    runner = FakeRunner(next_token=scripted(text)) if text is not None else FakeRunner()
    return TestClient(fake_app(runner, **kw))


def _body(**kw) -> dict:
    return {"model": "fake", "max_tokens": 200, "messages": HI, **kw}


def _events(resp) -> list[dict]:
    """The SSE events, each `event:` name checked against its data's type."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = []
    for chunk in "".join(resp.iter_text()).split("\n\n"):
        if not chunk.strip():
            continue
        name, data = chunk.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        anthropic_event(event)  # each event as the published schema has it
        events.append(event)
    return events


def _stream(client: TestClient, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return _events(r)


def _replay(events: list[dict]) -> dict:
    """The message a client rebuilds from the events, checking their order on the way:
    message_start, ping, blocks opened and closed one at a time with increasing indexes (a
    thinking block signed before it stops), message_delta, message_stop."""
    assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
    message = events[0]["message"]
    assert message["content"] == [] and message["stop_reason"] is None
    open_at, partial, signed = None, "", False
    for e in events[2:-2]:
        kind, blocks = e["type"], message["content"]
        if kind == "content_block_start":
            assert open_at is None and e["index"] == len(blocks)
            open_at, partial, signed = e["index"], "", False
            blocks.append(e["content_block"])
            continue
        assert e["index"] == open_at, e
        block, delta = blocks[open_at], e.get("delta", {})
        if kind == "content_block_stop":
            assert signed or block["type"] != "thinking"
            if block["type"] == "tool_use":
                assert block["input"] == {}
                block["input"] = json.loads(partial)
            open_at = None
        elif delta["type"] in ("text_delta", "thinking_delta"):
            field = delta["type"].removesuffix("_delta")
            assert block["type"] == field and not signed
            block[field] += delta[field]
        elif delta["type"] == "signature_delta":
            assert block["type"] == "thinking"
            block["signature"] += delta["signature"]
            signed = True
        else:
            assert delta["type"] == "input_json_delta" and block["type"] == "tool_use"
            partial += delta["partial_json"]
    assert open_at is None
    end, stop = events[-2:]
    assert end["type"] == "message_delta" and stop == {"type": "message_stop"}
    return {**message, **end["delta"], "usage": {**message["usage"], **end["usage"]}}


def _no_ids(message: dict) -> dict:
    content = [{k: v for k, v in b.items() if k != "id"} for b in message["content"]]
    return {**{k: v for k, v in message.items() if k != "id"}, "content": content}


def _whole_and_streamed(client: TestClient, body: dict) -> tuple[dict, dict]:
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    whole = r.json()
    conforms("anthropic-messages", "Message", whole)
    streamed = _replay(_stream(client, body))
    # The second request reads the first one's prompt from the cache: only usage differs.
    assert _no_ids({**streamed, "usage": None}) == _no_ids({**whole, "usage": None})
    assert streamed["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    return whole, streamed


def _text(text: str) -> dict:
    """A text block as the current API answers it: no citations."""
    return {"type": "text", "text": text, "citations": None}


def _refused(r, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    conforms("anthropic-messages", "ErrorResponse", body)
    assert body["error"]["type"] == kind
    return body["error"]["message"]


# -- answers --------------------------------------------------------------------------------


def test_the_message_whole_and_streamed():
    with _client("Hello there, friend.") as client:
        whole, streamed = _whole_and_streamed(client, _body())
        chat = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 200}).json()
    assert whole["id"].startswith("msg_") and whole["id"] != streamed["id"]
    assert {k: whole[k] for k in ("type", "role", "model")} == {
        "type": "message", "role": "assistant", "model": "fake",
    }  # fmt: skip
    assert whole["content"] == [_text("Hello there, friend.")]
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("end_turn", None)
    assert (whole["container"], whole["stop_details"]) == (None, None)
    usage = whole["usage"]
    assert usage["output_tokens"] == chat["usage"]["completion_tokens"]
    assert usage["cache_creation_input_tokens"] == 0
    assert usage["cache_creation"] == {
        "ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0,
    }  # fmt: skip
    assert usage["output_tokens_details"] == {"thinking_tokens": 0}
    assert (usage["service_tier"], usage["server_tool_use"]) == ("standard", None)
    prompt = chat["usage"]["prompt_tokens"]
    for u in (usage, streamed["usage"]):
        assert u["input_tokens"] + u["cache_read_input_tokens"] == prompt
    assert streamed["usage"]["cache_read_input_tokens"] > 0  # the same prompt, cached


@pytest.mark.parametrize(
    ("extra", "text", "reason", "sequence"),
    [
        ({}, "Hello there, friend.", "end_turn", None),
        ({"max_tokens": 5}, "Hello", "max_tokens", None),
        ({"stop_sequences": ["zz", "there"]}, "Hello ", "stop_sequence", "there"),
    ],
)
def test_each_stop_reason(extra, text, reason, sequence):
    with _client("Hello there, friend.") as client:
        whole, _ = _whole_and_streamed(client, _body(**extra))
    assert whole["content"] == [_text(text)]
    assert (whole["stop_reason"], whole["stop_sequence"]) == (reason, sequence)


@pytest.mark.parametrize("prefix", ["", "Let me check."])
def test_a_tool_call_is_a_tool_use_block_whole_and_streamed(prefix):
    with _client(prefix + CALL) as client:
        whole, streamed = _whole_and_streamed(client, _body(tools=[WEATHER]))
        events = _stream(client, _body(tools=[WEATHER]))
    *text, call = whole["content"]
    assert text == ([_text(prefix)] if prefix else [])
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
    assert (call["name"], call["input"]) == ("get_weather", {"city": "Paris"})
    assert whole["stop_reason"] == "tool_use" and streamed["stop_reason"] == "tool_use"
    (start,) = [e for e in events if e["type"] == "content_block_start" and e["index"] == len(text)]
    assert start["content_block"]["input"] == {} and start["content_block"]["name"] == "get_weather"


def test_arguments_that_are_not_an_object_are_an_empty_input():
    odd = '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>'
    with _client(odd) as client:
        whole, _ = _whole_and_streamed(client, _body(tools=[WEATHER]))
    assert [(b["type"], b["input"]) for b in whole["content"]] == [("tool_use", {})]


@pytest.mark.parametrize(
    ("thinking", "shown"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, True),
        ({"type": "adaptive"}, True),
        ({"type": "adaptive", "display": "omitted"}, False),
        ({"type": "disabled"}, False),
        (None, False),
    ],
)
def test_thinking_blocks_only_when_enabled(thinking, shown):
    body = _body(thinking=thinking) if thinking else _body()
    with _client(THOUGHT) as client:
        whole, _ = _whole_and_streamed(client, body)
        events = _stream(client, body)
    text = _text("Hello there, friend.")
    thought = {"type": "thinking", "thinking": "The user greets me.", "signature": ""}
    assert whole["content"] == ([thought, text] if shown else [text])
    # The tokens spent thinking, shown or not: "<think>The user greets me.</think>" of the
    # byte tokenizer's output, never more than the whole.
    usage = whole["usage"]
    assert 15 <= usage["output_tokens_details"]["thinking_tokens"] < usage["output_tokens"]
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert ("thinking_delta" in deltas) == shown and ("signature_delta" in deltas) == shown


# -- conversations: the same prompt as the OpenAI chat ------------------------------------

CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "Ask the tool.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {
                "type": "tool_use",
                "id": "toolu_A",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
            {"type": "tool_use", "id": "toolu_B", "name": "get_weather", "input": {"city": "Lyon"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Also, thanks."},
            {"type": "tool_result", "tool_use_id": "toolu_B", "content": "rain"},
            {
                "type": "tool_result",
                "tool_use_id": "toolu_A",
                "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "21 C"}],
            },
            {"type": "text", "text": "Which is better?"},
        ],
    },
    {"role": "assistant", "content": "Paris."},
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_A", "is_error": True}],
    },
]


def _openai_conversation() -> list[dict]:
    def call(n: int, city: str) -> dict:
        arguments = json.dumps({"city": city})
        return {"id": f"call0000{n}", "type": "function",
                "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip

    def result(n: int, content: str) -> dict:
        return {"role": "tool", "tool_call_id": f"call0000{n}", "name": "get_weather",
                "content": content}  # fmt: skip

    return [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Ask the tool.",
            "tool_calls": [call(0, "Paris"), call(1, "Lyon")],
        },
        result(1, "rain"),
        result(0, "sunny\n21 C"),
        {"role": "user", "content": "Also, thanks.\n\nWhich is better?"},
        {"role": "assistant", "content": "Paris."},
        result(0, "Error: "),
    ]


def test_a_conversation_is_the_prompt_of_the_same_openai_chat():
    """The fake model's output depends on every prompt token, so equal answers mean equal
    prompts: tool results in order before the turn's text, ids mapped, blocks joined."""
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}]
    openai = {"messages": _openai_conversation(), "max_tokens": 12, "tools": [
        {"type": "function", "function": {"name": WEATHER["name"],
         "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}
    ]}  # fmt: skip
    ours = _body(messages=CONVERSATION, system=system, tools=[WEATHER], max_tokens=12)
    with TestClient(fake_app(FakeRunner(info=model_info(n_ctx=4096)))) as client:
        chat = client.post("/v1/chat/completions", json=openai).json()
        message = client.post("/v1/messages", json=ours).json()
        counted = client.post("/v1/messages/count_tokens", json=ours).json()
        no_tools = client.post(
            "/v1/messages/count_tokens", json={"messages": CONVERSATION, "system": system}
        ).json()
    answer = chat["choices"][0]["message"]["content"]
    assert message["content"] == [_text(answer)]
    assert counted == {"input_tokens": chat["usage"]["prompt_tokens"]}
    assert no_tools["input_tokens"] < counted["input_tokens"]  # the tools are in the prompt


def test_sampling_fields_and_tool_choice_reach_the_engine():
    runner = FakeRunner()
    body = _body(
        temperature=0.5, top_p=0.9, top_k=7, stop_sequences=["zz"], max_tokens=9,
        tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        metadata={"user_id": "u1"},
    )  # fmt: skip
    with TestClient(fake_app(runner)) as client:
        r = client.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 200, r.text
        forced = runner.closed_samplers[-1].params
        client.post("/v1/messages", json=_body(tools=[WEATHER], tool_choice={"type": "auto"}))
        free = runner.closed_samplers[-1].params
    assert (forced.temperature, forced.top_p, forced.top_k) == (0.5, 0.9, 7)
    assert (forced.stop, forced.max_tokens) == (("zz",), 9)
    assert forced.grammar is not None and free.grammar is None


def test_an_output_format_is_a_schema_grammar():
    runner = FakeRunner()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    output = {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
    with TestClient(fake_app(runner)) as client:
        r = client.post("/v1/messages", json=_body(output_config=output))
        assert r.status_code == 200, r.text
        assert runner.closed_samplers[-1].params.grammar is not None
        unenforceable = {"type": "array", "uniqueItems": True}
        bad = {"format": {"type": "json_schema", "schema": unenforceable}}
        says = _refused(
            client.post("/v1/messages", json=_body(output_config=bad)), 400, "invalid_request_error"
        )
        assert says.startswith("output_config.format.schema") and "uniqueItems" in says
        forced = _body(
            output_config=output,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"},
        )
        says = _refused(client.post("/v1/messages", json=forced), 400, "invalid_request_error")
        assert "cannot be combined" in says


# -- refusals -------------------------------------------------------------------------------

_TOOL_TURN = [
    *HI,
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_A", "name": "get_weather", "input": {}}]},
]  # fmt: skip


def _without_max_tokens() -> dict:
    body = _body()
    del body["max_tokens"]
    return body


def _user(*blocks: dict) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


_PNG_SOURCE = {"type": "base64", "media_type": "image/png", "data": "AA=="}
BAD = {
    "no max_tokens": (_without_max_tokens(), "max_tokens: Field required"),
    "max_tokens 0": (_body(max_tokens=0), "max_tokens"),
    "max_tokens a string": (_body(max_tokens="5"), "max_tokens"),
    "temperature over 1": (_body(temperature=1.5), "temperature"),
    "temperature a string": (_body(temperature="0.5"), "temperature"),
    "stream a string": (_body(stream="yes"), "stream"),
    "no messages": (_body(messages=[]), "messages"),
    "a system role": (_body(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    "content a number": (_body(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    "text a number": (_body(messages=_user({"type": "text", "text": 5})), "content[0].text"),
    "unknown block": (_body(messages=_user({"type": "audio"})), "messages[0].content[0]"),
    "unanswered id": (
        _body(messages=[*_TOOL_TURN, *_user({"type": "tool_result", "tool_use_id": "toolu_Z"})]),
        "messages[2].content[0].tool_use_id",
    ),
    "a result before its call": (
        _body(messages=_user({"type": "tool_result", "tool_use_id": "toolu_A"})),
        "messages[0].content[0].tool_use_id",
    ),
    "input not an object": (
        _body(
            messages=[
                *HI,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": ["x"]}],
                },
            ]
        ),
        "messages[1].content[0].input",
    ),
    "an image for a model that does not see": (
        _body(messages=_user({"type": "image", "source": _PNG_SOURCE})),
        "messages[0].content[0]: model 'fake' does not take images",
    ),
    "an image of no type": (
        _body(messages=_user({"type": "image", "source": {"type": "base64", "data": "AA=="}})),
        "messages[0].content[0].source.media_type",
    ),
    "an image by url": (
        _body(messages=_user({"type": "image", "source": {"type": "url", "url": "http://x/"}})),
        "messages[0].content[0].source: url image sources are not supported",
    ),
    "a document in a result": (
        _body(
            messages=[
                *_TOOL_TURN,
                *_user(
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_A",
                        "content": [{"type": "document", "source": {}}],
                    }
                ),
            ]
        ),
        "messages[2].content[0].content[0]: document blocks are not supported: ferrum reads",
    ),
    "thinking from the user": (
        _body(messages=_user({"type": "thinking", "thinking": "x"})),
        "messages[0].content[0]",
    ),
    "a server tool": (
        _body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "'web_search' is a server tool (web_search_20250305)",
    ),
    "a tool without a schema": (_body(tools=[{"name": "f"}]), "tools[0].input_schema"),
    "a schema not an object": (
        _body(tools=[{"name": "f", "input_schema": {"type": "string"}}]),
        "tools[0].input_schema",
    ),
    "a bad tool name": (_body(tools=[{"name": "a b", "input_schema": {}}]), "tools[0].name"),
    "a choice of no tool": (
        _body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
        "'nope'",
    ),
    "a choice without a name": (
        _body(tools=[WEATHER], tool_choice={"type": "tool"}),
        "tool_choice.name",
    ),
    "a choice of another type": (_body(tool_choice={"type": "function"}), "tool_choice.type"),
    "stop sequence empty": (_body(stop_sequences=[""]), "stop_sequences"),
    "thinking of another type": (_body(thinking={"type": "sometimes"}), "thinking.type"),
}


# Fields of generation only, which count_tokens ignores.
_SAMPLING = {"max_tokens", "temperature", "stream", "stop_sequences"}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_a_400_in_anthropic_shape(case):
    body, says = BAD[case]
    with _client("Hi.") as client:
        message = _refused(client.post("/v1/messages", json=body), 400, "invalid_request_error")
        counted = client.post("/v1/messages/count_tokens", json=body)
    assert says in message
    if any(body.get(k) != _body().get(k) for k in _SAMPLING):
        assert counted.status_code == 200
    else:
        assert says in _refused(counted, 400, "invalid_request_error")


@pytest.mark.parametrize("raw", [b"{", b"", b"[]", b'{"max_tokens": NaN}'])
def test_a_body_that_is_not_a_json_object_is_a_400(raw):
    headers = {"content-type": "application/json"}
    with _client("Hi.") as client:
        for path in ("/v1/messages", "/messages", "/v1/messages/count_tokens"):
            _refused(client.post(path, content=raw, headers=headers), 400, "invalid_request_error")


def test_model_routes_and_size_errors_in_anthropic_shape():
    with TestClient(fake_app(models={"alpha": FakeRunner, "beta": FakeRunner})) as client:
        says = _refused(
            client.post("/v1/messages", json=_body(model="claude-x")), 404, "not_found_error"
        )
        assert "'claude-x' not found" in says and "'alpha'" in says
        counted = client.post("/v1/messages/count_tokens", json=_body(model="claude-x"))
        _refused(counted, 404, "not_found_error")
        _refused(client.get("/v1/messages"), 405, "invalid_request_error")
        big = {"content-length": str(64 * 1024 * 1024), "content-type": "application/json"}
        # Anthropic's 413 type, request_too_large, is not in the published schema.
        oversized = client.post("/v1/messages", content=b"{}", headers=big)
        _refused(oversized, 413, "invalid_request_error")
        # The other dialects keep their own shape.
        r = client.post("/v1/chat/completions", content=b"{}", headers=big)
        assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"


def test_x_api_key_or_a_bearer_token():
    with _client("Hi.", keys=Keys(("k1", "k2"))) as client:
        for headers in ({}, {"x-api-key": "nope"}, {"authorization": "Bearer nope"}):
            for path in ("/v1/messages", "/v1/messages/count_tokens", "/messages"):
                r = client.post(path, json=_body(), headers=headers)
                _refused(r, 401, "authentication_error")
        for headers in ({"x-api-key": "k2"}, {"authorization": "Bearer k1"}):
            assert client.post("/v1/messages", json=_body(), headers=headers).status_code == 200
        chat = {"messages": HI, "max_tokens": 2}
        r = client.post("/v1/chat/completions", json=chat, headers={"x-api-key": "k1"})
        assert r.status_code == 200
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# -- failures -------------------------------------------------------------------------------


def test_an_engine_fault_is_an_api_error_whole_and_an_error_event_streamed():
    runner = FakeRunner()
    with TestClient(fake_app(runner)) as client:
        runner.fail_seqs.add(0)
        _refused(client.post("/v1/messages", json=_body()), 500, "api_error")
        runner.fail_seqs.add(0)
        events = _stream(client, _body())
        assert client.post("/v1/messages", json=_body()).status_code == 200
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
    assert "message_stop" not in [e["type"] for e in events]


def test_the_deadline_ends_a_stream_with_an_error_event_and_frees_the_model():
    with TestClient(fake_app(FakeRunner(step_delay_s=0.02), request_timeout=0.3)) as client:
        says = _refused(client.post("/v1/messages", json=_body()), 408, "timeout_error")
        assert "took longer than 0.3 s" in says
        events = _stream(client, _body())
        assert events[-1] == {
            "type": "error",
            "error": {"type": "timeout_error", "message": "the request took longer than 0.3 s"},
            "request_id": None,
        }
        state = client.app.state.ferrum
        for _ in range(50):
            if [m.in_flight for m in state.models.loaded()] == [0]:
                break
            time.sleep(0.05)
        assert [m.in_flight for m in state.models.loaded()] == [0]


# -- Anthropic's SDK ------------------------------------------------------------------------


def test_anthropic_sdk_reads_every_shape():
    with _client("<think>Hm.</think>Let me check." + CALL) as http:
        # The SDK speaks httpx2, as the TestClient does: it is the SDK's HTTP client.
        client = anthropic.Anthropic(
            base_url="http://testserver", api_key="k", max_retries=0, http_client=http
        )
        kw = {"model": "claude-x", "max_tokens": 300, "messages": HI, "tools": [WEATHER],
              "thinking": {"type": "enabled", "budget_tokens": 1024}}  # fmt: skip
        whole = client.messages.create(**kw)
        with client.messages.stream(**kw) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        counted = client.messages.count_tokens(model="x", messages=HI, tools=[WEATHER])
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    assert whole.content[1].text == text == final.content[1].text == "Let me check."
    assert whole.content[2].input == final.content[2].input == {"city": "Paris"}
    assert whole.stop_reason == final.stop_reason == "tool_use"
    assert final.content[0].thinking == "Hm." and final.usage.output_tokens > 0
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def _strict(model: type[pydantic.BaseModel] | Any, data: dict) -> None:
    """`data` read by the SDK's generated types in strict mode (no coercion), and no field
    left over that the types do not know (the SDK keeps unknown fields as extras)."""
    adapter = pydantic.TypeAdapter(model)
    parsed = adapter.validate_python(data, strict=True)

    def extras(value: Any, path: str) -> list[str]:
        if isinstance(value, list):
            return [x for i, item in enumerate(value) for x in extras(item, f"{path}[{i}]")]
        if not isinstance(value, pydantic.BaseModel):
            return []
        found = [f"{path}.{k}" for k in value.model_extra or {}]
        fields = type(value).model_fields
        return found + [x for k in fields for x in extras(getattr(value, k), f"{path}.{k}")]

    assert extras(parsed, "") == [], data


def test_the_sdks_generated_types_read_every_answer_strictly():
    """A client generated from the published schema (the SDK's own pydantic types, in strict
    mode) parses every whole answer, every streamed event and an error, no field unknown."""
    from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
    from anthropic.types.shared import ErrorResponse

    body = _body(tools=[WEATHER], thinking={"type": "enabled", "budget_tokens": 1024})
    with _client("<think>Hm.</think>Let me check." + CALL) as client:
        whole = client.post("/v1/messages", json=body).json()
        events = _stream(client, body)
        counted = client.post("/v1/messages/count_tokens", json=body).json()
        refused = client.post("/v1/messages", json=_body(max_tokens="x")).json()
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
    _strict(Message, whole)
    for event in events:
        if event["type"] != "ping":  # documented, not one of the schema's stream events
            _strict(RawMessageStreamEvent, event)
    _strict(MessageTokensCount, counted)
    conforms("anthropic-messages", "MessageTokensCount", counted)
    _strict(ErrorResponse, refused)
