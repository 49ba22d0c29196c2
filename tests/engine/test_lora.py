"""LoRA adapters on real llama.cpp (tiny llama, generated adapters): an adapter applied at
decode time equals its weights merged into the model, token for token (greedy); scale 0
equals the base; requests of several adapter sets in one engine each equal their output
alone, and no KV is reused across sets."""

from __future__ import annotations

import os

import pytest

from ferrum.errors import ModelLoadError
from tests.factories import llama_engine, run_to_completion, sampling
from tests.tiny_models import write_tiny_gemma3, write_tiny_llama, write_tiny_lora

PROMPT = "the model of the world is a test of time, and the people of the water " * 3
SCALE = 0.5


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    return {
        "base": str(write_tiny_llama(d / "base.gguf")),
        "merged1": str(write_tiny_llama(d / "merged1.gguf", merge=(1, SCALE))),
        "merged2": str(write_tiny_llama(d / "merged2.gguf", merge=(2, 1.0))),
        "lora1": str(write_tiny_lora(d / "lora1.gguf", seed=1)),
        "lora2": str(write_tiny_lora(d / "lora2.gguf", seed=2)),
        "gemma": str(write_tiny_gemma3(d / "gemma.gguf")),
    }


def _greedy(engine, prompts: dict[str, tuple[str, tuple]], max_tokens: int = 12) -> dict:
    for rid, (text, adapters) in prompts.items():
        tokens = engine.runner.vocab.tokenize(text, True, False)
        params = sampling(max_tokens=max_tokens, ignore_eos=True, adapters=adapters)
        engine.add_request(rid, tokens, params)
    return run_to_completion(engine)


def _alone(path: str, adapters: tuple = (), lora=(), text: str = PROMPT) -> list[int]:
    with llama_engine(path, lora=lora, ctx=256, parallel=1) as engine:
        return _greedy(engine, {"a": (text, adapters)})["a"]["tokens"]


def test_adapter_equals_its_merged_weights(files):
    lora = (files["lora1"], files["lora2"])
    base = _alone(files["base"])
    assert _alone(files["base"], ((0, SCALE),), lora) == _alone(files["merged1"])
    assert _alone(files["base"], ((1, 1.0),), lora) == _alone(files["merged2"])
    assert _alone(files["merged1"]) != base  # the adapter does change the output
    assert _alone(files["base"], (), lora) == base  # loaded but not used: the base


def test_scale_zero_is_the_base(files):
    # Sent to llama.cpp as it is (the API drops zero scales before they get here).
    assert _alone(files["base"], ((0, 0.0),), (files["lora1"],)) == _alone(files["base"])


def test_mixed_sets_in_one_engine_equal_each_alone(files):
    lora = (files["lora1"], files["lora2"])
    sets = [(), ((0, SCALE),), ((1, 1.0),), ((0, SCALE), (1, 1.0))]
    alone = {s: _alone(files["base"], s, lora) for s in sets}
    with llama_engine(files["base"], lora=lora, ctx=1024, parallel=8) as engine:
        # One set after the other on the same prompt: each finds the others' KV parked
        # and must not take it.
        for n, s in enumerate(sets):
            out = _greedy(engine, {f"s{n}": (PROMPT, s)})[f"s{n}"]
            assert out["final"].cached_tokens == 0, s
            assert out["tokens"] == alone[s], s
        # Then all sets at once, interleaved: each reuses its own set's prefix.
        prompts = {f"r{i}": (PROMPT, sets[i % len(sets)]) for i in range(8)}
        mixed = _greedy(engine, prompts)
        engine.check_integrity()
    for rid, (_, s) in prompts.items():
        assert mixed[rid]["tokens"] == alone[s], (rid, s)
        assert mixed[rid]["final"].cached_tokens > 0, (rid, s)


def _open(path: str, lora: tuple[str, ...]) -> None:
    with llama_engine(path, lora=lora):
        pass


