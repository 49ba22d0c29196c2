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

A light preparation (a short chat: about a millisecond of work) does not wait for a turn: it
runs at once, beside the step in flight. Waiting would cost it far more than the work: the
rest of that step, and then the next step, which starts while the prepared request is still
on its way to the engine. So a short chat beside a busy engine reaches the next step, not
the one after. What runs this way is bounded, so a flood of light requests still takes turns:
at most `_FREE_SHARE` of the thread's time over any stretch, in bursts of `_FREE_BURST_S`.
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
# Light preparations run outside turns within an allowance that refills at this share of
# the time and holds at most this many seconds.
_FREE_SHARE = 0.05
_FREE_BURST_S = 0.01


# A body this short (a chat of a few sentences: no image, no large schema) prepares in about
# a millisecond.
LIGHT_BODY_BYTES = 4096


def light_body(content_length: str | None) -> bool:
    """Whether a request that declared this Content-Length may prepare outside the turns."""
    return content_length is not None and content_length.isdigit() and (
        int(content_length) <= LIGHT_BODY_BYTES
    )


class _Job:
    __slots__ = ("fn", "future", "light")

    def __init__(self, fn: Callable[[], Any], light: bool):
        self.fn = fn
        self.light = light
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()


class _Allowance:
    """Seconds of preparation that may run outside turns: a bucket refilled at `_FREE_SHARE`
    of the clock, at most `_FREE_BURST_S` full; used by the preparation thread only."""

    def __init__(self) -> None:
        self._left = _FREE_BURST_S
        self._at = time.monotonic()

    def has_some(self) -> bool:
        now = time.monotonic()
        self._left = min(_FREE_BURST_S, self._left + (now - self._at) * _FREE_SHARE)
        self._at = now
        return self._left > 0

    def spend(self, seconds: float) -> None:
        self._left -= seconds


class Preparer:
    """Runs request preparations on one thread, in turns with the server's engines."""

    def __init__(self, turns: Turns | None):
        self._party: Party | None = None
        if turns is not None:
            self._party = turns.join("preparation", paces=False)
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None  # None: none running; under _lock
        self._allowance = _Allowance()

    async def run(self, fn: Callable[[], T], light: bool = False) -> T:
        """fn() on the preparation thread; its result or its exception. A caller that is
        cancelled before its turn came costs nothing: its preparation is skipped. `light`:
        a short request's, which may run outside the turns (see the module's note)."""
        job = _Job(fn, light)
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
            if job.light and self._allowance.has_some():
                start = time.monotonic()
                self._do(job)
                self._allowance.spend(time.monotonic() - start)
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
