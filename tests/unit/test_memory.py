"""What a model costs before it loads (its files plus its KV cache) and the --memory-budget
the server may spend, on tiny real GGUFs and a fake nvidia-smi."""

from __future__ import annotations

import builtins
import io
import os
from pathlib import Path
from typing import Any

import gguf
import pytest

from ferrum.models import memory
from ferrum.models.memory import estimate_bytes, kv_bytes_per_token, memory_budget, model_files
from tests.tiny_models import N_LAYER, write_tiny_gemma3, write_tiny_llama, write_tiny_mamba

MIB, GIB = 2**20, 2**30


def _field(reader: gguf.GGUFReader, key: str) -> int:
    return int(reader.fields[key].contents())


def _expected_kv_bytes(path: Path, arch: str) -> int:
    """layers x KV heads x (K + V length) x 2 bytes (f16 cells), read back with gguf's own
    reader from what tests/tiny_models.py wrote."""
    reader = gguf.GGUFReader(path)
    layers = _field(reader, f"{arch}.block_count")
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv")
    head_dim = _field(reader, f"{arch}.embedding_length") // heads
    if f"{arch}.attention.key_length" in reader.fields:
        head_dim = _field(reader, f"{arch}.attention.key_length")
    return layers * kv_heads * (head_dim + head_dim) * 2


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny-llama.gguf")


class _SplitWriter(gguf.GGUFWriter):
    def __init__(self, path: Any, arch: str, **kwargs: Any) -> None:
        super().__init__(path, arch, split_max_tensors=8)


