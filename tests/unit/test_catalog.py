"""Which models a server serves: `--model` flags (files, NAME=PATH, built-ins, store names),
or else every built-in, store model and preset path; built-in presets under the user's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ferrum.models import builtin
from ferrum.models.builtin import BUILTINS, DEFAULT_CHAT_MODEL
from ferrum.models.catalog import serve_specs
from ferrum.models.errors import ModelNotFound
from ferrum.models.presets import Preset
from ferrum.models.registry import ModelSpec
from ferrum.models.store import Manifest, ModelStore

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    return ModelStore(tmp_path / "models", lock_timeout=1)


@pytest.fixture(autouse=True)
def located(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every built-in's locate() replaced by a recorder: a real one would read an installed
    wheel or assemble a GGUF from parts, and none may run while the catalog is built."""
    calls: list[str] = []

    def fake(name: str) -> Callable[[], str]:
        def locate() -> str:
            calls.append(name)
            return f"/builtin/{name}.gguf"

        return locate

    for name in list(BUILTINS):  # same keys, same order: only the values change
        monkeypatch.setitem(builtin.BUILTINS, name, fake(name))
    return calls


def _gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF not really")  # the catalog never reads a model's file
    return path


def _add(store: ModelStore, tmp_path: Path, name: str, *, added: float = 1.0) -> Manifest:
    """A store model whose file lies outside the store (as an adopted file does)."""
    file = _gguf(tmp_path / "blobs" / f"{name.replace('/', '_').replace(':', '_')}.gguf")
    manifest = Manifest(
        name=name, source=f"hf:{name}@abc", files=(str(file),), size=file.stat().st_size,
        sha256="ab" * 32, architecture="llama", context_length=2048, has_chat_template=True,
        quant="Q4_K_M", added=added,
    )  # fmt: skip
    store.add(manifest)
    return manifest


def _by_name(specs: list[ModelSpec]) -> dict[str, ModelSpec]:
    return {s.name: s for s in specs}


def test_built_in_names_are_what_the_rest_assumes() -> None:
    assert DEFAULT_CHAT_MODEL == SMOL
    assert set(BUILTINS) == {SMOL, GEMMA}


def test_without_flags_built_ins_come_first_then_the_store_then_preset_paths(
    store: ModelStore, tmp_path: Path, located: list[str]
) -> None:
    zeta = _add(store, tmp_path, "zeta", added=5.0)
    repo = _add(store, tmp_path, "org/repo:Q4_K_M", added=7.0)
    _add(store, tmp_path, SMOL)  # a built-in also in the store: served once, as the built-in
    own = _gguf(tmp_path / "own.gguf")
    presets = {
        "own": Preset(path=str(own)),
        "missing": Preset(path=str(tmp_path / "later.gguf")),  # need not exist yet
        "zeta": Preset(path="/elsewhere/zeta.gguf", system="z"),  # the store's wins
        GEMMA: Preset(path="/elsewhere/gemma.gguf"),  # the built-in wins
        "settings-only": Preset(system="no path: nothing to serve"),
    }
    specs = serve_specs((), store, presets)

    assert [s.name for s in specs] == [SMOL, GEMMA, "org/repo:Q4_K_M", "zeta", "own", "missing"]
    got = _by_name(specs)
    assert got[SMOL].source == f"builtin:{SMOL}"
    assert got[GEMMA].source == f"builtin:{GEMMA}"
    assert got["zeta"].source == zeta.source and got["zeta"].created == 5.0
    assert got["zeta"].locate() == zeta.files[0]
    assert got["zeta"].preset.system == "z"  # a store model still takes its preset
    assert got["org/repo:Q4_K_M"].locate() == repo.files[0]
    assert got["own"].source == f"file:{own}" and got["own"].locate() == str(own)
    assert got["missing"].locate() == str(tmp_path / "later.gguf")
    assert located == []  # nothing was assembled or looked up while listing


def test_an_empty_store_serves_the_built_ins_with_the_default_first(store: ModelStore) -> None:
    specs = serve_specs((), store, {})
    assert [s.name for s in specs] == [SMOL, GEMMA]


def test_built_ins_are_located_lazily(store: ModelStore, located: list[str]) -> None:
    specs = _by_name(serve_specs((), store, {}))
    flagged = serve_specs((GEMMA, f"fast={SMOL}"), store, {})
    assert located == []
    assert specs[GEMMA].locate() == f"/builtin/{GEMMA}.gguf"
    assert flagged[1].locate() == f"/builtin/{SMOL}.gguf"
    assert located == [GEMMA, SMOL]


