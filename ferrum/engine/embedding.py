"""Embeddings: the engine that batches the inputs of many requests into shared decodes.

`EmbeddingEngine` runs a `BatchEmbedder` (llama.cpp's is `llama.embedding_runner.EmbeddingRunner`)
on a thread of its own, the runner's sole owner while it runs. asyncio code awaits `embed()`;
the request goes through a thread-safe queue, and its answer comes back through
`call_soon_threadsafe`, once per decode for every request that decode completed.

Batching rule: one input is one sequence of one decode and is never split. The engine thread
takes the inputs waiting, first come first served, into a decode while it stays within the
runner's tokens (`info.n_batch`) and inputs (`info.n_seq_max`); the first input that does not
fit opens the next decode (no input overtakes an earlier one, so a long one never starves):

    waiting:  A0 A1 A2 | B0 | C0 C1        (n_batch 16, token counts below)
              5  4  3  | 6  | 2  2
    decode 1: A0 A1 A2        12 tokens    B0 (6) would make 18
    decode 2: B0 C0 C1        10 tokens    → A answered after decode 1, B and C after 2

Sharing the cores (`turns.Turns`): each decode runs in a turn of the server's engines. While
another engine is busy, a decode is cut to what fits `TURN_SHARE` of that engine's mean turn,
by the measured cost of a decode (fixed plus per token; at least one input), so a flood of
embeddings adds a fraction of a step to a chat stream's gaps, and a busy chat engine still
leaves the embeddings every other turn.

A request whose caller gave up (cancelled) before its inputs ran has them dropped unseen; a
decode that fails fails the requests it held inputs of and no other. The vectors come back
as the model pools them (not normalised): one of `info.n_embd` floats per input, in input
order; under "rank" pooling (cross-encoders) a score vector whose element 0 is the score.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ferrum.engine.contracts import Vocabulary
from ferrum.engine.turns import DecodeCost, Party, Turns
from ferrum.errors import (
    EngineError,
    FerrumError,
    InvalidRequest,
    ServiceUnavailable,
    TooManyRequests,
)

log = logging.getLogger("ferrum.embedding")

Vector = npt.NDArray[np.float32]
BatchObserver = Callable[[int, int, float], None]  # (inputs, tokens, seconds) of one decode

# While another engine is busy, an embedding decode aims at this share of its mean turn.
TURN_SHARE = 0.35

# llama.cpp's pooling types by the names the API and the CLI use.
POOLINGS = ("none", "mean", "cls", "last", "rank")


@dataclass(frozen=True)
class EmbeddingInfo:
    """What callers need to know of an embedding context (read-only, any thread)."""

    n_embd: int  # floats per returned vector (under "rank" pooling: the classifier's outputs)
    max_tokens: int  # the longest input; longer ones must be refused or cut by the caller
    pooling: str  # one of POOLINGS, as the context pools (the GGUF's unless overridden)
    architecture: str
    description: str
    n_vocab: int
    n_batch: int = 2048  # most tokens in one decode
    n_seq_max: int = 64  # most inputs in one decode
    causal: bool = False  # attends only backwards (a decoder model), so it keeps KV memory


class BatchEmbedder(Protocol):
    """A model's embeddings context, on one thread at a time (the engine's)."""

    @property
    def info(self) -> EmbeddingInfo: ...

    @property
    def vocab(self) -> Vocabulary: ...

    def embed_batch(self, inputs: Sequence[Sequence[int]]) -> list[Vector]:
        """One decode of every input as its own sequence (within info.n_batch tokens and
        info.n_seq_max inputs, each 1..info.max_tokens tokens); raises EngineError when the
        decode fails, ValueError when the inputs break those limits."""
        ...


@dataclass(eq=False)
class _Job:
    """One `embed()` call: its inputs, where their vectors go and its caller's future."""

    inputs: list[list[int]]
    future: asyncio.Future[list[Vector]]
    results: list[Vector | None]
    left: int  # inputs not yet decoded
    cancelled: bool = False  # set on the event loop when the caller gives up
    done: bool = False  # engine thread: answered or failed, its other inputs are dropped


