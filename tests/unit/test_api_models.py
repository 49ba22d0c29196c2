"""Several models behind one OpenAI API (fake runners): a request's `model` picks one, models
load on first use and unload when their keep-alive passes, presets apply, a hang-up never
leaves a model held, and every metric carries its model's name."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from ferrum.api.auth import Keys
from ferrum.models.presets import Preset
from ferrum.models.registry import ModelSpec
from tests.factories import FakeRunner, fake_app


def _two(**kw):
    """Two models on a server whose callers may set any keep_alive (an admin's right)."""
    runners = {"alpha": FakeRunner, "beta": FakeRunner}
    kw.setdefault("keys", Keys(open_admin=True))
    return TestClient(fake_app(models=runners, **kw))


def _chat(model: str, **kw):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return {**body, **kw}


def _loaded(client) -> dict[str, int]:
    state = client.app.state.ferrum
    return {m.spec.name: m.in_flight for m in state.models.loaded()}


def test_the_first_model_loads_at_start_and_others_on_first_use():
    with _two() as c:
        cards = {m["id"]: m["loaded"] for m in c.get("/v1/models").json()["data"]}
        assert cards == {"alpha": True, "beta": False}
        r = c.post("/v1/chat/completions", json=_chat("beta"))
        assert r.status_code == 200 and r.json()["model"] == "beta"
        assert _loaded(c) == {"alpha": 0, "beta": 0}
        assert c.get("/v1/models/beta").json()["meta"]["architecture"] == "fake"


def test_an_unknown_model_is_a_404_listing_what_exists():
    with _two() as c:
        r = c.post("/v1/chat/completions", json=_chat("gpt-4o"))
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "model_not_found"
        assert err["param"] == "model"
        assert "'alpha'" in err["message"] and "'beta'" in err["message"]
        assert c.get("/v1/models/gpt-4o").status_code == 404


def test_a_request_without_a_model_gets_the_first():
    with _two() as c:
        body = _chat("")
        del body["model"]
        assert c.post("/v1/chat/completions", json=body).json()["model"] == "alpha"


def test_keep_alive_zero_unloads_after_the_request_and_a_bad_one_is_a_400():
    with _two() as c:
        assert c.post("/v1/completions", json={"model": "beta", "prompt": "x", "max_tokens": 2,
                                               "keep_alive": 0}).status_code == 200
        for _ in range(100):
            if "beta" not in _loaded(c):
                break
            time.sleep(0.02)
        assert "beta" not in _loaded(c)
        r = c.post("/v1/chat/completions", json=_chat("beta", keep_alive="soon"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


def test_the_server_keep_alive_unloads_idle_models():
    with _two(registry={"keep_alive": 0.2}) as c:
        c.post("/v1/chat/completions", json=_chat("beta"))
        assert set(_loaded(c)) == {"alpha", "beta"}
        deadline = time.monotonic() + 5
        while _loaded(c) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _loaded(c) == {}
        # and a later request loads it again
        assert c.post("/v1/chat/completions", json=_chat("alpha")).status_code == 200


def test_max_models_one_swaps_models_between_requests():
    with _two(registry={"max_models": 1}) as c:
        for name in ("beta", "alpha", "beta"):
            r = c.post("/v1/chat/completions", json=_chat(name))
            assert r.status_code == 200 and r.json()["model"] == name
            assert set(_loaded(c)) == {name}


def test_a_hung_up_stream_releases_its_model():
    slow = FakeRunner(step_delay_s=0.02)
    with TestClient(fake_app(models={"alpha": lambda: slow, "beta": FakeRunner})) as c:
        body = _chat("alpha", stream=True, max_tokens=200)
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        deadline = time.monotonic() + 5
        while _loaded(c)["alpha"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _loaded(c)["alpha"] == 0


def test_failed_requests_release_their_model_too():
    with _two() as c:
        bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
        r = c.post("/v1/chat/completions", json=_chat("beta", response_format=bad_schema))
        assert r.status_code == 400
        r = c.post("/v1/completions", json={"model": "beta", "prompt": [999999]})
        assert r.status_code == 400
        assert _loaded(c)["beta"] == 0


def test_presets_give_sampling_defaults_and_a_system_prompt():
    seen: list[list[int]] = []

    def runner():
        def next_token(history):
            seen.append(list(history))
            return ord("z")

        return FakeRunner(next_token=next_token)

    specs = [
        ModelSpec("alpha", lambda: "", preset=Preset(system="BE BRIEF", sampling={"max_tokens": 2},
                                                      aliases=("gpt-4o",))),
        ModelSpec("beta", lambda: ""),
    ]
    with TestClient(fake_app(models={"alpha": runner, "beta": runner},
                             registry={"specs": specs})) as c:
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
        out = c.post("/v1/chat/completions", json=body).json()
        assert out["model"] == "alpha" and out["usage"]["completion_tokens"] == 2
        assert b"BE BRIEF" in bytes(t for t in seen[0] if t < 256)
        explicit = c.post("/v1/chat/completions", json={**body, "max_tokens": 5}).json()
        assert explicit["usage"]["completion_tokens"] == 5


def test_metrics_carry_the_model_and_health_sums_the_models():
    with _two() as c:
        c.post("/v1/chat/completions", json=_chat("alpha"))
        c.post("/v1/chat/completions", json=_chat("beta"))
        text = c.get("/metrics").text
        assert 'ferrum_requests_total{finish_reason="length",model="alpha"} 1.0' in text
        assert 'ferrum_requests_total{finish_reason="length",model="beta"} 1.0' in text
        assert 'ferrum_model_loads_total{model="beta"} 1.0' in text
        assert "ferrum_models_loaded 2.0" in text
        health = c.get("/health").json()
        assert set(health["models"]) == {"alpha", "beta"}
        assert health["prefix_cache"]["misses"] == 2 and health["active_requests"] == 0


@pytest.mark.parametrize("route", ["/tokenize", "/detokenize"])
def test_tokenize_routes_name_their_model(route):
    with _two() as c:
        body = {"model": "beta", "content": "ab"} if route == "/tokenize" else {
            "model": "beta", "tokens": [97, 98]}
        assert c.post(route, json=body).status_code == 200
        assert c.post(route, json={**body, "model": "nope"}).status_code == 404


def test_a_model_loaded_again_starts_on_an_empty_context():
    """Found by the fuzzer: a request that ran to the context's end left its sequence parked;
    Ollama's keep_alive 0 unloaded the model and the next request loaded it again. A reload
    must not find the old engine's sequences resident (llama.cpp frees the context)."""
    from fastapi.testclient import TestClient

    from tests.factories import fake_app

    with TestClient(fake_app(keys=Keys(open_admin=True))) as client:
        body = {"model": "fake", "prompt": "top_logprobs"}  # no max_tokens: to the end
        assert client.post("/v1/completions", json=body).status_code == 200
        r = client.post("/api/chat", json={"model": "fake", "messages": [], "keep_alive": 0})
        assert r.json()["done_reason"] == "unload"
        again = client.post("/v1/completions", json=body)
        assert again.status_code == 200, again.text
