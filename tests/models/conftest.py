"""Fixtures for the model store and pull tests: a fake hub of tiny random GGUFs, served on a
free port, with huggingface_hub pointed at it and kept away from the user's cache and token."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import gguf
import huggingface_hub.constants
import pytest

from ferrum.models.store import ModelStore
from tests.models.fake_hub import FakeHub
from tests.tiny_models import (
    write_tiny_gemma3,
    write_tiny_llama,
    write_tiny_lora,
    write_tiny_mamba,
)

TOKEN = "hf_test_token"
LLAMA = "test-org/tiny-llama-GGUF"
SPLIT = "test-org/tiny-split-GGUF"
ODD = "test-org/odd-quants-GGUF"
EMPTY = "test-org/no-gguf"
GATED = "test-org/gated-GGUF"
BROKEN = "test-org/broken-GGUF"
LORA = "test-org/tiny-support-lora-GGUF"  # a LoRA adapter of LORA_BASE, named in its GGUF
LORA_BASE = "test-org/tiny-llama"
BARE_LORA = "test-org/bare-lora-GGUF"  # a LoRA adapter that names no base
README = b"# a model card\n"


class _SplitWriter(gguf.GGUFWriter):
    """GGUFWriter that splits every 8 tensors (the tiny llama has 21: three shards)."""

    def __init__(self, path: object, arch: str, **kwargs: object) -> None:
        super().__init__(path, arch, split_max_tensors=8)  # type: ignore[arg-type]


def write_split_llama(path: Path) -> list[Path]:
    """The tiny llama as a 3-shard split model, named as llama.cpp's gguf-split names it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFWriter", _SplitWriter)
        write_tiny_llama(path)
    return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))


@pytest.fixture(scope="session")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    llama = root / LLAMA
    write_tiny_llama(llama / "tiny-llama-Q4_K_M.gguf")
    write_tiny_gemma3(llama / "tiny-llama-Q8_0.gguf")
    (llama / "README.md").write_bytes(README)
    write_split_llama(root / SPLIT / "tiny-split-Q4_K_M.gguf")
    write_tiny_mamba(root / SPLIT / "mmproj-tiny-f16.gguf")  # a projector, not a model
    write_tiny_llama(root / ODD / "odd-Q6_K.gguf")
    write_tiny_mamba(root / ODD / "odd-F16.gguf")
    (root / EMPTY).mkdir(parents=True)
    (root / EMPTY / "README.md").write_bytes(README)
    write_tiny_llama(root / GATED / "gated-Q4_K_M.gguf")
    broken = root / BROKEN
    broken.mkdir(parents=True)
    (broken / "broken-Q4_K_M.gguf").write_bytes(b"<html>not a model</html>" * 100)
    whole = write_tiny_llama(root / "whole.gguf").read_bytes()
    (broken / "broken-Q8_0.gguf").write_bytes(whole[: len(whole) * 2 // 3])
    (root / "whole.gguf").unlink()
    write_tiny_lora(root / LORA / "tiny-support-lora-F32.gguf", seed=1, base=LORA_BASE)
    write_tiny_lora(root / BARE_LORA / "bare-lora-F32.gguf", seed=2)
    return root


@pytest.fixture
def hub(hub_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with FakeHub(hub_root, gated={GATED}, token=TOKEN) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        # Read at import: keep the user's saved login out of the requests.
        monkeypatch.setattr(
            huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token")
        )
        # huggingface_hub writes what it received in 10 MiB chunks: smaller ones let a tiny
        # file's cut-off download keep the bytes that arrived (to test resuming).
        monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 4096)
        yield fake


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    return ModelStore(tmp_path / "models", lock_timeout=10)


def store_tree(store: ModelStore) -> set[str]:
    """Every file under the store's manifests, files and partial folders (not its locks)."""
    return {
        str(p.relative_to(store.root))
        for d in (store.manifests, store.files, store.partial)
        for p in d.rglob("*")
        if p.is_file()
    }


def copy_file(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return dst
