"""LoRA adapters changed while serving (fake runners): llama-server's GET/POST /lora-adapters
and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, tried as a user key, an
attacker naming paths, and an admin unloading an adapter under a running request."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ferrum.api.auth import Keys
from ferrum.models.adapters import LoraAdapter
from ferrum.models.registry import ModelSpec
from ferrum.models.store import ModelStore
from tests.factories import LORA_MAGIC, FakeRunner, fake_app

ADMIN = {"authorization": "Bearer sk-admin"}
USER = {"authorization": "Bearer sk-user"}


@pytest.fixture
def server(tmp_path: Path):
    store = ModelStore(tmp_path / "store")
    (store.root / "adapters").mkdir(parents=True)
    (store.root / "adapters" / "legal.gguf").write_bytes(LORA_MAGIC)
    flagged = tmp_path / "flagged.gguf"
    flagged.write_bytes(LORA_MAGIC)
    runner = FakeRunner()
    adapters = (LoraAdapter("support", str(flagged)),)
    specs = [ModelSpec("base", lambda: "", adapters=adapters)]
    app = fake_app(
        models={"base": lambda: runner},
        registry={"specs": specs},
        keys=Keys(("sk-user",), ("sk-admin",)),
        store=store,
        lora_dirs=(str(tmp_path / "operator"),),
    )
    with TestClient(app) as c:
        yield c, runner, store.root, tmp_path


def _load(c, name, path, headers=ADMIN):
    body = {"lora_name": name, "lora_path": str(path)}
    return c.post("/v1/load_lora_adapter", json=body, headers=headers)


def _chat(c, model, headers=USER, **kw):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return c.post("/v1/chat/completions", json={**body, **kw}, headers=headers)


def test_a_user_key_cannot_load_unload_or_rescale_adapters(server):
    c, runner, root, _ = server
    assert _load(c, "new", root / "adapters" / "legal.gguf", USER).status_code == 403
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "support"}, headers=USER)
    assert r.status_code == 403 and "admin key" in r.json()["error"]["message"]
    r = c.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}], headers=USER)
    assert r.status_code == 403
    assert runner.adapters.paths == [str(root.parent / "flagged.gguf")]
    assert _chat(c, "base:support").status_code == 200  # still served


def test_an_admin_loads_an_adapter_from_the_store_and_requests_pick_it(server):
    c, runner, root, _ = server
    r = _load(c, "legal", "adapters/legal.gguf")  # relative: in the store
    assert r.status_code == 200, r.text
    assert r.json() == {"id": 1, "name": "base:legal", "path": "legal.gguf"}
    assert "base:legal" in [m["id"] for m in c.get("/v1/models", headers=USER).json()["data"]]
    runner.adapter_sets.clear()
    assert _chat(c, "base:legal").status_code == 200
    assert _chat(c, "base", lora=[{"id": 1, "scale": 0.5}]).status_code == 200
    assert set(runner.adapter_sets) == {((1, 1.0),), ((1, 0.5),)}
    listed = c.get("/lora-adapters", headers=USER).json()
    assert [(a["id"], a["name"], a["path"]) for a in listed] == [
        (0, "support", "flagged.gguf"),  # the file's name, never the server's folders
        (1, "legal", "legal.gguf"),
    ]


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd",
        "../flagged-copy.gguf",  # out of the store by ..
        "adapters/../../outside.gguf",
        "link.gguf",  # a link in the store to a file outside it
    ],
)
def test_a_path_outside_the_store_and_the_operators_folders_is_a_403(server, path):
    c, runner, root, tmp = server
    outside = tmp / "outside.gguf"
    outside.write_bytes(LORA_MAGIC)
    (tmp / "flagged-copy.gguf").write_bytes(LORA_MAGIC)
    (root / "link.gguf").symlink_to(outside)
    r = _load(c, "evil", path)
    assert r.status_code == 403, r.text
    assert str(tmp) not in r.json()["error"]["message"]  # the server's paths stay its own
    assert len(runner.adapters.paths) == 1
    assert _chat(c, "base:evil").status_code == 404


def test_a_folder_the_operator_named_and_a_flagged_file_may_be_loaded(server):
    c, runner, _, tmp = server
    (tmp / "operator").mkdir()
    (tmp / "operator" / "ops.gguf").write_bytes(LORA_MAGIC)
    assert _load(c, "ops", tmp / "operator" / "ops.gguf").status_code == 200
    assert _load(c, "again", tmp / "flagged.gguf").status_code == 200  # a --lora file
    assert len(runner.adapters.paths) == 3


def test_bad_loads_are_4xx_and_change_nothing(server):
    c, runner, root, _ = server
    (root / "adapters" / "other-base.gguf").write_bytes(b"an adapter of another model")
    cases = [
        (_load(c, "x", root / "adapters" / "other-base.gguf"), 400, "not a LoRA adapter"),
        (_load(c, "x", root / "adapters" / "missing.gguf"), 400, "no such file"),
        (_load(c, "support", root / "adapters" / "legal.gguf"), 400, "already loaded"),
        (_load(c, "a:b/c", root / "adapters" / "legal.gguf"), 400, "lora_name"),
        (_load(c, "x", ""), 400, "no adapter file"),
    ]
    for r, status, words in cases:
        assert r.status_code == status, r.text
        assert words in r.json()["error"]["message"]
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=ADMIN)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    assert len(runner.adapters.paths) == 1
    assert [a["name"] for a in c.get("/lora-adapters", headers=USER).json()] == ["support"]


def test_unload_while_a_request_runs_finishes_it_with_the_adapter_then_frees_it(server):
    c, runner, _, _ = server
    runner.step_delay_s = 0.02
    answer: dict = {}

    def long_request() -> None:
        answer["r"] = _chat(c, "base:support", max_tokens=40)

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 10
    while ((0, 1.0),) not in runner.adapter_sets and time.monotonic() < deadline:
        time.sleep(0.01)
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "base:support"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["freed"] is False  # its request still decodes with it
    assert _chat(c, "base:support").status_code == 404  # nothing new may pick it
    assert _chat(c, "base", lora=[{"id": 0}]).status_code == 400
    worker.join(timeout=30)
    done = answer["r"]
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 40
    assert runner.adapters.freed == [0]  # freed once its last request was done
    assert c.get("/lora-adapters", headers=USER).json() == []
    # The id is never given again: a new adapter takes the next one.
    assert _load(c, "support", "adapters/legal.gguf").json()["id"] == 1


def test_default_scales_apply_to_requests_that_pick_no_adapter(server):
    c, runner, _, _ = server
    r = c.post("/lora-adapters", json=[{"id": 0, "scale": 0.25}], headers=ADMIN)
    assert r.status_code == 200, r.text
    assert c.get("/lora-adapters", headers=USER).json()[0]["scale"] == 0.25
    runner.adapter_sets.clear()
    assert _chat(c, "base").status_code == 200  # picks none: the defaults
    assert set(runner.adapter_sets) == {((0, 0.25),)}
    runner.adapter_sets.clear()
    assert _chat(c, "base", lora=[]).status_code == 200  # an explicit empty list: the base
    assert _chat(c, "base:support").status_code == 200  # named: its own scale
    assert set(runner.adapter_sets) == {(), ((0, 1.0),)}
    for bad in ([{"id": 5, "scale": 1.0}], [{"id": 0, "scale": 1e9}], {"id": 0}):
        assert c.post("/lora-adapters", json=bad, headers=ADMIN).status_code == 400


def test_a_reload_serves_the_same_adapters_under_the_same_ids(server):
    c, runner, _, _ = server
    assert _load(c, "legal", "adapters/legal.gguf").status_code == 200
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "support"}, headers=ADMIN)
    assert r.json()["freed"] is True
    r = c.post("/api/generate", json={"model": "base", "keep_alive": 0}, headers=ADMIN)
    assert r.status_code == 200, r.text
    runner.adapter_sets.clear()
    runner.adapters.freed.clear()
    assert _chat(c, "base:legal").status_code == 200  # loads the model again
    assert runner.adapters.paths[0] is None  # the unloaded adapter's id stays empty
    assert set(runner.adapter_sets) == {((1, 1.0),)}
    assert _chat(c, "base:support").status_code == 404


def test_the_file_checks_of_a_load_run_off_the_event_loop(server, monkeypatch):
    """`loadable_path` stats and resolves files: on a slow disk that must not stall every
    other request, so a load runs it in a worker thread, never on the event loop."""
    import asyncio

    from ferrum.api import lora_routes

    on_loop: list[bool] = []
    real = lora_routes.loadable_path

    def watched(*args, **kw):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no loop in this thread: a worker
            on_loop.append(False)
        return real(*args, **kw)

    monkeypatch.setattr(lora_routes, "loadable_path", watched)
    c, _, _, _ = server
    assert _load(c, "legal", "adapters/legal.gguf").status_code == 200
    assert _load(c, "evil", "/etc/passwd").status_code == 403  # its errors still come back
    assert on_loop == [False, False]
