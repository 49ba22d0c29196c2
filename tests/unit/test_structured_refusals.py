"""Structured output's accounting and its last refusal (issue #41): constrained requests
counted by kind and refused ones by reason in /metrics; a recursive schema with no base case
(no finite JSON satisfies it, so no answer could ever end) is a 400 naming the $ref on the
cycle, before any decode, while recursive schemas that can stop are served."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from tests.factories import EOS, FakeRunner, fake_app

HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _chat(client: TestClient, **extra: Any) -> Any:
    body = {"model": "fake", "messages": HI, "max_tokens": 200} | extra
    return client.post("/v1/chat/completions", json=body)


def _schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _series(text: str, name: str, label: str) -> dict[str, float]:
    found = re.findall(rf'^{name}_total{{.*{label}="([^"]+)".*}} (\S+)$', text, re.M)
    return {value: float(count) for value, count in found}


def test_constrained_requests_are_counted_by_kind_and_refusals_by_reason():
    recursive = {"type": "array", "minItems": 1, "items": {"$ref": "#"}}
    asked = [
        ({"guided_choice": ["a", "b"]}, 200),
        ({"guided_regex": "[0-9]{2}"}, 200),
        ({"guided_regex": "[0-9]{3}"}, 200),
        ({"response_format": _schema({"type": "integer"})}, 200),
        ({"response_format": {"type": "json_object"}}, 200),
        ({"guided_grammar": 'start: "x"'}, 200),
        ({"tools": [WEATHER], "tool_choice": "required"}, 200),
        ({}, 200),  # free text: not counted
        ({"guided_json": {"type": "array", "uniqueItems": True}}, 400),
        ({"guided_regex": "a(("}, 400),
        ({"guided_json": {"description": "x" * 200_000}}, 400),
        ({"guided_json": {"type": "array", "maxItems": 10**6}}, 400),
        ({"guided_json": recursive}, 400),
        ({"guided_json": "{no"}, 400),
        ({"guided_regex": "a", "guided_choice": ["b"]}, 400),
    ]
    with TestClient(fake_app()) as client:
        for extra, status in asked:
            assert _chat(client, **extra).status_code == status, extra
        text = client.get("/metrics").text
    assert _series(text, "ferrum_structured_requests", "kind") == {
        "choice": 1,
        "regex": 2,
        "json_schema": 2,
        "grammar": 1,
        "tool_call": 1,
    }
    assert _series(text, "ferrum_structured_refusals", "reason") == {
        "unsupported_keyword": 1,
        "compile_error": 1,
        "too_large": 1,
        "schema_limits": 1,
        "unbounded_recursion": 1,
        "invalid_json": 1,
        "conflict": 1,
    }


NO_BASE_CASE = [
    (
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        ".properties.a ($ref '#')",
    ),
    ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, ".items ($ref '#')"),
    (  # through $defs, each step required, the only alternatives recursing too
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"$ref": "#/$defs/pair"}]}
                    },
                    "required": ["next"],
                },
                "pair": {"type": "array", "prefixItems": [{"$ref": "#/$defs/node"}], "minItems": 1},
            },
            "$ref": "#/$defs/node",
        },
        "$ref '#/$defs/",
    ),
]


@pytest.mark.parametrize("schema, names", NO_BASE_CASE)
@pytest.mark.parametrize("field", ["response_format", "guided_json"])
def test_a_recursive_schema_without_a_base_case_is_a_400_naming_its_ref(schema, names, field):
    runner = FakeRunner()
    extra = {field: _schema(schema) if field == "response_format" else schema}
    with TestClient(fake_app(runner)) as client:
        r = _chat(client, **extra)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "no base case" in error["message"] and names in error["message"], error
        assert error["param"].startswith(field), error
        assert not runner.batch_sizes  # refused before any decode
        assert _chat(client).is_success  # the server keeps serving


def test_a_forced_tool_whose_parameters_recurse_without_end_is_refused_by_name():
    tool = json.loads(json.dumps(WEATHER))
    tool["function"]["parameters"]["properties"]["city"] = {"$ref": "#"}
    with TestClient(fake_app()) as client:
        r = _chat(client, tools=[tool], tool_choice="required")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools[0].function.parameters", r.text
    assert "tools[0].function.parameters.properties.city ($ref '#')" in r.text


CAN_END = [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # `a` optional
    {"type": "array", "items": {"$ref": "#"}},  # the empty array
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no type: any scalar
    {
        "$defs": {
            "tree": {
                "type": "object",
                "properties": {
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}},
                    "next": {"anyOf": [{"$ref": "#/$defs/tree"}, {"type": "null"}]},
                },
                "required": ["kids", "next"],
            }
        },
        "$ref": "#/$defs/tree",
    },
]


@pytest.mark.parametrize("schema", CAN_END)
def test_recursive_schemas_that_can_end_are_served_and_their_answers_validate(schema):
    with TestClient(fake_app(FakeRunner(next_token=lambda h: EOS))) as client:
        r = _chat(client, response_format=_schema(schema))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
