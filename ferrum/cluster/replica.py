"""One ferrum server as a Ray Serve replica.

`FerrumReplica` builds the same app `ferrum serve` runs (`ferrum.server.build_server`: the
registry, its engines, every API dialect) and serves the ingress's relayed HTTP requests to
it in process, through ASGI: the answer goes back as a stream whose first item is the status
and headers (`Head`), then the body's chunks as the app sends them. A client that hangs up
cancels the stream, which the app sees as a disconnect, so its engine requests are aborted
as they would be under `ferrum serve`.

Every stats period Ray asks the replica for its routing stats: the chained hashes of the
prefix blocks each loaded model's engine holds (read on the engine thread, bounded by
`--route-summary-blocks`), which the prefix router routes on. The replica also leaves its
/metrics and /health answers on the cluster's board for the ingress to show.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import itertools
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve

from ferrum.api.loaded import ServedModel
from ferrum.api.serving import ServerState
from ferrum.api.slots import board_views
from ferrum.cluster.board import board_name
from ferrum.cluster.policy import RouteKey, encode_hashes
from ferrum.cluster.routers import PREFIX_KEY
from ferrum.cluster.settings import ClusterSettings
from ferrum.engine.kv.tiers import DEFAULT_CACHE_DIR
from ferrum.server import build_server

log = logging.getLogger("ferrum.cluster")

REPLICA_HEADER = "x-ferrum-replica"


@dataclass(frozen=True)
class Relayed:
    """An HTTP request as the ingress received it."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True)
class Head:
    status: int
    headers: list[tuple[bytes, bytes]]


class FerrumReplica:
    """The deployment's class (`ferrum.cluster.app` wraps it in `serve.deployment`)."""

    # Ray runs an async constructor on the replica's event loop, where its engines will run.
    async def __init__(self, settings: ClusterSettings):  # type: ignore[misc]
        self.settings = settings
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        # The folder's lock and the catalog's scan are file I/O: off the event loop.
        self.app, self._folder_lock = await asyncio.to_thread(_build, settings)
        self.state: ServerState = self.app.state.ferrum
        self._board: Any = None
        # The app's lifespan: registry started, default model loaded (a model that cannot
        # load fails the replica's start, and `serve.run` with it).
        self._lifespan: AbstractAsyncContextManager[Any] = self.app.router.lifespan_context(
            self.app
        )
        await self._lifespan.__aenter__()

    async def handle(self, request: Relayed, route: RouteKey | None = None) -> AsyncIterator[Any]:
        """The app's answer: a `Head`, then body chunks. `route` is the router's (unused here)."""
        extra = [
            (REPLICA_HEADER.encode(), self.replica_id.encode()),
            (b"x-ferrum-replica-pid", str(os.getpid()).encode()),
        ]
        async with contextlib.aclosing(asgi_call(self.app, request, extra)) as items:
            async for item in items:
                yield item

    async def record_routing_stats(self) -> dict[str, Any]:
        prefixes: dict[str, bytes] = {}
        limit = self.settings.cluster.route_summary_blocks
        for loaded in self.state.models.loaded():
            model = loaded.model
            if isinstance(model, ServedModel) and model.engine.alive:
                held = await model.engine.resident_prefixes(limit)
                prefixes[loaded.spec.name] = encode_hashes(held.hashes)
        await self._post_to_board()
        return {PREFIX_KEY: prefixes}

    async def _post_to_board(self) -> None:
        """This replica's /metrics, /health and dashboard views, left where the ingress
        reads them."""
        try:
            metrics = await self._get("/metrics")
            health = await self._get("/health")
            views = await board_views(self.state)
            if self._board is None:
                self._board = ray.get_actor(board_name(self.settings.cluster.app_name))
            await self._board.put.remote(
                self.replica_id, metrics.decode(), health.decode(), views
            )
        except Exception as exc:  # the board is for display; routing goes on without it
            self._board = None
            log.warning("could not post to the cluster board: %s", exc)

    async def _get(self, path: str) -> bytes:
        headers = []
        key = self.state.keys.first  # the app's own keys: no keys file read each period
        if key:  # an admin key if any: /health's details need a key
            headers.append((b"authorization", f"Bearer {key}".encode()))
        chunks = []
        request = Relayed("GET", path, b"", headers, b"")
        async with contextlib.aclosing(asgi_call(self.app, request, [])) as items:
            async for item in items:
                if isinstance(item, bytes):
                    chunks.append(item)
        return b"".join(chunks)

    async def check_health(self) -> None:
        """Ray restarts a replica whose engine thread has died."""
        dead = [m.spec.name for m in self.state.models.loaded() if not m.model.alive]
        if dead:
            raise RuntimeError(f"engine of {', '.join(dead)} is not running")

    async def __del__(self) -> None:
        # Scale-down: Ray has already let the replica's requests finish (graceful shutdown).
        lifespan = getattr(self, "_lifespan", None)  # absent when the constructor failed
        if lifespan is not None:
            await lifespan.__aexit__(None, None, None)


def _build(settings: ClusterSettings) -> tuple[Any, int]:
    """The replica's app, its disk tier in a folder of its own, and that folder's lock."""
    cache_dir = Path(settings.engine.cache_dir or DEFAULT_CACHE_DIR).expanduser()
    folder, lock = _own_folder(cache_dir)
    engine = dataclasses.replace(settings.engine, cache_dir=str(folder))
    app, _ = build_server(engine, settings.server, settings.models)
    return app, lock


def _own_folder(parent: Path) -> tuple[Path, int]:
    """The first `replica-N` folder under parent that no other live replica holds, and the
    lock (a file descriptor, held for the process's life) that says this one does. Two
    engines writing and cleaning one disk tier would remove each other's files; a replica
    restarted takes a free folder back, with what its predecessor saved there."""
    parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count():
        folder = parent / f"replica-{n}"
        fd = os.open(parent / f"replica-{n}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return folder, fd
    raise AssertionError("unreachable")


async def asgi_call(
    app: Any, request: Relayed, extra_headers: list[tuple[bytes, bytes]]
) -> AsyncGenerator[Any, None]:
    """Runs one HTTP request through an ASGI app in process: a `Head`, then body chunks."""
    sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await sent.put(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query,
        "root_path": "",
        "headers": request.headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    complete = False
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield Head(message["status"], list(message.get("headers", [])) + extra_headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    complete = True
                    break
        if not complete:  # the app stopped mid-answer: an error, never a quiet cut
            exc = task.exception() if task.done() and not task.cancelled() else None
            log.error("%s %s ended mid-answer", request.method, request.path, exc_info=exc)
            raise RuntimeError(f"the replica's answer to {request.path} ended early")
    finally:
        gone.set()  # the app sees a disconnect if it still waits on its client
        with contextlib.suppress(Exception):  # the answer has ended either way
            await asyncio.wait_for(task, timeout=5)
