"""AsyncEngine: runs `LLMEngine` on its own thread and serves it to asyncio code.

The engine thread is the single owner of the engine (and so of llama.cpp and the KV ledger);
while the engine is the only one wanting the cores, it lends that ownership to the process's
compute thread, which runs the steps back to back (`_steps_alone`) while the engine thread
waits.
asyncio code only sends commands (add, abort, a read of the engine's state) through a
thread-safe queue and reads one `RequestStream` per request. Outputs cross back once per
engine step, in one `call_soon_threadsafe`, so the event loop is woken once per step rather
than once per token. A request answered whole (not streamed) crosses once, finished: its
deltas are merged on the engine thread, so its waiting handler costs the event loop nothing
while it decodes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ferrum.engine.compute import compute
from ferrum.engine.engine import LLMEngine
from ferrum.engine.kv.prefix import ResidentPrefixes
from ferrum.engine.outputs import RequestOutput
from ferrum.engine.request import FinishReason, ImageSpan, SamplingParams
from ferrum.engine.turns import Party, Turns
from ferrum.errors import EngineError, ServiceUnavailable, TooManyRequests

log = logging.getLogger("ferrum.engine")
T = TypeVar("T")

# A step that scheduled nothing while work waits (a saved prefix being read from disk): the
# next one comes after this pause rather than at once.
_STALLED_WAIT_S = 0.001

_IDLE_POLL_S = 0.5
# A burst of requests sent together reaches the queue over a few milliseconds (each is
# validated and prepared first). An idle engine that started stepping on the first would
# make the rest wait a whole step for their prefill, so it gathers commands until the queue
# has been quiet this long (at most _GATHER_MAX_S). Only an idle engine does: no running
# stream ever waits on it.
_GATHER_QUIET_S = 0.005
_GATHER_MAX_S = 0.05


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    split_think: bool
    whole: bool  # the caller reads only the finished output
    images: tuple[ImageSpan, ...] = ()
    checkpoints: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], Any]
    done: concurrent.futures.Future[Any]


_Command = _Add | _Abort | _Call


class RequestStream:
    """The outputs of one request, in order; iteration ends after the finished output."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False

    def put(self, out: RequestOutput) -> None:
        self._queue.put_nowait(out)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            outs = [await self._queue.get()]
            # Coalesce deltas that piled up while the consumer was busy.
            while not outs[-1].finished and not self._queue.empty():
                outs.append(self._queue.get_nowait())
            out = _merge(outs)
            self.finished = out.finished
            yield out


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    """One output with the deltas of `outs` in order and the rest of the last one."""
    last = outs[-1]
    if len(outs) == 1:
        return last
    return dataclasses.replace(
        last,
        content="".join(o.content for o in outs),
        reasoning="".join(o.reasoning for o in outs),
        token_ids=[t for o in outs for t in o.token_ids],
        logprobs=None if last.logprobs is None else [e for o in outs for e in o.logprobs or ()],
    )


