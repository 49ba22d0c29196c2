"""The store's room and a pull's end: the quota (`--models-max-bytes`) and the free disk, checked
with the bytes of the pulls under way reserved, copies that duplicate files counted, and pulls
that are cancelled or fail leaving no part files when the API asks so (the CLI keeps them)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from ferrum.models.errors import (
    InsufficientStorage,
    PullCancelled,
    PullError,
    StoreQuotaExceeded,
)
from ferrum.models.pull import PullProgress, pull
from ferrum.models.store import ModelStore
from tests.models.conftest import LLAMA, SPLIT, store_tree
from tests.models.fake_hub import FakeHub

Q4 = f"{LLAMA}:Q4_K_M"  # 670 KB
Q8 = f"{LLAMA}:Q8_0"


def _size(hub: FakeHub, name: str) -> int:
    return sum(p.stat().st_size for p in hub.repos[LLAMA].files.values() if name in p.name)


def _in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn(*args, **kwargs))
        except Exception as exc:  # the test reads it
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _wait_for(check, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        time.sleep(0.02)


def _downloading(store: ModelStore, name: str) -> bool:
    return any(p.stat().st_size for p in store.partial_dir(name).glob("*.part"))


def test_a_pull_over_the_quota_is_refused_before_any_byte(hub: FakeHub, tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "models", max_bytes=_size(hub, "Q4_K_M") - 1)
    with pytest.raises(StoreQuotaExceeded, match="quota") as err:
        pull(store, Q4)
    assert err.value.status == 400
    assert hub.requests("GET", "/cdn/") == [] and store_tree(store) == set()
    roomy = ModelStore(tmp_path / "models", max_bytes=_size(hub, "Q4_K_M"))
    assert pull(roomy, Q4).size == _size(hub, "Q4_K_M")


def test_two_pulls_cannot_both_take_the_room_of_one(hub: FakeHub, tmp_path: Path) -> None:
    """The first pull reserves its size: the second, started while the first downloads, sees
    that room taken, though no byte of the first is on disk yet."""
    room = _size(hub, "Q4_K_M") + _size(hub, "Q8_0") - 1
    store = ModelStore(tmp_path / "models", max_bytes=room)
    hub.hold(65536)
    first, out = _in_thread(pull, store, Q4)
    _wait_for(lambda: _downloading(store, Q4))
    with pytest.raises(StoreQuotaExceeded):
        pull(store, Q8)
    hub.release()
    first.join(30)
    assert out[0].name == Q4  # type: ignore[union-attr]


def test_two_pulls_cannot_both_take_the_free_disk_of_one(
    hub: FakeHub, store: ModelStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Room for either model alone: not for the second while the first is under way.
    usage = type("usage", (), {"free": max(_size(hub, "Q4_K_M"), _size(hub, "Q8_0")) + 1000})
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage)
    hub.hold(65536)
    first, out = _in_thread(pull, store, Q4)
    _wait_for(lambda: _downloading(store, Q4))
    with pytest.raises(InsufficientStorage, match="not enough disk space"):
        pull(store, Q8)
    hub.release()
    first.join(30)
    assert out[0].name == Q4  # type: ignore[union-attr]


def test_a_copy_that_duplicates_its_files_counts(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ModelStore(tmp_path / "models", max_bytes=_size(hub, "Q4_K_M") + 1000)
    pull(store, Q4)
    store.copy(Q4, "linked")  # a hard link takes no room
    assert store.space.used() == _size(hub, "Q4_K_M")

    def no_links(src: object, dst: object) -> None:
        raise OSError("hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(StoreQuotaExceeded, match="a copy of"):
        store.copy(Q4, "duplicated")


def test_a_cancelled_pull_stops_and_leaves_no_parts_unless_it_resumes(
    hub: FakeHub, store: ModelStore
) -> None:
    seen: list[PullProgress] = []
    for resume in (False, True):
        cancel = threading.Event()
        hub.hold(65536)
        thread, out = _in_thread(
            pull, store, Q4, progress=seen.append, cancel=cancel, resume=resume
        )
        _wait_for(lambda: _downloading(store, Q4))
        cancel.set()
        hub.release()  # the next chunk arrives: the download stops there
        thread.join(30)
        assert isinstance(out[0], PullCancelled)
        parts = list(store.partial_dir(Q4).glob("*.part"))
        assert bool(parts) == resume  # the CLI's (resume=True) are kept for the next pull
        assert store.list() == []
    assert seen[-1].completed < seen[-1].total  # it stopped half-way


def test_a_failed_pull_without_resume_leaves_no_parts(hub: FakeHub, store: ModelStore) -> None:
    hub.cut_next_download(50_000)
    with pytest.raises(PullError):
        pull(store, SPLIT, resume=False)
    assert store_tree(store) == set()
