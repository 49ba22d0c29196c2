"""Pulls from the fake hub: the quantization picked, split models, gated repositories,
resuming, refused files, full disks, concurrent pulls and local files adopted in place."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path

import huggingface_hub
import pytest

from ferrum.errors import InvalidRequest, NotFound
from ferrum.models import download as download_module
from ferrum.models import pull as pull_module
from ferrum.models.errors import (
    HubAccessDenied,
    InsufficientStorage,
    InvalidModelFile,
    ModelNotFound,
    NotOnHub,
    PullError,
)
from ferrum.models.gguf_file import read_gguf
from ferrum.models.pull import PullProgress, adopt, pull
from ferrum.models.reference import GGUFModel, choose, gguf_models, parse_reference, quant_of
from ferrum.models.store import ModelStore
from tests.models.conftest import (
    BROKEN,
    EMPTY,
    GATED,
    LLAMA,
    ODD,
    SPLIT,
    TOKEN,
    copy_file,
    store_tree,
    write_split_llama,
)
from tests.models.fake_hub import FakeHub
from tests.tiny_models import write_tiny_gemma3, write_tiny_llama


def _sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# -- references and picks (no hub) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "repo", "quant", "filename", "revision"),
    [
        ("org/repo", "org/repo", None, None, None),
        ("org/repo:q4_k_m", "org/repo", "Q4_K_M", None, None),
        ("hf.co/org/repo:IQ4_XS", "org/repo", "IQ4_XS", None, None),
        ("https://huggingface.co/org/repo", "org/repo", None, None, None),
        ("org/repo/sub/m-Q8_0.gguf", "org/repo", None, "sub/m-Q8_0.gguf", None),
        ("https://huggingface.co/org/repo/blob/dev/m.gguf", "org/repo", None, "m.gguf", "dev"),
    ],
)
def test_hub_references(ref, repo, quant, filename, revision) -> None:
    r = parse_reference(ref)
    assert (r.kind, r.repo, r.quant, r.filename, r.revision) == (
        "hub", repo, quant, filename, revision
    )


def test_file_references(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.gguf").write_bytes(b"x")
    assert parse_reference("./m.gguf") == parse_reference(str(tmp_path / "m.gguf"))
    assert parse_reference("here.gguf").path == str(tmp_path / "here.gguf")
    assert parse_reference("~/m.gguf").path == os.path.expanduser("~/m.gguf")
    for bad in ("llama3", "a/b/c", "org/repo:Q4 K"):
        with pytest.raises(InvalidRequest):
            parse_reference(bad)


def test_a_hub_name_longer_than_the_hub_allows_is_refused() -> None:
    for ref in (f"org/{'r' * 97}", f"hf.co/{'o' * 97}/repo:Q4_K_M", f"org/{'r' * 97}/m.gguf"):
        with pytest.raises(InvalidRequest, match="96 characters") as err:
            parse_reference(ref)
        assert err.value.param == "model"
    assert parse_reference(f"{'o' * 96}/{'r' * 96}").repo == f"{'o' * 96}/{'r' * 96}"


@pytest.mark.parametrize(
    ("name", "quant"),
    [
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("qwen2.5-0.5b-instruct-q8_0.gguf", "Q8_0"),
        ("model.IQ4_XS.gguf", "IQ4_XS"),
        ("gemma-2b-it-f16.gguf", "F16"),
        ("m-BF16-00001-of-00002.gguf", "BF16"),
        ("Qwen3-8B-UD-Q4_K_XL.gguf", "Q4_K_XL"),
        ("plain-model.gguf", None),
    ],
)
def test_quant_from_file_names(name: str, quant: str | None) -> None:
    assert quant_of(name) == quant


def test_a_repository_groups_shards_and_skips_projectors_and_incomplete_splits() -> None:
    sizes = {
        "m-Q4_K_M-00001-of-00002.gguf": 5, "m-Q4_K_M-00002-of-00002.gguf": 6,
        "m-Q8_0-00001-of-00002.gguf": 9,  # its second shard is missing
        "mmproj-m-f16.gguf": 3, "sub/m-Q2_K.gguf": 4, "README.md": 1,
    }  # fmt: skip
    models = gguf_models(sizes)
    assert [(m.quant, m.files, m.size) for m in models] == [
        ("Q4_K_M", ("m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf"), 11),
        ("Q2_K", ("sub/m-Q2_K.gguf",), 4),
    ]


def test_the_default_pick_order() -> None:
    def models(*quants: str) -> list[GGUFModel]:
        return [GGUFModel(q, (f"m-{q}.gguf",), 100 - i) for i, q in enumerate(quants)]

    assert choose("r", models("Q8_0", "Q4_K_M", "Q4_K_S"), None).quant == "Q4_K_M"
    assert choose("r", models("Q8_0", "Q5_K_M", "Q4_K_S"), None).quant == "Q4_K_S"
    assert choose("r", models("Q8_0", "Q4_0", "Q6_K"), None).quant == "Q4_0"
    assert choose("r", models("F16", "Q6_K", "Q3_K_L"), None).quant == "Q3_K_L"  # smallest
    assert choose("r", models("Q8_0", "Q4_0"), "q8_0").quant == "Q8_0"


# -- pulls from the fake hub ------------------------------------------------------------------


def test_the_default_pick_and_its_message(hub: FakeHub, store: ModelStore, hub_root) -> None:
    events: list[PullProgress] = []
    m = pull(store, LLAMA, progress=events.append)
    hub_file = hub_root / LLAMA / "tiny-llama-Q4_K_M.gguf"
    assert m.name == f"{LLAMA}:Q4_K_M" and m.quant == "Q4_K_M"
    assert m.source == f"hf:{LLAMA}@{hub.repos[LLAMA].commit}"
    assert (m.architecture, m.context_length, m.has_chat_template) == ("llama", 2048, True)
    assert Path(m.files[0]).read_bytes() == hub_file.read_bytes()
    assert m.sha256 == _sha(hub_file) and m.size == hub_file.stat().st_size
    statuses = [e.status for e in events]
    assert f"using {LLAMA}:Q4_K_M (available: Q4_K_M, Q8_0)" in statuses
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    transfer = [e for e in events if e.status == "pulling tiny-llama-Q4_K_M.gguf"]
    assert transfer[-1].completed == transfer[-1].total == m.size
    assert [e.completed for e in transfer] == sorted(e.completed for e in transfer)
    assert store.get(f"{LLAMA}:Q4_K_M") == m and store_tree(store) == {
        f"manifests/{store.files_dir(m.name).name}.json",
        f"files/{store.files_dir(m.name).name}/tiny-llama-Q4_K_M.gguf",
    }
    # Pulled again: the same commit is already there, nothing is downloaded.
    assert pull(store, LLAMA) == m
    assert len(hub.requests("GET", "/cdn/")) == 1


def test_an_explicit_quant_and_a_file_reference(hub: FakeHub, store: ModelStore) -> None:
    m = pull(store, f"{LLAMA}:q8_0")
    assert (m.name, m.architecture) == (f"{LLAMA}:Q8_0", "gemma3")
    assert pull(store, f"{LLAMA}/tiny-llama-Q8_0.gguf") == m  # the same model, by its file
    q8_0 = hub.blob_path(LLAMA, "tiny-llama-Q8_0.gguf")
    assert hub.requests("GET", "/cdn/") == hub.requests("GET", q8_0)


def test_a_missing_quant_lists_the_ones_that_exist(hub: FakeHub, store: ModelStore) -> None:
    with pytest.raises(ModelNotFound) as exc:
        pull(store, f"{LLAMA}:Q3_K_S")
    assert exc.value.status == 404
    assert f"'{LLAMA}:Q4_K_M', '{LLAMA}:Q8_0'" in exc.value.message
    with pytest.raises(NotOnHub, match="no GGUF model file 'nope.gguf'"):
        pull(store, f"{LLAMA}/nope.gguf")
    assert store_tree(store) == set()


def test_a_split_model_is_one_model_first_shard_first(hub: FakeHub, store: ModelStore) -> None:
    m = pull(store, SPLIT)
    assert m.name == f"{SPLIT}:Q4_K_M" and m.architecture == "llama"
    assert [Path(f).name for f in m.files] == [
        f"tiny-split-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)
    ]
    assert all(Path(f).parent == store.files_dir(m.name) for f in m.files)
    assert m.size == sum(Path(f).stat().st_size for f in m.files)
    assert len(hub.requests("GET", "/cdn/")) == 3  # the projector was left alone


def test_without_a_preferred_quant_the_smallest_is_picked(
    hub: FakeHub, store: ModelStore, hub_root
) -> None:
    sizes = {q: (hub_root / ODD / f"odd-{q}.gguf").stat().st_size for q in ("Q6_K", "F16")}
    assert pull(store, ODD).quant == min(sizes, key=sizes.__getitem__)


def test_repositories_without_models(hub: FakeHub, store: ModelStore) -> None:
    with pytest.raises(NotOnHub, match=f"repository '{EMPTY}' has no GGUF model"):
        pull(store, EMPTY)
    with pytest.raises(NotOnHub, match="not found") as exc:
        pull(store, "test-org/does-not-exist")
    assert exc.value.status == 404 and isinstance(exc.value, NotFound)


def test_a_gated_repository_needs_the_right_token(
    hub: FakeHub, store: ModelStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(HubAccessDenied, match="gated") as exc:
        pull(store, GATED)
    assert exc.value.status == 403
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(HubAccessDenied):
        pull(store, GATED)
    assert store_tree(store) == set()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert pull(store, GATED).name == f"{GATED}:Q4_K_M"
    # The token went to the hub, not to the CDN host.
    assert hub.requests("HEAD", "/resolve/")[-1].headers.get("authorization") == f"Bearer {TOKEN}"
    assert "authorization" not in {k.lower() for k in hub.requests("GET", "/cdn/")[-1].headers}
    monkeypatch.delenv("HF_TOKEN")
    store.remove(GATED)
    assert pull(store, GATED, token=TOKEN).name == f"{GATED}:Q4_K_M"


def test_a_pull_cut_short_resumes_where_it_stopped(
    hub: FakeHub, store: ModelStore, hub_root
) -> None:
    name = f"{LLAMA}:Q4_K_M"
    hub.cut_next_download(100_000)  # then the hub goes down: huggingface_hub's retry fails
    with pytest.raises(PullError, match="503"):
        pull(store, LLAMA)
    with pytest.raises(ModelNotFound):
        store.get(name)
    (part,) = store.partial_dir(name).glob("*.part")
    kept = part.stat().st_size
    assert 0 < kept <= 100_000
    hub.down = False
    m = pull(store, LLAMA)
    last = hub.requests("GET", "/cdn/")[-1]
    assert last.headers.get("Range") == f"bytes={kept}-"
    hub_file = hub_root / LLAMA / "tiny-llama-Q4_K_M.gguf"
    assert Path(m.files[0]).read_bytes() == hub_file.read_bytes()
    assert not store.partial_dir(name).exists()


def test_the_hub_unreachable(store: ModelStore, hub: FakeHub, monkeypatch) -> None:
    hub.down = True
    with pytest.raises(PullError, match="503") as exc:
        pull(store, LLAMA)
    assert exc.value.status == 502 and exc.value.code == "pull_failed"
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(PullError, match="cannot reach http://127.0.0.1:9"):
        pull(store, LLAMA)


@pytest.mark.parametrize(("quant", "why"), [("Q4_K_M", "not a GGUF"), ("Q8_0", "truncated")])
def test_bad_files_are_refused_and_leave_the_store_clean(
    hub: FakeHub, store: ModelStore, quant: str, why: str
) -> None:
    with pytest.raises(InvalidModelFile, match=why):
        pull(store, f"{BROKEN}:{quant}")
    assert store_tree(store) == set() and store.list() == []


def test_bytes_that_differ_from_the_hubs_hash_are_refused(hub: FakeHub, store: ModelStore) -> None:
    hub.corrupt = True
    with pytest.raises(InvalidModelFile, match="sha256 differs from the hub's"):
        pull(store, LLAMA)
    assert store_tree(store) == set()
    hub.corrupt = False
    m = pull(store, LLAMA)  # starts over: nothing of the bad download is kept
    assert hub.requests("GET", "/cdn/")[-1].headers.get("Range") is None
    assert _sha(m.files[0]) == m.sha256


def test_a_full_disk(hub: FakeHub, store: ModelStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def fill_disk(url, temp_file, **kwargs):
        temp_file.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(download_module, "http_get", fill_disk)
        with pytest.raises(InsufficientStorage, match="disk full") as exc:
            pull(store, LLAMA)
    assert exc.value.status == 507
    assert store_tree(store) == set()
    # Known up front: refused before any byte is fetched.
    hub.log.clear()
    usage = type("usage", (), {"free": 10})
    monkeypatch.setattr(pull_module.shutil, "disk_usage", lambda path: usage)
    with pytest.raises(InsufficientStorage, match="not enough disk space"):
        pull(store, LLAMA)
    assert hub.requests("GET", "/cdn/") == [] and store_tree(store) == set()


def test_two_pulls_of_one_model_at_once_give_one_model(hub: FakeHub, tmp_path: Path) -> None:
    stores = [ModelStore(tmp_path / "models", lock_timeout=20) for _ in range(2)]
    results: list[object] = [None, None]
    start = threading.Barrier(2)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = pull(stores[i], SPLIT)
        except Exception as exc:  # reported by the assertion below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1] and not isinstance(results[0], Exception)
    assert len(hub.requests("GET", "/cdn/")) == 3  # each shard fetched once
    (m,) = stores[0].list()
    assert all(_sha(f) for f in m.files) and len(store_tree(stores[0])) == 4


def test_adopt_a_local_file_in_place(store: ModelStore, tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "mine" / "my-model-Q5_K_M.gguf")
    m = pull(store, str(path))  # a path is adopted
    assert (m.name, m.source, m.files) == ("my-model-Q5_K_M", f"file:{path}", (str(path),))
    assert (m.quant, m.sha256, m.architecture) == ("Q5_K_M", _sha(path), "llama")
    assert adopt(store, path, "mine").files == (str(path),)
    store.remove("my-model-Q5_K_M")
    store.remove("mine")
    assert path.exists() and store_tree(store) == set()
    shards = write_split_llama(tmp_path / "split" / "s.gguf")
    m = adopt(store, shards[1])  # any shard brings the whole model
    assert m.files == tuple(str(p) for p in shards) and m.name == "s" and m.quant == "F32"


def test_adopt_refuses_what_is_not_a_model(store: ModelStore, tmp_path: Path, hub_root) -> None:
    bad = copy_file(hub_root / BROKEN / "broken-Q8_0.gguf", tmp_path / "cut.gguf")
    with pytest.raises(InvalidModelFile, match="truncated"):
        adopt(store, bad)
    with pytest.raises(NotFound, match="no such file"):
        adopt(store, tmp_path / "none.gguf")
    assert store_tree(store) == set()


def test_the_fake_hub_answers_huggingface_hub_itself(hub: FakeHub, tmp_path: Path) -> None:
    """The fake's routes are those huggingface_hub uses: its own listing and download work."""
    api = huggingface_hub.HfApi(endpoint=hub.url)
    assert api.list_repo_files(LLAMA) == sorted(hub.repos[LLAMA].files)
    got = huggingface_hub.hf_hub_download(
        LLAMA, "tiny-llama-Q8_0.gguf", endpoint=hub.url, cache_dir=tmp_path / "cache"
    )
    assert _sha(got) == _sha(hub.repos[LLAMA].files["tiny-llama-Q8_0.gguf"])
    readme = huggingface_hub.hf_hub_download(
        LLAMA, "README.md", endpoint=hub.url, cache_dir=tmp_path / "cache"
    )
    assert Path(readme).read_bytes() == b"# a model card\n"