class AsyncEngine:
    def __init__(
        self,
        core: LLMEngine,
        max_queue: int = 1 << 30,
        gather: tuple[float, float] = (_GATHER_QUIET_S, _GATHER_MAX_S),
        turns: Party | None = None,
    ):
        self.core = core
        # Each step runs in a turn at the cores shared with the server's other engines (alone:
        # a seat of its own, never contended).
        self._party = turns if turns is not None else Turns().join("engine")
        self._gather_quiet_s, self._gather_max_s = gather
        # Requests in flight beyond those that can run at once wait; past this, submit refuses.
        self.capacity = core.scheduler.max_running + max_queue
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        # Engine thread only: the requests answered whole, each with its deltas so far.
        self._held: dict[str, list[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.core.publish_stats()  # gauges exist before the first request
        self._thread = threading.Thread(target=self._run, name="ferrum-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._party.leave()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def clamp_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The engine's length rule (pure: safe on the event loop)."""
        return self.core.clamp_max_tokens(num_prompt_tokens, max_tokens)

    def check_images(self, images: tuple[ImageSpan, ...]) -> None:
        """Refuses (400) an image too long for one step where images go whole (pure)."""
        self.core.check_images(images)

    def check_capacity(self, n: int) -> None:
        """Refuses (429) n more requests when the queue beyond --parallel is full."""
        if not self.alive or self._stopping:
            raise ServiceUnavailable("the engine is not running")
        if len(self._streams) + n > self.capacity:
            raise TooManyRequests(
                f"{len(self._streams)} requests in flight and the queue is full; retry shortly"
            )

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        split_think: bool,
        whole: bool = False,
        images: tuple[ImageSpan, ...] = (),
        checkpoints: tuple[int, ...] = (),
    ) -> RequestStream:
        """The request's stream of outputs; `whole`: one output only, the finished one, with
        everything in it (for an answer that is not streamed); `images`: the image rows at
        their prompt positions; `checkpoints`: `LLMEngine.add_request`'s."""
        if not self.alive or self._stopping:
            raise ServiceUnavailable("the engine is not running")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        add = _Add(request_id, prompt_token_ids, params, split_think, whole, images, checkpoints)
        self._commands.put(add)
        return stream

    def abort(self, request_id: str) -> None:
        """Idempotent; a request already finished is left alone."""
        if self._streams.pop(request_id, None) is not None:
            self._commands.put(_Abort(request_id))

    async def resident_prefixes(self, limit: int) -> ResidentPrefixes:
        """What the engine holds, for a cluster's router (`LLMEngine.resident_prefixes`)."""
        core = self.core
        return await self.on_engine_thread(lambda: core.resident_prefixes(limit))

    async def on_engine_thread(self, fn: Callable[[], T]) -> T:
        """fn's result, run between two steps by the thread that owns the engine then (the
        engine thread, or the compute thread while the engine steps alone there): the only
        way other code may read the engine's state (its prefix index, its ledger) while it
        runs."""
        if not self.alive or self._stopping:
            raise ServiceUnavailable("the engine is not running")
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put(_Call(fn, done))
        return await asyncio.wrap_future(done)

    # -- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        core = self.core
        while not self._stopping:
            outputs = self._drain_commands(block=not core.has_work)
            if core.has_work:
                if core.stalled:
                    time.sleep(_STALLED_WAIT_S)  # waiting on a disk read or a donor: no spin
                if outputs:
                    self._post(outputs)
                    outputs = []
                if not compute().run(self._steps_alone):
                    with self._party.turn():
                        outputs = self._step()
            elif outputs:
                core.publish_stats()
            if not core.has_work:
                self._check_idle()
            if outputs:
                self._post(outputs)
        self._post(core.fail_all("server shutting down"))
        self._refuse_calls()
        try:
            core.shutdown()
        except Exception:  # a stop goes on without what could not be saved
            log.exception("could not save the prefix cache at shutdown")

    def _steps_alone(self) -> int:
        """On the compute thread: steps one after another in one turn, each with what it
        produced posted and the commands that came meanwhile applied, for as long as there is
        work and nothing else wants the cores (another engine's or the preparer's turn,
        another compute job). Every decode runs on the compute thread anyway (compute.py), so
        while the server has one busy engine its steps cost no hand-off between threads and
        no turn of their own (together ~0.1 ms a step here, of ~10 ms). The engine thread
        waits meanwhile, so the engine still has one owner at a time. How many steps ran (0:
        the cores were wanted at once; the engine thread waits for its turn instead)."""
        core = self.core
        steps = 0
        with self._party.turn(wait=False) as held:
            while held and core.has_work and not core.stalled and not self._stopping:
                if compute().wanted():
                    break
                self._after_step(self._step())
                steps += 1
                held = self._party.lap()
        return steps

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        """Applies the commands that came during a step and posts its outputs with theirs."""
        drained = self._drain_commands(block=False)
        if drained and not self.core.has_work:
            self.core.publish_stats()  # an abort ended the last request: the gauges say so
        outputs.extend(drained)
        if outputs:
            self._post(outputs)

    def _step(self) -> list[RequestOutput]:
        try:
            return self.core.step()
        except Exception:  # never let one bad step kill the server
            log.exception("engine step failed; failing the requests in flight")
            return self.core.fail_all("internal engine error")

    def _check_idle(self) -> None:
        """The ledger check when idle; a broken ledger is a bug to report, not a reason to die."""
        try:
            self.core.check_integrity()
        except Exception:
            log.exception("KV ledger integrity check failed; dropping parked sequences")
            self.core.kv_manager.drop_parked()

    def _drain_commands(self, block: bool) -> list[RequestOutput]:
        """Applies the commands waiting; `block` (an idle engine): waits for the first, then
        gathers those that follow within the quiet window."""
        outputs: list[RequestOutput] = []
        commands = self._commands
        if not block and commands.empty():
            return outputs  # the usual case between two steps, without raising queue.Empty
        try:
            cmd = commands.get(timeout=_IDLE_POLL_S) if block else commands.get_nowait()
            gather_until = time.monotonic() + self._gather_max_s if block else 0.0
            while cmd is not None:
                if isinstance(cmd, _Add):
                    outputs.extend(self._add(cmd))
                elif isinstance(cmd, _Call):
                    _answer(cmd)
                else:
                    out = self.core.abort(cmd.request_id)
                    if out is not None:
                        outputs.append(out)
                left = gather_until - time.monotonic()
                if left > 0:
                    cmd = commands.get(timeout=min(self._gather_quiet_s, left))
                else:
                    cmd = commands.get_nowait()
        except queue.Empty:
            pass
        return outputs

    def _refuse_calls(self) -> None:
        """Calls still queued when the engine stops get an error, never silence."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Call) and cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(ServiceUnavailable("the engine is not running"))

    def _add(self, cmd: _Add) -> list[RequestOutput]:
        if cmd.whole:
            self._held[cmd.request_id] = []
        try:
            self.core.add_request(
                cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.split_think, cmd.images,
                cmd.checkpoints,
            )  # fmt: skip
        except Exception as exc:  # the request fails, the engine goes on
            log.exception("could not add request %s", cmd.request_id)
            error = EngineError(f"could not start the request: {exc}")
            return [
                RequestOutput(
                    cmd.request_id, finished=True, finish_reason=FinishReason.ERROR, error=error
                )
            ]
        return []

    def _post(self, outputs: list[RequestOutput]) -> None:
        if self._held:
            outputs = self._hold(outputs)
            if not outputs:
                return
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._dispatch, outputs)

    def _hold(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs to send now: those of requests answered whole are merged and kept
        until their last one (a finish, an abort or an error: each ends the request)."""
        send = []
        for out in outputs:
            held = self._held.get(out.request_id)
            if held is None:
                send.append(out)
            elif not out.finished:
                held.append(out)
            else:
                send.append(_merge([*self._held.pop(out.request_id), out]))
        return send

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its client
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]


def _answer(call: _Call) -> None:
    if not call.done.set_running_or_notify_cancel():
        return  # its caller stopped waiting
    try:
        call.done.set_result(call.fn())
    except Exception as exc:  # the caller gets the error; the engine goes on
        call.done.set_exception(exc)
