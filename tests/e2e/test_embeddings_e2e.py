"""Embeddings end to end: a real BERT embedding model (all-MiniLM-L6-v2, converted to GGUF in
the test set-up) served beside a chat model, called with the `openai` SDK (which asks for
base64), checked against an independent numpy forward pass of the same weights."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from tests.e2e.conftest import running_server
from tests.embedding_model import reference_embeddings, write_minilm_gguf
from tests.schemas import checked, validate_embeddings

TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome, and the popcorn was great too!",
    "A monkey is playing drums.",
    "Zwei Männer schieben einen Wagen über die Straße.",
    "Prices rose 3.5% in 2024; analysts expected 2.9%.",
    "東京は日本の首都です。",
    " ".join(["a long sentence about lighthouses and storms"] * 12),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    gguf = write_minilm_gguf(tmp_path_factory.mktemp("minilm") / "minilm.gguf")
    models = (f"minilm={gguf}", "smollm2-135m-instruct")
    with running_server(tmp_path_factory, "ferrum-embed", models=models) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:
    """The SDK over a transport that checks every answer against OpenAI's published schema."""
    seen = checked.Checked()
    yield checked.client(f"{server}/v1", seen)
    assert seen.answers > 0, "no answer went through the schema checks"


def test_embeddings_match_an_independent_reference(client):
    reply = client.embeddings.create(model="minilm", input=TEXTS)  # base64 on the wire
    got = np.array([d.embedding for d in reply.data])
    want = reference_embeddings(TEXTS)
    cosines = np.sum(got * want, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() >= 0.999, cosines
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert reply.usage.prompt_tokens > len(TEXTS)


def test_an_inputs_embedding_does_not_depend_on_its_batch(server, client):
    alone = np.array(client.embeddings.create(model="minilm", input=TEXTS[2]).data[0].embedding)

    async def crowd():
        async with httpx.AsyncClient(base_url=server, timeout=60) as http:
            bodies = [{"model": "minilm", "input": TEXTS[i:] or TEXTS} for i in range(8)]
            return await asyncio.gather(*(http.post("/v1/embeddings", json=b) for b in bodies))

    replies = asyncio.run(crowd())
    for r in replies:
        validate_embeddings(r.json())
    crowded = np.array(replies[0].json()["data"][2]["embedding"])
    assert float(alone @ crowded) >= 0.9999
    assert all(r.status_code == 200 for r in replies)


def test_rerank_orders_documents_and_says_it_used_cosine(server):
    docs = ["A monkey is playing drums.", "Someone is eating bread.", "Stocks fell today."]
    r = httpx.post(f"{server}/v1/rerank", json={"model": "minilm",
                   "query": "A man is eating food.", "documents": docs}).json()
    assert r["scoring"] == "cosine" and [x["index"] for x in r["results"]][0] == 1


def test_bad_inputs_are_400s_and_chat_keeps_serving(server, client):
    too_many = httpx.post(f"{server}/v1/embeddings", json={"model": "minilm",
                          "input": ["x"] * 10_000})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "input"
    long_text = "word " * 600
    too_long = httpx.post(f"{server}/v1/embeddings", json={"model": "minilm", "input": long_text})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input[0]"
    cut = httpx.post(f"{server}/v1/embeddings", json={"model": "minilm", "input": long_text,
                     "truncate": True})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 512
    chat_embed = httpx.post(f"{server}/v1/embeddings", json={"model": "smollm2-135m-instruct",
                            "input": "x"})
    assert chat_embed.status_code == 400
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert reply.usage.completion_tokens == 4
