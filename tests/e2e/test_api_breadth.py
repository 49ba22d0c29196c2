"""The OpenAI API's wider fields end to end on the built-in Gemma 3 270M, through the `openai`
SDK: logprobs, seeds, logit_bias, stop_token_ids, min_tokens, structured output and tools."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import NO_SPECULATION, running_server
from tests.schemas import checked

CAT = [{"role": "user", "content": "Describe a cat as a JSON object with keys name and age."}]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "colour": {"enum": ["black", "white", "orange"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """A server of its own: the KV these tests leave parked would shift other modules' greedy
    texts (llama.cpp rounds differently as the occupied cell range grows). No speculation,
    as on the shared servers (conftest.NO_SPECULATION): a seed twice must give one text."""
    with running_server(tmp_path_factory, "ferrum-breadth", *NO_SPECULATION) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:
    """A client whose transport validates every answer it reads against the published
    schemas (tests/schemas), whole, streamed and errors."""
    seen = checked.Checked()
    yield checked.client(f"{server}/v1", seen)
    assert seen.answers > 0


def _chat(client, **kw):
    return client.chat.completions.create(**{"model": "m", "temperature": 0, **kw})


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


def test_chat_logprobs_concatenate_to_the_content_stream_and_whole(client):
    kw = {"messages": CAT, "max_tokens": 12, "logprobs": True, "top_logprobs": 5}
    whole = _chat(client, **kw).choices[0]
    entries = whole.logprobs.content
    assert "".join(e.token for e in entries) == whole.message.content
    for e in entries:
        assert e.logprob <= 0 and bytes(e.bytes).decode() == e.token
        assert len(e.top_logprobs) == 5
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy: the best one
    chunks = list(_chat(client, stream=True, **kw))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    # The rerun reuses the cached prompt and computes only its last token: llama.cpp's kernels
    # for one row and for many round differently, so logprobs match only approximately.
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=0.15)


def test_completion_logprobs(client):
    r = client.completions.create(
        model="m", prompt="The sky is", max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.top_logprobs) == 6 and all(len(t) == 3 for t in lp.top_logprobs)


def test_seed_reproduces_sampled_text_and_n_choices_differ(client):
    kw = {"messages": CAT, "max_tokens": 24, "temperature": 1.0, "seed": 1234, "n": 3}
    # Both answers below reuse the prompt's KV from this one: a prompt computed in one batch
    # and one reused from the cache differ in float noise, which a sample at temperature 1
    # can turn into another token (the first call of a fresh server would compute it).
    _chat(client, **kw)
    first = [c.message.content for c in _chat(client, **kw).choices]
    again = [c.message.content for c in _chat(client, **kw).choices]
    assert first == again
    assert len(set(first)) > 1  # each choice samples with its own seed (seed + index)


def _token_id(server: str, text: str) -> int:
    tokens = httpx.post(f"{server}/tokenize", json={"content": text}).json()["tokens"]
    assert len(tokens) == 1, (text, tokens)
    return tokens[0]


def test_logit_bias_bans_and_forces_tokens(client, server):
    greedy = _chat(client, messages=CAT, max_tokens=4, logprobs=True).choices[0]
    first = greedy.logprobs.content[0]
    first_id = _token_id(server, first.token)
    banned = _chat(client, messages=CAT, max_tokens=4, logit_bias={str(first_id): -100})
    assert not banned.choices[0].message.content.startswith(first.token)
    forced = _chat(client, messages=CAT, max_tokens=3, logit_bias={str(first_id): 100})
    assert forced.choices[0].message.content == first.token * 3


def test_stop_token_ids_and_min_tokens(client, server):
    greedy = _chat(client, messages=CAT, max_tokens=8, logprobs=True).choices[0]
    tokens = [e.token for e in greedy.logprobs.content]
    third = _token_id(server, tokens[2])
    stopped = _chat(client, messages=CAT, max_tokens=8, extra_body={"stop_token_ids": [third]})
    assert stopped.choices[0].message.content == "".join(tokens[:2])
    assert stopped.choices[0].finish_reason == "stop"
    # <end_of_turn> (106) pushed to the top ends the turn at once, unless min_tokens holds it.
    end_now = {"logit_bias": {"106": 100}}
    assert _chat(client, messages=CAT, max_tokens=8, **end_now).choices[0].message.content == ""
    held = _chat(client, messages=CAT, max_tokens=8, extra_body={"min_tokens": 4}, **end_now)
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 5


def test_json_schema_output_validates_stream_and_whole(client):
    kw = {"messages": CAT, "max_tokens": 120, "response_format": _schema_format(PERSON_SCHEMA)}
    whole = _chat(client, **kw).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), PERSON_SCHEMA)
    streamed = "".join(
        c.choices[0].delta.content or "" for c in _chat(client, stream=True, **kw) if c.choices
    )
    jsonschema.validate(json.loads(streamed), PERSON_SCHEMA)


def test_json_object_output_is_a_json_object(client, server):
    # Left alone, this base model writes JSON until max_tokens. Pushing "}" up makes it want
    # to close at once: free text then starts with a bare "}", the grammar makes it an object.
    push_close = {"logit_bias": {str(_token_id(server, "}")): 12}, "max_tokens": 60}
    free = _chat(client, messages=CAT, **push_close).choices[0].message.content
    assert free.startswith("}")
    r = _chat(client, messages=CAT, response_format={"type": "json_object"}, **push_close)
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", content
    assert isinstance(json.loads(content), dict)


def test_unsupported_schema_keyword_is_a_400_naming_it(client):
    # llguidance honours `minimum` and ignores annotations; `uniqueItems` it cannot enforce.
    schema = {"type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, messages=CAT, max_tokens=4, response_format=_schema_format(schema))
    assert "uniqueItems" in e.value.body["message"]
    assert e.value.body["param"] == "response_format.json_schema.schema"


def _check_call(call, tools: list[dict]) -> None:
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), spec[call.function.name])


def test_required_tool_choice_gives_valid_calls(client):
    r = _chat(
        client,
        messages=ASK_WEATHER,
        max_tokens=150,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], [WEATHER, TIME])


def test_named_tool_choice_streams_the_call(client):
    kw = {
        "messages": ASK_WEATHER,
        "max_tokens": 150,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    }
    whole = _chat(client, **kw).choices[0]
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_time"
    _check_call(call, [WEATHER, TIME])
    chunks = [c for c in _chat(client, stream=True, **kw) if c.choices]
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == [
        (0, "get_time", call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_and_reasoning_round_trip(client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "The tool said so."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    r = _chat(client, messages=messages, max_tokens=8, tools=[WEATHER])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 60


def test_structured_requests_batch_with_free_ones(server):
    """8 concurrent mixed requests: every constrained output still meets its constraint."""
    aclient = checked.async_client(f"{server}/v1")

    async def one(i: int):
        kind = ("schema", "free", "tool", "schema")[i % 4]
        kw: dict = {"model": "m", "messages": CAT, "max_tokens": 100, "temperature": 0.7, "seed": i}
        if kind == "schema":
            kw["response_format"] = _schema_format(PERSON_SCHEMA)
        elif kind == "tool":
            kw.update(
                messages=ASK_WEATHER,
                tools=[WEATHER],
                tool_choice="required",
                parallel_tool_calls=False,
            )
        return kind, await aclient.chat.completions.create(**kw)

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            await aclient.close()

    for kind, r in asyncio.run(main()):
        choice = r.choices[0]
        if kind == "schema":
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)
        elif kind == "tool":
            _check_call(choice.message.tool_calls[0], [WEATHER])
        else:
            assert choice.message.content


@pytest.mark.parametrize("items", [{"type": "string"}, {"enum": ["cat", "cats", "dog", "cow"]}])
def test_unique_items_hold_on_the_real_vocabulary(client, items):
    """uniqueItems over free strings and over a fixed set, on SmolLM2's own tokens (quotes,
    commas and words in one token): asked for a repeat, the model gets distinct items; the
    same schema without the keyword repeats (the watch's teeth)."""
    ask = [{"role": "user", "content": "Write the word cat four times as a JSON list."}]
    schema = {"type": "array", "items": items, "minItems": 3, "maxItems": 4}
    answers = []
    for unique in (True, False):
        fmt = _schema_format({**schema, "uniqueItems": unique})
        r = _chat(client, messages=ask, max_tokens=60, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        answers.append(json.loads(r.choices[0].message.content))
    kept, free = answers
    jsonschema.validate(kept, {**schema, "uniqueItems": True})
    assert len(set(map(json.dumps, free))) < len(free), free
