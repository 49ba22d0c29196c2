"""Tool request validation, and the grammars that force calls: each grammar is parsed by
llama.cpp and walked token by token over a tiny model's vocabulary, so "accepts" below means
llama.cpp's own grammar engine would let the model write exactly that text and then stop."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from typing import Any

import llama_cpp as ll
import pytest

from ferrum.api.tool_calls import FORMATS, ToolFormat
from ferrum.api.tool_request import ToolRequest
from ferrum.engine.sampler import init_grammar, json_schema_grammar
from ferrum.errors import InvalidRequest
from tests.tiny_models import EOS_ID, write_tiny_llama

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters at all
ORDER = {  # a pydantic-style schema: $defs and local $refs
    "type": "function",
    "function": {
        "name": "place_order",
        "parameters": {
            "$defs": {
                "Item": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                    "required": ["sku", "qty"],
                }
            },
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
            "required": ["items"],
        },
    },
}
TOOLS = [WEATHER, TIME, ORDER]

_QUIET = ll.llama_log_callback(lambda level, text, data: None)


class _TinyGrammarRunner:
    """The two runner methods grammars need, over a vocabulary-only tiny model."""

    def __init__(self, vocab: Any):
        self.vocab = vocab

    @staticmethod
    def json_schema_grammar(schema: dict[str, Any]) -> str:
        return json_schema_grammar(schema)

    def check_grammar(self, grammar: str) -> None:
        ll.llama_sampler_free(init_grammar(self.vocab, grammar))

    def accepts(self, grammar: str, text: str) -> bool:
        sampler = init_grammar(self.vocab, grammar)
        try:
            for token in self._tokenize(text):
                if not self._allows(sampler, token):
                    return False
                ll.llama_sampler_accept(sampler, token)
            return self._allows(sampler, EOS_ID)  # complete: end of generation is allowed
        finally:
            ll.llama_sampler_free(sampler)

    def _tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (ll.llama_token * (len(data) + 8))()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, False)
        return list(buf[:n])

    @staticmethod
    def _allows(sampler: Any, token: int) -> bool:
        one = ll.llama_token_data(token, 0.0, 0.0)
        arr = ll.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
        ll.llama_sampler_apply(sampler, ctypes.byref(arr))
        return one.logit != float("-inf")


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> Iterator[_TinyGrammarRunner]:
    path = write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")
    ll.llama_log_set(_QUIET, ctypes.c_void_p(0))
    ll.llama_backend_init()
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(str(path).encode(), params)
    assert model
    yield _TinyGrammarRunner(ll.llama_model_get_vocab(model))
    ll.llama_model_free(model)


def _call(fmt: ToolFormat, *calls: tuple[str, dict]) -> str:
    return fmt.render_calls([(name, json.dumps(args)) for name, args in calls])


PARIS = ("get_weather", {"city": "Paris"})
OSLO = ("get_weather", {"city": "Oslo", "unit": "celsius"})
ORDER_CALL = ("place_order", {"items": [{"sku": "A1", "qty": 2}]})


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_required_admits_any_tool_and_parallel_calls(runner, fmt):
    grammar = ToolRequest.from_body(TOOLS, "required").grammar(fmt, runner)
    assert grammar is not None
    assert runner.accepts(grammar, _call(fmt, PARIS))
    assert runner.accepts(grammar, _call(fmt, ("get_time", {})))
    assert runner.accepts(grammar, _call(fmt, ORDER_CALL))
    assert runner.accepts(grammar, _call(fmt, PARIS, OSLO, ORDER_CALL))
    # ... and what it admits parses back to the same calls.
    _, parsed = fmt.parse(_call(fmt, PARIS, ORDER_CALL))
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [PARIS, ORDER_CALL]


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_required_refuses_anything_but_valid_calls(runner, fmt):
    grammar = ToolRequest.from_body(TOOLS, "required").grammar(fmt, runner)
    assert not runner.accepts(grammar, "The weather is fine.")
    assert not runner.accepts(grammar, "Sure. " + _call(fmt, PARIS))
    assert not runner.accepts(grammar, _call(fmt, ("get_wether", {"city": "Paris"})))
    assert not runner.accepts(grammar, _call(fmt, ("get_weather", {"town": "Paris"})))
    assert not runner.accepts(grammar, _call(fmt, ("get_weather", {"city": 7})))
    assert not runner.accepts(grammar, _call(fmt, ("get_weather", {"city": "P", "unit": "K"})))
    assert not runner.accepts(grammar, _call(fmt, ("place_order", {"items": [{"sku": "A1"}]})))
    assert not runner.accepts(grammar, "")  # at least one call


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_a_named_function_is_called_exactly_once(runner, fmt):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    grammar = ToolRequest.from_body(TOOLS, choice).grammar(fmt, runner)
    assert runner.accepts(grammar, _call(fmt, OSLO))
    assert not runner.accepts(grammar, _call(fmt, ("get_time", {})))
    assert not runner.accepts(grammar, _call(fmt, PARIS, OSLO))


def test_parallel_false_allows_one_call(runner):
    grammar = ToolRequest.from_body(TOOLS, "required", False).grammar(FORMATS["hermes"], runner)
    assert runner.accepts(grammar, _call(FORMATS["hermes"], PARIS))
    assert not runner.accepts(grammar, _call(FORMATS["hermes"], PARIS, OSLO))


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_free_choices_have_no_grammar(runner, choice):
    assert ToolRequest.from_body(TOOLS, choice).grammar(FORMATS["hermes"], runner) is None


def test_same_def_names_in_two_functions_stay_apart(runner):
    def with_def(name: str, item_type: str) -> dict:
        parameters = {
            "$defs": {"Item": {"type": item_type}},
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/Item"}},
            "required": ["x"],
        }
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    tools = [with_def("a", "string"), with_def("b", "integer")]
    fmt = FORMATS["hermes"]
    grammar = ToolRequest.from_body(tools, "required").grammar(fmt, runner)
    assert runner.accepts(grammar, _call(fmt, ("a", {"x": "s"}), ("b", {"x": 1})))
    assert not runner.accepts(grammar, _call(fmt, ("a", {"x": 1})))
    assert not runner.accepts(grammar, _call(fmt, ("b", {"x": "s"})))


def test_a_schema_the_grammar_cannot_enforce_is_refused_only_when_forced(runner):
    tool = {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 1}},
            },
        },
    }
    assert ToolRequest.from_body([WEATHER, tool], "auto").grammar(FORMATS["hermes"], runner) is None
    with pytest.raises(InvalidRequest) as err:
        ToolRequest.from_body([WEATHER, tool], "required").grammar(FORMATS["hermes"], runner)
    assert err.value.param == "tools[1].function.parameters"


def test_defaults_follow_openai():
    assert ToolRequest.from_body(None).mode == "none"
    assert ToolRequest.from_body([]).mode == "none"
    request = ToolRequest.from_body(TOOLS)
    assert (request.mode, request.parallel, request.active) == ("auto", True, True)
    assert ToolRequest.from_body(None, "auto").mode == "none"
    none = ToolRequest.from_body(TOOLS, "none")
    assert not none.active and none.template_tools() is None


def test_template_tools_are_openai_tool_dicts():
    tools = ToolRequest.from_body(TOOLS).template_tools()
    assert tools is not None
    assert tools[0] == WEATHER
    assert tools[1] == {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    }


def _fn(**spec: Any) -> dict:
    return {"type": "function", "function": spec}


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "param"),
    [
        ("get_weather", None, None, "tools"),
        ([{"type": "retrieval"}], None, None, "tools[0]"),
        ([{"type": "function"}], None, None, "tools[0].function"),
        ([_fn(description="no name")], None, None, "tools[0].function.name"),
        ([_fn(name="has space")], None, None, "tools[0].function.name"),
        ([_fn(name="x" * 65)], None, None, "tools[0].function.name"),
        ([WEATHER, _fn(name="f", parameters=[])], None, None, "tools[1].function.parameters"),
        (
            [_fn(name="f", parameters={"type": "string"})],
            None,
            None,
            "tools[0].function.parameters",
        ),
        ([_fn(name="f", description=3)], None, None, "tools[0].function.description"),
        ([WEATHER, TIME, WEATHER], None, None, "tools[2].function.name"),
        (None, "required", None, "tool_choice"),
        (TOOLS, "always", None, "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice"),
        (TOOLS, {"type": "function", "name": "get_time"}, None, "tool_choice"),
        (TOOLS, "auto", "yes", "parallel_tool_calls"),
    ],
)
def test_malformed_tool_requests_name_the_parameter(tools, choice, parallel, param):
    with pytest.raises(InvalidRequest) as err:
        ToolRequest.from_body(tools, choice, parallel)
    assert err.value.param == param
    assert err.value.status == 400
