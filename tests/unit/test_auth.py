"""Roles and isolation between keys, tried as a hostile but authenticated user would (#37):
a user key cannot change the models or their keep-alive for everyone, cannot read another
key's stored responses, and /health tells a caller without a key only that the server lives."""

from __future__ import annotations

import logging
import time

import pytest
from fastapi.testclient import TestClient

from ferrum.api.auth import Keys, cache_scope, read_keys_file
from ferrum.cli import main
from tests.factories import FakeRunner, fake_app

USER = {"Authorization": "Bearer sk-user"}
OTHER = {"Authorization": "Bearer sk-other"}
ADMIN = {"x-api-key": "sk-admin"}


@pytest.fixture
def http():
    keys = Keys(("sk-user", "sk-other"), ("sk-admin",))
    runners = {"alpha": FakeRunner, "beta": FakeRunner}
    with TestClient(fake_app(models=runners, keys=keys, max_keep_alive=600.0)) as c:
        yield c


def _expiry(c: TestClient, name: str) -> float | None:
    slot = c.app.state.ferrum.models._slots[name]
    return None if slot.expires_at is None else slot.expires_at - time.monotonic()


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/api/pull", {"model": "org/repo"}),
        ("DELETE", "/api/delete", {"model": "alpha"}),
        ("POST", "/api/copy", {"source": "alpha", "destination": "gemma3-270m"}),
    ],
)
def test_the_store_routes_need_an_admin_key(http, method, path, body):
    r = http.request(method, path, json=body, headers=USER)
    assert r.status_code == 403 and "admin key" in r.json()["error"]  # Ollama's shape
    # An admin gets past the role check to the route's own answer (no store here: a 400).
    r = http.request(method, path, json=body, headers=ADMIN)
    assert r.status_code != 403, r.text


def test_a_server_without_keys_refuses_the_store_routes_unless_opened_on_purpose():
    with TestClient(fake_app()) as c:
        r = c.post("/api/copy", json={"source": "fake", "destination": "x"})
        assert r.status_code == 403 and "--open-admin" in r.json()["error"]
    with TestClient(fake_app(keys=Keys(open_admin=True))) as c:
        assert c.post("/api/copy", json={"source": "fake", "destination": "x"}).status_code != 403


def test_a_user_key_cannot_pin_or_unload_a_model_for_everyone(http):
    chat = {"model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json={**chat, "keep_alive": -1}, headers=USER)
    assert r.is_success
    assert 590 < _expiry(http, "beta") <= 600.0  # -1 taken as --max-keep-alive
    http.post("/v1/chat/completions", json={**chat, "keep_alive": "10h"}, headers=USER)
    assert 590 < _expiry(http, "beta") <= 600.0
    http.post("/v1/chat/completions", json={**chat, "keep_alive": "1s"}, headers=USER)
    assert _expiry(http, "beta") > 290  # not below the model's own (300 s here)
    # 0 cannot shorten the model's own keep-alive (the server's 300 s in the fake registry).
    http.post("/v1/chat/completions", json={**chat, "keep_alive": 0}, headers=USER)
    assert "beta" in {m.spec.name for m in http.app.state.ferrum.models.loaded()}
    r = http.post("/api/generate", json={"model": "beta", "keep_alive": 0}, headers=USER)
    assert r.status_code == 403  # Ollama's unload idiom
    # An admin decides for everyone.
    http.post("/v1/chat/completions", json={**chat, "keep_alive": -1}, headers=ADMIN)
    assert _expiry(http, "beta") is None
    r = http.post("/api/generate", json={"model": "beta", "keep_alive": 0}, headers=ADMIN)
    assert r.json()["done_reason"] == "unload"


def test_a_stored_response_belongs_to_the_key_that_made_it(http):
    body = {"model": "alpha", "input": "my secret", "max_output_tokens": 3}
    rid = http.post("/v1/responses", json=body, headers=USER).json()["id"]
    assert http.get(f"/v1/responses/{rid}", headers=USER).status_code == 200
    for attempt in (
        http.get(f"/v1/responses/{rid}", headers=OTHER),
        http.delete(f"/v1/responses/{rid}", headers=OTHER),
        http.post(
            "/v1/responses", json={**body, "previous_response_id": rid}, headers=OTHER
        ),
    ):
        assert attempt.status_code == 404, attempt.text
        assert "secret" not in attempt.text
    # The other key's delete did nothing: the owner still reads and continues it.
    assert http.get(f"/v1/responses/{rid}", headers=USER).status_code == 200
    more = http.post("/v1/responses", json={**body, "previous_response_id": rid}, headers=USER)
    assert more.status_code == 200


def test_health_without_a_key_says_only_whether_the_server_lives(http):
    bare = http.get("/health")
    assert bare.status_code == 200 and bare.json() == {"status": "ok"}
    assert http.get("/health", headers={"Authorization": "Bearer wrong"}).json() == {
        "status": "ok"
    }
    full = http.get("/health", headers=USER).json()
    assert full["model"] == "alpha" and "models" in full


def test_a_refused_key_is_logged_without_the_key(http, caplog):
    with caplog.at_level(logging.WARNING, logger="ferrum.api"):
        r = http.post("/v1/completions", json={"prompt": "x"}, headers={"x-api-key": "sk-guess"})
    assert r.status_code == 401
    assert "/v1/completions" in caplog.text and "sk-guess" not in caplog.text


def test_cache_scopes_are_the_key_a_salt_or_shared():
    keys = Keys(("sk-secret-a", "sk-secret-b"))
    a = keys.caller({"authorization": "Bearer sk-secret-a"})
    b = keys.caller({"x-api-key": "sk-secret-b"})
    assert a.tenant != b.tenant and "secret" not in a.tenant + a.label
    assert cache_scope(a, None, False) != cache_scope(b, None, False)
    assert cache_scope(a, "s", False) == cache_scope(b, "s", False) != cache_scope(a, "t", False)
    assert cache_scope(a, None, True) == cache_scope(b, None, True) == ""
    # A salt can never name a key's scope.
    assert not cache_scope(a, a.tenant, False).startswith("key:")


def test_a_keys_file_gives_roles(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team\nuser sk-1\nadmin sk-2\n\nuser sk-3\n")
    assert read_keys_file(str(path)) == (("sk-1", "sk-3"), ("sk-2",))
    path.write_text("owner sk-1\n")
    with pytest.raises(ValueError, match="expected"):
        read_keys_file(str(path))


@pytest.mark.parametrize("argv", [["--api-key", ","], ["--admin-key", " "]])
def test_an_empty_key_flag_is_refused_rather_than_running_open(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2 and "holds no key" in capsys.readouterr().err
