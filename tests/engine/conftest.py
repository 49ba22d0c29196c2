from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from ferrum.config import EngineConfig, ModelsConfig, ServerConfig
from ferrum.server import build_server
from tests.tiny_models import write_tiny_gemma3, write_tiny_llama, write_tiny_mamba
from tests.tiny_vision import TINY_GEMMA3, write_tiny_mmproj


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf"))


@pytest.fixture(scope="session")
def mmproj(tmp_path_factory) -> str:
    """The tiny projector of `tiny_vision.py`, which pairs with `tiny_llama`."""
    return str(write_tiny_mmproj(tmp_path_factory.mktemp("vision") / "mmproj.gguf"))


@pytest.fixture(scope="session")
def mmproj_gemma3(tmp_path_factory) -> str:
    """A tiny projector of Gemma 3's type: its images are decoded with attention both ways."""
    path = tmp_path_factory.mktemp("vision") / "mmproj-gemma3.gguf"
    return str(write_tiny_mmproj(path, TINY_GEMMA3))


@pytest.fixture(scope="session")
def tiny_mamba(tmp_path_factory) -> str:
    return str(write_tiny_mamba(tmp_path_factory.mktemp("models") / "tiny-mamba.gguf"))


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> str:
    return str(write_tiny_gemma3(tmp_path_factory.mktemp("models") / "tiny-gemma3.gguf"))


@pytest.fixture(params=["llama", "mamba"])
def tiny_model(request, tiny_llama, tiny_mamba) -> str:
    return tiny_llama if request.param == "llama" else tiny_mamba


@pytest.fixture(scope="module")
def client(tiny_llama, mmproj, tmp_path_factory):
    """A server in process: the tiny llama as "eye" (with the tiny projector) and "text"."""
    engine_cfg = EngineConfig(ctx_size=512, parallel=4, batch_size=64, threads=2,
                              cache_ram=0, cache_disk=0)  # fmt: skip
    models = ModelsConfig(model=(f"eye={tiny_llama}", f"text={tiny_llama}"),
                          models_dir=str(tmp_path_factory.mktemp("store")),
                          mmproj=(f"eye={mmproj}",))  # fmt: skip
    app = build_server(engine_cfg, ServerConfig(port=9999), models)[0]
    with TestClient(app) as c:
        yield c
