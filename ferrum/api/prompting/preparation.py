"""Request preparation (template, tokenizer, schema checks, grammar) in turns with the decodes.

Preparing a request is CPU work: Python holding the GIL, and llama.cpp's tokenizer and grammar
parser. Run beside a decode, it takes a core from one of the decode's threads, and every
barrier of that graph then waits for a thread that is not running: on 2 cores, eight ~3,000-
token prompts prepared in worker threads tripled the p99 gap between running streams' tokens.

So one preparation thread takes turns at the cores with the engines (`ferrum.engine.turns`):
between two engine steps it prepares what is waiting, for at most a share of an engine
step's time (at least one request, so none waits forever), then gives the cores back. A
running stream's gap grows by at most that share (plus one request's preparation); a burst
is prepared in as few turns as its preparations fit in, and reaches the engine together.
Without shared turns (`--engine-turns off`) the thread prepares as requests come.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ferrum.engine.turns import Party, Turns

T = TypeVar("T")

# A preparation turn may last this share of the busy engines' shortest mean step.
_SHARE = 0.5
# The thread ends after this long without work, and starts again with the next request.
_IDLE_S = 5.0


class _Job:
    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()


class Preparer:
    """Runs request preparations on one thread, in turns with the server's engines."""

    def __init__(self, turns: Turns | None):
        self._party: Party | None = None
        if turns is not None:
            self._party = turns.join("preparation", paces=False)
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None  # None: none running; under _lock

    async def run(self, fn: Callable[[], T]) -> T:
        """fn() on the preparation thread; its result or its exception. A caller that is
        cancelled before its turn came costs nothing: its preparation is skipped."""
        job = _Job(fn)
        with self._lock:
            self._jobs.put(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="ferrum-prepare",
                                                daemon=True)  # fmt: skip
                self._thread.start()
        return await asyncio.wrap_future(job.future)

    def _next(self, wait: bool) -> _Job | None:
        """The next job, or None: none is waiting (wait=False), or none came for _IDLE_S
        (wait=True), and the thread, about to end, no longer counts as running."""
        while True:
            try:
                return self._jobs.get(timeout=_IDLE_S) if wait else self._jobs.get_nowait()
            except queue.Empty:
                if not wait:
                    return None
            with self._lock:  # puts happen under it: an empty queue here stays empty
                if self._jobs.empty():
                    self._thread = None
                    return None

    def _serve(self) -> None:
        while (job := self._next(wait=True)) is not None:
            if self._party is None:
                self._do(job)
                continue
            with self._party.turn():
                budget = self._party.budget_s(_SHARE)
                start = time.monotonic()
                self._do(job)
                while budget is None or time.monotonic() - start < budget:
                    if (job := self._next(wait=False)) is None:
                        break
                    self._do(job)

    @staticmethod
    def _do(job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return  # its request went away while it waited
        try:
            job.future.set_result(job.fn())
        except BaseException as exc:  # the request fails; the thread goes on
            job.future.set_exception(exc)
