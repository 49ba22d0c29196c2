"""LoRA adapters pulled into the store from the fake hub: the manifest records the adapter's
base (the GGUF's `general.base_model.*`, or `--base`), the store lists it as `BASE:ADAPTER`,
a server serves it on its base (its output equals the adapter's weights merged, token for
token) and refuses to load it on another model."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ferrum.config import EngineConfig, ModelsConfig, ServerConfig
from ferrum.models import commands
from ferrum.models.errors import InvalidModelFile
from ferrum.models.pull import pull
from ferrum.models.store import ModelStore
from ferrum.server import build_server
from tests.models.conftest import BARE_LORA, LLAMA, LORA, LORA_BASE, store_tree
from tests.models.fake_hub import FakeHub
from tests.tiny_models import write_tiny_llama

BASE_NAME = f"{LLAMA}:Q4_K_M"  # the tiny llama, the adapters' base
SERVED = f"{BASE_NAME}:tiny-support-lora-GGUF"  # the adapter as the server names it


def test_an_adapter_repo_is_stored_as_an_adapter_of_the_base_its_gguf_names(
    hub: FakeHub, store: ModelStore
) -> None:
    m = pull(store, LORA)
    assert (m.name, m.base) == (f"{LORA}:F32", LORA_BASE)
    assert store.get(m.name).base == LORA_BASE  # written, and read back
    assert pull(store, LLAMA).base is None  # a model is no adapter


def test_an_adapter_naming_no_base_needs_base_and_a_model_refuses_it(
    hub: FakeHub, store: ModelStore
) -> None:
    with pytest.raises(InvalidModelFile, match="names no base model: pull it with --base"):
        pull(store, BARE_LORA)
    assert store.list() == [] and not store_tree(store)  # nothing half-installed
    assert pull(store, BARE_LORA, base="tiny").base == "tiny"
    with pytest.raises(InvalidModelFile, match="not a LoRA adapter"):
        pull(store, LLAMA, base="tiny")
    assert [m.name for m in store.list()] == [f"{BARE_LORA}:F32"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    commands.add_parsers(parser.add_subparsers(dest="command", required=True))
    code = commands.run(parser.parse_args(argv))
    return code, capsys.readouterr().out


def test_ferrum_list_shows_an_adapter_as_base_colon_adapter(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = ["--models-dir", str(tmp_path / "m")]
    assert _run(capsys, "pull", LLAMA, *d)[0] == 0
    assert _run(capsys, "pull", BARE_LORA, "--base", "mine", "--name", "bot", *d)[0] == 0
    code, out = _run(capsys, "list", *d)
    rows = [line.split() for line in out.splitlines()]
    assert code == 0 and rows[0][-2:] == ["STORED", "AS"]
    names = {r[0]: r[-1] for r in rows[1:]}
    assert names["mine:bot"] == "bot"  # listed as served, with the name to rm it by
    assert BASE_NAME in names
    code, out = _run(capsys, "show", "bot", *d)
    assert code == 0 and "LoRA adapter of mine" in out


def _server(store: ModelStore, tmp_path: Path, model: tuple[str, ...] = ()):
    engine_cfg = EngineConfig(ctx_size=256, parallel=2, batch_size=64, threads=2, cache_ram=0,
                              cache_disk=0)  # fmt: skip
    models = ModelsConfig(model=model, models_dir=str(store.root))
    return build_server(engine_cfg, ServerConfig(port=9999, open_admin=True), models)[0]


PROMPT = "the model of the world is a test of time, and the people of the water"


def _text(client: TestClient, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_a_stored_adapter_is_served_on_its_base_and_equals_its_merge(
    hub: FakeHub, store: ModelStore, tmp_path: Path
) -> None:
    pull(store, LLAMA)
    pull(store, LORA)
    with TestClient(_server(store, tmp_path, (BASE_NAME,))) as client:
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert ids == [BASE_NAME, SERVED]  # the adapter is no model of its own
        tags = [m["name"] for m in client.get("/api/tags").json()["models"]]
        assert SERVED in tags and f"{LORA}:F32" not in tags
        adapted, plain = _text(client, SERVED), _text(client, BASE_NAME)
    merged = write_tiny_llama(tmp_path / "merged.gguf", merge=(1, 1.0))
    with TestClient(_server(ModelStore(tmp_path / "s2"), tmp_path, (f"m={merged}",))) as client:
        assert adapted == _text(client, "m") != plain


def test_an_adapter_of_another_base_is_left_out_and_refused_by_a_clear_400(
    hub: FakeHub, store: ModelStore, tmp_path: Path
) -> None:
    pull(store, LLAMA)
    pull(store, BARE_LORA, base="someone/other-model")
    with pytest.raises(ValueError, match="is a LoRA adapter of someone/other-model"):
        _server(store, tmp_path, (f"{BARE_LORA}:F32",))  # served as a model: no
    with TestClient(_server(store, tmp_path, (BASE_NAME,))) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [BASE_NAME]
        load = {"lora_name": "bare", "lora_path": f"{BARE_LORA}:F32"}  # by its store name
        r = client.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "made for 'someone/other-model'" in message and BASE_NAME in message
        assert _text(client, BASE_NAME)  # nothing else affected


def test_an_adapter_pulled_for_this_base_loads_by_its_store_name(
    hub: FakeHub, store: ModelStore, tmp_path: Path
) -> None:
    pull(store, LLAMA)
    with TestClient(_server(store, tmp_path, (BASE_NAME,))) as client:
        pull(store, BARE_LORA, base=LLAMA)  # while serving: loaded by an admin
        load = {"lora_name": "bare", "lora_path": f"{BARE_LORA}:F32"}
        r = client.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 200, r.text
        assert r.json()["name"] == f"{BASE_NAME}:bare"
        assert _text(client, f"{BASE_NAME}:bare") != _text(client, BASE_NAME)
