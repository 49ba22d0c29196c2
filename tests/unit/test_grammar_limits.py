"""What a structured-output request may make the server compile (issue #37): a 70-byte schema
once became an 18 MB grammar that stayed in memory and stalled every other request. Each
dialect refuses it before conversion, with a 400 naming the keyword; the converter and the
caches are bounded behind that."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from ferrum.api.openai.bodies import ResponseFormat
from ferrum.api.prompting.grammar import GrammarBuilder
from ferrum.api.prompting.schema_limits import MAX_ALTERNATIVES, MAX_DEPTH, MAX_REPEAT
from ferrum.engine.constraint import MAX_SOURCE_BYTES, Constraints
from ferrum.engine.lru import SizedLRU
from ferrum.errors import InvalidRequest
from tests.factories import FakeVocab, _ByteTokenizer, fake_app

# The finding: 200 bytes of request, 18 MB of grammar.
ATTACK = {"type": "array", "items": {"type": "integer"}, "minItems": 1_000_000}
HI = [{"role": "user", "content": "hi"}]


def _openai(schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return "/v1/chat/completions", {"model": "fake", "messages": HI, "response_format": fmt}


def _ollama(schema):
    return "/api/chat", {"model": "fake", "messages": HI, "format": schema, "stream": False}


def _anthropic(schema):
    output = {"format": {"type": "json_schema", "schema": schema}}
    body = {"model": "fake", "messages": HI, "max_tokens": 4, "output_config": output}
    return "/v1/messages", body


def _responses(schema):
    fmt = {"type": "json_schema", "name": "x", "schema": schema}
    return "/v1/responses", {"model": "fake", "input": "hi", "text": {"format": fmt}}


def _forced_tool(schema):
    parameters = {"type": "object", "properties": {"xs": schema}, "required": ["xs"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    body = {"model": "fake", "messages": HI, "tools": [tool], "tool_choice": "required"}
    return "/v1/chat/completions", body


def _message(r) -> str:
    """The error's message in any dialect's shape."""
    error = r.json()["error"]
    return error if isinstance(error, str) else error["message"]


def _refused(shape, schema) -> str:
    path, body = shape(schema)
    with TestClient(fake_app()) as client:
        r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    return _message(r)


@pytest.mark.parametrize("shape", [_openai, _ollama, _anthropic, _responses, _forced_tool])
def test_the_million_items_schema_is_a_400_naming_minitems_in_every_dialect(shape):
    says = _refused(shape, ATTACK)
    assert "minItems" in says and str(MAX_REPEAT) in says, says


def test_the_openai_refusal_names_the_parameter():
    path, body = _openai(ATTACK)
    with TestClient(fake_app()) as client:
        error = client.post(path, json=body).json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert error["message"].startswith("response_format.json_schema.schema.minItems is 1000000")


@pytest.mark.parametrize(
    "schema, names",
    [
        ({"type": "string", "maxLength": 10**6}, ".maxLength"),
        ({"type": "string", "minLength": 5000}, ".minLength"),
        ({"type": "array", "maxItems": 1001}, ".maxItems"),
        ({"type": "string", "pattern": "^a{0,100000}$"}, ".pattern"),
        ({"type": "string", "pattern": "^a{5000}$"}, ".pattern"),
        ({"type": "string", "pattern": "^a{2," + "9" * 5000 + "}$"}, ".pattern"),
        # Each count under the bound, their sum far over it.
        ({"type": "string", "pattern": "^" + "a{999}" * 100 + "$"}, "add up to more than"),
    ],
)
def test_a_repetition_over_the_bound_is_refused_naming_where(schema, names):
    says = _refused(_openai, {"type": "object", "properties": {"p": schema}})
    assert f"schema.properties.p{names}" in says or names in says, says


def test_a_deep_nesting_is_refused():
    schema: dict = {"type": "integer"}
    for _ in range(MAX_DEPTH + 1):
        schema = {"type": "array", "items": schema}
    says = _refused(_ollama, schema)
    assert "nests" in says and str(MAX_DEPTH) in says, says


def test_too_many_subschemas_and_too_many_optional_properties_are_refused():
    many = {f"p{i}": {"type": "string"} for i in range(2001)}
    says = _refused(_openai, {"type": "object", "properties": many, "required": list(many)})
    assert "subschemas" in says
    optional = {f"p{i}": {"type": "string"} for i in range(200)}
    says = _refused(_openai, {"type": "object", "properties": optional})
    assert "optional properties" in says


@pytest.mark.parametrize("key", ["enum", "anyOf", "oneOf"])
def test_too_many_choices_are_refused(key):
    choices = [f"v{i}" if key == "enum" else {"const": i} for i in range(MAX_ALTERNATIVES + 1)]
    says = _refused(_anthropic, {key: choices})
    assert f".{key} has {MAX_ALTERNATIVES + 1} choices" in says, says


def test_a_huge_schema_is_refused_by_its_size():
    says = _refused(_openai, {"enum": ["x" * 1000] * 200})
    assert "bytes of JSON" in says


def test_real_schemas_within_the_bounds_still_build():
    props = {
        f"field_{i}": [
            {"type": "string", "maxLength": 256},
            {"type": "integer"},
            {"type": "array", "items": {"type": "string"}, "maxItems": 20},
        ][i % 3]
        for i in range(60)
    }
    schema = {"type": "object", "properties": props, "required": list(props)[:30]}
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    started = time.perf_counter()
    grammar = GrammarBuilder(FakeVocab()).for_response_format(fmt)
    assert grammar
    assert time.perf_counter() - started < 2  # a guard against a runaway, not a measurement


# -- behind the checks: llguidance's own bounds ----------------------------------------------


def test_a_grammar_source_over_the_byte_bound_is_refused_naming_the_field():
    with TestClient(fake_app()) as client:
        body = {"model": "fake", "prompt": "x", "guided_regex": "a" * (MAX_SOURCE_BYTES + 1)}
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_regex"
    assert f"at most {MAX_SOURCE_BYTES}" in r.json()["error"]["message"]


def test_a_grammar_nested_too_deep_is_refused_not_a_crash():
    deep = "start: " + '("a" ' * 18_000 + ")?" * 18_000  # under the byte bound
    with TestClient(fake_app()) as client:
        body = {"model": "fake", "prompt": "x", "guided_grammar": deep}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        assert client.post("/v1/completions", json={"model": "fake", "prompt": "x"}).is_success


# -- the caches, bounded by bytes -----------------------------------------------------------


def test_the_lru_evicts_by_bytes_and_by_count():
    gone: list[str] = []
    lru: SizedLRU[str, str] = SizedLRU(max_entries=10, max_bytes=100, on_evict=gone.append)
    for i in range(8):
        lru.put(f"k{i}", f"v{i}", 30)
        assert lru.total_bytes <= 100
    assert len(lru) == 3 and gone == [f"v{i}" for i in range(5)]
    assert lru.get("k5") == "v5"  # now the most recent: k6 goes next
    lru.put("k8", "v8", 30)
    assert "k6" not in lru and "k5" in lru
    assert not lru.put("big", "vbig", 101) and gone[-1] == "vbig" and "big" not in lru
    many: SizedLRU[int, int] = SizedLRU(max_entries=2, max_bytes=10**9)
    for i in range(5):
        many.put(i, i, 1)
    assert len(many) == 2


def test_the_builder_keeps_grammars_by_bytes():
    bound = 16 * 1024
    builder = GrammarBuilder(FakeVocab(), kept_bytes=bound)
    total = 0
    for n in range(50):
        schema = {"type": "array", "items": {"type": "integer"}, "description": "d" * 4000 + str(n)}
        fmt = ResponseFormat.model_validate(
            {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        )
        grammar = builder.for_response_format(fmt)
        assert grammar is not None
        total += len(grammar)
        assert builder.kept_bytes <= bound
    assert total > 10 * bound and builder.kept_bytes > bound // 2


def test_a_refused_schema_is_an_invalid_request_at_the_builder():
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": ATTACK}}
    )
    with pytest.raises(InvalidRequest) as err:
        GrammarBuilder(FakeVocab()).for_response_format(fmt)
    assert err.value.param == "response_format.json_schema.schema"


def test_compiled_grammars_are_kept_by_bytes():
    import llguidance

    from ferrum.engine.constraint import to_grammar

    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()), slices=[])
    bound = 4 * 1024 * 1024
    constraints = Constraints(tokenizer, [257], kept_bytes=bound)
    for n in range(40):  # ~200 B of grammar each, 256 B a character estimated: 2 MB in all
        constraints.check(to_grammar("regex", f"[a-z]{{{n}}}" + "x" * 150))
        assert constraints.kept_bytes <= bound
    assert constraints.kept_bytes > bound // 2
