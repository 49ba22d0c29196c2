"""End to end over HTTP with the `openai` SDK against `ferrum serve` on the built-in Gemma 3
270M served alone (so any model name answers with it)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests import schemas
from tests.schemas import checked

SYSTEM = "You are a helpful assistant. Answer briefly."


@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:
    """A client whose transport validates every answer it reads against the published
    schemas (tests/schemas), whole, streamed and errors."""
    seen = checked.Checked()
    yield checked.client(f"{server}/v1", seen)
    assert seen.answers > 0


def _chat_messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _stream_chat(client, **kw) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_chat_stream_equals_non_stream(client):
    kw = {
        "model": "gpt-4o",
        "messages": _chat_messages("Name three colours."),
        "max_tokens": 40,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**kw)
    assert whole.model == "gemma3-270m"
    text, chunks = _stream_chat(client, stream_options={"include_usage": True}, **kw)
    assert text == whole.choices[0].message.content and text.strip()
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish[0].choices[0].finish_reason == whole.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_completion_stream_equals_non_stream(client):
    kw = {
        "model": "x",
        "prompt": "The three primary colours are",
        "max_tokens": 24,
        "temperature": 0,
    }
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.usage.completion_tokens <= 24 and whole.object == "text_completion"


def test_max_tokens_and_ignore_eos(client):
    r = client.completions.create(
        model="x",
        prompt="Once upon a time",
        max_tokens=32,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 32 and r.choices[0].finish_reason == "length"


def test_stop_sequence_is_honoured_and_not_emitted(client):
    base = client.completions.create(
        model="x", prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0
    )
    text = base.choices[0].text
    stop = text.strip()[2:5] if len(text.strip()) > 5 else text[:2]
    r = client.completions.create(
        model="x", prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    streamed = list(
        client.completions.create(
            model="x",
            prompt="Count: 1, 2, 3,",
            max_tokens=20,
            temperature=0,
            stop=[stop],
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_sampling_with_seed_is_reproducible(client):
    kw = {
        "model": "x",
        "prompt": "My favourite food is",
        "max_tokens": 16,
        "temperature": 0.9,
        "seed": 1234,
    }
    assert (
        client.completions.create(**kw).choices[0].text
        == client.completions.create(**kw).choices[0].text
    )


def test_eight_concurrent_streams_all_finish(server, client):
    # Batched and lone decodes may differ in the last float bits (llama.cpp picks matmul kernels
    # by batch size), so greedy text is compared only where exact: see the tiny-model tests.
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    def kw(p):
        return {
            "model": "x",
            "messages": [{"role": "user", "content": p}],
            "max_tokens": 24,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }

    aclient = checked.async_client(f"{server}/v1")

    async def one(p):
        text = ""
        finish = None
        async for c in await aclient.chat.completions.create(stream=True, **kw(p)):
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
        return text, finish

    async def all_at_once():
        return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(all_at_once())
    assert [f for _, f in results] == ["length"] * 8
    assert all(t.strip() for t, _ in results)
    metrics = httpx.get(f"{server}/metrics").text
    batched = [
        line
        for line in metrics.splitlines()
        if line.startswith("ferrum_step_sequences_bucket") and 'le="4.0"' in line
    ]
    total = [
        line for line in metrics.splitlines() if line.startswith("ferrum_step_sequences_count")
    ]
    # some steps decoded more than 4 sequences at once: the requests were batched
    assert float(batched[0].split()[-1]) < float(total[0].split()[-1])


def test_errors_are_openai_shaped(client, server):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="x", prompt="word " * 5000, max_tokens=4)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="x", messages=[{"role": "bot", "content": "x"}])
    r = httpx.post(
        f"{server}/v1/chat/completions",
        content=b"not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    schemas.validate_error(r.json())
    assert httpx.get(f"{server}/v1/unknown").status_code == 404


def test_models_health_metrics_tokenize(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["gemma3-270m"]
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["queue_depth"] == 0
    toks = httpx.post(f"{server}/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert httpx.post(f"{server}/detokenize", json={"tokens": toks}).json()["content"] == (
        "Hello world"
    )
    assert "ferrum_requests_total" in httpx.get(f"{server}/metrics").text


def test_missing_model_exits_nonzero_with_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "ferrum.cli", "serve", "--model", str(tmp_path / "missing.gguf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].startswith("ferrum: error: model file not found")
