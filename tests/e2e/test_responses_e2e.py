"""The Responses API end to end: the `openai` SDK and the OpenAI Agents SDK against
`ferrum serve` on the default chat model, SmolLM2-135M-Instruct. Structured output and
forced tool calls are grammar-enforced, so they hold even for a model this small."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.e2e.conftest import running_server
from tests.schemas import checked
from tests.unit.test_responses_api import TOOL as WEATHER

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory, "ferrum-responses", models=(MODEL,)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:
    """A client whose transport validates every answer it reads against the published
    schemas (tests/schemas), whole, streamed and errors."""
    seen = checked.Checked()
    yield checked.client(f"{server}/v1", seen)
    assert seen.answers > 0


def test_create_stream_and_retrieve_agree(client):
    kw = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 24, "temperature": 0}
    whole = client.responses.create(**kw)
    assert whole.model == MODEL and whole.output_text.strip()
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-1].type == f"response.{whole.status}"
    assert deltas == final.output_text == whole.output_text
    assert client.responses.retrieve(whole.id).output_text == whole.output_text


def test_a_continuation_prefills_only_the_new_input(client):
    first = client.responses.create(
        model=MODEL, instructions="Answer briefly.", input="What is the capital of France?",
        max_output_tokens=40, temperature=0,
    )  # fmt: skip
    second = client.responses.create(
        model=MODEL, instructions="Answer briefly.", previous_response_id=first.id,
        input="And of Italy?", max_output_tokens=40, temperature=0,
    )  # fmt: skip
    # The previous prompt and its output, all but the last sampled token, were still parked.
    reused = second.usage.input_tokens_details.cached_tokens
    assert reused >= first.usage.input_tokens + first.usage.output_tokens - 1


def test_structured_output_follows_the_schema(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL, input="Describe a person.", max_output_tokens=80, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)


def test_a_forced_tool_call_is_a_function_call_item(client):
    r = client.responses.create(
        model=MODEL, input="What's the weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
        temperature=0,
    )  # fmt: skip
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_an_agent_calls_its_tool_and_answers(server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    oai = checked.async_client(f"{server}/v1")
    agent = Agent(
        name="weather",
        instructions="You answer weather questions with the get_weather tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=oai),
        # The first turn must call the tool (grammar-forced); the SDK then lets the model
        # answer freely with the tool's output.
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=80),
    )
    result = asyncio.run(Runner.run(agent, "What's the weather in Paris?", max_turns=4))
    assert len(calls) == 1 and calls[0].strip()
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem"
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_bad_input_is_an_openai_error(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id="resp_gone", input="hi")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[{"type": "computer_call", "id": "x"}])
    assert err.value.body["param"] == "input[0].type"
