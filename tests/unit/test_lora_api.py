"""LoRA adapters through the API (fake runners): a request picks adapters by model name
`BASE:NAME` or by llama-server's `lora` field, each decode carries one set, `/v1/models`
and `/api/tags` list the adapters, and bad picks are 404s and 400s in each API's shape."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from ferrum.models.adapters import LoraAdapter
from ferrum.models.registry import ModelSpec
from tests.factories import FakeRunner, fake_app

ADAPTERS = (LoraAdapter("support", "/a/support.gguf", 1.0), LoraAdapter("sql", "/a/sql.gguf", 0.5))


def _client(runners: dict, adapters: dict[str, tuple]) -> TestClient:
    specs = [ModelSpec(n, lambda: "", adapters=adapters.get(n, ())) for n in runners]
    return TestClient(fake_app(models=runners, registry={"specs": specs}))


@pytest.fixture
def one():
    runner = FakeRunner()
    with _client({"base": lambda: runner}, {"base": ADAPTERS}) as c:
        yield c, runner


def _chat(model: str, **kw):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {**body, **kw}


def test_model_name_and_lora_field_pick_the_adapter_set(one):
    c, runner = one
    asked = [
        ("base", {}, ()),
        ("base:support", {}, ((0, 1.0),)),
        ("base:sql", {}, ((1, 0.5),)),
        ("sql", {}, ((1, 0.5),)),  # an adapter's bare name, as vLLM serves them
        ("base", {"lora": [{"id": 1, "scale": 2.0}, {"id": 0}]}, ((0, 1.0), (1, 2.0))),
        ("base:sql", {"lora": [{"id": 1, "scale": 0.0}]}, ()),  # scale 0: the base
    ]
    for model, extra, expected in asked:
        runner.adapter_sets.clear()
        r = c.post("/v1/chat/completions", json=_chat(model, **extra))
        assert r.status_code == 200, r.text
        assert set(runner.adapter_sets) == {expected}, (model, extra)


def test_completions_and_ollama_pick_by_name_too(one):
    c, runner = one
    r = c.post("/v1/completions", json={"model": "base:sql", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = {"model": "base:support", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    assert c.post("/api/generate", json=body).status_code == 200
    assert set(runner.adapter_sets) == {((1, 0.5),), ((0, 1.0),)}


def test_adapters_are_listed_as_base_colon_name(one):
    c, _ = one
    ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
    assert ids == ["base", "base:support", "base:sql"]
    cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    assert cards["base:sql"]["parent"] == "base"
    names = [m["name"] for m in c.get("/api/tags").json()["models"]]
    assert names == ["base", "base:support", "base:sql"]


def test_unknown_adapter_is_a_404_naming_it_and_listing_the_others(one):
    c, _ = one
    r = c.post("/v1/chat/completions", json=_chat("base:nope"))
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "'base:nope'" in message and "'base:sql'" in message and "'base:support'" in message
    r = c.post("/api/chat", json={"model": "base:nope", "messages": [], "stream": False})
    assert r.status_code == 404 and "base:nope" in r.json()["error"]


@pytest.mark.parametrize(
    "lora",
    [
        [{"id": 7}],
        [{"id": -1}],
        [{"id": 0, "scale": 1e9}],
        [{"id": 0, "scale": "1"}],
        [{"id": 0, "bogus": 1}],
        [{"id": 0, "scale": 1.0}] * 65,
        {"id": 0},
    ],
)
def test_bad_lora_entries_are_400s(one, lora):
    c, runner = one
    r = c.post("/v1/chat/completions", json=_chat("base", lora=lora))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert c.post("/v1/chat/completions", json=_chat("base:sql")).status_code == 200


def test_a_nan_scale_is_a_400(one):
    c, _ = one
    raw = '{"model": "base", "prompt": "hi", "max_tokens": 2, "lora": [{"id": 0, "scale": NaN}]}'
    r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text


def test_lora_on_a_model_without_adapters_is_a_400():
    with _client({"plain": FakeRunner, "base": FakeRunner}, {"base": ADAPTERS}) as c:
        r = c.post("/v1/chat/completions", json=_chat("plain", lora=[{"id": 0}]))
        assert r.status_code == 400 and "no LoRA adapters" in r.json()["error"]["message"]
        assert c.post("/v1/chat/completions", json=_chat("base:sql")).status_code == 200
        r = c.post("/v1/chat/completions", json=_chat("base:nope"))
        assert r.status_code == 404 and "'base:sql'" in r.json()["error"]["message"]
        # A model name with a tag is still that model (Ollama style).
        assert c.post("/v1/chat/completions", json=_chat("plain:latest")).status_code == 200


def _series(c: TestClient, name: str) -> dict[str, float]:
    """The samples of one /metrics family, by their adapter (or adapter set) label."""
    found = {}
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            found[labels.split('adapter', 1)[1].split('"', 2)[1]] = float(value)
    return found


def test_metrics_and_health_count_requests_tokens_steps_and_switches_by_adapter(one):
    c, _ = one
    for model, extra in [
        ("base", {}),
        ("base:sql", {}),
        ("base:sql", {}),
        ("base", {"lora": [{"id": 0}, {"id": 1, "scale": 0.3}]}),
    ]:
        r = c.post("/v1/chat/completions", json=_chat(model, **extra))
        assert r.status_code == 200, r.text
    assert _series(c, "ferrum_adapter_requests_total") == {"": 1, "sql": 3, "support": 1}
    # Each request generated its two tokens; one with two adapters counts under both.
    assert _series(c, "ferrum_adapter_tokens_generated_total") == {"": 2, "sql": 6, "support": 2}
    steps = _series(c, "ferrum_adapter_steps_total")
    assert set(steps) == {"", "sql", "support+sql"}, steps
    assert sum(steps.values()) >= 8  # prefill and a decode each at least
    switches = _series_value(c, "ferrum_adapter_switches_total")
    assert switches == 2  # base → sql, sql → support+sql (one request at a time)
    lora = c.get("/health").json()["models"]["base"]["lora"]
    assert lora["adapters"] == [
        {"id": 0, "name": "support", "requests": 1, "generated_tokens": 2},
        {"id": 1, "name": "sql", "requests": 3, "generated_tokens": 6},
    ]
    assert lora["base"] == {"requests": 1, "generated_tokens": 2} and lora["switches"] == 2
    assert "lora" not in c.get("/health").json()  # a model's own, never summed


def _series_value(c: TestClient, name: str) -> float:
    lines = [x for x in c.get("/metrics").text.splitlines() if x.startswith(name + "{")]
    assert len(lines) == 1, lines
    return float(lines[0].rsplit(" ", 1)[1])


def test_a_model_without_adapters_shows_no_adapter_series():
    with _client({"plain": FakeRunner}, {}) as c:
        assert c.post("/v1/chat/completions", json=_chat("plain")).status_code == 200
        assert "ferrum_adapter_" not in c.get("/metrics").text
        assert c.get("/health").json()["models"]["plain"]["lora"]["adapters"] == []
