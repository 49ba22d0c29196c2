from __future__ import annotations

import pytest

from tests.tiny_models import write_tiny_gemma3, write_tiny_llama, write_tiny_mamba


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf"))


@pytest.fixture(scope="session")
def tiny_mamba(tmp_path_factory) -> str:
    return str(write_tiny_mamba(tmp_path_factory.mktemp("models") / "tiny-mamba.gguf"))


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> str:
    return str(write_tiny_gemma3(tmp_path_factory.mktemp("models") / "tiny-gemma3.gguf"))


@pytest.fixture(params=["llama", "mamba"])
def tiny_model(request, tiny_llama, tiny_mamba) -> str:
    return tiny_llama if request.param == "llama" else tiny_mamba
