"""/v1/embeddings, /v1/rerank and Ollama's /api/embed over a fake embedder: shapes, limits,
normalisation, base64, batching across requests, and every bad input as a 4xx."""

from __future__ import annotations

import base64
import struct

import numpy as np
import ollama
import pytest
from fastapi.testclient import TestClient

from tests.factories import FakeEmbedder, FakeRunner, fake_app
from tests.schemas import validate_embeddings

EMBEDDER = FakeEmbedder()


@pytest.fixture
def client():
    models = {"embed": lambda: EMBEDDER, "chat": FakeRunner}
    with TestClient(fake_app(models=models)) as c:
        yield c


def _vectors(body) -> np.ndarray:
    return np.array([d["embedding"] for d in body["data"]])


def test_embeddings_shape_order_usage_and_unit_length(client):
    r = client.post("/v1/embeddings", json={"model": "embed", "input": ["abc", "xyz", "abd"]})
    assert r.status_code == 200
    body = r.json()
    validate_embeddings(body)  # OpenAI's published schema
    assert body["object"] == "list" and body["model"] == "embed"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    v = _vectors(body)
    assert v.shape == (3, 16) and np.allclose(np.linalg.norm(v, axis=1), 1.0)
    assert v[0] @ v[2] > v[0] @ v[1]  # "abc" is nearer "abd" than "xyz"
    # BOS + 3 bytes each, as the fake vocabulary tokenizes
    assert body["usage"] == {"prompt_tokens": 12, "total_tokens": 12}


def test_one_string_and_token_arrays_are_inputs_too(client):
    one = client.post("/v1/embeddings", json={"model": "embed", "input": "abc"}).json()
    tokens = client.post("/v1/embeddings", json={"model": "embed", "input": [256, 97, 98, 99]})
    many = client.post("/v1/embeddings", json={"model": "embed", "input": [[256, 97, 98, 99]]})
    assert _vectors(one).tolist() == _vectors(tokens.json()).tolist()
    assert _vectors(one).tolist() == _vectors(many.json()).tolist()


def test_base64_decodes_to_the_float_result(client):
    body = {"model": "embed", "input": ["hello"]}
    floats = _vectors(client.post("/v1/embeddings", json=body).json())[0]
    b64 = client.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(floats.tolist())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": [[]]}, "input[0]"),
        ({"input": [[1, 99999]]}, "input[0]"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": "y" * 40}, "input[0]"),
        ({"input": "ok", "dimensions": 8}, "dimensions"),
        ({"input": "ok", "encoding_format": "hex"}, "encoding_format"),
    ],
)
def test_bad_input_is_a_400_naming_it(client, body, param):
    r = client.post("/v1/embeddings", json={"model": "embed", **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, err
    assert client.post("/v1/chat/completions", json={"model": "chat", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).status_code == 200


def test_truncate_cuts_a_long_input_keeping_its_last_token(client):
    r = client.post("/v1/embeddings", json={"model": "embed", "input": "y" * 40, "truncate": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 32
    assert EMBEDDER.batches[-1][-1][-1] == ord("y")


def test_chat_models_do_not_embed_and_embedding_models_do_not_chat(client):
    r = client.post("/v1/embeddings", json={"model": "chat", "input": "x"})
    assert r.status_code == 400 and "does not serve embeddings" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"model": "embed",
                    "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
    assert client.post("/v1/rerank", json={"model": "chat", "query": "q",
                       "documents": ["d"]}).status_code == 400


def test_rerank_orders_by_cosine_and_says_so(client):
    docs = ["zzzz", "apple pie", {"text": "apple"}, "qqq"]
    r = client.post("/v1/rerank", json={"model": "embed", "query": "apple", "documents": docs,
                                        "top_n": 2, "return_documents": True})
    body = r.json()
    assert r.status_code == 200 and body["scoring"] == "cosine"
    assert [x["index"] for x in body["results"]] == [2, 1]
    assert body["results"][0]["document"] == {"text": "apple"}
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True) and scores[0] == pytest.approx(1.0)


def test_rerank_takes_up_to_2048_documents(client):
    body = {"model": "embed", "query": "q", "top_n": 1}
    r = client.post("/v1/rerank", json={**body, "documents": ["d"] * 2048})
    assert r.status_code == 200, r.text
    r = client.post("/v1/rerank", json={**body, "documents": ["d"] * 2049})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


def test_metrics_count_embedding_requests_inputs_and_tokens(client):
    client.post("/v1/embeddings", json={"model": "embed", "input": ["ab", "cd"]})
    text = client.get("/metrics").text
    assert 'ferrum_embedding_requests_total{model="embed"} 1.0' in text
    assert 'ferrum_embedding_inputs_total{model="embed"} 2.0' in text
    assert 'ferrum_embedding_tokens_total{model="embed"} 6.0' in text


def test_the_models_list_says_which_model_embeds(client):
    client.post("/v1/embeddings", json={"model": "embed", "input": "x"})
    card = client.get("/v1/models/embed").json()
    assert card["meta"]["embedding"] is True and card["meta"]["n_embd"] == 16


def test_ollama_embed_and_embeddings_with_the_official_client(client):
    from tests.schema_check import OllamaBridge  # the in-process transport for ollama

    oll = ollama.Client(host="http://testserver", transport=OllamaBridge(client))
    out = oll.embed(model="embed", input=["abc", "xyz"])
    assert len(out.embeddings) == 2 and out.prompt_eval_count == 8
    assert np.linalg.norm(out.embeddings[0]) == pytest.approx(1.0)
    legacy = oll.embeddings(model="embed", prompt="abc")
    assert legacy.embedding == pytest.approx(out.embeddings[0])
    # Ollama truncates by default; truncate=False refuses
    assert len(oll.embed(model="embed", input="y" * 40).embeddings) == 1
    with pytest.raises(ollama.ResponseError) as err:
        oll.embed(model="embed", input="y" * 40, truncate=False)
    assert err.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as err:
        oll.embed(model="chat", input="x")
    assert err.value.status_code == 400
