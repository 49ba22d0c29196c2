"""Which served model a stored LoRA adapter's base names (`store_adapters.base_matches`), and
how the store's adapters are attached at start (`attach_stored`)."""

from __future__ import annotations

import pytest

from ferrum.models.adapters import LoraAdapter
from ferrum.models.presets import Preset
from ferrum.models.registry import ModelSpec
from ferrum.models.store import Manifest
from ferrum.models.store_adapters import adapter_name, attach_stored, base_matches


def _spec(name: str, *aliases: str, adapters: tuple = ()) -> ModelSpec:
    return ModelSpec(name, lambda: "", preset=Preset(aliases=aliases), adapters=adapters)


@pytest.mark.parametrize(
    ("base", "served", "matches"),
    [
        ("org/Model", "org/Model-GGUF:Q4_K_M", True),  # the Hub's model, a GGUF repo's quant
        ("ORG/model-gguf", "org/Model-GGUF:Q8_0", True),
        ("org/Model", "other/Model-GGUF:Q4_K_M", False),  # another organization's
        ("org/Model", "org/Model-2-GGUF:Q4_K_M", False),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct", True),  # a built-in
        ("HuggingFaceTB/SmolLM2-360M-Instruct", "smollm2-135m-instruct", False),
        ("tiny", "tiny", True),
        ("org/tiny", "tiny", True),
    ],
)
def test_a_base_names_its_model_however_the_store_spells_it(base, served, matches):
    assert base_matches(base, _spec(served)) is matches


def test_an_alias_names_the_base_too():
    assert base_matches("org/Model", _spec("mine", "org/Model-GGUF"))


def _manifest(name: str, base: str | None) -> Manifest:
    return Manifest(name, "hf:x@1", (f"/store/{name}.gguf",), 1, "0" * 64, "llama", None,
                    False, "F16", 0.0, base=base)  # fmt: skip


def test_stored_adapters_join_their_base_after_its_other_adapters():
    flagged = LoraAdapter("flagged", "/f.gguf")
    specs = [_spec("a/base-GGUF:Q4_K_M", adapters=(flagged,)), _spec("other")]
    stored = [
        _manifest("a/support-bot-GGUF:F16", "a/base"),
        _manifest("a/orphan:F16", "nobody/served"),  # left out: its base is not served
        _manifest("a/flagged:F16", "a/base"),  # left out: the name is taken
        _manifest("a/base-GGUF:Q4_K_M", None),  # a model: nothing to attach
    ]
    base, other = attach_stored(specs, stored)
    assert [a.name for a in base.adapters] == ["flagged", "support-bot-GGUF"]
    assert base.adapters[1].path == "/store/a/support-bot-GGUF:F16.gguf"
    assert other.adapters == ()


def test_an_adapter_is_named_by_its_store_names_repository_part():
    assert adapter_name(_manifest("org/Support Bot:F16", "x")) == "Support-Bot"
    assert adapter_name(_manifest("bot", "x")) == "bot"