def test_a_file_is_named_by_its_stem_and_located_absolutely(
    store: ModelStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _gguf(tmp_path / "work" / "models" / "Tiny-Q4_K_M.gguf")
    monkeypatch.chdir(tmp_path / "work")
    [spec] = serve_specs(("models/Tiny-Q4_K_M.gguf",), store, {})
    assert spec.name == "Tiny-Q4_K_M"
    assert spec.locate() == str(model)  # absolute: the working folder may change later
    assert spec.source.startswith("file:") and spec.source.endswith("Tiny-Q4_K_M.gguf")


def test_a_file_under_home_is_found(
    store: ModelStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _gguf(tmp_path / "home" / "m.gguf")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    [spec] = serve_specs(("~/m.gguf",), store, {})
    assert (spec.name, spec.locate()) == ("m", str(model))


def test_name_equals_path_names_the_model(store: ModelStore, tmp_path: Path) -> None:
    a, b = _gguf(tmp_path / "a" / "model.gguf"), _gguf(tmp_path / "b" / "model.gguf")
    presets = {"chat": Preset(system="from the preset")}
    specs = serve_specs((f"chat={a}", f"other={b}"), store, presets)
    assert [(s.name, s.locate()) for s in specs] == [("chat", str(a)), ("other", str(b))]
    assert specs[0].preset.system == "from the preset"  # presets follow the given name
    assert specs[1].preset == Preset()


def test_a_built_in_by_name_or_renamed(store: ModelStore) -> None:
    specs = serve_specs((GEMMA, f"fast={SMOL}"), store, {})
    assert [(s.name, s.source) for s in specs] == [
        (GEMMA, f"builtin:{GEMMA}"),
        ("fast", f"builtin:{SMOL}"),
    ]
    assert specs[1].preset.sampling["temperature"] == 0.2  # the model's defaults go with it


def test_a_store_model_by_exact_or_untagged_name(store: ModelStore, tmp_path: Path) -> None:
    repo = _add(store, tmp_path, "org/repo:Q4_K_M", added=9.0)
    plain = _add(store, tmp_path, "plain")
    for arg in ("org/repo:Q4_K_M", "ORG/Repo:q4_k_m", "org/repo"):
        [spec] = serve_specs((arg,), store, {})
        assert spec.name == "org/repo:Q4_K_M", arg  # the store's spelling, whatever was typed
        assert spec.locate() == repo.files[0]
        assert (spec.source, spec.created) == (repo.source, 9.0)
    [spec] = serve_specs(("plain:latest",), store, {})
    assert (spec.name, spec.locate()) == ("plain", plain.files[0])
    [spec] = serve_specs(("mine=org/repo",), store, {"mine": Preset(system="s")})
    assert (spec.name, spec.locate(), spec.preset.system) == ("mine", repo.files[0], "s")


def test_a_missing_gguf_is_not_looked_up_in_the_store(store: ModelStore, tmp_path: Path) -> None:
    for arg in (str(tmp_path / "nope.gguf"), "x=./nope.gguf", "nope.gguf"):
        with pytest.raises(ValueError, match="model file not found") as info:
            serve_specs((arg,), store, {})
        assert not isinstance(info.value, ModelNotFound)
        assert "nope.gguf" in str(info.value)


def test_an_unknown_name_lists_built_ins_and_store_models(
    store: ModelStore, tmp_path: Path
) -> None:
    _add(store, tmp_path, "org/repo:Q4_K_M")
    _add(store, tmp_path, "org/repo:Q8_0")
    _add(store, tmp_path, "zeta")
    everything = sorted([SMOL, GEMMA, "org/repo:Q4_K_M", "org/repo:Q8_0", "zeta"])
    for arg in ("nonesuch", "x=nonesuch", "org/repo"):  # the last: which tag is meant?
        with pytest.raises(ModelNotFound) as info:
            serve_specs((arg,), store, {})
        assert info.value.available == everything
        for name in everything:
            assert repr(name) in str(info.value)


def test_a_name_given_twice_is_refused(store: ModelStore, tmp_path: Path) -> None:
    a, b = _gguf(tmp_path / "a" / "m.gguf"), _gguf(tmp_path / "b" / "m.gguf")
    _add(store, tmp_path, "zeta")
    for args in (
        (str(a), str(b)),  # two files with one stem
        (str(a), str(a)),
        (SMOL, SMOL),
        (f"{GEMMA}={a}", GEMMA),
        ("zeta", f"zeta={a}"),
    ):
        with pytest.raises(ValueError, match="given twice"):
            serve_specs(args, store, {})


def test_the_built_in_chat_models_defaults_sit_under_the_users_preset(
    store: ModelStore,
) -> None:
    bare = _by_name(serve_specs((), store, {}))[SMOL].preset
    defaults = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 1024}
    assert bare.sampling == defaults

    user = Preset(sampling={"temperature": 0.8, "seed": 1}, engine={"ctx_size": 2048},
                  keep_alive=-1.0)  # fmt: skip
    for specs in (serve_specs((), store, {SMOL: user}), serve_specs((SMOL,), store, {SMOL: user})):
        preset = _by_name(specs)[SMOL].preset
        assert preset.sampling == {**defaults, "temperature": 0.8, "seed": 1}
        assert preset.engine == {"ctx_size": 2048}
        assert preset.keep_alive == -1.0
    assert builtin.BUILTIN_PRESETS[SMOL].sampling["temperature"] == 0.2  # not changed in place


def test_built_in_defaults_stay_with_built_ins(store: ModelStore, tmp_path: Path) -> None:
    # A file or store model that happens to be named like a built-in is not that model.
    other = _gguf(tmp_path / "other.gguf")
    [spec] = serve_specs((f"{SMOL}={other}",), store, {})
    assert spec.preset == Preset()
    gemma = _by_name(serve_specs((), store, {}))[GEMMA]
    assert gemma.preset == Preset()
