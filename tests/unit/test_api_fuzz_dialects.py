"""Hypothesis fuzzes the routes the OpenAPI schema leaves out (Ollama's, Anthropic's), the
Responses API and the OpenAI routes' text and number fields, in process over the fake runner,
with what schemathesis never sends (its strings are always valid Unicode): lone surrogates,
numbers at the ends of what JSON can carry (1e300, 2**64, -1e300), strings that look like
numbers ("NaN", "Infinity", "1e999") and map keys that look like token ids ("²", "--5").

Each case is a valid body with a few of its fields (or new ones) replaced by such values. No
response may be a 5xx, every 4xx must carry its route's error shape, and afterwards the
server must be whole. FERRUM_FUZZ_EXAMPLES sets the examples per route (default 40 under the
ci profile, a tenth under dev: tests/profiles.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.factories import FakeEmbedder, FakeRunner, fake_app
from tests.profiles import examples
from tests.schema_check import conforms

EXAMPLES = int(os.environ.get("FERRUM_FUZZ_EXAMPLES", examples(40)))
HI = [{"role": "user", "content": "hi"}]

Path = tuple[str | int, ...]

# Each route: a body it answers, and the fields worth breaking (paths into the body).
ROUTES: dict[str, tuple[dict[str, Any], list[Path]]] = {
    "/api/chat": (
        {"model": "fake", "messages": HI, "stream": False, "options": {"num_predict": 4}},
        [("model",), ("messages", 0, "content"), ("messages", 0, "role"), ("keep_alive",),
         ("options", "temperature"), ("options", "top_p"), ("options", "top_k"),
         ("options", "seed"), ("options", "num_predict"), ("options", "repeat_penalty"),
         ("options", "stop"), ("options", "min_p"), ("options", "num_ctx"), ("format",),
         ("think",), ("messages", 0, "thinking"), ("stream",)],
    ),
    "/api/generate": (
        {"model": "fake", "prompt": "hi", "stream": False, "options": {"num_predict": 4}},
        [("prompt",), ("system",), ("raw",), ("keep_alive",), ("options", "temperature"),
         ("options", "num_predict"), ("options", "seed"), ("options", "top_k"), ("format",)],
    ),
    "/api/embed": (
        {"model": "embed", "input": ["a", "b"]},
        [("input",), ("input", 0), ("truncate",), ("dimensions",), ("keep_alive",), ("model",)],
    ),
    "/api/embeddings": (
        {"model": "embed", "prompt": "a"}, [("prompt",), ("keep_alive",), ("model",)]
    ),
    "/api/show": ({"model": "fake"}, [("model",), ("name",)]),
    "/api/copy": ({"source": "fake", "destination": "x"}, [("source",), ("destination",)]),
    "/v1/messages": (
        {"model": "fake", "max_tokens": 4, "messages": HI},
        [("max_tokens",), ("messages", 0, "content"), ("messages", 0, "role"), ("system",),
         ("temperature",), ("top_p",), ("top_k",), ("stop_sequences",), ("metadata",),
         ("thinking", "budget_tokens"), ("thinking", "type"), ("stream",)],
    ),
    "/v1/messages/count_tokens": (
        {"model": "fake", "messages": HI}, [("messages", 0, "content"), ("system",)]
    ),
    "/v1/chat/completions": (
        {"model": "fake", "messages": HI, "max_tokens": 4},
        [("messages", 0, "content"), ("max_tokens",), ("temperature",), ("seed",),
         ("logit_bias",), ("stop",), ("keep_alive",), ("timeout",), ("n",), ("top_k",)],
    ),
    "/v1/completions": (
        {"model": "fake", "prompt": "hi", "max_tokens": 4},
        [("prompt",), ("max_tokens",), ("logit_bias",), ("logprobs",), ("keep_alive",)],
    ),
    "/v1/rerank": (
        {"model": "embed", "query": "q", "documents": ["a", "b"]},
        [("query",), ("documents", 0), ("top_n",), ("keep_alive",)],
    ),
    "/tokenize": ({"model": "fake", "content": "hi"}, [("content",), ("model",)]),
    "/v1/responses": (
        {"model": "fake", "input": "hi", "max_output_tokens": 4},
        [("input",), ("input", 0, "content"), ("instructions",), ("max_output_tokens",),
         ("temperature",), ("top_p",), ("keep_alive",), ("previous_response_id",),
         ("text", "format", "type"), ("stream",)],
    ),
}  # fmt: skip

_LONE = st.sampled_from(["\ud800", "\udfff", "\udc00x", "a\ud83d", "\ud83d\ude00"])
_TEXT = st.text(max_size=8)
NASTY: st.SearchStrategy[Any] = st.one_of(
    st.builds(lambda a, s, b: a + s + b, _TEXT, _LONE, _TEXT),
    st.sampled_from([1e300, -1e300, 1.7976931348623157e308, 5e-324, -0.0, 0, -1]),
    st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]),
    st.sampled_from(["NaN", "nan", "Infinity", "-Infinity", "1e999", "-1e300", "0x10", "1_000"]),
    st.integers(), st.floats(allow_nan=False, allow_infinity=False), _TEXT, st.booleans(),
    st.none(), st.lists(_TEXT, max_size=2), st.dictionaries(_TEXT, _TEXT, max_size=2),
    # Maps whose keys look like numbers to Python and not to int() (logit_bias's).
    st.dictionaries(st.sampled_from(["²", "--5", "٣", "9" * 5000, "7", " 8"]),
                    st.integers(-100, 100), min_size=1, max_size=2),
)  # fmt: skip


def _put(body: Any, path: Path, value: Any) -> Any:
    """`body` with `value` at `path`, making dicts where the path leads nowhere."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(key, int) and isinstance(body, list) and key < len(body):
        return [*body[:key], _put(body[key], rest, value), *body[key + 1 :]]
    inner = body if isinstance(body, dict) else {}
    return {**inner, str(key): _put(inner.get(str(key)), rest, value)}


def _in_its_shape(path: str, r) -> None:
    """A 4xx carries the error shape of its route's dialect; nothing is a 5xx."""
    assert r.status_code < 500, (path, r.status_code, r.text[:500])
    if r.status_code < 400:
        return
    body = r.json()
    if path.startswith("/api/"):
        assert set(body) == {"error"} and isinstance(body["error"], str), body
    elif path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        conforms("anthropic-messages", "ErrorResponse", body)
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body


@pytest.fixture(scope="module")
def client():
    with TestClient(fake_app(models={"fake": FakeRunner, "embed": FakeEmbedder})) as c:
        yield c


@pytest.mark.parametrize("path", list(ROUTES))
def test_the_dialects_survive_lone_surrogates_and_extreme_numbers(client, path):
    base, fields = ROUTES[path]

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(changes=st.lists(st.tuples(st.sampled_from(fields), NASTY), min_size=1, max_size=3))
    def run(changes: list[tuple[Path, Any]]) -> None:
        body: Any = base
        for field, value in changes:
            body = _put(body, field, value)
        raw = json.dumps(body)  # ASCII: a surrogate leaves as its "\ud800" escape
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        _in_its_shape(path, r)

    run()
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["active_requests"] == 0
