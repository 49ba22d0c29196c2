"""What one request may cost the threads every other request shares: text too long for the
model refused before it is tokenized, /detokenize bounded and off the event loop, embeddings
cancelled when their client leaves or their deadline passes."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.factories import FakeEmbedder, FakeRunner, FakeVocab, fake_app
from tests.unit.test_transport import serving

N_CTX = 1024  # the fake model's; a byte a token
BIG = "x" * (2 << 20)


@pytest.fixture
def tokenized(monkeypatch) -> list[int]:
    """The length of every text the fake tokenizer is given."""
    seen: list[int] = []
    original = FakeVocab.tokenize

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        seen.append(len(text))
        return original(self, text, add_special, parse_special)

    monkeypatch.setattr(FakeVocab, "tokenize", tokenize)
    return seen


def _refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)


# -- text too long for the model, refused untokenized ---------------------------------------


def test_a_completion_prompt_too_long_to_fit_is_refused_before_tokenizing(tokenized):
    with TestClient(fake_app()) as c:
        _refused(c.post("/v1/completions", json={"prompt": BIG, "max_tokens": 1}), "prompt")
        assert max(tokenized, default=0) < N_CTX
        # One byte over what the context's tokens could hold still gets its tokens counted.
        _refused(c.post("/v1/completions", json={"prompt": "x" * N_CTX}), "prompt")
        assert tokenized[-1] == N_CTX


def test_a_chat_too_long_to_fit_is_refused_before_tokenizing(tokenized):
    half = BIG[: len(BIG) // 2]
    messages = [{"role": "user", "content": half}, {"role": "user", "content": half}]
    with TestClient(fake_app()) as c:
        _refused(c.post("/v1/chat/completions", json={"messages": messages}), "messages")
        r = c.post("/api/chat", json={"model": "fake", "messages": messages, "stream": False})
        assert r.status_code == 400 and "bytes" in r.json()["error"]
    assert max(tokenized, default=0) < N_CTX


def test_tools_too_long_to_fit_are_refused_before_tokenizing(tokenized):
    """The prompt holds the tools (as the template writes them, or as instructions), so their
    bytes count too; with tool_choice none they are not in it and cost nothing."""
    tool = {"type": "function", "function": {"name": "f", "description": BIG}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "max_tokens": 1}
    with TestClient(fake_app()) as c:
        _refused(c.post("/v1/chat/completions", json=body), "tools")
        assert max(tokenized, default=0) < N_CTX
        r = c.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
        assert r.status_code == 200, r.text


def test_tokenize_refuses_text_no_context_of_the_model_holds(tokenized):
    with TestClient(fake_app()) as c:
        _refused(c.post("/tokenize", json={"content": BIG}), "content")
        assert c.post("/tokenize", json={"content": "hi"}).json()["tokens"] == [104, 105]
    assert max(tokenized) == 2


def test_embedding_inputs_too_long_are_refused_or_cut_before_tokenizing(tokenized):
    """The fake embedder takes 32 tokens: truncate refuses nothing, and tokenizes a cut."""
    models = {"fake": FakeRunner, "emb": FakeEmbedder}
    with TestClient(fake_app(models=models)) as c:
        body = {"model": "emb", "input": ["short", BIG]}
        _refused(c.post("/v1/embeddings", json=body), "input[1]")
        assert max(tokenized) < 64
        r = c.post("/v1/embeddings", json={**body, "truncate": True})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 6 + 32
        r = c.post("/api/embed", json={"model": "emb", "input": BIG})  # truncates by default
        assert r.status_code == 200 and r.json()["prompt_eval_count"] == 32
        r = c.post("/v1/rerank", json={"model": "emb", "query": BIG, "documents": ["a"]})
        _refused(r, "input[0]")  # a cosine rerank embeds the query as input 0
    assert max(tokenized) <= 2 * 32


# -- /detokenize ----------------------------------------------------------------------------


def test_detokenize_refuses_more_ids_than_the_context_holds():
    with TestClient(fake_app()) as c:
        _refused(c.post("/detokenize", json={"tokens": [1] * (2 << 20)}), "tokens")
        r = c.post("/detokenize", json={"tokens": [104] * N_CTX})
        assert r.json()["content"] == "h" * N_CTX


def test_detokenize_runs_off_the_event_loop(monkeypatch):
    """A slow join (0.5 ms an id here) must not hold up every other route meanwhile."""
    original = FakeVocab.token_bytes

    def slow(self, token: int) -> bytes:
        time.sleep(0.0005)
        return original(self, token)

    monkeypatch.setattr(FakeVocab, "token_bytes", slow)
    with serving(fake_app()) as (host, port):
        url = f"http://{host}:{port}"
        worker = threading.Thread(
            target=httpx.post, args=(f"{url}/detokenize",), kwargs={"json": {"tokens": [1] * N_CTX}}
        )
        worker.start()
        time.sleep(0.1)
        start = time.monotonic()
        assert httpx.get(f"{url}/health").status_code == 200
        waited = time.monotonic() - start
        worker.join()
    assert waited < 0.2


# -- embeddings that nobody waits for -------------------------------------------------------


class StuckEmbedder(FakeEmbedder):
    """An embedder whose decode never ends; records each embed call's end."""

    def __init__(self):
        super().__init__()
        self.ends: list[str] = []

    async def embed(self, inputs):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.ends.append("cancelled")
            raise
        return await super().embed(inputs)


def test_an_embedding_past_the_request_timeout_is_a_408_and_cancelled():
    stuck = StuckEmbedder()
    models = {"fake": FakeRunner, "emb": lambda: stuck}
    with TestClient(fake_app(models=models, request_timeout=0.3)) as c:
        r = c.post("/v1/embeddings", json={"model": "emb", "input": "hi"})
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
        r = c.post("/api/embed", json={"model": "emb", "input": "hi"})
        assert r.status_code == 408 and "longer than" in r.json()["error"]
        r = c.post("/v1/rerank", json={"model": "emb", "query": "q", "documents": ["d"]})
        assert r.status_code == 408
    assert stuck.ends == ["cancelled"] * 3


@pytest.mark.parametrize("path", ["/v1/embeddings", "/api/embed", "/api/embeddings"])
def test_an_embedding_whose_client_hung_up_is_cancelled(path):
    stuck = StuckEmbedder()
    app = fake_app(models={"fake": FakeRunner, "emb": lambda: stuck})
    body = {"model": "emb", "input": "hi", "prompt": "hi"}
    with TestClient(app) as http:  # on the app's own loop, its lifespan run
        http.portal.call(_hang_up, app, path, json.dumps(body).encode())
    assert stuck.ends == ["cancelled"]


async def _hang_up(app, path: str, body: bytes) -> None:
    """Drives the ASGI app by hand: the client leaves once its body is sent."""
    loop = asyncio.get_running_loop()
    gone_at: float | None = None

    async def receive():
        nonlocal gone_at
        if gone_at is None:
            gone_at = loop.time() + 0.3
            return {"type": "http.request", "body": body, "more_body": False}
        if loop.time() < gone_at:
            await asyncio.sleep(gone_at - loop.time())  # as a server: the next message waits
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "headers": [(b"content-type", b"application/json")], "server": ("testserver", 80),
        "client": ("test", 1), "root_path": "",
    }  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), 10)
