"""Tool-call parsing: recorded (hand-written, realistic) outputs of each family's models, parsed
whole and streamed. Oracle: streamed in any chunks == parsed whole, and the content streamed
so far is always a prefix of the final content (no marker is ever shown and then taken back)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrum.api.prompting.tool_calls import (
    FORMATS,
    GEMMA,
    HERMES,
    LLAMA3,
    MISTRAL,
    ToolCall,
    ToolFormat,
    detect_format,
)
from tests.profiles import examples

PARIS = {"city": "Paris"}
OSLO = {"city": "Oslo", "unit": "celsius"}
W = "get_weather"

# (format, model output, expected content, expected calls as (name, arguments dict))
RECORDED = [
    # hermes: Qwen 2.5 / Hermes 3
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [(W, PARIS)]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
     "</tool_call>", "", [(W, PARIS), (W, OSLO)]),
    (HERMES, "I'll look that up.\n\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "I'll look that up.", [(W, PARIS)]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>', []),
    (HERMES, "The weather in Paris is 18 °C. <b>Enjoy</b> < > <tool",
     "The weather in Paris is 18 °C. <b>Enjoy</b> < > <tool", []),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # no close
     "", [(W, PARIS)]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # max_tokens
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', []),
    (HERMES, '<tool_call>\n{"name": "write", "arguments": {"text": "a </tool_call> b"}}\n'
     "</tool_call>\nDone.", "Done.", [("write", {"text": "a </tool_call> b"})]),
    (HERMES, '<tool_call>{"name": "write", "arguments": {"text": "}} </tool_call> \\"{"}}'
     "</tool_call>", "", [("write", {"text": '}} </tool_call> "{'})]),
    (HERMES, '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name: not a call
     '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    # llama3: Llama 3.1 / 3.2 JSON calls
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [(W, PARIS)]),
    (LLAMA3, '\n{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
     "", [(W, PARIS), (W, OSLO)]),
    (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     "", [(W, PARIS)]),
    (LLAMA3, '{"name": "echo", "parameters": {"s": "]}{"}}\n{"name": "echo", "parameters": {}}',
     "", [("echo", {"s": "]}{"}), ("echo", {})]),
    (LLAMA3, 'Let me check. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     "Let me check.", [(W, PARIS)]),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"',
     '{"name": "get_weather", "parameters": {"city": "Paris"', []),
    (LLAMA3, '{"temperature": 18, "unit": "C"}', '{"temperature": 18, "unit": "C"}', []),
    (LLAMA3, "<|python_tag|>print(weather('Paris'))", "<|python_tag|>print(weather('Paris'))", []),
    (LLAMA3, 'Use {"name": "x"} to call.', 'Use {"name": "x"} to call.', []),
    # mistral: Mistral 7B v0.3 / Nemo
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     "", [(W, PARIS)]),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]',
     "", [(W, PARIS), (W, OSLO)]),
    (MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [(W, PARIS)]),
    (MISTRAL, 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     "Sure.", [(W, PARIS)]),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }]',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }]', []),
    (MISTRAL, "[1, 2, 3] are the numbers.", "[1, 2, 3] are the numbers.", []),
    # gemma: ferrum's fenced convention
    (GEMMA, '```tool_call\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
     "", [(W, PARIS)]),
    (GEMMA, 'Checking both.\n```tool_call\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
     '\n```\n```tool_call\n{"name": "get_weather", "arguments": '
     '{"city": "Oslo", "unit": "celsius"}}\n```\n', "Checking both.", [(W, PARIS), (W, OSLO)]),
    (GEMMA, '```tool_call\n{"name": "run", "arguments": {"code": "```py\\nprint(1)\\n```"}}\n```',
     "", [("run", {"code": "```py\nprint(1)\n```"})]),
    (GEMMA, "```tool_call\nget_weather(city='Paris')\n```",
     "```tool_call\nget_weather(city='Paris')\n```", []),
    (GEMMA, "Here is code:\n```python\nprint(1)\n```\n`x` ``", "Here is code:\n```python\n"
     "print(1)\n```\n`x` ``", []),
]  # fmt: skip


def _calls(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    parser = fmt.stream_parser()
    whole_content = fmt.parse("".join(pieces))[0]
    content, calls = "", []
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += delta.content
        calls += delta.calls
        assert whole_content.startswith(content)  # nothing shown is ever taken back
    return content, calls


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), RECORDED)
def test_recorded_outputs_parse(fmt, text, content, calls):
    got_content, got_calls = fmt.parse(text)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert [c.index for c in got_calls] == list(range(len(calls)))


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), RECORDED)
def test_streaming_token_by_token_equals_whole(fmt, text, content, calls):
    got_content, got_calls = _stream(fmt, list(text))
    assert got_content == content and _calls(got_calls) == calls


@settings(max_examples=examples(300), deadline=None)
@given(data=st.data())
def test_streaming_in_random_chunks_equals_whole(data):
    fmt, text, content, calls = data.draw(st.sampled_from(RECORDED))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    got_content, got_calls = _stream(fmt, pieces)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert [c.index for c in got_calls] == list(range(len(calls)))


@settings(max_examples=examples(200), deadline=None)
@given(
    fmt=st.sampled_from(list(FORMATS.values())),
    text=st.text(alphabet=st.sampled_from(list('<>[]{}":,; \n`tool_call/|name')), max_size=60),
    cuts=st.sets(st.integers(0, 60), max_size=8),
)
def test_arbitrary_text_never_crashes_and_streams_like_whole(fmt, text, cuts):
    cuts = sorted(c for c in cuts if c <= len(text))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, calls = fmt.parse(text)
    got_content, got_calls = _stream(fmt, pieces)
    assert got_content == content and _calls(got_calls) == _calls(calls)


def test_a_call_is_emitted_as_soon_as_it_closes():
    parser = HERMES.stream_parser()
    assert parser.feed("Sure.\n<tool_").content == "Sure."
    assert parser.feed('call>\n{"name": "get_weather", "arguments": ').calls == []
    delta = parser.feed('{"city": "Paris"}}\n</tool_call>')
    assert _calls(delta.calls) == [(W, PARIS)]
    assert parser.feed("\n<tool_call>").calls == []
    assert parser.finish().content == "\n<tool_call>"  # an open marker and nothing more


def test_llama3_holds_a_leading_brace_until_it_knows():
    parser = LLAMA3.stream_parser()
    assert parser.feed(" {").content == ""
    assert parser.feed(' "na').content == ""
    assert parser.feed('me": "get_weather", "parameters": {}}').calls[0].name == W
    other = LLAMA3.stream_parser()
    assert other.feed("{").content == ""
    assert other.feed('"answer": 42}').content == '{"answer": 42}'


def test_arguments_given_as_a_json_string_are_kept():
    _, calls = HERMES.parse(
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n'
        "</tool_call>"
    )
    assert calls[0].arguments == '{"city": "Paris"}'


def test_ids_are_unique_and_shaped_for_the_family():
    _, calls = HERMES.parse('<tool_call>{"name": "a"}</tool_call>')
    _, many = MISTRAL.parse(json.dumps([{"name": "a", "arguments": {}}] * 3))
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in many)
    assert len({c.id for c in many}) == 3
    assert json.loads(calls[0].arguments) == {}


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_calls_written_in_a_format_parse_back(fmt):
    calls = [(W, json.dumps(PARIS)), ("lookup", json.dumps({"q": 'a "quoted" ``` </x>'}))]
    content, parsed = fmt.parse(fmt.render_calls(calls))
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
        (n, json.loads(a)) for n, a in calls
    ]


QWEN_LIKE = "{%- if tools %}<tools>{{ tool | tojson }}</tools> <tool_call> ... {%- endif %}"
LLAMA31_LIKE = (
    "<|start_header_id|>ipython<|end_header_id|> {%- if builtin_tools %}<|python_tag|>{% endif %}"
)
MISTRAL_LIKE = (
    "[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS] [TOOL_CALLS] [TOOL_RESULTS]"
)
GEMMA3_LIKE = "{{ bos_token }}<start_of_turn>user\n{{ message.content }}<end_of_turn>"


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        (QWEN_LIKE, HERMES),
        (LLAMA31_LIKE, LLAMA3),
        (MISTRAL_LIKE, MISTRAL),
        (GEMMA3_LIKE, GEMMA),
        ("<|system|>{{ m.content }}<|end|>", HERMES),  # unknown: the most common convention
    ],
)
def test_format_is_detected_from_the_template(template, fmt):
    assert detect_format(template) is fmt