@pytest.fixture(scope="module")
def split_llama(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The tiny llama as llama.cpp's gguf-split writes it: three shards (21 tensors, 8 each)."""
    folder = tmp_path_factory.mktemp("split")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFWriter", _SplitWriter)
        write_tiny_llama(folder / "tiny.gguf")
    return sorted(folder.glob("tiny-*-of-*.gguf"))


def test_a_split_models_files_are_every_shard_beside_the_first(tmp_path: Path) -> None:
    first = tmp_path / "Model-Q4_K_M-00001-of-00003.gguf"
    assert model_files(str(first)) == [
        tmp_path / "Model-Q4_K_M-00001-of-00003.gguf",
        tmp_path / "Model-Q4_K_M-00002-of-00003.gguf",
        tmp_path / "Model-Q4_K_M-00003-of-00003.gguf",
    ]
    for single in ("model.gguf", "m-0001-of-0003.gguf", "m-00001-of-00003.bin", "00001.gguf"):
        assert model_files(str(tmp_path / single)) == [tmp_path / single]


def test_kv_bytes_of_a_tiny_llama_follow_its_attention_shape(llama: Path) -> None:
    expected = _expected_kv_bytes(llama, "llama")
    # 2 layers x 2 KV heads x (16 + 16) x 2 bytes, as write_tiny_llama documents.
    assert expected == N_LAYER * 2 * (16 + 16) * 2 == 256
    assert kv_bytes_per_token(str(llama)) == expected


def test_kv_bytes_use_an_explicit_key_length(tmp_path: Path) -> None:
    gemma = write_tiny_gemma3(tmp_path / "gemma.gguf")
    assert kv_bytes_per_token(str(gemma)) == _expected_kv_bytes(gemma, "gemma3") == 128


def test_a_model_without_attention_has_no_kv_bytes(tmp_path: Path) -> None:
    assert kv_bytes_per_token(str(write_tiny_mamba(tmp_path / "mamba.gguf"))) == 0


@pytest.mark.parametrize(
    "content", [b"", b"hello, not a model", b"GGUF", b"GGUF" + b"\xff" * 64, b"<html>" * 100]
)
def test_a_non_gguf_has_no_kv_bytes_rather_than_an_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    assert kv_bytes_per_token(str(path)) == 0
    assert estimate_bytes(str(path), ctx_size=4096) == len(content)


def test_a_missing_or_truncated_file_has_no_kv_bytes(tmp_path: Path, llama: Path) -> None:
    assert kv_bytes_per_token(str(tmp_path / "missing.gguf")) == 0
    assert estimate_bytes(str(tmp_path / "missing.gguf"), ctx_size=4096) == 0
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(llama.read_bytes()[:-1000])
    assert kv_bytes_per_token(str(cut)) == 0


def test_the_estimate_is_the_file_plus_the_kv_cache_at_the_context_size(llama: Path) -> None:
    size, kv = llama.stat().st_size, kv_bytes_per_token(str(llama))
    assert kv > 0
    assert estimate_bytes(str(llama), ctx_size=0) == size
    assert estimate_bytes(str(llama), ctx_size=2048) == size + 2048 * kv
    assert estimate_bytes(str(llama), ctx_size=4096) - estimate_bytes(str(llama), 2048) == 2048 * kv


def test_a_split_models_estimate_counts_every_shard(split_llama: list[Path], llama: Path) -> None:
    assert [p.name for p in split_llama] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    first = str(split_llama[0])
    assert model_files(first) == split_llama
    kv = kv_bytes_per_token(first)
    assert kv == kv_bytes_per_token(str(llama))  # the first shard holds the metadata
    shards = sum(p.stat().st_size for p in split_llama)
    assert shards > split_llama[0].stat().st_size
    assert estimate_bytes(first, ctx_size=1024) == shards + 1024 * kv


def test_a_missing_shard_is_left_out_of_the_estimate(tmp_path: Path) -> None:
    shards = [tmp_path / f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for i, shard in enumerate(shards):
        shard.write_bytes(b"x" * (i + 1) * 100)
    shards[1].unlink()
    assert estimate_bytes(str(shards[0]), ctx_size=512) == 100 + 300


def test_budget_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_free_vram", _must_not_run)
    monkeypatch.setattr(memory, "_available_ram", _must_not_run)
    assert memory_budget("", gpu=False) == 0
    assert memory_budget("", gpu=True) == 0  # no limit, whatever the build
    assert memory_budget("2GiB", gpu=False) == 2 * GIB
    assert memory_budget("512M", gpu=True) == 512 * MIB
    assert memory_budget("1048576", gpu=False) == MIB
    with pytest.raises(ValueError, match="lots"):
        memory_budget("lots", gpu=False)


def _must_not_run() -> int:
    raise AssertionError("an explicit budget must not probe the machine")


@pytest.fixture
def meminfo(monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc/meminfo with 3 GiB available (a fixed value: the real one moves between reads)."""
    real_open = builtins.open
    text = "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    3145728 kB\n"

    def fake_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if file == "/proc/meminfo":
            return io.StringIO(text)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(memory, "open", fake_open, raising=False)


def _nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str | None) -> Path:
    """PATH holding only a fake nvidia-smi running `script` (none at all when None)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    if script is not None:
        tool = bin_dir / "nvidia-smi"
        tool.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n{script}\n')
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return calls


def test_auto_without_gpu_is_the_available_ram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, meminfo: None
) -> None:
    calls = _nvidia_smi(tmp_path, monkeypatch, "echo 81920")
    assert memory_budget("auto", gpu=False) == 3 * GIB
    assert memory_budget(" AUTO ", gpu=False) == 3 * GIB
    assert not calls.exists()  # a CPU build never asks the GPU


def test_auto_reads_this_machines_available_ram() -> None:
    budget = memory_budget("auto", gpu=False)
    assert 0 < budget <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_auto_with_gpu_is_the_free_memory_of_every_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, meminfo: None
) -> None:
    calls = _nvidia_smi(tmp_path, monkeypatch, "echo 1000\necho 2000")
    assert memory_budget("auto", gpu=True) == 3000 * MIB
    assert "--query-gpu=memory.free" in calls.read_text()


@pytest.mark.parametrize(
    "script",
    [None, "exit 9", "echo '[N/A]'", "echo"],
    ids=["no-nvidia-smi", "fails", "no-reading", "no-output"],
)
def test_auto_with_gpu_falls_back_to_ram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, meminfo: None, script: str | None
) -> None:
    _nvidia_smi(tmp_path, monkeypatch, script)
    assert memory_budget("auto", gpu=True) == 3 * GIB
