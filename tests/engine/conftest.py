from __future__ import annotations

import pytest

from tests.tiny_models import write_tiny_gemma3, write_tiny_llama, write_tiny_mamba
from tests.tiny_vision import write_tiny_mmproj


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf"))


@pytest.fixture(scope="session")
def mmproj(tmp_path_factory) -> str:
    """The tiny projector of `tiny_vision.py`, which pairs with `tiny_llama`."""
    return str(write_tiny_mmproj(tmp_path_factory.mktemp("vision") / "mmproj.gguf"))


@pytest.fixture(scope="session")
def tiny_mamba(tmp_path_factory) -> str:
    return str(write_tiny_mamba(tmp_path_factory.mktemp("models") / "tiny-mamba.gguf"))


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> str:
    return str(write_tiny_gemma3(tmp_path_factory.mktemp("models") / "tiny-gemma3.gguf"))


@pytest.fixture(params=["llama", "mamba"])
def tiny_model(request, tiny_llama, tiny_mamba) -> str:
    return tiny_llama if request.param == "llama" else tiny_mamba
