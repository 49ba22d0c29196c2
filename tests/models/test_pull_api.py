"""/api/pull from the fake hub, as a client meets it: a client that hangs up cancels its pull
and leaves no part files, a failed pull leaves none, pulls run on threads of their own (the
default pool stays free for the other routes) two at a time, and the quota is a 400."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ferrum.api.auth import Keys
from ferrum.models.pull_workers import PullWorkers
from ferrum.models.store import ModelStore
from tests.factories import fake_app
from tests.models.conftest import LLAMA, SPLIT, store_tree
from tests.models.fake_hub import FakeHub
from tests.models.test_room import Q4, Q8, _downloading, _size, _wait_for

ODD = "test-org/odd-quants-GGUF"


async def _call(app, method: str, path: str, body: dict, gone: asyncio.Event | None = None):
    """Drives the ASGI app by hand: the client disconnects once `gone` is set. Returns the
    status and the body."""
    sent: list[bytes] = []
    status = 0
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await (gone or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message.get("body"):
            sent.append(message["body"])

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "headers": [(b"content-type", b"application/json")], "server": ("testserver", 80),
        "client": ("test", 1), "root_path": "",
    }  # fmt: skip
    await app(scope, receive, send)
    return status, b"".join(sent)


async def _until(check, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        await asyncio.sleep(0.02)


def _served(store: ModelStore, **kw) -> TestClient:
    return TestClient(fake_app(store=store, keys=Keys(open_admin=True), **kw))


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_cancels_its_pull(
    hub: FakeHub, tmp_path: Path, stream: bool
) -> None:
    store = ModelStore(tmp_path / "models")
    with _served(store) as http:
        app = http.app

        async def hang_up_mid_download() -> int:
            gone = asyncio.Event()
            call = asyncio.ensure_future(
                _call(app, "POST", "/api/pull", {"model": Q4, "stream": stream}, gone)
            )
            await _until(lambda: _downloading(store, Q4))
            gone.set()
            status, _ = await call
            return status

        hub.hold(65536)
        http.portal.call(hang_up_mid_download)
        hub.release()  # the next chunk arrives: the download stops there
        _wait_for(lambda: not store.partial_dir(Q4).exists())
        time.sleep(0.3)  # a pull that ran on would install its model now
        assert store_tree(store) == set()
        assert Q4 not in [s.name for s in app.state.ferrum.models.specs()]


def test_a_failed_pull_leaves_no_part_files(hub: FakeHub, tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "models")
    with _served(store) as http:
        hub.cut_next_download(50_000)  # then the hub is down
        r = http.post("/api/pull", json={"model": SPLIT, "stream": False})
        assert r.status_code == 502 and "503" in r.json()["error"]
        assert store_tree(store) == set()


def test_pulls_run_two_at_a_time_off_the_default_pool(hub: FakeHub, tmp_path: Path) -> None:
    """Three pulls under way on a host whose default pool has two threads: /api/tags (a file
    read on the default pool) still answers, and the third pull waits for the first two."""
    store = ModelStore(tmp_path / "models")
    with _served(store, pulls=PullWorkers(2)) as http:
        app = http.app

        async def three_pulls_then_tags() -> list[tuple[int, bytes]]:
            asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(2))
            models = [Q4, Q8, f"{ODD}:Q6_K"]
            calls = [
                asyncio.ensure_future(
                    _call(app, "POST", "/api/pull", {"model": m, "stream": False})
                )
                for m in models
            ]
            await _until(lambda: len(hub.requests("GET", "/cdn/")) == 2)
            status, body = await asyncio.wait_for(_call(app, "GET", "/api/tags", {}), 5)
            assert status == 200 and json.loads(body)["models"]
            await asyncio.sleep(0.3)
            assert len(hub.requests("GET", "/cdn/")) == 2  # the third waits its turn
            hub.release()
            return list(await asyncio.gather(*calls))

        hub.hold(65536)
        results = http.portal.call(three_pulls_then_tags)
        assert [status for status, _ in results] == [200] * 3, results
        assert len(store.list()) == 3


def test_a_pull_over_the_quota_is_a_400(hub: FakeHub, tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "models", max_bytes=_size(hub, "Q4_K_M") // 2)
    with _served(store) as http:
        r = http.post("/api/pull", json={"model": LLAMA, "stream": False})
        assert r.status_code == 400 and "quota" in r.json()["error"]
        lines = http.post("/api/pull", json={"model": LLAMA}).text.splitlines()
        assert "quota" in json.loads(lines[-1])["error"]
        assert hub.requests("GET", "/cdn/") == [] and store_tree(store) == set()
