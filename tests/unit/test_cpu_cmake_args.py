"""scripts/cpu-cmake-args: the kernel flags the install builds llama.cpp with, asked of a fake
compiler that reports a chosen CPU's extensions."""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cpu-cmake-args"
SAPPHIRE_RAPIDS = ["SSE4_2", "AVX", "AVX2", "FMA", "F16C", "BMI2", "AVXVNNI", "AVX512F",
                   "AVX512CD", "AVX512VL", "AVX512DQ", "AVX512BW", "AVX512VNNI", "AVX512VBMI",
                   "AVX512BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16"]  # fmt: skip

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 flags")


def _flags(tmp_path: Path, macros: list[str], **env: str) -> list[str]:
    cc = tmp_path / "cc"
    lines = "".join(f"#define __{m}__ 1\\n" for m in macros)
    cc.write_text(f"#!/bin/sh\nprintf '{lines}'\n")
    cc.chmod(0o755)
    out = subprocess.run([str(SCRIPT)], env={**os.environ, "CC": str(cc), **env},
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return shlex.split(out)  # as scikit-build-core splits CMAKE_ARGS


def test_every_extension_up_to_256_bits_when_avx512_is_declined(tmp_path):
    flags = _flags(tmp_path, SAPPHIRE_RAPIDS, FERRUM_AVX512="0")
    assert "-DGGML_NATIVE=OFF" in flags
    for name in ("AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI"):
        assert f"-DGGML_{name}=ON" in flags
    assert not any("AVX512" in f for f in flags)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert not any("AMX" in f and f.endswith("=ON") for f in flags)


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def test_an_avx512_host_builds_natively_without_amx(tmp_path):
    flags = _flags(tmp_path, SAPPHIRE_RAPIDS)
    assert "-DGGML_NATIVE=ON" in flags
    assert f"-DCMAKE_C_FLAGS={NO_AMX}" in flags and f"-DCMAKE_CXX_FLAGS={NO_AMX}" in flags
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert not any("AMX" in f and f.endswith("=ON") for f in flags)
    no_bw = _flags(tmp_path, [m for m in SAPPHIRE_RAPIDS if m != "AVX512BW"])
    assert "-DGGML_NATIVE=OFF" in no_bw and not any("AVX512" in f for f in no_bw)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_gcc_keeps_amx_off_against_a_later_march_that_has_it():
    """What the native build relies on: cmake puts CMAKE_C_FLAGS before ggml's -march=native,
    and GCC keeps an explicit -mno-amx-* against a later -march whose CPU has AMX."""

    def amx_macros(*args: str) -> list[str]:
        out = subprocess.run(["gcc", *args, "-dM", "-E", "-x", "c", os.devnull],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        return [line for line in out.splitlines() if "AMX" in line]

    assert amx_macros("-march=sapphirerapids")  # the CPU named has AMX
    assert amx_macros(*NO_AMX.split(), "-march=sapphirerapids") == []


def test_an_avx2_machine_gets_no_more_than_it_has(tmp_path):
    flags = _flags(tmp_path, ["SSE4_2", "AVX", "AVX2", "FMA", "F16C", "BMI2"])
    assert "-DGGML_AVX2=ON" in flags and "-DGGML_FMA=ON" in flags
    assert "-DGGML_NATIVE=OFF" in flags
    assert not any(x in f for f in flags for x in ("VNNI", "AVX512"))
