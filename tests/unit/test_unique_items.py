"""`uniqueItems` enforced while JSON is written (issue #41): the schema's rules
(api/prompting/schema_unique.py) and the watch over the output (engine/unique_items.py).

Oracles:
- the watch never refuses JSON whose watched arrays hold distinct items, however it is cut
  into tokens and spaced, and refuses one with a duplicate no later than the byte that
  completes the duplicate and no earlier than the duplicate begins;
- a random writer under the real llguidance matcher plus the watch (the fake's byte tokens)
  never gets stuck, and every output it finishes validates against the schema (jsonschema);
- a refusal names the keyword's place.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import jsonschema
import jsonschema_rs
import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from ferrum.api.prompting.schema_unique import unique_rules
from ferrum.engine.constraint import Unenforceable, rules_of, to_grammar, with_unique
from ferrum.engine.unique_items import Rule, TokenKinds, UniqueWatch
from tests.factories import EOS, N_VOCAB, FakeRunner, FakeVocab, fake_app

pytestmark = pytest.mark.unit

FREE = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
COLORS = ["red", "re", "green", 'é"\\', 3, 1.5, True, None]
FIXED = {"type": "array", "items": {"enum": COLORS}, "uniqueItems": True}
NESTED = {
    "type": "object",
    "properties": {
        "tags": FREE,
        "rows": {"type": "array", "items": {"type": "object", "properties": {"c": FIXED}}},
    },
    "additionalProperties": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True},
}
REFS = {
    "$defs": {"Color": {"enum": ["a", "b", "ab"]}, "Set": {"type": "array", "uniqueItems": True,
                                                          "items": {"$ref": "#/$defs/Color"}}},
    "anyOf": [{"$ref": "#/$defs/Set"}, {"type": "null"}],
}  # fmt: skip
# Numbers as llguidance spells them: 1e16 as 10000000000000000, 1e-7 as 0.0000001.
NUMBERS = {"type": "array", "items": {"enum": [1e16, 1e-7, 2.5, -3]}, "uniqueItems": True,
           "minItems": 1}  # fmt: skip
# A tuple's place by its index; a branch that writes any JSON (`{}`) beside a watched array.
TUPLE = {"type": "array", "prefixItems": [{"type": "array"}, FREE], "items": FIXED}
OPEN = {"anyOf": [{"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}, {}]}
OPEN_FREE = {"type": "array", "items": {"anyOf": [
    {"items": {"type": "string"}, "uniqueItems": True, "type": ["array", "null"]},
    {"description": "any JSON"}]}}  # fmt: skip
SCHEMAS = [FREE, FIXED, NESTED, REFS, NUMBERS, TUPLE, OPEN, OPEN_FREE]


def _grammar(schema: dict[str, Any]) -> str:
    plain, rules = unique_rules(copy.deepcopy(schema))
    return with_unique(to_grammar("json_schema", plain), rules)


def _watch(schema: dict[str, Any]) -> UniqueWatch:
    _, rules = unique_rules(copy.deepcopy(schema))
    return UniqueWatch([Rule.from_json(r) for r in rules])


def _first_refusal(watch: UniqueWatch, text: bytes, cuts: list[int]) -> int | None:
    """The byte offset of the first token the watch refuses (None: all admitted)."""
    start = 0
    for end in [*sorted(set(cuts)), len(text)]:
        if end <= start:
            continue
        piece = text[start:end]
        if not watch.admits(piece):
            return start
        watch.feed(piece)
        start = end
    return None


def _dumps(value: Any, spaced: bool, ascii_only: bool | None = None) -> bytes:
    ascii_only = not spaced if ascii_only is None else ascii_only
    return json.dumps(value, indent=1 if spaced else None, ensure_ascii=ascii_only).encode()


@given(st.lists(st.text(max_size=6), unique=True, max_size=6), st.booleans(), st.data())
def test_distinct_free_strings_are_never_refused(items, spaced, data):
    text = _dumps(items, spaced)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    assert _first_refusal(_watch(FREE), text, cuts) is None


@given(st.lists(st.text(max_size=6), min_size=1, unique=True, max_size=5), st.booleans(),
       st.data())  # fmt: skip
def test_a_repeated_free_string_is_refused_at_its_closing_quote_however_cut(items, spaced, data):
    repeat = data.draw(st.sampled_from(items))
    text = _dumps([*items, repeat], spaced)
    closing = len(text) - len(b"]") - (len(b"\n") if spaced else 0) - 1  # its last quote
    assert text[closing : closing + 1] == b'"', text
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    refused = _first_refusal(_watch(FREE), text, cuts)
    pieces = sorted({0, *cuts, len(text)})
    spans = zip(pieces, pieces[1:], strict=False)
    held = next(start for start, end in spans if start <= closing < end)
    assert refused == held, (text, cuts, refused, held)


@given(st.lists(st.sampled_from(COLORS), max_size=8), st.booleans(), st.data())
def test_a_duplicate_is_refused_where_it_is_written(items, spaced, data):
    # A fixed value is written as llguidance writes it: UTF-8, escapes only where JSON must.
    distinct = list({json.dumps(v): v for v in items}.values())
    assert _first_refusal(_watch(FIXED), _dumps(distinct, spaced, False), []) is None
    if len(distinct) == len(items):
        return
    text = _dumps(items, spaced, False)
    refused = _first_refusal(_watch(FIXED), text, list(range(len(text))))
    # Where the first repeat is written: between its first and last byte.
    seen, at = set(), 0
    for value in items:
        piece = json.dumps(value, ensure_ascii=False).encode()
        at = text.index(piece, at)
        if json.dumps(value) in seen:
            break
        seen.add(json.dumps(value))
        at += len(piece)
    assert refused is not None and at <= refused < at + len(piece), (text, refused, at)


def test_equal_values_written_differently_are_one_value():
    for first, second in (("a", "\\u0061"), ("1.5", "1.50"), ("3", "3.0")):
        schema = FREE if first == "a" else FIXED
        quote = '"' if first == "a" else ""
        text = f"[{quote}{first}{quote},{quote}{second}{quote}]".encode()
        assert _first_refusal(_watch(schema), text, list(range(len(text)))) is not None, text
    text = b"[true,1]"  # JSON Schema keeps booleans apart from numbers
    assert _first_refusal(_watch({**FIXED, "items": {"enum": [True, 1]}}), text, []) is None


def test_no_new_item_starts_once_every_value_is_used():
    schema = {**FIXED, "items": {"type": "boolean"}}
    watch = _watch(schema)
    watch.feed(b"[true, false")
    assert not watch.admits(b",") and watch.admits(b"]") and watch.admits(b" ]")


def _write(grammar: str, rng: random.Random, limit: int = 400) -> tuple[bytes, str]:
    """A random writer under the constraint: proposes a byte, takes it if allowed, else a
    random allowed one; 'stuck' if nothing is allowed before the end."""
    constraint = FakeVocab().constraints().constraint(grammar)
    out = bytearray()
    bias = list(b'"ab,]}3tf')
    for _ in range(limit):
        token = EOS if rng.random() < 0.05 else rng.choice(bias)
        if not constraint.allows(token):
            allowed = constraint.allowed(N_VOCAB)
            ids = [t for t in range(N_VOCAB) if allowed[t]]
            if not ids:
                return bytes(out), "stuck"
            token = rng.choice([t for t in ids if t in bias or t == EOS] or ids)
        if token == EOS:
            return bytes(out), "stop"
        constraint.accept(token)
        out.append(token)
    return bytes(out), "length"


@pytest.mark.parametrize(
    "schema",
    SCHEMAS,
    ids=["free", "fixed", "nested", "refs", "numbers", "tuple", "open", "open-free"],
)
def test_a_random_writer_never_gets_stuck_and_what_it_finishes_validates(schema):
    grammar, rng, ends = _grammar(schema), random.Random(7), set()
    for _ in range(150):
        text, end = _write(grammar, rng)
        assert end != "stuck", text
        if end == "stop":
            jsonschema.validate(json.loads(text), schema)
        ends.add(end)
    assert "stop" in ends


def test_without_the_watch_the_same_writer_repeats_items():
    """Teeth: the writer above does write duplicates when only the grammar holds it."""
    plain, _ = unique_rules(copy.deepcopy(FIXED))
    grammar, rng = to_grammar("json_schema", plain), random.Random(7)
    failed = 0
    for _ in range(150):
        text, end = _write(grammar, rng)
        if end == "stop" and not jsonschema.Draft202012Validator(FIXED).is_valid(json.loads(text)):
            failed += 1
    assert failed > 0


@pytest.mark.parametrize(
    "schema, where, says",
    [
        ({"type": "array", "uniqueItems": True}, "", "only over free strings"),
        ({"properties": {"a": {**FREE, "items": {"type": "string", "pattern": "^x"}}}},
         ".properties.a", "only over free strings"),
        ({"type": "array", "items": {"type": "object"}, "uniqueItems": True}, "", "free strings"),
        ({**FIXED, "items": {"enum": ["a", "b"]}, "minItems": 3}, "", "only 2 distinct"),
        ({"anyOf": [FREE, {"type": "array", "items": {"type": "integer"}}]}, ".anyOf[0]",
         "another array schema"),
        ({"$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}, "uniqueItems": True}},
          "$ref": "#/$defs/t"}, ".$ref", ""),
        ({"properties": {"a": {"$ref": "other.json#/x"}, "b": FREE}}, ".properties.a", "$ref"),
        # a recursion whose arrays are one $ref away from the definition that recurses
        ({"$defs": {"T": FREE, "N": {"properties": {"tags": {"$ref": "#/$defs/T"}, "kids": {
            "type": "array", "items": {"$ref": "#/$defs/N"}}}}}, "$ref": "#/$defs/N"},
         ".$ref.properties.kids.items", "recursive"),
        # the same place may hold a fixed array of repeats: a rule would hold it back
        ({"anyOf": [{"properties": {"v": {**FIXED, "items": {"enum": ["a", "b"]}}}},
                    {"properties": {"v": {"const": ["a", "a"]}}}]}, ".anyOf[0].properties.v",
         "another array schema"),
        ({**FIXED, "items": {"enum": ["a", "b"]}, "allOf": [{"minItems": 3}]}, "",
         "only 2 distinct"),
        ({"patternProperties": {"(x": FREE}}, "", "not a regex"),
        # values llguidance would write back as other values, or narrow by its own reading
        ({**FIXED, "items": {"enum": [1e23]}}, "", "only over free strings"),
        ({**FIXED, "items": {"enum": [2**53 + 1]}}, "", "only over free strings"),
        ({**FIXED, "items": {"enum": ["2020-01-01", "x"], "format": "date"}}, "", "free strings"),
        ({**FREE, "const": ["a", "a"]}, "", "no instance"),
        ({**FREE, "enum": [["a", "a"], ["b", "b"]]}, "", "no instance"),
    ],
)  # fmt: skip
def test_what_cannot_be_enforced_is_refused_by_place(schema, where, says):
    with pytest.raises(Unenforceable) as err:
        unique_rules(copy.deepcopy(schema))
    assert err.value.where == where and says in str(err.value)


def test_rules_name_each_place_and_the_keyword_leaves_the_schema():
    plain, rules = unique_rules(copy.deepcopy(NESTED))
    assert "uniqueItems" not in json.dumps(plain)
    assert rules == [
        {"path": [{"key": "tags"}], "values": None},
        {"path": [{"key": "rows"}, {"index": True}, {"key": "c"}], "values": COLORS},
        {"path": [{"other": ["rows", "tags"], "patterns": []}], "values": [True, False]},
    ]
    assert unique_rules({"type": "object"}) == ({"type": "object"}, [])


def _repeater(history: list[int]) -> int:
    """A fake model that writes the same string again and again: `["a","a","a"]`."""
    last, before = history[-1], history[-2] if len(history) > 1 else 0
    if last in b"[,":
        return ord('"')
    if last == ord('"') and before in b"[,":
        return ord("a")
    if last == ord("a"):
        return ord('"')
    if last == ord('"'):
        return ord("]") if history.count(ord('"')) >= 6 else ord(",")
    return EOS


def test_a_model_that_repeats_itself_gets_distinct_items_through_the_api():
    schema = {"type": "object", "properties": {"tags": FREE}, "required": ["tags"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"model": "fake", "messages": [{"role": "user", "content": "["}], "max_tokens": 60}
    with TestClient(fake_app(FakeRunner(next_token=_repeater))) as client:
        r = client.post("/v1/chat/completions", json=body | {"response_format": fmt})
        free = client.post("/v1/chat/completions", json=body | {"response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"tags": {**FREE, "uniqueItems": False}},
                "required": ["tags"]}}}})  # fmt: skip
    assert r.status_code == 200 and free.status_code == 200, r.text
    answer, plain = (json.loads(x.json()["choices"][0]["message"]["content"]) for x in (r, free))
    jsonschema.validate(answer, schema)
    assert len(answer["tags"]) >= 2 and plain["tags"].count("a") >= 2, (answer, plain)


def test_tool_parameters_with_unique_items_are_refused_naming_the_function():
    tool = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": FREE}}}}  # fmt: skip
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "tools": [tool], "tool_choice": "required"}  # fmt: skip
    with TestClient(fake_app()) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tools[0].function.parameters", error
        assert "uniqueItems" in error["message"]
        assert client.post("/v1/chat/completions", json=body | {"tool_choice": "auto"}).is_success


def test_keys_match_patterns_as_json_schema_does():
    """ECMA-262 regexes, as the validators read them: `$` does not match before a trailing
    newline (Python's `re` would), and `\\p{L}` is a letter class (Python's `re` refuses it)."""
    schema = {"patternProperties": {"^a$": {"type": "string"}, "^\\p{L}+$": FREE},
              "additionalProperties": FREE}  # fmt: skip
    for text in (b'{"a\\n": ["x", "x"]}', b'{"\xc3\xa9": ["x", "x"]}', b'{"1": ["x", "x"]}'):
        assert _first_refusal(_watch(schema), text, []) is not None, text
        once = json.loads(text.replace(b'"x", "x"', b'"x"'))
        assert jsonschema_rs.validator_for(schema).is_valid(once), once


def test_only_a_grammar_made_with_rules_carries_them():
    assert rules_of(to_grammar("choice", ["x_ferrum_unique"])) == ()
    assert rules_of('{"grammars": [], "x_ferrum_unique": "no"}') == ()
    assert len(rules_of(_grammar(FREE))) == 1
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30,
            "guided_choice": ["x_ferrum_unique"]}  # fmt: skip
    with TestClient(fake_app()) as client:
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "x_ferrum_unique"


def test_a_token_that_climbs_back_into_a_watched_array_is_tried():
    """Deep inside a watched array (an object item, which `{}` beside it allows), a token that
    closes the object and writes a repeat is refused from a mask too."""
    watch = _watch({"anyOf": [FIXED, {}]})
    watch.feed(b'[true, {"k": [1')
    table = [b"]", b"]},true]", b"]}]", b"2"]
    allowed = np.ones(len(table), dtype=bool)
    watch.refuse_in(allowed, table.__getitem__, TokenKinds.of(table))
    assert allowed.tolist() == [True, False, True, True]


def test_enum_arrays_beside_the_keyword_lose_their_repeats_and_need_no_watch():
    plain, rules = unique_rules(copy.deepcopy({**FREE, "enum": [["a", "a"], ["b"], "s"]}))
    assert rules == [] and plain["enum"] == [["b"], "s"] and "uniqueItems" not in plain


def test_a_tuple_item_is_watched_at_its_own_index_only():
    watch = _watch(TUPLE)
    assert _first_refusal(watch, b'[["x", "x"], ["y"], "a", 3]', []) is None
    assert _first_refusal(_watch(TUPLE), b'[[], ["y", "y"]]', []) is not None
    assert _first_refusal(_watch(TUPLE), b'[[], [], ["re", "re"]]', []) is not None


def test_a_key_spelled_with_an_escape_is_an_additional_property_as_llguidance_reads_it():
    schema = {"properties": {"b": {"type": "array", "items": {"enum": ["x"]}}},
              "additionalProperties": {**FIXED, "items": {"enum": ["x", "y"]}}}  # fmt: skip
    assert _first_refusal(_watch(schema), b'{"\\u0062": ["x", "y"]}', []) is None
    assert _first_refusal(_watch(schema), b'{"\\u0062": ["x", "x"]}', []) is not None
    assert _first_refusal(_watch(schema), b'{"b": ["x", "x"]}', []) is None  # not watched


def test_a_fixed_value_starts_with_an_escape_only_where_llguidance_writes_one():
    assert not _watch({**FIXED, "items": {"enum": ["a", '"']}}).admits(b'["\\u00')  # a as a
    watch = _watch({**FIXED, "items": {"enum": ["a", "\n", '"']}})
    assert watch.admits(b'["\\n"') and watch.admits(b'["\\u000') and watch.admits(b'["\\"')
