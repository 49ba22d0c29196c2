"""`ferrum serve`'s flags: derived from the config dataclasses, each also FERRUM_<NAME>."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from ferrum.cli import _build, _check, main, make_parser
from ferrum.config import EngineConfig, ModelsConfig, ServerConfig
from ferrum.models.catalog import serve_specs, with_alias
from ferrum.models.store import ModelStore


def _configs(argv: list[str]) -> tuple[EngineConfig, ServerConfig]:
    args = make_parser().parse_args(["serve", *argv])
    return _build(EngineConfig, args), _build(ServerConfig, args)


def _models(argv: list[str]) -> ModelsConfig:
    return _build(ModelsConfig, make_parser().parse_args(["serve", *argv]))


def test_defaults_are_the_dataclass_defaults():
    assert _configs([]) == (EngineConfig(), ServerConfig())
    assert _models([]) == ModelsConfig()


def test_every_field_has_a_flag_of_its_type():
    argv = ["--ctx-size", "1024", "--inject-faults", "0.5", "--no-prefix-cache"]
    argv += ["--api-key", "a,b", "--api-key", "c", "--shutdown-grace", "2.5"]
    engine, server = _configs(argv)
    assert (engine.ctx_size, engine.inject_faults, engine.no_prefix_cache) == (1024, 0.5, True)
    assert (server.api_key, server.shutdown_grace) == (("a", "b", "c"), 2.5)
    models = _models(["-m", "a=x.gguf", "--model", "smollm2-135m-instruct", "--max-models", "2"])
    assert models.model == ("a=x.gguf", "smollm2-135m-instruct") and models.max_models == 2
    assert _models(["--models-max-bytes", "50GiB"]).models_max_bytes == "50GiB"
    assert _configs(["--split-prefill", "0"])[0].split_prefill == 0  # off
    parsed = vars(make_parser().parse_args(["serve"]))
    for cls in (EngineConfig, ServerConfig, ModelsConfig):
        assert {f.name for f in dataclasses.fields(cls)} <= parsed.keys()


def test_environment_variables_set_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("FERRUM_CTX_SIZE", "2048")
    monkeypatch.setenv("FERRUM_REQUEST_TIMEOUT", "7.5")
    monkeypatch.setenv("FERRUM_PUBLIC_METRICS", "yes")
    monkeypatch.setenv("FERRUM_API_KEY", "k1, k2")
    monkeypatch.setenv("FERRUM_SPLIT_PREFILL", "64")
    engine, server = _configs([])
    assert engine.ctx_size == 2048 and engine.split_prefill == 64
    assert (server.request_timeout, server.public_metrics) == (7.5, True)
    assert server.api_key == ("k1", "k2")
    engine, server = _configs(["--ctx-size", "512", "--api-key", "flag"])
    assert engine.ctx_size == 512 and server.api_key == ("flag",)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("FERRUM_CTX_SIZE", "lots"),
        ("FERRUM_PUBLIC_METRICS", "maybe"),
        ("FERRUM_REQUEST_TIMEOUT", "soon"),
    ],
)
def test_a_bad_variable_is_one_line_and_exit_2(monkeypatch, capsys, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as exit_:
        main(["serve"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ferrum: error: {var}") and "\n" not in err


def test_a_bad_flag_value_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_:
        make_parser().parse_args(["serve", "--ctx-size", "big"])
    assert exit_.value.code == 2
    assert "--ctx-size" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["--keep-alive", "soon"], ["--max-models", "-1"], ["--memory-budget", "lots"],
     ["--spec-recent", "-1"], ["--models-max-bytes", "lots"],
     ["--split-prefill", "-1"], ["--prefill-cap", "-1"]],  # fmt: skip
)
def test_a_bad_models_flag_is_one_line_and_exit_2(capsys, tmp_path, argv):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--models-dir", str(tmp_path), *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ferrum: error: ") and "\n" not in err


def _readme_serve_lines() -> list[list[str]]:
    """Every `ferrum serve` command line of the README's shell blocks, as argv after `serve`."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", readme, re.S)
    lines = [line.split("#")[0] for block in blocks for line in block.splitlines()]
    words = [shlex.split(line.split("&&")[-1]) for line in lines if "ferrum serve" in line]
    return [w[w.index("serve") + 1 :] for w in words]


def test_the_readmes_command_lines_parse_llama_server_habits_included():
    """Each `ferrum serve` line of the README goes through the parser and the start checks as
    `ferrum serve` runs them (no model loads); the llama-server-style one means what it means
    to llama-server: -m PATH named by -a, -c, -np, -t, --host, --port."""
    argvs = _readme_serve_lines()
    assert [] in argvs and any("-a" in argv for argv in argvs), argvs
    for argv in argvs:
        engine, server = _configs(argv)
        models = _models(argv)
        _check(engine, models)
        if "-a" in argv:
            assert with_alias(models.model, models.alias) == ("my-model=./model.gguf",)
            assert (engine.ctx_size, engine.parallel, engine.threads) == (8192, 4, 4)
            assert (server.host, server.port) == ("0.0.0.0", 8081)


def test_alias_names_the_one_model_given(tmp_path):
    gguf = tmp_path / "SmolLM2-135M.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    for flag in ("--alias", "-a"):
        models = _models(["-m", str(gguf), flag, "tiny"])
        (spec,) = serve_specs(models.model, ModelStore(str(tmp_path / "store")), {}, models.alias)
        assert spec.name == "tiny"
    (spec,) = serve_specs((str(gguf),), ModelStore(str(tmp_path / "store")), {})
    assert spec.name == "SmolLM2-135M.Q8_0"  # without an alias: the file's stem


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["-a", "tiny"], "no --model was given"),
        (["-m", "a.gguf", "-m", "b.gguf", "-a", "tiny"], "2 models were given"),
        (["-m", "other=a.gguf", "-a", "tiny"], "both name the model"),
    ],
)
def test_an_alias_that_names_no_single_model_is_refused_at_start(capsys, argv, says):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ferrum: error: --alias") and says in err and "\n" not in err
