"""Per-model presets from TOML: what a file means, every mistake refused by file and key, and
how a preset lays over another."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ferrum.models import presets as presets_module
from ferrum.models.presets import Preset, load_presets, merge


def _write(tmp_path: Path, text: str, name: str = "presets.toml") -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return str(path)


def _refused(path: str, *needles: str) -> str:
    """The message of the ValueError loading `path` raises; it names the file and `needles`."""
    with pytest.raises(ValueError) as info:
        load_presets(path)
    message = str(info.value)
    for needle in (path, *needles):
        assert needle in message, f"{needle!r} missing from {message!r}"
    return message


def test_the_documented_example_parses_as_documented(tmp_path: Path) -> None:
    doc = presets_module.__doc__
    assert doc is not None
    example = doc.split("\n\n", 1)[1].split("Unknown keys")[0]
    loaded = load_presets(_write(tmp_path, example))
    assert loaded == {
        "smollm2-135m-instruct": Preset(
            engine={"ctx_size": 4096, "parallel": 4, "cache_type_k": "q8_0"},
            chat_template="chatml",
            aliases=("smol", "gpt-4o-mini"),
            system="You are a terse assistant.",
            keep_alive=600.0,
            sampling={"temperature": 0.2, "max_tokens": 256},
        ),
        "my-model": Preset(
            path="/models/my-model.gguf",
            lora=(
                f"support={tmp_path / 'adapters' / 'support.gguf'}@0.8",
                f"sql={tmp_path / 'sql.gguf'}@1.0",
            ),
        ),
    }


def test_every_key_parses_with_its_type(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        [models.full]
        path = "/abs/full.gguf"
        ctx_size = 8192
        parallel = 2
        batch_size = 512
        split_prefill = 128
        chat_template = "gemma"
        aliases = ["f"]
        system = "Be brief."
        keep_alive = -1
        [models.full.sampling]
        temperature = 1          # an integer where a number is wanted is fine
        top_p = 0.95
        top_k = 40
        min_p = 0.05
        max_tokens = 100
        presence_penalty = 0.5
        frequency_penalty = -0.5
        repetition_penalty = 1.1
        seed = 7

        [models.empty]
        """,
    )
    loaded = load_presets(path)
    full = loaded["full"]
    assert full.path == "/abs/full.gguf"
    assert full.engine == {
        "ctx_size": 8192, "parallel": 2, "batch_size": 512, "split_prefill": 128,
    }  # fmt: skip
    assert (full.chat_template, full.aliases, full.system) == ("gemma", ("f",), "Be brief.")
    assert full.keep_alive == -1.0  # negative: keep for good
    assert full.sampling == {
        "temperature": 1.0, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "max_tokens": 100,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "seed": 7,
    }  # fmt: skip
    assert type(full.sampling["temperature"]) is float
    assert type(full.sampling["top_k"]) is int
    assert loaded["empty"] == Preset()
    assert loaded["empty"].keep_alive is None  # unset: the server's default applies


def test_no_file_and_no_models_mean_no_presets(tmp_path: Path) -> None:
    assert load_presets("") == {}
    assert load_presets(_write(tmp_path, "# nothing yet\n")) == {}


def test_relative_paths_resolve_against_the_presets_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)  # the working folder must not matter
    path = _write(
        tmp_path,
        """
        [models.rel]
        path = "weights/rel.gguf"
        [models.up]
        path = "../up.gguf"
        [models.abs]
        path = "/srv/abs.gguf"
        [models.home]
        path = "~/home.gguf"
        """,
        name="conf/presets.toml",
    )
    loaded = load_presets(path)
    conf = tmp_path / "conf"
    assert Path(loaded["rel"].path) == conf / "weights" / "rel.gguf"
    assert Path(loaded["up"].path).resolve() == tmp_path / "up.gguf"
    assert loaded["abs"].path == "/srv/abs.gguf"
    assert Path(loaded["home"].path) == tmp_path / "home" / "home.gguf"


def test_missing_file_and_bad_toml_name_the_file(tmp_path: Path) -> None:
    _refused(str(tmp_path / "nope.toml"))
    _refused(_write(tmp_path, "[models.x\nctx_size = 1\n"))
    _refused(_write(tmp_path, "[models.x]\nctx_size = 1\nctx_size = 2\n"))


@pytest.mark.parametrize(
    "text",
    [
        "[model.x]\nctx_size = 1\n",  # a typo of the one table allowed
        "ctx_size = 4096\n",  # a setting outside any model
        "models = 3\n",
        'models = "x"\n',
    ],
)
def test_anything_but_models_tables_at_the_top_is_refused(tmp_path: Path, text: str) -> None:
    _refused(_write(tmp_path, text), "[models.NAME]")


def test_an_unknown_top_level_key_is_named(tmp_path: Path) -> None:
    _refused(_write(tmp_path, "[modles.x]\nctx_size = 1\n"), "modles")


