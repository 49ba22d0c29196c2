"""The model store: manifests, lookup rules, atomic writes, locks, removal and copies."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ferrum.errors import InvalidRequest
from ferrum.models.errors import ModelBusy, ModelNotFound
from ferrum.models.store import Manifest, ModelStore, default_models_dir, slug
from tests.models.conftest import store_tree


def _manifest(name: str, files: list[Path], **kw: object) -> Manifest:
    fields: dict[str, object] = {
        "name": name, "source": f"test:{name}", "files": tuple(str(f) for f in files),
        "size": sum(f.stat().st_size for f in files), "sha256": "ab" * 32,
        "architecture": "llama", "context_length": 2048, "has_chat_template": True,
        "quant": "Q4_K_M", "added": 1.0,
    }  # fmt: skip
    return Manifest(**{**fields, **kw})  # type: ignore[arg-type]


def _add_owned(store: ModelStore, name: str, *files: str) -> Manifest:
    """A model whose files the store owns (as a pull leaves them)."""
    d = store.files_dir(name)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in files or ("model.gguf",):
        (d / f).write_bytes(f"{name}/{f}".encode())
        paths.append(d / f)
    manifest = _manifest(name, paths)
    store.add(manifest)
    return manifest


def test_a_manifest_round_trips_and_bad_ones_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "x.gguf"
    f.write_bytes(b"x")
    m = _manifest("org/repo:Q4_K_M", [f], context_length=None, quant=None)
    assert Manifest.from_json(m.to_json()) == m
    text = m.to_json()
    mistyped = ('"size": 1', '"size": "1"'), ('"has_chat_template": true', '"has_chat_template": 1')
    for broken in ("{}", "[]", *(text.replace(old, new) for old, new in mistyped)):
        assert broken != text
        with pytest.raises(ValueError):
            Manifest.from_json(broken)


def test_default_models_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FERRUM_MODELS_DIR", str(tmp_path / "a"))
    assert default_models_dir() == tmp_path / "a"
    monkeypatch.delenv("FERRUM_MODELS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_models_dir() == tmp_path / "xdg" / "ferrum" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_models_dir() == tmp_path / "home" / ".cache" / "ferrum" / "models"


def test_names_are_unique_regardless_of_case_and_stay_file_safe() -> None:
    assert slug("Org/Repo:Q4_K_M") == slug("org/repo:q4_k_m")
    for name in ("org/repo:Q4", "..", "a/../../b", "x:y.gguf"):
        assert "/" not in slug(name) and ":" not in slug(name) and "." not in slug(name)
    for bad in ("", " x", "a\nb", "x" * 201):
        with pytest.raises(InvalidRequest):
            slug(bad)


def test_list_is_sorted_and_get_names_what_exists(store: ModelStore) -> None:
    for name in ("zeta", "Alpha", "org/repo:Q8_0"):
        _add_owned(store, name)
    assert [m.name for m in store.list()] == ["Alpha", "org/repo:Q8_0", "zeta"]
    assert store.get("alpha").name == "Alpha"
    with pytest.raises(ModelNotFound) as exc:
        store.get("beta")
    assert exc.value.status == 404 and exc.value.code == "model_not_found"
    assert "'Alpha', 'org/repo:Q8_0', 'zeta'" in exc.value.message


def test_resolve_rules(store: ModelStore) -> None:
    for name in ("org/one:Q4_K_M", "org/two:Q4_K_M", "org/two:Q8_0", "plain", "tagged:latest"):
        _add_owned(store, name)
    assert store.resolve("org/one:Q4_K_M").name == "org/one:Q4_K_M"  # exact
    assert store.resolve("ORG/One:q4_k_m").name == "org/one:Q4_K_M"  # any case
    assert store.resolve("plain:latest").name == "plain"  # ":latest" ignored
    assert store.resolve("tagged:latest").name == "tagged:latest"  # unless it is the name
    assert store.resolve("org/one").name == "org/one:Q4_K_M"  # the only tag
    with pytest.raises(ModelNotFound) as exc:
        store.resolve("org/two")  # two tags: which one?
    assert "'org/two:Q4_K_M', 'org/two:Q8_0'" in exc.value.message
    assert "plain" not in exc.value.message
    with pytest.raises(ModelNotFound):
        store.resolve("org/three")


def test_add_replaces_atomically(store: ModelStore, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _add_owned(store, "m")
    new = replace(old, quant="Q8_0")

    def crash(src: object, dst: object) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        store.add(new)
    monkeypatch.undo()
    assert store.get("m") == old  # the old manifest, whole
    assert list(store.manifests.glob(".*.tmp")) == []
    store.add(new)
    assert store.get("m") == new


def test_add_deletes_the_files_a_model_no_longer_lists(store: ModelStore) -> None:
    old = _add_owned(store, "m", "old.gguf")
    new = _add_owned(store, "m", "new.gguf")
    assert not os.path.exists(old.files[0]) and os.path.exists(new.files[0])


def test_opening_cleans_orphans_but_not_a_pull_in_progress(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    kept = _add_owned(store, "kept")
    orphan = store.files_dir("orphan")
    orphan.mkdir()
    (orphan / "x.gguf").write_bytes(b"x")
    moving = store.files_dir("moving")  # a pull is moving these in, holding the lock
    moving.mkdir()
    stale = store.manifests / ".x.1.tmp"
    stale.write_text("{")
    os.utime(stale, (time.time() - 3600,) * 2)
    fresh = store.manifests / ".y.2.tmp"
    fresh.write_text("{")
    with store.lock("moving"):
        ModelStore(tmp_path)
    assert not orphan.exists() and not stale.exists()
    assert moving.exists() and fresh.exists()
    assert os.path.exists(kept.files[0])


def test_a_corrupted_manifest_is_ignored_with_a_warning(
    store: ModelStore, caplog: pytest.LogCaptureFixture
) -> None:
    _add_owned(store, "good")
    bad = _add_owned(store, "bad")
    (store.manifests / f"{slug('bad')}.json").write_text('{"version": 1, "name": "ba')
    with caplog.at_level(logging.WARNING, "ferrum.models"):
        assert [m.name for m in store.list()] == ["good"]
        with pytest.raises(ModelNotFound):
            store.get("bad")
    assert "unreadable model manifest" in caplog.text
    # Its files count as orphans now: the next open removes them.
    (store.manifests / f"{slug('bad')}.json").unlink()
    ModelStore(store.root)
    assert not os.path.exists(bad.files[0])


def test_remove_leaves_no_orphans_and_never_touches_outside_files(
    store: ModelStore, tmp_path: Path
) -> None:
    _add_owned(store, "org/repo:Q4_K_M", "a-00001-of-00002.gguf", "a-00002-of-00002.gguf")
    outside = tmp_path / "mine.gguf"
    outside.write_bytes(b"mine")
    store.add(_manifest("adopted", [outside]))
    store.partial_dir("org/repo:Q4_K_M").mkdir()
    assert store.remove("org/repo").name == "org/repo:Q4_K_M"
    assert store.remove("adopted").name == "adopted"
    assert store_tree(store) == set() and list(store.files.iterdir()) == []
    assert outside.read_bytes() == b"mine"
    with pytest.raises(ModelNotFound):
        store.remove("adopted")


@pytest.mark.parametrize("name", ["/" * 100, "é" * 50 + "x", "a:" * 90])
def test_a_name_too_long_for_a_file_name_is_refused_naming_the_parameter(
    store: ModelStore, name: str
) -> None:
    """Under 200 characters, but percent-encoded past the 255 bytes of a file name."""
    _add_owned(store, "src")
    with pytest.raises(InvalidRequest, match="too long") as err:
        store.copy("src", name)
    assert err.value.param == "destination"
    with pytest.raises(InvalidRequest, match="too long") as err:
        store.add(_manifest(name, [Path(store.get("src").files[0])]))
    assert err.value.param == "model"
    store.copy("src", "b" * 200)  # the longest a plain name may be
    assert [m.name for m in store.list()] == ["b" * 200, "src"]


def test_copies_survive_the_removal_of_either(store: ModelStore, tmp_path: Path) -> None:
    src = _add_owned(store, "src", "m.gguf")
    dst = store.copy("src", "dst")
    assert dst.source == "copy:src" and dst.sha256 == src.sha256
    assert dst.files[0] != src.files[0] and os.path.samefile(dst.files[0], src.files[0])
    store.remove("src")
    assert Path(store.get("dst").files[0]).read_bytes() == b"src/m.gguf"
    again = store.copy("dst", "src")
    store.remove("dst")
    assert Path(store.get("src").files[0]).read_bytes() == b"src/m.gguf"
    outside = tmp_path / "o.gguf"
    outside.write_bytes(b"o")
    store.add(_manifest("adopted", [outside]))
    assert store.copy("adopted", "alias").files == (str(outside),)  # referenced, not linked
    with pytest.raises(InvalidRequest, match="onto itself"):
        store.copy("src", "SRC")
    assert again.name == "src"


def test_a_busy_name_waits_then_raises_model_busy(tmp_path: Path) -> None:
    holder = ModelStore(tmp_path)
    _add_owned(holder, "m")
    other = ModelStore(tmp_path, lock_timeout=0.2)  # as if another process
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with holder.lock("m"):
            held.set()
            release.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    try:
        started = time.monotonic()
        with pytest.raises(ModelBusy) as exc:
            other.remove("m")
        assert time.monotonic() - started >= 0.2
        assert exc.value.status == 409 and exc.value.code == "model_busy"
        assert other.get("m")  # untouched
    finally:
        release.set()
        t.join()
    other.remove("m")
    assert other.list() == []