def test_an_adapter_of_another_base_is_refused(files):
    with pytest.raises(ModelLoadError, match="LoRA adapter"):
        _open(files["gemma"], (files["lora1"],))


def test_a_model_file_is_not_an_adapter(files):
    with pytest.raises(ModelLoadError, match="LoRA adapter"):
        _open(files["base"], (files["merged1"],))


def test_missing_adapter_file(files, tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        _open(files["base"], (str(tmp_path / "nope.gguf"),))


def test_served_with_lora_flags_the_adapter_equals_its_merge(files, tmp_path):
    """The whole path: `--lora` on a real server build, a request naming `BASE:NAME` (and
    one with llama-server's `lora` field) answers as the merged model does."""
    from fastapi.testclient import TestClient

    from ferrum.config import EngineConfig, ModelsConfig, ServerConfig
    from ferrum.server import build_server

    def completion(model_file: str, lora: tuple[str, ...], body: dict) -> str:
        engine_cfg = EngineConfig(ctx_size=512, parallel=2, batch_size=64, threads=2,
                                  cache_ram=0, cache_disk=0)  # fmt: skip
        models = ModelsConfig(model=(f"tiny={model_file}",), models_dir=str(tmp_path), lora=lora)
        app = build_server(engine_cfg, ServerConfig(port=9999), models)[0]
        request = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body}
        with TestClient(app) as client:
            r = client.post("/v1/completions", json=request)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

    flags = (f"other={files['lora2']}", f"tiny:mine={files['lora1']}@{SCALE}")
    merged = completion(files["merged1"], (), {"model": "tiny"})
    assert completion(files["base"], flags, {"model": "tiny:mine"}) == merged
    by_id = {"model": "tiny", "lora": [{"id": 1, "scale": SCALE}]}
    assert completion(files["base"], flags, by_id) == merged
    assert completion(files["base"], flags, {"model": "tiny"}) != merged


def test_an_adapter_loaded_while_serving_equals_its_merge_and_unloads(files, tmp_path):
    """vLLM's load/unload routes on a real server build: an adapter loaded at runtime (from
    a --lora-dir folder) answers as the merged model does, a model file is refused with a
    400, and once unloaded (nothing running) it is freed and no longer picked."""
    from fastapi.testclient import TestClient

    from ferrum.config import EngineConfig, ModelsConfig, ServerConfig
    from ferrum.server import build_server

    folder = os.path.dirname(files["lora1"])
    engine_cfg = EngineConfig(ctx_size=512, parallel=2, batch_size=64, threads=2,
                              cache_ram=0, cache_disk=0)  # fmt: skip
    models = ModelsConfig(model=(f"tiny={files['base']}",), models_dir=str(tmp_path),
                          lora=(f"other={files['lora2']}",), lora_dirs=(folder,))  # fmt: skip
    app = build_server(engine_cfg, ServerConfig(port=9999, open_admin=True), models)[0]
    request = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    with TestClient(app) as client:
        plain = client.post("/v1/completions", json={**request, "model": "tiny"}).json()
        load = {"lora_name": "mine", "lora_path": files["lora1"]}
        r = client.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 200 and r.json()["id"] == 1, r.text
        r = client.post("/v1/completions", json={**request, "model": "tiny", "lora": [
            {"id": 1, "scale": SCALE}]})  # fmt: skip
        mine = r.json()["choices"][0]["text"]
        bad = {"lora_name": "model", "lora_path": files["merged1"]}
        r = client.post("/v1/load_lora_adapter", json=bad)
        assert r.status_code == 400 and "not a LoRA adapter" in r.text
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "mine"})
        assert r.status_code == 200 and r.json()["freed"] is True
        r = client.post("/v1/completions", json={**request, "model": "tiny:mine"})
        assert r.status_code == 404
        again = client.post("/v1/completions", json={**request, "model": "tiny"}).json()
    assert mine != plain["choices"][0]["text"]
    assert again["choices"][0]["text"] == plain["choices"][0]["text"]
    assert mine == _merged_text(files["merged1"], tmp_path, request)


