"""scripts/cpu-cmake-args: the kernel flags the install builds llama.cpp with, asked of a fake
compiler that reports a chosen CPU's extensions."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cpu-cmake-args"
SAPPHIRE_RAPIDS = ["SSE4_2", "AVX", "AVX2", "FMA", "F16C", "BMI2", "AVXVNNI", "AVX512F",
                   "AVX512CD", "AVX512VL", "AVX512DQ", "AVX512BW", "AVX512VNNI", "AVX512VBMI",
                   "AVX512BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16"]  # fmt: skip

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 flags")


def _flags(tmp_path: Path, macros: list[str], **env: str) -> set[str]:
    cc = tmp_path / "cc"
    lines = "".join(f"#define __{m}__ 1\\n" for m in macros)
    cc.write_text(f"#!/bin/sh\nprintf '{lines}'\n")
    cc.chmod(0o755)
    out = subprocess.run([str(SCRIPT)], env={**os.environ, "CC": str(cc), **env},
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return set(out.split())


def test_every_extension_up_to_256_bits_and_never_amx(tmp_path):
    flags = _flags(tmp_path, SAPPHIRE_RAPIDS)
    assert "-DGGML_NATIVE=OFF" in flags
    for name in ("AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI"):
        assert f"-DGGML_{name}=ON" in flags
    assert not any("AVX512" in f for f in flags)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= flags
    assert not any("AMX" in f and f.endswith("=ON") for f in flags)


def test_avx512_on_request_and_only_with_its_whole_base(tmp_path):
    wide = _flags(tmp_path, SAPPHIRE_RAPIDS, FERRUM_AVX512="1")
    for name in ("AVX512", "AVX512_VNNI", "AVX512_VBMI", "AVX512_BF16", "AVX_VNNI"):
        assert f"-DGGML_{name}=ON" in wide
    assert not any("AMX" in f and f.endswith("=ON") for f in wide)
    no_bw = _flags(tmp_path, [m for m in SAPPHIRE_RAPIDS if m != "AVX512BW"], FERRUM_AVX512="1")
    assert not any("AVX512" in f for f in no_bw)


def test_an_avx2_machine_gets_no_more_than_it_has(tmp_path):
    flags = _flags(tmp_path, ["SSE4_2", "AVX", "AVX2", "FMA", "F16C", "BMI2"], FERRUM_AVX512="1")
    assert "-DGGML_AVX2=ON" in flags and "-DGGML_FMA=ON" in flags
    assert not any(x in f for f in flags for x in ("VNNI", "AVX512"))
