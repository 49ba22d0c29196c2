"""`--lora` and `--lora-scaled`: the forms llama-server and ferrum accept, ids in the order of
both flags together, and each mistake refused at start with the flag named."""

from __future__ import annotations

import pytest

from ferrum.cli import _build, make_parser
from ferrum.config import ModelsConfig
from ferrum.models.adapters import LoraAdapter, attach, parse_lora_flag
from ferrum.models.presets import Preset
from ferrum.models.registry import ModelSpec


def _lora(*argv: str) -> tuple[str, ...]:
    return _build(ModelsConfig, make_parser().parse_args(["serve", *argv])).lora


@pytest.fixture
def files(tmp_path):
    for n in ("a", "b", "c"):
        (tmp_path / f"{n}.gguf").write_bytes(b"GGUF")
    return {n: str(tmp_path / f"{n}.gguf") for n in ("a", "b", "c")}


def _specs(*names: str) -> list[ModelSpec]:
    return [ModelSpec(n, lambda: "", preset=Preset(aliases=(f"{n}-alias",))) for n in names]


def test_ids_follow_the_order_of_both_flags(files):
    flags = _lora("--lora", files["a"], "--lora-scaled", files["b"], "0.5", "--lora",
                  f"sql={files['c']}")  # fmt: skip
    (spec,) = attach(_specs("base"), flags)
    assert spec.adapters == (
        LoraAdapter("a", files["a"], 1.0),
        LoraAdapter("b", files["b"], 0.5),
        LoraAdapter("sql", files["c"], 1.0),
    )


def test_forms_of_one_flag():
    assert parse_lora_flag("/m/x.gguf").adapter == LoraAdapter("x", "/m/x.gguf")
    assert parse_lora_flag("n=/m/x.gguf@0.25").adapter == LoraAdapter("n", "/m/x.gguf", 0.25)
    flag = parse_lora_flag("base:n=/m/x.gguf")
    assert (flag.base, flag.adapter.name) == ("base", "n")
    assert parse_lora_flag("/m/a@b.gguf").adapter.path == "/m/a@b.gguf"  # not a scale


def test_several_models_need_the_base_named(files):
    with pytest.raises(ValueError, match="BASE:NAME=PATH"):
        attach(_specs("one", "two"), [f"x={files['a']}"])
    specs = attach(_specs("one", "two"), [f"two-alias:x={files['a']}"])
    assert [len(s.adapters) for s in specs] == [0, 1]
    with pytest.raises(ValueError, match="no model 'three'"):
        attach(_specs("one", "two"), [f"three:x={files['a']}"])


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("x=/nowhere/x.gguf", "file not found"),
        ("x={a}@nan", "finite"),
        ("x={a}@1000", "finite"),
        ("x=", "no adapter file"),
    ],
)
def test_bad_flags_are_refused(files, flag, message):
    with pytest.raises(ValueError, match=message):
        attach(_specs("base"), [flag.format(**files)])


def test_a_name_given_twice_is_refused(files):
    with pytest.raises(ValueError, match="already has"):
        attach(_specs("base"), [f"x={files['a']}", f"x={files['b']}"])


def test_lora_scaled_needs_a_number(files, capsys):
    with pytest.raises(SystemExit):
        _lora("--lora-scaled", files["a"], "big")
    assert "not a number" in capsys.readouterr().err


def _preset_specs(tmp_path, body: str) -> list[ModelSpec]:
    from ferrum.models.presets import load_presets

    (tmp_path / "presets.toml").write_text(body)
    presets = load_presets(str(tmp_path / "presets.toml"))
    return [ModelSpec(n, lambda: "", preset=presets.get(n, Preset())) for n in ("base", "other")]


def test_a_presets_adapters_are_its_models_first_ids_paths_from_the_file(files, tmp_path):
    body = """
[models.base]
lora = ["support=a.gguf@0.5", "b.gguf"]
[models.other.lora]
sql = "c.gguf@2"
"""
    base, other = attach(_preset_specs(tmp_path, body), [f"base:late={files['c']}"])
    assert base.adapters == (
        LoraAdapter("support", files["a"], 0.5),  # relative to the presets file
        LoraAdapter("b", files["b"], 1.0),
        LoraAdapter("late", files["c"], 1.0),  # the flags' after the preset's
    )
    assert other.adapters == (LoraAdapter("sql", files["c"], 2.0),)


@pytest.mark.parametrize(
    ("lora", "words"),
    [
        ('["x=a.gguf@nan"]', "finite"),
        ('["x=a.gguf@1e9"]', "finite"),
        ('["other:x=a.gguf"]', "own model"),
        ('"a.gguf"', "list"),
        ("[1]", "list"),
    ],
)
def test_bad_preset_adapters_are_refused_naming_the_file_and_model(files, tmp_path, lora, words):
    with pytest.raises(ValueError, match=words) as info:
        _preset_specs(tmp_path, f"[models.base]\nlora = {lora}\n")
    assert "presets file" in str(info.value) and "'base'" in str(info.value)


def test_a_preset_adapter_file_that_is_missing_is_refused_at_start(files, tmp_path):
    specs = _preset_specs(tmp_path, '[models.base]\nlora = ["x=nope.gguf"]\n')
    with pytest.raises(ValueError, match="file not found"):
        attach(specs, [])


def test_lora_dir_is_repeatable_and_off_by_default():
    parsed = make_parser().parse_args(["serve", "--lora-dir", "/a", "--lora-dir", "/b"])
    assert _build(ModelsConfig, parsed).lora_dirs == ("/a", "/b")
    assert _build(ModelsConfig, make_parser().parse_args(["serve"])).lora_dirs == ()