def test_unknown_model_keys_are_named(tmp_path: Path) -> None:
    path = _write(tmp_path, "[models.m]\nctx_size = 1\nctxsize = 2\ntemperature = 0.2\n")
    _refused(path, "'m'", "ctxsize", "temperature")
    _refused(_write(tmp_path, "[models]\nm = 3\n"), "'m'", "table")


def test_unknown_sampling_keys_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, "[models.m.sampling]\ntemprature = 0.2\n")
    _refused(path, "'m'", "sampling", "temperature")  # at least the right spelling is listed
    _refused(_write(tmp_path, '[models.m]\nsampling = "hot"\n'), "'m'", "sampling")


def test_an_unknown_sampling_key_is_named(tmp_path: Path) -> None:
    _refused(_write(tmp_path, "[models.m.sampling]\ntemprature = 0.2\n"), "temprature")


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("ctx_size = true", "ctx_size"),  # a bool is not an integer, though Python says so
        ("parallel = 2.5", "parallel"),
        ("batch_size = 4096.0", "batch_size"),
        ('ctx_size = "4096"', "ctx_size"),
        ('sampling = { temperature = "0.2" }', "temperature"),
        ("sampling = { temperature = true }", "temperature"),
        ("sampling = { max_tokens = false }", "max_tokens"),
        ("sampling = { top_k = 1.5 }", "top_k"),
        ('sampling = { seed = "7" }', "seed"),
    ],
)
def test_wrong_types_name_the_model_and_key(tmp_path: Path, line: str, key: str) -> None:
    _refused(_write(tmp_path, f"[models.m]\n{line}\n"), "'m'", key)


@pytest.mark.parametrize(
    "line", ['keep_alive = "soon"', 'keep_alive = "5x"', "keep_alive = true", 'keep_alive = ""']
)
def test_bad_keep_alive_names_the_key(tmp_path: Path, line: str) -> None:
    _refused(_write(tmp_path, f"[models.m]\n{line}\n"), "'m'", "keep_alive")


def test_keep_alive_takes_seconds_or_go_durations(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[models.a]\nkeep_alive = 30\n[models.b]\nkeep_alive = "1h30m"\n'
        '[models.c]\nkeep_alive = "-1"\n[models.d]\nkeep_alive = 0\n',
    )
    got = {name: p.keep_alive for name, p in load_presets(path).items()}
    assert got == {"a": 30.0, "b": 5400.0, "c": -1.0, "d": 0.0}


@pytest.mark.parametrize(
    "line", ['aliases = "smol"', "aliases = [1, 2]", 'aliases = ["ok", 3]', "aliases = {a = 1}"]
)
def test_bad_aliases_name_the_key(tmp_path: Path, line: str) -> None:
    _refused(_write(tmp_path, f"[models.m]\n{line}\n"), "'m'", "aliases")


@pytest.mark.parametrize("line", ["system = 42", "chat_template = 1", "path = true"])
def test_string_keys_refuse_other_types(tmp_path: Path, line: str) -> None:
    _refused(_write(tmp_path, f"[models.m]\n{line}\n"), "'m'", line.split()[0])


def test_merge_lays_the_override_over_the_base_key_by_key() -> None:
    base = Preset(
        path="/base.gguf",
        engine={"ctx_size": 4096, "parallel": 4},
        chat_template="chatml",
        aliases=("b",),
        system="base system",
        keep_alive=300.0,
        sampling={"temperature": 0.2, "top_p": 0.9, "max_tokens": 1024},
    )
    override = Preset(
        engine={"parallel": 1, "batch_size": 64},
        system="own system",
        keep_alive=0.0,  # 0 (unload at once) is a setting, not "unset"
        sampling={"temperature": 0.7, "seed": 3},
    )
    merged = merge(base, override)
    assert merged == Preset(
        path="/base.gguf",
        engine={"ctx_size": 4096, "parallel": 1, "batch_size": 64},
        chat_template="chatml",
        aliases=("b",),
        system="own system",
        keep_alive=0.0,
        sampling={"temperature": 0.7, "top_p": 0.9, "max_tokens": 1024, "seed": 3},
    )
    # Neither input is changed, and an empty override leaves the base as it was.
    assert base.sampling == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 1024}
    assert override.engine == {"parallel": 1, "batch_size": 64}
    assert merge(base, Preset()) == base
    assert merge(Preset(), base) == base


def test_merge_takes_every_field_the_override_sets() -> None:
    base = Preset(path="/a", chat_template="chatml", aliases=("a",), system="s", keep_alive=1.0)
    override = Preset(path="/b", chat_template="gemma", aliases=("b", "c"), system="t",
                      keep_alive=-1.0)  # fmt: skip
    assert merge(base, override) == override
