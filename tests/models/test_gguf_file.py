"""read_gguf against the `gguf` package's writer and reader (the oracle), and against files
built byte by byte for what that writer cannot produce."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from ferrum.models.errors import InvalidModelFile
from ferrum.models.gguf_file import FILE_TYPES, GGML_TYPES, read_gguf
from tests.models.conftest import write_split_llama
from tests.tiny_models import write_tiny_gemma3, write_tiny_llama, write_tiny_mamba


def _oracle_end(path: Path) -> int:
    """The end of the tensor data, as the gguf package's reader sees it."""
    reader = gguf.GGUFReader(path)
    return max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)


@pytest.mark.parametrize("write", [write_tiny_llama, write_tiny_mamba, write_tiny_gemma3])
def test_facts_of_the_tiny_models_match_the_gguf_reader(tmp_path: Path, write) -> None:
    path = write(tmp_path / "m.gguf")
    facts = read_gguf(path)
    reader = gguf.GGUFReader(path)
    arch = reader.get_field("general.architecture").contents()
    assert facts.architecture == arch
    assert facts.context_length == reader.get_field(f"{arch}.context_length").contents() == 2048
    assert facts.name == f"tiny-{arch}-test"
    assert facts.has_chat_template == (reader.get_field("tokenizer.chat_template") is not None)
    assert facts.tensor_count == len(reader.tensors)
    assert (facts.split_count, facts.split_no) == (1, 0)
    assert facts.expected_size == _oracle_end(path)
    assert facts.quant == "F32"  # general.file_type ALL_F32


def test_chat_template_presence(tmp_path: Path) -> None:
    assert read_gguf(write_tiny_llama(tmp_path / "l.gguf")).has_chat_template
    assert not read_gguf(write_tiny_mamba(tmp_path / "m.gguf")).has_chat_template


def test_quantized_tensors_and_a_custom_alignment(tmp_path: Path) -> None:
    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0,
                  gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F16):  # fmt: skip
        data = rng.normal(size=(3, 96)).astype(np.float32)
        q = gguf.quants.quantize(data, qtype)
        writer.add_tensor(f"t.{qtype.name}", q, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    facts = read_gguf(path)
    assert facts.expected_size == _oracle_end(path)
    assert gguf.GGUFReader(path).alignment == 64


def test_split_shards_each_describe_their_own_tensors(tmp_path: Path) -> None:
    shards = write_split_llama(tmp_path / "s-Q4_K_M.gguf")
    assert [p.name for p in shards] == [f"s-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    facts = [read_gguf(p) for p in shards]
    assert [(f.split_no, f.split_count) for f in facts] == [(0, 3), (1, 3), (2, 3)]
    assert facts[0].architecture == "llama" and facts[0].has_chat_template
    assert facts[1].architecture == ""  # later shards carry no metadata
    assert [f.expected_size for f in facts] == [_oracle_end(p) for p in shards]
    assert sum(f.tensor_count for f in facts) == 21


def test_the_type_tables_agree_with_the_gguf_package() -> None:
    for type_id, (name, block, size) in GGML_TYPES.items():
        qtype = gguf.GGMLQuantizationType(type_id)
        assert qtype.name == name
        assert gguf.GGML_QUANT_SIZES[qtype] == (block, size), name
    for file_type, name in FILE_TYPES.items():
        assert gguf.LlamaFileType(file_type).name in (f"MOSTLY_{name}", f"ALL_{name}")


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"<html>404</html>" * 10)
    with pytest.raises(InvalidModelFile, match="not a GGUF file") as exc:
        read_gguf(path)
    assert exc.value.status == 400 and exc.value.code == "invalid_model_file"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelFile, match="cannot read"):
        read_gguf(tmp_path / "none.gguf")


@pytest.mark.parametrize("version", [1, 4])
def test_unsupported_version(tmp_path: Path, version: int) -> None:
    path = tmp_path / "v.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, 0))
    with pytest.raises(InvalidModelFile, match=f"unsupported GGUF version {version}"):
        read_gguf(path)


@pytest.mark.parametrize("keep", [0.0, 0.001, 0.5, 0.99])
def test_a_file_cut_inside_its_header(tmp_path: Path, keep: float) -> None:
    whole = write_tiny_llama(tmp_path / "whole.gguf")
    header_end = min(int(t.data_offset) for t in gguf.GGUFReader(whole).tensors)
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole.read_bytes()[: max(4, int(header_end * keep))])
    with pytest.raises(InvalidModelFile, match="truncated header"):
        read_gguf(path)


def test_a_file_cut_inside_its_tensor_data(tmp_path: Path) -> None:
    whole = write_tiny_llama(tmp_path / "whole.gguf")
    data = whole.read_bytes()
    expected = read_gguf(whole).expected_size
    assert expected is not None and expected <= len(data)
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: expected - 1000])
    with pytest.raises(InvalidModelFile, match=f"truncated: {expected - 1000} of {expected} bytes"):
        read_gguf(path)


def _string(s: str, order: str) -> bytes:
    b = s.encode()
    return struct.pack(order + "Q", len(b)) + b


def _raw_gguf(order: str, ggml_type: int, *, arch: bool = True) -> bytes:
    """A GGUF with one 32-element tensor of `ggml_type`, built byte by byte."""
    kvs = _string("general.architecture", order) + struct.pack(order + "I", 8)
    kvs += _string("llama", order)
    # A string array (a vocabulary) the reader must step over.
    kvs += _string("tokenizer.ggml.tokens", order) + struct.pack(order + "IIQ", 9, 8, 3)
    kvs += b"".join(_string(t, order) for t in ("a", "bb", "ccc"))
    kvs += _string("llama.context_length", order) + struct.pack(order + "II", 4, 4096)
    head = b"GGUF" + struct.pack(order + "IQQ", 3, 1, 3 if arch else 2)
    if not arch:
        kvs = kvs[len(_string("general.architecture", order)) + 4 + len(_string("llama", order)) :]
    tensor = _string("t", order) + struct.pack(order + "IQIQ", 1, 32, ggml_type, 0)
    header = head + kvs + tensor
    header += b"\0" * (-len(header) % 32)
    return header + b"\1" * 32 * 4


def test_big_endian_files_are_read(tmp_path: Path) -> None:
    path = tmp_path / "be.gguf"
    path.write_bytes(_raw_gguf(">", 0))
    facts = read_gguf(path)
    assert (facts.architecture, facts.context_length) == ("llama", 4096)
    assert facts.expected_size == path.stat().st_size


def test_an_unknown_tensor_type_leaves_the_size_unknown(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    path.write_bytes(_raw_gguf("<", 99))
    facts = read_gguf(path)
    assert facts.expected_size is None and facts.context_length == 4096


def test_a_first_shard_must_name_its_architecture(tmp_path: Path) -> None:
    path = tmp_path / "noarch.gguf"
    path.write_bytes(_raw_gguf("<", 0, arch=False))
    with pytest.raises(InvalidModelFile, match="no general.architecture"):
        read_gguf(path)
