"""Rewrites of keywords llguidance does not implement (`schema_rewrites.py`). Oracle: the
reference validator (jsonschema) accepts exactly the same values under the rewritten schema
as under the original, for values drawn at random; and what cannot be rewritten stays."""

from __future__ import annotations

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrum.api.prompting.schema_rewrites import keyword_path, rewritten

_SCALARS = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-3, 3) | st.text(max_size=3)
VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("ab"), inner),
    max_leaves=6,
)
_TYPES = ["null", "boolean", "object", "array", "string", "number", "integer"]
REWRITABLE = [
    {"not": {"type": "null"}},
    {"not": {"type": ["string", "number"], "title": "no"}},
    {"type": "integer", "not": {"type": "number"}},  # nothing validates, before and after
    {"type": ["integer", "string"], "not": {"type": "string"}},
    {"not": {"type": "array"}, "allOf": [{"type": ["array", "object"]}]},
    {"type": "array", "uniqueItems": False},
    {"type": "array", "uniqueItems": True, "maxItems": 1},
    {"type": "object", "properties": {"a": {"not": {"type": "object"}}}, "required": ["a"]},
    {
        "anyOf": [
            {"not": {"type": "boolean"}},
            {"type": "array", "maxItems": 0, "uniqueItems": True},
        ]
    },  # fmt: skip
]


@pytest.mark.parametrize("schema", REWRITABLE)
@settings(max_examples=150, deadline=None)
@given(value=VALUES)
def test_a_rewrite_accepts_exactly_what_the_original_accepts(schema, value):
    after = rewritten(schema)
    assert "not" not in str(after) and "uniqueItems" not in str(after)
    valid = jsonschema.Draft202012Validator(schema).is_valid(value)
    assert jsonschema.Draft202012Validator(after).is_valid(value) == valid


@pytest.mark.parametrize(
    "schema",
    [
        {"not": {"type": "integer"}},  # a number that is not whole: no grammar for it
        {"not": {"type": "string", "minLength": 2}},  # more than a type
        {"not": {"enum": ["a"]}},
        {"type": "array", "uniqueItems": True},
        {"type": "array", "uniqueItems": True, "maxItems": 2},
        {"not": {"type": _TYPES}},
    ],
)
def test_what_cannot_be_kept_whole_is_left_for_the_refusal(schema):
    assert rewritten(schema) == schema


def test_the_original_is_not_changed():
    schema = {"properties": {"a": {"not": {"type": "null"}}}}
    rewritten(schema)
    assert schema == {"properties": {"a": {"not": {"type": "null"}}}}


def test_the_place_of_an_unimplemented_keyword():
    schema = {"properties": {"a": {"items": {"type": "array", "uniqueItems": True}}}}
    message = 'Unimplemented keys: ["uniqueItems"]'
    assert keyword_path(schema, message) == ".properties.a.items"
    assert keyword_path({"uniqueItems": True}, message) == ""
    assert keyword_path(schema, "Unknown format: x") is None


def _grammar_accepts(schema: dict, text: str) -> bool:
    """Whether llguidance, given the rewritten schema's grammar, lets `text` through whole
    (byte by byte, then the end of generation)."""
    from ferrum.engine.constraint import to_grammar
    from tests.factories import EOS, FakeVocab

    grammar = to_grammar("json_schema", rewritten(schema))
    try:
        constraint = FakeVocab().constraints().constraint(grammar)
    except ValueError as exc:  # an unsatisfiable schema is refused: it admits nothing
        assert "Unsatisfiable" in str(exc)
        return False
    for token in text.encode():
        if not constraint.allows(token):
            return False
        constraint.accept(token)
    return constraint.allows(EOS)


@pytest.mark.parametrize("schema", REWRITABLE)
@pytest.mark.parametrize(
    "text", ["null", "true", "1", "1.5", '"s"', "[]", "[1]", '{"a": 1}', '{"a": null}', "{}"]
)
def test_the_grammar_of_a_rewrite_admits_what_the_validator_admits(schema, text):
    import json

    valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
    assert _grammar_accepts(schema, text) == valid
