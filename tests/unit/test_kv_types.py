"""KV cache cell types and flash attention as a user sets them (llama-server's flags, the
environment, a presets file), what is refused at start, and what every byte count says."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ferrum.cli import _build, _check, main, make_parser
from ferrum.config import EngineConfig, ModelsConfig, ServerConfig
from ferrum.engine.outputs import StepStats
from ferrum.errors import ModelLoadError
from ferrum.kv_types import CELL_TYPES, check_head_sizes, kv_bytes_per_cell
from ferrum.metrics import Metrics
from ferrum.models.memory import estimate_bytes, kv_bytes_per_token
from ferrum.models.presets import Preset, load_presets
from ferrum.models.registry import ModelSpec
from ferrum.server import _Loader
from ferrum.server_metrics import ServerMetrics
from tests.factories import FakeRunner, fake_app, model_info
from tests.tiny_models import write_tiny_llama


def _engine(argv: list[str]) -> EngineConfig:
    return _build(EngineConfig, make_parser().parse_args(["serve", *argv]))


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ferrum: error: ") and "\n" not in err
    return err


def test_llama_servers_flags_are_accepted() -> None:
    cfg = _engine(["-ctk", "q8_0", "-ctv", "q4_0", "-fa", "on"])
    assert (cfg.cache_type_k, cfg.cache_type_v, cfg.flash_attn) == ("q8_0", "q4_0", "on")
    cfg = _engine(["--cache-type-k", "bf16", "--cache-type-v", "f32", "--flash-attn", "off"])
    assert (cfg.cache_type_k, cfg.cache_type_v, cfg.flash_attn) == ("bf16", "f32", "off")
    assert (EngineConfig().cache_type_k, EngineConfig().flash_attn) == ("f16", "auto")
    cluster = _build(
        EngineConfig, make_parser().parse_args(["cluster", "-ctk", "q8_0", "-fa", "on"])
    )
    assert (cluster.cache_type_k, cluster.flash_attn) == ("q8_0", "on")


def test_the_environment_sets_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRUM_CACHE_TYPE_K", "q5_1")
    monkeypatch.setenv("FERRUM_CACHE_TYPE_V", "iq4_nl")
    monkeypatch.setenv("FERRUM_FLASH_ATTN", "on")
    cfg = _engine([])
    assert (cfg.cache_type_k, cfg.cache_type_v, cfg.flash_attn) == ("q5_1", "iq4_nl", "on")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["-ctv", "q8_0", "-fa", "off"], "--cache-type-v"),
        (["--cache-type-v", "q4_0", "--flash-attn", "off"], "--cache-type-v"),
        (["-ctk", "q3_k"], "--cache-type-k"),
        (["-ctv", "int8"], "--cache-type-v"),
        (["-fa", "maybe"], "--flash-attn"),
    ],
)
def test_impossible_settings_are_refused_at_start_naming_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], flag: str
) -> None:
    assert flag in _refused(capsys, ["--models-dir", str(tmp_path), *argv])


def test_a_quantized_k_without_flash_attention_is_allowed() -> None:
    # llama.cpp stores K untransposed either way: only V needs flash attention.
    _check(_engine(["-ctk", "q8_0", "-fa", "off"]), ModelsConfig())


def _presets(tmp_path: Path, body: str) -> str:
    path = tmp_path / "presets.toml"
    path.write_text('[models."smollm2-135m-instruct"]\n' + body)
    return str(path)


def test_a_preset_sets_a_models_kv_types(tmp_path: Path) -> None:
    body = 'cache_type_k = "q8_0"\ncache_type_v = "q8_0"\nflash_attn = "on"\n'
    preset = load_presets(_presets(tmp_path, body))["smollm2-135m-instruct"]
    assert preset.engine == {"cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"}


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ('cache_type_k = "q9"\n', "cache_type_k"),
        ('flash_attn = "yes"\n', "flash_attn"),
        ("cache_type_v = 8\n", "cache_type_v"),
    ],  # fmt: skip
)
def test_a_bad_preset_value_is_refused_naming_the_key(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, body: str, key: str
) -> None:
    presets = _presets(tmp_path, body)
    err = _refused(capsys, ["--models-dir", str(tmp_path), "--presets", presets])
    assert key in err and "presets.toml" in err


def test_a_presets_quantized_v_with_the_flags_flash_attention_off_is_refused_at_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    presets = _presets(tmp_path, 'cache_type_v = "q8_0"\n')
    argv = ["--models-dir", str(tmp_path), "--presets", presets, "-fa", "off"]
    err = _refused(capsys, argv)
    assert "--cache-type-v" in err and "smollm2-135m-instruct" in err


def test_a_block_that_does_not_divide_the_head_size_is_refused_naming_the_flag() -> None:
    check_head_sizes("f16", "f16", 16, 16)
    check_head_sizes("q8_0", "q4_0", 64, 64)
    with pytest.raises(ValueError, match="--cache-type-k q8_0"):
        check_head_sizes("q8_0", "f16", 16, 16)
    with pytest.raises(ValueError, match="--cache-type-v q4_1"):
        check_head_sizes("f16", "q4_1", 64, 48)


def test_a_default_model_whose_heads_the_block_does_not_divide_is_refused_at_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    llama = str(write_tiny_llama(tmp_path / "llama.gguf"))  # heads of 16 values
    argv = ["--models-dir", str(tmp_path), "-m", llama, "-ctk", "q8_0", "--cache-disk", "0"]
    err = _refused(capsys, argv)
    assert "--cache-type-k q8_0" in err and "16 values" in err


def test_another_model_whose_heads_the_block_does_not_divide_is_refused_at_its_load(
    tmp_path: Path,
) -> None:
    llama = str(write_tiny_llama(tmp_path / "llama.gguf"))
    cfg = EngineConfig(cache_type_k="f16", cache_type_v="q4_0")
    with ThreadPoolExecutor(1) as threads:
        loader = _Loader(cfg, ServerConfig(), ServerMetrics(), threads)
        with pytest.raises(ModelLoadError, match="--cache-type-v q4_0"):
            loader._build(ModelSpec("other", lambda: llama))


def test_bytes_per_cell_follow_the_types() -> None:
    # 2 layers x 1 KV head x 64 values: ggml's block sizes (f16: 2 bytes a value,
    # q8_0: 34 bytes per 32, q4_0: 18 bytes per 32).
    assert kv_bytes_per_cell(128, 128, "f16", "f16") == 512
    assert kv_bytes_per_cell(128, 128, "q8_0", "q8_0") == 2 * 4 * 34
    assert kv_bytes_per_cell(128, 128, "q4_0", "q8_0") == 4 * 18 + 4 * 34
    assert kv_bytes_per_cell(128, 128, "f32", "bf16") == 128 * 4 + 128 * 2
    every = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"}
    assert set(CELL_TYPES) == every


def test_the_registrys_estimate_follows_the_types(tmp_path: Path) -> None:
    llama = str(write_tiny_llama(tmp_path / "llama.gguf"))  # 2 layers x 2 KV heads x 16
    weights = Path(llama).stat().st_size
    assert kv_bytes_per_token(llama) == 2 * 2 * 32 * 2
    assert kv_bytes_per_token(llama, "q8_0", "q8_0") == 2 * (64 // 32) * 34
    assert estimate_bytes(llama, 1024, "q8_0", "q4_0") == weights + 1024 * (2 * 34 + 2 * 18)
    assert estimate_bytes(llama, 1024) == weights + 1024 * 256
    # What the registry weighs against --memory-budget: a model's preset types over the flags'.
    preset = Preset(engine={"cache_type_k": "q8_0", "cache_type_v": "q8_0"})
    with ThreadPoolExecutor(1) as threads:
        loader = _Loader(EngineConfig(ctx_size=1024), ServerConfig(), ServerMetrics(), threads)
        assert loader.estimate(ModelSpec("m", lambda: llama, preset=preset)) == (
            weights + 1024 * 4 * 34
        )
        assert loader.estimate(ModelSpec("f", lambda: llama)) == weights + 1024 * 256


def test_metrics_show_the_kv_bytes_in_use_and_the_types() -> None:
    metrics = Metrics()
    metrics.set_kv_types("q8_0", "q4_0", "on")
    metrics.on_step(StepStats(kv_bytes_used=4352, kv_bytes_total=8704, kv_usage=0.5))
    text = metrics.render().decode()
    assert "ferrum_kv_cache_bytes 4352.0" in text
    info = 'ferrum_kv_cache_type_info{flash_attn="on",type_k="q8_0",type_v="q4_0"} 1.0'
    assert info in text
    snap = metrics.snapshot()
    assert (snap["kv_cache_bytes"], snap["kv_cache_bytes_total"]) == (4352, 8704)
    assert snap["kv_cache_types"] == {"type_k": "q8_0", "type_v": "q4_0", "flash_attn": "on"}


def test_health_and_ollamas_ps_and_show_report_the_cache_in_use() -> None:
    info = model_info(cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on")
    runner = FakeRunner(info=info.__class__(**{**info.__dict__, "kv_bytes_per_cell": 68}))
    with TestClient(fake_app(runner)) as client:
        body = {"model": "fake", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
        health = client.get("/health").json()
        ps = client.get("/api/ps").json()["models"][0]
        show = client.post("/api/show", json={"model": "fake"}).json()
    # 64 blocks of 16 cells at 68 bytes a cell; the engine's gauges count blocks in use.
    fake = health["models"]["fake"]
    assert fake["kv_cache_bytes_total"] == health["kv_cache_bytes_total"] == 1024 * 68
    assert fake["kv_cache_bytes"] == round(fake["kv_cache_usage_ratio"] * 1024 * 68)
    expected = {"type_k": "q8_0", "type_v": "q8_0", "flash_attn": "on", "bytes_per_token": 68}
    assert ps["kv_cache"] == expected | {"bytes": 1024 * 68}
    assert show["kv_cache"] == ps["kv_cache"]
