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
from pydantic import ValidationError

from ferrum.api.openai.bodies import ChatCompletionRequest, invalid_request
from ferrum.api.prompting.grammar import GrammarBuilder
from ferrum.api.prompting.tool_calls import FORMATS, ToolFormat
from ferrum.api.prompting.tool_request import ToolRequest
from ferrum.engine.llama.vocab import LlamaVocab
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


def _tool_request(tools: Any, choice: Any = None, parallel: Any = None) -> ToolRequest:
    """`tools`, `tool_choice` and `parallel_tool_calls` as the API reads them: through the
    request model (shape errors are a 400 naming the parameter), then related."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    for key, value in (
        ("tools", tools),
        ("tool_choice", choice),
        ("parallel_tool_calls", parallel),
    ):
        if value is not None:
            body[key] = value
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(exc.errors()) from exc
    return ToolRequest.from_body(req.tools, req.tool_choice, req.parallel_tool_calls)


class _TinyGrammars:
    """The grammar builder over a vocabulary-only tiny model, and a token-by-token walk."""

    def __init__(self, vocab: LlamaVocab):
        self.vocab = vocab
        self.builder = GrammarBuilder(vocab)

    def force(self, fmt: ToolFormat, *body: Any) -> str | None:
        """The grammar of a request with these tools, tool_choice and parallel_tool_calls."""
        return self.builder.for_tools(_tool_request(*body), fmt)

    def accepts(self, grammar: str, text: str) -> bool:
        constraint = self.vocab.constraint(grammar)
        for token in self.vocab.tokenize(text, False, False):
            if not constraint.allows(token):
                return False
            constraint.accept(token)
        return constraint.allows(EOS_ID)  # complete: end of generation is allowed


@pytest.fixture(scope="module")
def grammars(tmp_path_factory) -> Iterator[_TinyGrammars]:
    path = write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")
    ll.llama_log_set(_QUIET, ctypes.c_void_p(0))
    ll.llama_backend_init()
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(str(path).encode(), params)
    assert model
    vocab = LlamaVocab(model)
    yield _TinyGrammars(vocab)
    vocab.close()
    ll.llama_model_free(model)


def _call(fmt: ToolFormat, *calls: tuple[str, dict]) -> str:
    return fmt.render_calls([(name, json.dumps(args)) for name, args in calls])


PARIS = ("get_weather", {"city": "Paris"})
OSLO = ("get_weather", {"city": "Oslo", "unit": "celsius"})
ORDER_CALL = ("place_order", {"items": [{"sku": "A1", "qty": 2}]})


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_required_admits_any_tool_and_parallel_calls(grammars, fmt):
    grammar = grammars.force(fmt, TOOLS, "required")
    assert grammar is not None
    assert grammars.accepts(grammar, _call(fmt, PARIS))
    assert grammars.accepts(grammar, _call(fmt, ("get_time", {})))
    assert grammars.accepts(grammar, _call(fmt, ORDER_CALL))
    assert grammars.accepts(grammar, _call(fmt, PARIS, OSLO, ORDER_CALL))
    # ... and what it admits parses back to the same calls.
    _, parsed = fmt.parse(_call(fmt, PARIS, ORDER_CALL))
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [PARIS, ORDER_CALL]


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_required_refuses_anything_but_valid_calls(grammars, fmt):
    grammar = grammars.force(fmt, TOOLS, "required")
    assert not grammars.accepts(grammar, "The weather is fine.")
    assert not grammars.accepts(grammar, "Sure. " + _call(fmt, PARIS))
    assert not grammars.accepts(grammar, _call(fmt, ("get_wether", {"city": "Paris"})))
    assert not grammars.accepts(grammar, _call(fmt, ("get_weather", {"town": "Paris"})))
    assert not grammars.accepts(grammar, _call(fmt, ("get_weather", {"city": 7})))
    assert not grammars.accepts(grammar, _call(fmt, ("get_weather", {"city": "P", "unit": "K"})))
    assert not grammars.accepts(grammar, _call(fmt, ("place_order", {"items": [{"sku": "A1"}]})))
    assert not grammars.accepts(grammar, "")  # at least one call


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_a_named_function_is_called_exactly_once(grammars, fmt):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    grammar = grammars.force(fmt, TOOLS, choice)
    assert grammars.accepts(grammar, _call(fmt, OSLO))
    assert not grammars.accepts(grammar, _call(fmt, ("get_time", {})))
    assert not grammars.accepts(grammar, _call(fmt, PARIS, OSLO))


def test_parallel_false_allows_one_call(grammars):
    grammar = grammars.force(FORMATS["hermes"], TOOLS, "required", False)
    assert grammars.accepts(grammar, _call(FORMATS["hermes"], PARIS))
    assert not grammars.accepts(grammar, _call(FORMATS["hermes"], PARIS, OSLO))


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_free_choices_have_no_grammar(grammars, choice):
    assert grammars.force(FORMATS["hermes"], TOOLS, choice) is None


def test_same_def_names_in_two_functions_stay_apart(grammars):
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
    grammar = grammars.force(fmt, tools, "required")
    assert grammars.accepts(grammar, _call(fmt, ("a", {"x": "s"}), ("b", {"x": 1})))
    assert not grammars.accepts(grammar, _call(fmt, ("a", {"x": 1})))
    assert not grammars.accepts(grammar, _call(fmt, ("b", {"x": "s"})))


def test_a_schema_the_grammar_cannot_enforce_is_refused_only_when_forced(grammars):
    tool = {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "array", "uniqueItems": True}},
            },
        },
    }
    assert grammars.force(FORMATS["hermes"], [WEATHER, tool], "auto") is None
    with pytest.raises(InvalidRequest) as err:
        grammars.force(FORMATS["hermes"], [WEATHER, tool], "required")
    assert err.value.param == "tools[1].function.parameters"


def test_defaults_follow_openai():
    assert _tool_request(None).mode == "none"
    assert _tool_request([]).mode == "none"
    request = _tool_request(TOOLS)
    assert (request.mode, request.parallel, request.active) == ("auto", True, True)
    assert _tool_request(None, "auto").mode == "none"
    none = _tool_request(TOOLS, "none")
    assert not none.active and none.template_tools() is None


def test_template_tools_are_openai_tool_dicts():
    tools = _tool_request(TOOLS).template_tools()
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
        ([{"type": "retrieval"}], None, None, "tools[0].type"),
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
        _tool_request(tools, choice, parallel)
    assert err.value.param == param
    assert err.value.status == 400