@dataclass
class EmbeddingStats:
    """Counters since start: requests and inputs decoded, tokens, decodes by input count."""

    requests: int = 0
    inputs: int = 0
    tokens: int = 0
    failed_batches: int = 0
    dropped_inputs: int = 0  # of requests cancelled before they ran
    batch_inputs: Counter[int] = field(default_factory=Counter)  # inputs per decode → decodes


class EmbeddingEngine:
    def __init__(
        self,
        runner: BatchEmbedder,
        *,
        max_queue_inputs: int = 10_000,
        on_batch: BatchObserver | None = None,
        turns: Party | None = None,
    ):
        self._runner = runner
        # Alone (no server's turns given): a seat of its own, never contended.
        self._party = turns if turns is not None else Turns().join("embeddings")
        self._cost = DecodeCost()
        self._info = runner.info
        self._max_queue = max_queue_inputs
        self._on_batch = on_batch
        self._commands: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._queued = 0  # inputs accepted and not yet answered (event loop only)
        self._stats = EmbeddingStats()
        self._stats_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def info(self) -> EmbeddingInfo:
        return self._info

    @property
    def vocab(self) -> Vocabulary:
        """The tokenizer: read-only, any thread."""
        return self._runner.vocab

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> EmbeddingStats:
        with self._stats_lock:
            return dataclasses.replace(self._stats, batch_inputs=Counter(self._stats.batch_inputs))

    def start(self) -> None:
        """Starts the engine thread; call on the event loop that will await `embed`."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="ferrum-embedding", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Fails what is still waiting and ends the thread; the runner is then free to close."""
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._party.leave()

    async def embed(self, inputs: list[list[int]]) -> list[Vector]:
        """Each input's vector, in input order. The lists must not change until answered."""
        if not self.alive or self._stopping or self._loop is None:
            raise ServiceUnavailable("the embedding engine is not running")
        if not inputs:
            return []
        self._check_lengths(inputs)
        if len(inputs) > self._max_queue:  # would never fit: no point in retrying
            raise InvalidRequest(f"at most {self._max_queue} inputs per request", param="input")
        if self._queued + len(inputs) > self._max_queue:
            raise TooManyRequests(
                f"{self._queued} embedding inputs are waiting and the queue is full; retry shortly"
            )
        job = _Job(inputs, self._loop.create_future(), [None] * len(inputs), len(inputs))
        self._queued += len(inputs)
        self._commands.put(job)
        try:
            return await job.future
        except asyncio.CancelledError:
            job.cancelled = True  # the engine thread drops its inputs not yet decoded
            raise
        finally:
            self._queued -= len(inputs)

    def _check_lengths(self, inputs: list[list[int]]) -> None:
        # The API cuts or refuses long inputs first; this guard keeps a caller that did not
        # from reaching llama.cpp, which aborts the process on an input it cannot hold.
        limit = self._info.max_tokens
        for i, tokens in enumerate(inputs):
            if not 0 < len(tokens) <= limit:
                raise InvalidRequest(
                    f"input {i} has {len(tokens)} tokens; the model takes 1 to {limit}",
                    param=f"input[{i}]",
                    code="context_length_exceeded" if tokens else None,
                )

    # -- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        pending: deque[tuple[_Job, int]] = deque()  # (request, input index), arrival order
        try:
            while self._take(pending, block=not pending):
                answers: list[tuple[_Job, FerrumError | None]] = []
                batch = self._next_batch(pending, self._token_limit())
                if batch:
                    with self._party.turn():
                        self._decode(batch, answers)
                self._post(answers)
        except Exception:  # a bug here must not leave callers waiting forever
            log.exception("the embedding engine failed")
        finally:
            self._shut(pending)

    def _take(self, pending: deque[tuple[_Job, int]], block: bool) -> bool:
        """Moves every request waiting into `pending` (blocking for one when `block`); False
        once stop() has been called."""
        try:
            job = self._commands.get() if block else self._commands.get_nowait()
            while job is not None:
                self._admit(job, pending)
                job = self._commands.get_nowait()
            return False
        except queue.Empty:
            return True

    def _admit(self, job: _Job, pending: deque[tuple[_Job, int]]) -> None:
        if job.cancelled:
            self._count_dropped(len(job.inputs))
            return
        n_vocab = self._info.n_vocab
        for i, tokens in enumerate(job.inputs):
            # A bad id makes llama.cpp refuse the whole decode, so it fails alone, here.
            if min(tokens) < 0 or max(tokens) >= n_vocab:
                error = InvalidRequest(
                    f"input {i} holds a token id outside the vocabulary [0, {n_vocab})",
                    param=f"input[{i}]",
                )
                self._post([self._finish(job, error)])
                return
        pending.extend((job, i) for i in range(len(job.inputs)))
        with self._stats_lock:
            self._stats.requests += 1

    def _token_limit(self) -> int:
        """Most tokens in the next decode: the runner's, or what fits the turn's budget."""
        budget = self._party.budget_s(TURN_SHARE)
        if budget is None:
            return self._info.n_batch
        return min(self._info.n_batch, self._cost.tokens_within(budget))

    def _next_batch(
        self, pending: deque[tuple[_Job, int]], max_tokens: int
    ) -> list[tuple[_Job, int]]:
        """The batching rule (module docstring): first come first served, within limits (the
        first input always goes, whatever `max_tokens` says)."""
        batch: list[tuple[_Job, int]] = []
        tokens, max_inputs = 0, self._info.n_seq_max
        while pending and len(batch) < max_inputs:
            job, i = pending[0]
            if job.cancelled or job.done:
                pending.popleft()
                if job.cancelled:
                    self._count_dropped(1)
                continue
            n = len(job.inputs[i])
            if batch and tokens + n > max_tokens:
                break
            batch.append(pending.popleft())
            tokens += n
        return batch

    def _decode(
        self, batch: list[tuple[_Job, int]], answers: list[tuple[_Job, FerrumError | None]]
    ) -> None:
        inputs = [job.inputs[i] for job, i in batch]
        tokens = sum(map(len, inputs))
        start = time.perf_counter()
        try:
            vectors = self._runner.embed_batch(inputs)
            if len(vectors) != len(inputs):
                raise EngineError(f"{len(vectors)} vectors for {len(inputs)} inputs")
        except Exception as exc:
            log.exception("embedding decode of %d inputs failed", len(inputs))
            with self._stats_lock:
                self._stats.failed_batches += 1
            for job in dict.fromkeys(job for job, _ in batch):  # each request once, in order
                if not job.done:
                    answers.append(self._finish(job, _engine_error(exc)))
            return
        seconds = time.perf_counter() - start
        self._cost.add(tokens, seconds)
        for (job, i), vector in zip(batch, vectors, strict=True):
            job.results[i] = vector
            job.left -= 1
            if job.left == 0:
                answers.append(self._finish(job, None))
        with self._stats_lock:
            s = self._stats
            s.inputs += len(inputs)
            s.tokens += tokens
            s.batch_inputs[len(inputs)] += 1
        if self._on_batch is not None:
            try:
                self._on_batch(len(inputs), tokens, seconds)
            except Exception:  # an observer's bug costs its metric, not the engine
                log.exception("embedding batch observer failed")

    def _finish(self, job: _Job, error: FerrumError | None) -> tuple[_Job, FerrumError | None]:
        job.done = True
        return job, error

    def _count_dropped(self, n: int) -> None:
        with self._stats_lock:
            self._stats.dropped_inputs += n

    def _shut(self, pending: deque[tuple[_Job, int]]) -> None:
        """Fails every request still waiting: those pending and those never taken."""
        jobs = dict.fromkeys(job for job, _ in pending if not job.done)
        try:
            while True:
                job = self._commands.get_nowait()
                if job is not None:
                    jobs[job] = None
        except queue.Empty:
            pass
        self._post([self._finish(job, ServiceUnavailable("server shutting down")) for job in jobs])

    def _post(self, answers: list[tuple[_Job, FerrumError | None]]) -> None:
        loop = self._loop
        if answers and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_resolve, answers)


def _resolve(answers: list[tuple[_Job, FerrumError | None]]) -> None:
    """On the event loop: each request's vectors or error (a cancelled one is left alone)."""
    for job, error in answers:
        if job.future.done():
            continue
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result([v for v in job.results if v is not None])


def _engine_error(exc: Exception) -> EngineError:
    """A fresh error per request: one exception raised in several tasks gets tangled."""
    if isinstance(exc, FerrumError):
        return EngineError(exc.message)
    return EngineError(f"the embedding decode failed: {exc}")
