"""Structured output with llguidance (issue #41), as clients send it: generated schemas of every
common shape (ferrum/bench/schema_corpus.py, the corpus the structured study sends too) each
compile (unknown keywords and annotations ignored) or are refused naming the keyword; what the
fake model writes under them validates; regex, choice and grammars from vLLM's and
llama-server's fields; bad input is a 400 in the dialect's shape.

The fake runner enforces grammars with a real llguidance matcher over its byte tokens, and its
"model" always proposes end-of-generation: every other token is the matcher's refusal resolved
(the shortest way out first), so each output is a complete, minimal instance."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from ferrum.bench.schema_corpus import generate
from tests.factories import EOS, FakeRunner, fake_app

HI = [{"role": "user", "content": "hi"}]
# Keywords llguidance cannot enforce: a schema with one is refused, naming it; except `not`
# of a type other than "integer", which ferrum rewrites exactly (schema_rewrites.py), and
# `uniqueItems` over free strings, which the engine enforces as the JSON is written
# (schema_unique.py).
UNENFORCEABLE = ("uniqueItems", "not", "contains", "if", "dependentSchemas")
# Schemas past what the engine enforces, beside the corpus (which it honours whole).
BEYOND = [
    {"type": "array", "items": {"type": "object"}, "uniqueItems": True},
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "uniqueItems": True},
    {"not": {"type": "integer"}},
    {"type": "array", "contains": {"type": "string"}},
]
REWRITTEN_NOT = ("null", "string", "boolean", "object", "array", "number")


def _keywords(node: Any) -> set[str]:
    if isinstance(node, dict):
        own = set(node)
        if node.get("not") in [{"type": t} for t in REWRITTEN_NOT]:
            own.discard("not")
        if node.get("items") == {"type": "string"}:
            own.discard("uniqueItems")
        return own | {k for v in node.values() for k in _keywords(v)}
    if isinstance(node, list):
        return {k for v in node for k in _keywords(v)}
    return set()


def _chat(client: TestClient, **extra: Any) -> Any:
    body = {"model": "fake", "messages": HI, "max_tokens": 300} | extra
    return client.post("/v1/chat/completions", json=body)


def test_a_corpus_of_schemas_compiles_or_names_its_keyword_and_outputs_validate():
    accepted = refused = 0
    with TestClient(fake_app(FakeRunner(next_token=lambda h: EOS))) as client:
        for schema in [*generate(150), *BEYOND]:
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            r = _chat(client, response_format=fmt)
            unenforceable = _keywords(schema) & set(UNENFORCEABLE)
            if r.status_code == 400:
                message = r.json()["error"]["message"]
                assert unenforceable, f"refused a schema it could honour: {message} {schema}"
                assert any(k in message for k in unenforceable), message
                refused += 1
                continue
            assert r.status_code == 200, r.text
            assert not unenforceable, f"accepted {unenforceable} without enforcing: {schema}"
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            accepted += 1
    assert (accepted, refused) == (150, len(BEYOND))  # every generated schema is honoured


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        ({"guided_regex": r"[0-9]{3}-[a-z]+"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]+", t)),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"regex": "id-[0-9]+"}}, lambda t: re.fullmatch("id-[0-9]+", t)),
        (
            {
                "structured_outputs": {
                    "json": {
                        "type": "object",
                        "required": ["a"],
                        "properties": {"a": {"type": "integer"}},
                    }
                }
            },
            lambda t: isinstance(json.loads(t)["a"], int),
        ),
        (
            {"guided_json": '{"type": "array", "items": {"type": "integer"}, "minItems": 2}'},
            lambda t: len(json.loads(t)) >= 2,
        ),
        ({"json_schema": {"type": "boolean"}}, lambda t: json.loads(t) in (True, False)),
        ({"grammar": 'root ::= "say " [a-c]+'}, lambda t: re.fullmatch("say [a-c]+", t)),
        ({"guided_grammar": 'start: "x" NUM\nNUM: /[0-9]+/'}, lambda t: re.fullmatch("x[0-9]+", t)),
    ],
)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_vllm_and_llama_server_fields_constrain_the_output(extra, check, route):
    with TestClient(fake_app()) as client:  # the default fake model: letters, refused
        if route == "chat":
            r = _chat(client, **extra)
            text = r.json()["choices"][0]["message"]["content"] if r.is_success else r.text
        else:
            body = {"model": "fake", "prompt": "x", "max_tokens": 300} | extra
            r = client.post("/v1/completions", json=body)
            text = r.json()["choices"][0]["text"] if r.is_success else r.text
    assert r.status_code == 200, text
    assert check(text), text


@pytest.mark.parametrize(
    "extra, param, says",
    [
        ({"guided_regex": "a(("}, "guided_regex", "unclosed group"),
        ({"guided_grammar": "start: foo("}, "guided_grammar", "Expected"),
        ({"grammar": 'root ::= "a" [0-9'}, "grammar", "GBNF"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
        (
            {"guided_json": {"type": "object", "description": "x" * 1_000_000}},
            "guided_json",
            "bytes of JSON",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(extra, param, says):
    with TestClient(fake_app()) as client:
        r = _chat(client, **extra)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and says in error["message"], error
        assert _chat(client).is_success  # the server keeps serving


def test_a_megabyte_schema_is_a_400_in_each_dialects_shape():
    huge = {"type": "object", "description": "x" * 1_000_000}
    with TestClient(fake_app()) as client:
        r = client.post("/api/chat", json={"model": "fake", "messages": HI, "format": huge})
        assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
        output = {"format": {"type": "json_schema", "schema": huge}}
        body = {"model": "fake", "max_tokens": 8, "messages": HI, "output_config": output}
        r = client.post("/v1/messages", json=body)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text


def test_constrained_choices_each_follow_the_grammar_with_logprobs():
    with TestClient(fake_app()) as client:
        r = _chat(client, n=3, guided_regex="[ab]{4}", logprobs=True, top_logprobs=2)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert re.fullmatch("[ab]{4}", choice["message"]["content"]), choice


def test_mask_computations_are_counted_and_timed():
    with TestClient(fake_app()) as client:
        assert _chat(client, guided_regex="[0-9]{5}").is_success
        text = client.get("/metrics").text
    counted = re.search(r"^ferrum_structured_masks_total\S* (\S+)$", text, re.M)
    assert counted and float(counted.group(1)) >= 5, text  # letters proposed: all refused
    assert re.search(r"^ferrum_structured_mask_seconds_count\S* [1-9]", text, re.M)