def test_a_changed_repository_replaces_the_model_and_discards_stale_parts(
    hub: FakeHub, store: ModelStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub's file changes (a new commit): the next pull fetches it whole (its half
    download of the old file cannot be resumed) and the old file goes."""
    old_root, new_root = tmp_path / "v1", tmp_path / "v2"
    write_tiny_llama(old_root / "org" / "r" / "m-Q4_K_M.gguf")
    write_tiny_gemma3(new_root / "org" / "r" / "m-Q4_K_M.gguf")
    with FakeHub(old_root) as v1:
        monkeypatch.setenv("HF_ENDPOINT", v1.url)
        old = pull(store, "org/r")
        store.copy("org/r:Q4_K_M", "kept")
        v1.cut_next_download(50_000)
        with pytest.raises(PullError):
            pull(store, "org/r", name="other")  # leaves a part of the old file
    assert list(store.partial_dir("other").glob("*.part"))
    with FakeHub(new_root) as v2:
        monkeypatch.setenv("HF_ENDPOINT", v2.url)
        new = pull(store, "org/r")
        other = pull(store, "org/r", name="other")
        gets = v2.requests("GET", "/cdn/")
    assert (old.architecture, new.architecture) == ("llama", "gemma3")
    assert new.source != old.source and new.files == old.files  # same path, new bytes
    assert [g.headers.get("Range") for g in gets] == [None, None]  # nothing resumed
    assert other.sha256 == new.sha256 and not store.partial_dir("other").exists()
    assert os.listdir(store.files_dir(new.name)) == ["m-Q4_K_M.gguf"]
    assert store.get("kept").architecture == "llama"  # the copy keeps the old bytes
    assert read_gguf(store.get("kept").files[0]).architecture == "llama"
