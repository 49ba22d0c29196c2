"""Input that once made a 500 (issue #37), sent as an attacker would, in every dialect: each
must be a 4xx in its route's own error shape, naming the parameter."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from ferrum.api.app import MAX_BODY_BYTES
from tests.factories import FakeEmbedder, FakeRunner, fake_app, model_info

LONE = "\ud800"  # a high surrogate with no low one after it
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client():
    models = {"fake": FakeRunner, "embed": FakeEmbedder}
    with TestClient(fake_app(models=models)) as c:
        yield c


def openai_error(r, param: str | None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err["message"]


def ollama_error(r) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    return body["error"]


def anthropic_error(r) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


# -- logit_bias -----------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["²", "--5", "٣", "9" * 5000, "5.0", "-1"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_logit_bias_key_that_is_not_a_plain_token_id_is_a_400(client, path, key):
    body = {"model": "fake", "max_tokens": 2, "logit_bias": {key: 1}}
    body |= {"messages": HI} if "chat" in path else {"prompt": "hi"}
    message = openai_error(client.post(path, json=body), "logit_bias")
    assert "logit_bias" in message


def test_a_plain_token_id_still_biases(client):
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2, "logit_bias": {" 97 ": 1}}
    assert client.post("/v1/completions", json=body).status_code == 200


# -- lone surrogates ------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": f"a{LONE}b"}]
JSON = {"content-type": "application/json"}
SURROGATE_CASES = [  # path, body, the parameter named, the error shape
    ("/v1/chat/completions", {"messages": MESSAGES}, "messages[0].content", "openai"),
    ("/v1/completions", {"prompt": LONE}, "prompt", "openai"),
    ("/v1/completions", {"prompt": "x", "stop": [LONE]}, "stop[0]", "openai"),
    ("/v1/responses", {"input": LONE}, "input", "openai"),
    ("/v1/responses", {"input": [{"role": "user", "content": LONE}]}, "input[0].content",
     "openai"),
    ("/tokenize", {"content": LONE}, "content", "openai"),
    ("/v1/embeddings", {"model": "embed", "input": ["ok", LONE]}, "input[1]", "openai"),
    ("/v1/rerank", {"model": "embed", "query": LONE, "documents": ["a"]}, "query", "openai"),
    ("/v1/rerank", {"model": "embed", "query": "q", "documents": [{"text": LONE}]},
     "documents[0].text", "openai"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {LONE: 1}}, "logit_bias", "openai"),
    ("/v1/messages", {"max_tokens": 5, "messages": MESSAGES}, "messages[0].content",
     "anthropic"),
    ("/api/chat", {"messages": MESSAGES}, "messages[0].content", "ollama"),
    ("/api/generate", {"prompt": LONE}, "prompt", "ollama"),
    ("/api/generate", {"prompt": "x", "system": LONE}, "system", "ollama"),
    ("/api/embed", {"model": "embed", "input": LONE}, "input", "ollama"),
    ("/api/embeddings", {"model": "embed", "prompt": LONE}, "prompt", "ollama"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "shape"), SURROGATE_CASES)
def test_a_lone_surrogate_is_a_400_naming_its_parameter(client, path, body, param, shape):
    raw = json.dumps({"model": "fake", "stream": False, **body})  # ASCII: "\ud800" escaped
    assert "\\ud800" in raw
    r = client.post(path, content=raw, headers=JSON)
    message = {"openai": lambda: openai_error(r, param), "ollama": lambda: ollama_error(r),
               "anthropic": lambda: anthropic_error(r)}[shape]()  # fmt: skip
    assert message.startswith(param) and "lone surrogate (U+D800)" in message


def test_a_surrogate_pair_and_an_escaped_backslash_are_fine(client):
    emoji = json.dumps({"model": "fake", "prompt": "\U0001f600", "max_tokens": 2})
    assert "\\ud83d\\ude00" in emoji  # a pair: one character, valid
    literal = json.dumps({"model": "fake", "prompt": "\\ud800", "max_tokens": 2})  # text
    for raw in (emoji, literal):
        r = client.post("/v1/completions", content=raw, headers=JSON)
        assert r.status_code == 200, r.text


# -- the prompt's length names the parameter that holds it ----------------------------------


def test_a_prompt_too_long_names_prompt_on_completions_and_messages_on_chat():
    with TestClient(fake_app(FakeRunner(info=model_info(n_ctx=64)))) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 100})
        openai_error(r, "prompt")
        assert r.json()["error"]["code"] == "context_length_exceeded"
        long_chat = {"messages": [{"role": "user", "content": "x" * 100}]}
        openai_error(c.post("/v1/chat/completions", json=long_chat), "messages")


# -- keep_alive -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1e300, "1e300", 10**400, "9999999h", 366 * 86400 + 1])
def test_an_absurd_keep_alive_is_a_400_naming_it_and_ps_stays_whole(client, value):
    raw = json.dumps({"model": "fake", "messages": HI, "max_tokens": 2, "keep_alive": value})
    r = client.post("/v1/chat/completions", content=raw, headers=JSON)
    assert "keep_alive" in openai_error(r, "keep_alive")
    raw = json.dumps({"model": "fake", "messages": HI, "stream": False, "keep_alive": value})
    assert "keep_alive" in ollama_error(client.post("/api/chat", content=raw, headers=JSON))
    assert client.get("/api/ps").status_code == 200


def test_keep_alive_still_takes_forever_and_a_year(client):
    for value in (-1, -1e300, "-5m", 366 * 86400, "8784h"):
        body = {"model": "fake", "messages": HI, "max_tokens": 2, "keep_alive": value}
        assert client.post("/v1/chat/completions", json=body).status_code == 200, value
    assert client.get("/api/ps").status_code == 200


# -- the gate's errors take the route's shape too -------------------------------------------


def test_an_oversized_body_on_an_ollama_route_gets_ollama_s_shape(client):
    r = client.post("/api/chat", content=b" " * (MAX_BODY_BYTES + 1), headers=JSON)
    assert "bytes" in ollama_error(r)