def _merged_text(path: str, tmp_path, request: dict) -> str:
    from fastapi.testclient import TestClient

    from ferrum.config import EngineConfig, ModelsConfig, ServerConfig
    from ferrum.server import build_server

    engine_cfg = EngineConfig(ctx_size=512, parallel=2, batch_size=64, threads=2,
                              cache_ram=0, cache_disk=0)  # fmt: skip
    models = ModelsConfig(model=(f"tiny={path}",), models_dir=str(tmp_path))
    app = build_server(engine_cfg, ServerConfig(port=9999), models)[0]
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={**request, "model": "tiny"})
        return str(r.json()["choices"][0]["text"])


def _server(model_file: str, tmp_path, lora=(), lora_dirs=(), disk: float = 0.0):
    from ferrum.config import EngineConfig, ModelsConfig, ServerConfig
    from ferrum.server import build_server

    engine_cfg = EngineConfig(ctx_size=512, parallel=2, batch_size=64, threads=2, cache_ram=0,
                              cache_disk=disk, cache_dir=str(tmp_path / "kv"))  # fmt: skip
    models = ModelsConfig(model=(f"tiny={model_file}",), models_dir=str(tmp_path), lora=lora,
                          lora_dirs=lora_dirs)  # fmt: skip
    return build_server(engine_cfg, ServerConfig(port=9999, open_admin=True), models)[0]


def _ask(client, model: str) -> tuple[str, int]:
    """A greedy completion's text and the prompt tokens it found cached."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return r.json()["choices"][0]["text"], usage["prompt_tokens_details"]["cached_tokens"]


def test_an_adapter_reloaded_under_its_name_from_another_file_reuses_no_kv(files, tmp_path):
    """Load lora1 as "x", ask, unload, load lora2 as "x", ask the same: the second answer
    finds nothing cached and equals lora2 merged (a fresh server's answer)."""
    from fastapi.testclient import TestClient

    folder = os.path.dirname(files["lora1"])
    with TestClient(_server(files["base"], tmp_path, lora_dirs=(folder,))) as client:
        load = {"lora_name": "x", "lora_path": files["lora1"]}
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 200
        first, _ = _ask(client, "tiny:x")
        again, cached = _ask(client, "tiny:x")
        assert again == first and cached > 0  # its own prefix is reused
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).json()["freed"]
        load = {"lora_name": "x", "lora_path": files["lora2"]}
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 200
        second, cached = _ask(client, "tiny:x")
    assert cached == 0
    with TestClient(_server(files["merged2"], tmp_path / "fresh")) as client:
        assert second == _ask(client, "tiny")[0] != first


def test_a_file_replaced_under_the_same_flag_reuses_no_kv_from_the_disk_tier(files, tmp_path):
    """The disk tier keeps prefix KV across restarts, under the adapter's id. A server started
    again with `--lora x=PATH` where PATH now holds another adapter numbers it 0 again: its
    requests must not find the old file's KV."""
    import shutil

    from fastapi.testclient import TestClient

    path = tmp_path / "x.gguf"
    shutil.copyfile(files["lora1"], path)
    flags = (f"x={path}",)
    with TestClient(_server(files["base"], tmp_path, flags, disk=0.1)) as client:
        first, _ = _ask(client, "tiny:x")
    with TestClient(_server(files["base"], tmp_path, flags, disk=0.1)) as client:
        same, cached = _ask(client, "tiny:x")
    assert same == first and cached > 0  # the same file: its KV comes back from disk
    shutil.copyfile(files["lora2"], path)
    with TestClient(_server(files["base"], tmp_path, flags, disk=0.1)) as client:
        second, cached = _ask(client, "tiny:x")
    assert cached == 0
    with TestClient(_server(files["merged2"], tmp_path / "fresh")) as client:
        assert second == _ask(client, "tiny")[0]
