"""The one thread of this process that runs llama.cpp's compute graphs (`llama_decode`).

Why one: llama.cpp's CPU backend, built with OpenMP (the install's build), runs each graph on a
team of threads that belongs to the thread which called it, and libgomp keeps that team for as
long as its caller lives. Once more threads are kept than the machine has cores, libgomp stops
spinning at the barriers between a graph's operations and sleeps there instead, on every team:

    engine thread A  decodes    ─┐ 2 teams of 2 threads on 2 cores: each barrier a futex
    loader / engine thread B    ─┘ wake-up, every decode of either ~30% slower

Measured on this project's 2-core host (Gemma 3 270M, 8 sequences decoding): 59 ms a step
from a thread alone, 78 ms once another live thread had decoded once (the sliding-window
probe at model load, or an embedding engine's thread). So every graph of every model runs
here, the calling thread waiting; engines still take turns (turns.py), this only decides on
which thread a turn's decode runs.

The instance is process-wide on purpose: what it stands for, libgomp's teams, is too.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


class _Job(Generic[T]):
    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn: Callable[[], T]):
        self.fn = fn
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


class ComputeThread:
    """Runs the functions it is given one at a time on its own thread, in order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job[Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def run(self, fn: Callable[[], T]) -> T:
        """fn() on the compute thread; its result, or its exception raised here."""
        if threading.current_thread() is self._thread:
            return fn()  # called from a job: already here
        job = _Job(fn)
        self._ensure_started()
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return cast(T, job.result)

    def wanted(self) -> bool:
        """Whether a job waits (a job that runs long checks this between pieces of its work)."""
        return not self._jobs.empty()

    def _ensure_started(self) -> None:
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="ferrum-compute",
                                                daemon=True)  # fmt: skip
                self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job.result = job.fn()
            except BaseException as exc:  # the caller raises it; this thread goes on
                job.error = exc
            job.done.set()


_PROCESS = ComputeThread()


def compute() -> ComputeThread:
    """The process's compute thread."""
    return _PROCESS
