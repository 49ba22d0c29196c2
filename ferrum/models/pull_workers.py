"""The threads a server's pulls run on: a pool of their own, not the event loop's default one.

A download holds its thread for minutes. On the default pool (`asyncio.to_thread`, a few
threads on a small host) six hung-up pulls once starved tokenizing, /api/tags, embeddings
and model loads for eleven minutes. So pulls get `size` threads of their own (2 by default);
further pulls wait their turn in order (a client sees its progress lines once its pull
starts) rather than being refused: a pull is an admin's act, and a waiting one costs nothing.

Each pull gets a `threading.Event`: when the task awaiting it is cancelled (its client hung
up), the event is set, so a running pull stops at its next chunk (`pull.pull`'s `cancel`), and
a waiting one never starts. `close` (the server stopping) sets every event, so no download
keeps the process alive.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class PullWorkers:
    def __init__(self, size: int = 2):
        self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="ferrum-pull")
        self._cancels: set[threading.Event] = set()

    async def run(self, job: Callable[[threading.Event], T]) -> T:
        """Runs `job(cancel)` on a pull thread; cancelling the caller sets `cancel`."""
        cancel = threading.Event()
        self._cancels.add(cancel)
        try:
            # Cancelling this future cancels a job that has not started (`wrap_future`).
            return await asyncio.wrap_future(self._pool.submit(job, cancel))
        except asyncio.CancelledError:
            cancel.set()
            raise
        finally:
            self._cancels.discard(cancel)

    def close(self) -> None:
        for cancel in list(self._cancels):
            cancel.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
