"""Every dialect answers every refusal in its own shape, from `ferrum serve` (the real app over
fake models, each status made to happen) and from a cluster's ingress (its error functions,
without a cluster), and both answer a path alike: one seam (`ferrum.api.dialects`) decides."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request

import ferrum.api.app as app_module
from ferrum.api.app import check_gate
from ferrum.api.auth import Keys
from ferrum.cluster import ingress
from ferrum.errors import (
    AuthenticationError,
    FerrumError,
    InvalidRequest,
    NotFound,
    RequestTooLarge,
    ServiceUnavailable,
    TooManyRequests,
)
from tests.factories import FakeRunner, fake_app
from tests.schema_check import conforms

HI = [{"role": "user", "content": "hi"}]
# A valid body per dialect's generation path, and the same body made invalid.
BODIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "openai": ("/v1/chat/completions", {"messages": HI, "max_tokens": 2}, {"messages": 5}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 2}, {"input": 5}),
    "ollama": ("/api/chat", {"messages": HI, "stream": False}, {"messages": 5}),
    "anthropic": ("/v1/messages", {"messages": HI, "max_tokens": 2}, {"messages": 5}),
}
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",  # the published schema has no request_too_large
    429: "rate_limit_error",
    503: "overloaded_error",
}
STATUSES = (400, 401, 404, 413, 429, 503)


def _broken() -> FakeRunner:
    raise RuntimeError("no such file")


@contextmanager
def _refusing(status: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, dict]]:
    """A served app made to refuse a request with `status` (413: the body-size refusal, a 400
    on OpenAI's and Ollama's paths), and what to change in the request for it."""
    app_kw: dict[str, Any] = {}
    change: dict[str, Any] = {}
    if status == 401:
        app_kw["keys"] = Keys(("sk-right",))
        change["headers"] = {"Authorization": "Bearer sk-wrong"}
    elif status == 404:
        app_kw["models"] = {"fake": FakeRunner, "other": FakeRunner}  # one model answers any name
        change["model"] = "no-such-model"
    elif status == 413:
        monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 40)
    elif status == 429:
        app_kw["max_queue"] = -4  # no room beside the 4 running slots: the queue is full
    elif status == 503:
        app_kw["models"] = {"fake": FakeRunner, "broken": _broken}
        change["model"] = "broken"  # it cannot load: 503
    with TestClient(fake_app(**app_kw)) as client:
        yield client, change


def _check_shape(dialect: str, status: int, r: Any) -> None:
    """The response is `dialect`'s error for `status`, the size refusal as each dialect
    answers it (400 `request_too_large`, Anthropic's 413)."""
    body = r.json()
    if dialect == "anthropic":
        assert r.status_code == status, body
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == ANTHROPIC_TYPES[status]
        conforms("anthropic-messages", "ErrorResponse", body)
    else:
        assert r.status_code == (400 if status == 413 else status), body
        if dialect == "ollama":
            assert set(body) == {"error"} and isinstance(body["error"], str), body
        else:
            assert set(body) == {"error"}, body
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
            if status == 413:
                assert body["error"]["code"] == "request_too_large"
    if status == 429:
        assert r.headers["retry-after"] == "1"
    if status == 413:
        assert r.headers["connection"] == "close"


@pytest.mark.parametrize("status", STATUSES)
@pytest.mark.parametrize("dialect", list(BODIES))
def test_serve_refuses_in_each_dialects_own_shape(dialect, status, monkeypatch):
    path, good, bad = BODIES[dialect]
    body = {"model": "fake", **(bad if status == 400 else good)}
    with _refusing(status, monkeypatch) as (client, change):
        if "model" in change:
            body["model"] = change["model"]
        r = client.post(path, json=body, headers=change.get("headers"))
    _check_shape(dialect, status, r)


ERRORS: dict[int, FerrumError] = {
    400: InvalidRequest("bad", param="messages"),
    401: AuthenticationError("invalid or missing API key"),
    404: NotFound("no such model"),
    413: RequestTooLarge("the body is over 16 MiB"),
    429: TooManyRequests("the queue is full"),
    503: ServiceUnavailable("no replica could answer; retry shortly"),
}


class _Answered:
    """A JSONResponse read as a client reads one."""

    def __init__(self, response: Any):
        self.status_code = response.status_code
        self.headers = response.headers
        self._body = response.body

    def json(self) -> Any:
        return json.loads(self._body)


@pytest.mark.parametrize("status", STATUSES)
@pytest.mark.parametrize("dialect", list(BODIES))
def test_the_cluster_ingress_refuses_in_each_dialects_own_shape(dialect, status):
    path = BODIES[dialect][0]
    _check_shape(dialect, status, _Answered(ingress._error(path, ERRORS[status])))
    if path.startswith("/v1/"):  # ...without /v1 too, as every /v1 route is served
        _check_shape(dialect, status, _Answered(ingress._error(path[3:], ERRORS[status])))


def _request(path: str, headers: dict[str, str], method: str = "POST") -> Request:
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    return Request(scope)


def _gate_refusal(path: str, headers: dict[str, str]) -> FerrumError:
    with pytest.raises(FerrumError) as refused:
        check_gate(Keys(("sk-right",)), False, _request(path, headers))
    return refused.value


def test_the_cluster_health_refuses_an_oversized_body_as_serve_does():
    """The ingress's own /health runs the gate too; its app has no error handlers, so a
    refusal raised there was a 500."""
    relay = ingress.Relay.__new__(ingress.Relay)  # no cluster: only the gate is reached
    relay.gate_keys = Keys()
    relay.settings = SimpleNamespace(server=SimpleNamespace(public_metrics=False))
    too_big = _request("/health", {"Content-Length": str(17 * 1024 * 1024)}, "GET")
    r = asyncio.run(relay.health(too_big))
    assert r.status_code == 400 and json.loads(r.body)["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("dialect", list(BODIES))
def test_a_refused_key_or_an_oversized_body_is_answered_alike_by_serve_and_the_cluster(dialect):
    """The ingress runs the same gate (`check_gate`) before relaying: its answer on a path is
    byte for byte the one `ferrum serve` gives."""
    path, good, _ = BODIES[dialect]
    cases = [
        {"Authorization": "Bearer sk-wrong"},
        {"Authorization": "Bearer sk-right", "Content-Length": str(17 * 1024 * 1024)},
    ]
    with TestClient(fake_app(keys=Keys(("sk-right",)))) as client:
        for headers in cases:
            served = client.post(path, content=b"{}", headers=headers)
            cluster = ingress._error(path, _gate_refusal(path, headers))
            assert (served.status_code, served.content) == (cluster.status_code, cluster.body)


def _last_error_line(dialect: str, client: TestClient) -> tuple[str, str]:
    """A stream on `dialect`'s path that an engine fault breaks: its error line, and the
    stream's content type."""
    path, good, _ = BODIES[dialect]
    body = {"model": "fake", **good, "stream": True, "max_tokens": 50}
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        text = r.read().decode()
        kind = r.headers["content-type"]
    if dialect == "ollama":
        return text.splitlines(keepends=True)[-1], kind
    events = [e + "\n\n" for e in text.split("\n\n") if e]
    return [e for e in events if e != "data: [DONE]\n\n"][-1], kind


@pytest.mark.parametrize("dialect", ["openai", "ollama", "anthropic"])
def test_a_broken_stream_ends_alike_from_serve_and_the_cluster(dialect):
    """A stream that fails after it began ends with one error in the dialect's framing (an SSE
    `data:` event, Anthropic's `event: error`, Ollama's last NDJSON line), written the same
    way by a replica's own stream and by an ingress whose replica died mid-answer."""
    runner = FakeRunner()
    with TestClient(fake_app(runner)) as client:
        runner.fail_seqs.add(0)
        served, content_type = _last_error_line(dialect, client)
    path = BODIES[dialect][0]
    relayed = ingress._stream_error(path, content_type, "the replica failed").decode()

    def framing(line: str) -> tuple[str, dict[str, Any]]:
        head, _, data = line.rpartition("data: ") if dialect != "ollama" else ("", "", line)
        parsed = json.loads(data)
        # compact JSON, one line, ending as the framing ends
        end = "\n" if dialect == "ollama" else "\n\n"
        assert data == json.dumps(parsed, separators=(",", ":")) + end, line
        return head, parsed

    (served_head, served_body), (relayed_head, relayed_body) = framing(served), framing(relayed)
    assert served_head == relayed_head == ("event: error\n" if dialect == "anthropic" else "")
    assert _keys(served_body) == _keys(relayed_body)
    assert "the replica failed" in json.dumps(relayed_body)


def _keys(obj: Any) -> Any:
    return {k: _keys(v) for k, v in obj.items()} if isinstance(obj, dict) else None


# An unknown route under each dialect's prefix, as a client of that dialect calls one: the
# dialect whose shape its 404 has.
UNKNOWN_ROUTES = [
    ("POST", "/v1/responses/compact", "openai"),  # fits GET /v1/responses/{response_id}
    ("POST", "/responses/compact", "openai"),
    ("POST", "/v1/responses/resp_1/cancel", "openai"),
    ("PUT", "/v1/responses/resp_1", "openai"),
    ("POST", "/v1/nothing", "openai"),
    ("GET", "/v1/nothing", "openai"),
    ("POST", "/v1/messages/whatever", "anthropic"),
    ("GET", "/messages/whatever", "anthropic"),
    ("POST", "/api/nothing", "ollama"),
    ("GET", "/api/nothing", "ollama"),
]
# A route that exists, called with another method: 405, still in its dialect's shape.
WRONG_METHODS = [
    ("GET", "/v1/chat/completions", "openai"),
    ("GET", "/v1/responses", "openai"),
    ("POST", "/v1/models", "openai"),
    ("GET", "/v1/messages", "anthropic"),
    ("GET", "/v1/messages/count_tokens", "anthropic"),
]


def _dialect_error(dialect: str, status: int, r: Any) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    if dialect == "anthropic":
        conforms("anthropic-messages", "ErrorResponse", body)
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        assert body["error"]["type"] == kind, body
    elif dialect == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str), body
    else:
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["code"] == ("not_found" if status == 404 else None), body


def test_an_unknown_route_is_a_404_in_its_dialects_shape_and_a_wrong_method_a_405():
    """A 405 means the path exists with another method: a path that only fits a route's
    template (POST /v1/responses/compact) is a 404, as a route that does not exist at all.
    A cluster's ingress relays every path to a replica, which answers with this app."""
    with TestClient(fake_app()) as client:
        for method, path, dialect in UNKNOWN_ROUTES:
            _dialect_error(dialect, 404, client.request(method, path, json={}))
        for method, path, dialect in WRONG_METHODS:
            _dialect_error(dialect, 405, client.request(method, path, json={}))
