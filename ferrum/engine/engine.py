"""The engine core: one `step()` turns a scheduled batch into per-request output deltas.

It owns the scheduler (and through it the KV ledger), the runner and each request's text
pipeline. It is single-threaded by design: `AsyncEngine` runs it on one thread and is the only
caller. The runner is any `Runner` (contracts.py): llama.cpp's, or the tests' fake.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ferrum.engine.adapter_files import AdapterLifetimes
from ferrum.engine.contracts import BatchItem, ModelInfo, Runner, TokenLogprobs
from ferrum.engine.kv.ledger import BlockManager, IntegrityError
from ferrum.engine.kv.prefix import ResidentPrefixes
from ferrum.engine.kv.residency import KVManager
from ferrum.engine.kv.tiers import TierConfig, TierStats
from ferrum.engine.logprobs import LogprobTracker
from ferrum.engine.outputs import EngineObserver, FinishedRequest, RequestOutput, StepStats
from ferrum.engine.request import FinishReason, ImageSpan, Request, SamplingParams
from ferrum.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from ferrum.engine.speculation.speculator import Drafter, SpecConfig, Speculator
from ferrum.engine.text import TextPipeline
from ferrum.errors import ContextLengthExceeded, EngineError, InvalidRequest

log = logging.getLogger("ferrum.engine")


@dataclass
class _RequestState:
    """Engine-side state of one request that the scheduler does not need."""

    request: Request
    text: TextPipeline
    pending: RequestOutput
    logprobs: LogprobTracker | None = None
    # Positions the sequence holds in llama.cpp while a verified draft is being consumed
    # (0 otherwise): a finish inside the run trims the ones past the finish.
    kv_end: int = 0


class LLMEngine:
    def __init__(
        self,
        runner: Runner,
        block_size: int = 16,
        observer: EngineObserver | None = None,
        max_running: int | None = None,
        prefix_cache: bool = True,
        speculation: SpecConfig | None = None,
        drafter: Callable[[SpecConfig], Drafter] | None = None,
        tiers: TierConfig | None = None,
        prefill_cap: int = 0,
        decode_every: int = 1,
    ):
        info = runner.info
        self.runner = runner
        self.info = info
        # Largest number of positions a single request may occupy (prompt + output): the
        # context, or with a stream per sequence, a stream.
        blocks = BlockManager(info.n_ctx // block_size, block_size, info.request_ctx // block_size)
        self.max_positions = blocks.seq_blocks * block_size
        # Recurrent state cannot be shared between sequences; only attention KV cells can.
        share = not (info.is_recurrent or info.is_hybrid)
        # A saved state may be cut back to any prefix only where attention KV is all it is;
        # a sliding window keeps just enough cells to drop the last position.
        cut = None if share and info.n_swa == 0 else 1 if share else 0
        self.kv_manager = KVManager(
            blocks, runner, info.n_seq_max, prefix_cache, share, tiers, cut, info.own_copies,
            window=info.n_swa if share else 0, streams=info.kv_streams,
        )  # fmt: skip
        self.speculator = self._speculator(speculation or SpecConfig(kind="none"), info, drafter)
        self.scheduler = Scheduler(
            self.kv_manager,
            max_running=max_running or info.n_seq_max,
            token_budget=info.n_batch,
            speculator=self.speculator,
            prefill_cap=prefill_cap,
            decode_every=decode_every,
            whole_images=info.images_whole,
        )
        self.observer = observer or EngineObserver()
        self._live: dict[str, _RequestState] = {}
        self.stalled = False  # the last step had work but could schedule none of it
        self._finished_stats: list[FinishedRequest] = []
        self._tiers_published: TierStats | None = None
        self.adapters = AdapterLifetimes(runner.adapters)  # loaded or unloaded while serving

    @staticmethod
    def _speculator(
        config: SpecConfig, info: ModelInfo, drafter: Callable[[SpecConfig], Drafter] | None
    ) -> Speculator | None:
        """The speculator, or None when speculation is off or the model cannot roll back."""
        if not config.enabled:
            return None
        if info.is_recurrent or info.is_hybrid:
            log.info("speculation off: recurrent state cannot drop rejected drafts")
            return None
        return Speculator(config) if drafter is None else Speculator(config, drafter)

    # -- commands ---------------------------------------------------------------------------

    def clamp_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The one rule for lengths: a prompt must leave room for one token; max_tokens is
        clamped to the room left in the context. Pure: safe to call from any thread."""
        if num_prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        room = self.max_positions - num_prompt_tokens
        if room < 1:
            raise ContextLengthExceeded(
                f"the prompt has {num_prompt_tokens} tokens; this server's context holds "
                f"{self.max_positions} (prompt plus at least one generated token)",
                param="prompt",  # the API names it as its request did (`serving.submit`)
            )
        return room if max_tokens is None or max_tokens < 0 else min(max_tokens, room)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        split_think: bool = True,
        images: tuple[ImageSpan, ...] = (),
        checkpoints: tuple[int, ...] = (),
    ) -> None:
        """`checkpoints`: prompt positions where later requests are likely to part from this
        one (`Request.checkpoints`); a hint, those outside the prompt are left out."""
        if request_id in self._live:
            raise InvalidRequest(f"duplicate request id {request_id}")
        self.adapters.check(params.adapters)
        self.check_images(images)
        n = len(prompt_token_ids)
        marks = tuple(sorted({p for p in checkpoints if 0 < p <= n}))
        request = Request(request_id, list(prompt_token_ids), params, images=images,
                          checkpoints=marks)  # fmt: skip
        self.runner.start_request(request_id, params)
        text = TextPipeline(self.runner.vocab.token_bytes, params.stop, split_think)
        live = _RequestState(request, text, RequestOutput(request_id))
        if params.logprobs is not None:
            live.logprobs = LogprobTracker()
        live.pending = self._new_output(live)
        self._live[request_id] = live
        self.scheduler.add(request)

    def check_images(self, images: tuple[ImageSpan, ...]) -> None:
        """InvalidRequest for an image that cannot fit one step where images go whole.
        Pure: safe to call from any thread."""
        room = self.scheduler.image_room()
        longest = max((span.end - span.start for span in images), default=0)
        if room is not None and longest > max(room, 0):
            raise InvalidRequest(
                f"an image of {longest} positions does not fit one step of this model "
                f"({room} with --batch-size {self.info.n_batch} and --parallel "
                f"{self.scheduler.max_running}); its projector decodes each image whole"
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        live = self._live.get(request_id)
        if live is None:
            return None
        self._finish(live, FinishReason.ABORT)
        self.adapters.collect(self._requests())
        return self._take(live)

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """Ends every request with an error (after an unexpected engine fault)."""
        outs = []
        for live in list(self._live.values()):
            self._finish(live, FinishReason.ERROR, error=EngineError(reason))
            outs.append(self._take(live))
        return outs

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        switches = self.scheduler.turns.switches
        sched = self.scheduler.schedule()
        stats = StepStats(num_tokens=sched.num_tokens, num_sequences=len(sched.chunks))
        stats.preemptions = len(sched.preempted)
        touched: list[_RequestState] = []
        self.stalled = not sched.chunks
        if sched.chunks:
            stats.adapters = tuple(i for i, _ in sched.chunks[0].request.adapters)
            stats.adapter_switches = self.scheduler.turns.switches - switches
            self._execute(sched, stats, touched)
        outputs = [self._take(live) for live in touched]
        stats.step_s = time.monotonic() - t0
        saved = self.kv_manager.saved
        if saved is not None and stats.prompt_tokens_computed:
            saved.costs.prefilled(stats.num_tokens, stats.step_s)
        self.publish_stats(stats)
        if self.adapters.releasing:  # an unloaded adapter's last request may have finished
            self.adapters.collect(self._requests())
        return outputs

    def _requests(self) -> list[Request]:
        return [live.request for live in self._live.values()]

    def release_adapter(self, adapter_id: int) -> list[int]:
        """Frees the adapter once no request it holds decodes with it (`adapter_files.py`);
        the ids freed now."""
        return self.adapters.release(adapter_id, self._requests())

    def _execute(
        self, sched: SchedulerOutput, stats: StepStats, touched: list[_RequestState]
    ) -> None:
        items = []
        for c in sched.chunks:
            req = c.request
            assert req.seq_id is not None  # scheduled requests hold a sequence
            tokens = req.all_token_ids[c.start : c.start + c.length] + list(c.draft)
            sample_for = req.request_id if c.samples else None
            draft = len(c.draft)
            embeds = req.embeds_in(c.start, c.length) if req.images else ()
            items.append(
                BatchItem(req.seq_id, tokens, c.start, sample_for, draft, req.adapters, embeds)
            )
        result = self.runner.execute(items)
        if self.speculator is not None and result.decode_s > 0 and not sched.has_prefill:
            self.speculator.timed(sched.num_tokens, result.decode_s)
        stats.decode_retries = max(0, result.decode_calls - 1 - result.split_calls)
        stats.faults_injected = result.faults_injected
        stats.mask_seconds = result.mask_seconds
        now = time.monotonic()
        for i, c in enumerate(sched.chunks):
            req = c.request
            live = self._live[req.request_id]
            if i in result.failed:
                stats.decode_failures += 1
                failure = EngineError(f"decode failed: {result.failed[i]}")
                self._finish(live, FinishReason.ERROR, error=failure)
                touched.append(live)
                continue
            if c.start < req.num_prompt_tokens:
                stats.prompt_tokens_computed += min(c.length, req.num_prompt_tokens - c.start)
            tokens = result.sampled.get(i, [])
            self._consume(live, c, tokens, result.logprobs.get(i), now, stats)
            if tokens:
                touched.append(live)

    def _consume(
        self,
        live: _RequestState,
        c: ScheduledChunk,
        tokens: list[int],
        logprobs: list[TokenLogprobs] | None,
        now: float,
        stats: StepStats,
    ) -> None:
        """Progress and output from one chunk's result: its sampled tokens, the accepted
        draft tokens first. Each token is taken as if it had been decoded alone: a finish
        (end of generation, a stop string, max_tokens) inside the run ends it there."""
        req = live.request
        accepted = max(0, len(tokens) - 1)
        if c.draft and self.speculator is not None:
            self.speculator.verified(req, len(c.draft), accepted)
            stats.draft_sequences += 1
            stats.draft_tokens += len(c.draft)
            stats.draft_accepted += accepted
        live.kv_end = c.start + c.length + accepted
        if not tokens:
            self.scheduler.computed(c)
        for j, token in enumerate(tokens):
            self.scheduler.computed(c, accepted=j)
            self._on_token(live, token, logprobs[j] if logprobs else None, now, stats)
            if req.request_id not in self._live:
                break  # finished
        live.kv_end = 0

    def _ends_output(self, req: Request, token: int) -> bool:
        """End-of-generation (unless ignore_eos, which a grammar overrides) or a stop token."""
        params = req.params
        if token in params.stop_token_ids:
            return True
        may_end = not params.ignore_eos or params.grammar is not None
        return may_end and self.runner.vocab.is_eog(token)

    def _on_token(
        self,
        live: _RequestState,
        token: int,
        logprobs: TokenLogprobs | None,
        now: float,
        stats: StepStats,
    ) -> None:
        req = live.request
        self.scheduler.append_token(req, token)
        stats.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
            stats.ttfts.append(now - req.arrival_time)
        elif req.last_token_time is not None:
            stats.inter_token_latencies.append(now - req.last_token_time)
        req.last_token_time = now
        out = live.pending
        out.token_ids.append(token)
        if self._ends_output(req, token):
            self._finish(live, FinishReason.STOP)
            return
        delta = live.text.feed_token(token)
        out.content += delta.content
        out.reasoning += delta.reasoning
        if live.logprobs is not None and out.logprobs is not None:
            live.logprobs.add(logprobs or TokenLogprobs(token, 0.0), delta.raw)
            out.logprobs += live.logprobs.release(live.text.released_chars, live.text.mid_character)
        if delta.stopped:
            self._finish(live, FinishReason.STOP)
        elif req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.max_positions:
            self._finish(live, FinishReason.LENGTH)

    def _finish(
        self, live: _RequestState, reason: FinishReason, error: EngineError | None = None
    ) -> None:
        req = live.request
        if live.kv_end > req.num_computed_tokens and req.seq_id is not None:
            # Finished inside an accepted draft: the sequence keeps only what was taken.
            self.kv_manager.trim(req)
        self.scheduler.finish(req, reason)
        self.runner.finish_request(req.request_id)
        if self.speculator is not None:
            self.speculator.forget(req)
        tail = live.text.finish()
        out = live.pending
        out.content += tail.content
        out.reasoning += tail.reasoning
        if live.logprobs is not None and out.logprobs is not None:
            live.logprobs.extend_last(tail.raw)
            out.logprobs += live.logprobs.finish(live.text.released_chars)
        out.finished = True
        out.finish_reason = reason
        out.stop_string = live.text.stop_string
        out.error = error
        del self._live[req.request_id]
        self._finished_stats.append(
            FinishedRequest(
                finish_reason=reason,
                prompt_tokens=req.num_prompt_tokens,
                completion_tokens=req.num_output_tokens,
                latency_s=time.monotonic() - req.arrival_time,
                ttft_s=(req.first_token_time - req.arrival_time) if req.first_token_time else None,
                cached_tokens=req.num_cached_tokens,
                adapters=tuple(i for i, _ in req.adapters),
                cached_image_tokens=req.cached_image_tokens,
            )
        )

    def _take(self, live: _RequestState) -> RequestOutput:
        """Hands out the accumulated delta and starts a fresh one."""
        out = live.pending
        out.completion_tokens = live.request.num_output_tokens
        out.cached_tokens = live.request.num_cached_tokens
        live.pending = self._new_output(live)
        return out

    @staticmethod
    def _new_output(live: _RequestState) -> RequestOutput:
        req = live.request
        return RequestOutput(
            req.request_id,
            prompt_tokens=req.num_prompt_tokens,
            logprobs=None if live.logprobs is None else [],
        )

    def publish_stats(self, stats: StepStats | None = None) -> None:
        """Sends gauges and the requests finished since the last call to the observer."""
        stats = stats or StepStats()
        sched = self.scheduler
        stats.kv_usage = sched.blocks.usage
        stats.kv_blocks_total = sched.blocks.num_blocks
        cell_bytes = sched.blocks.block_size * self.info.kv_bytes_per_cell
        stats.kv_bytes_total = sched.blocks.num_blocks * cell_bytes
        stats.kv_bytes_used = (sched.blocks.num_blocks - sched.blocks.num_free) * cell_bytes
        kv = self.kv_manager
        stats.parked_sequences = len(kv.parked)
        stats.parked_blocks = kv.parked.num_blocks
        stats.evictions_total = kv.evictions
        stats.window_fallbacks_total = kv.window_fallbacks
        if kv.saved is not None:
            tiers = kv.saved.snapshot()
            if tiers != self._tiers_published:  # a copy only when they changed
                self._tiers_published = tiers.copy()
            stats.tiers = self._tiers_published
        stats.queue_depth = len(sched.waiting)
        stats.active_requests = len(sched.running)
        stats.finished, self._finished_stats = self._finished_stats, []
        self.observer.on_step(stats)

    def shutdown(self) -> None:
        """At a stop, once no request is left: parked sequences go to the tiers (and disk)."""
        self.kv_manager.save_parked()

    def resident_prefixes(self, limit: int) -> ResidentPrefixes:
        """At most `limit` hashes of the prefix blocks this engine holds (engine thread)."""
        kv = self.kv_manager
        hashes = kv.index.resident_hashes(limit) if kv.prefix_cache else []
        return ResidentPrefixes(kv.blocks.block_size, tuple(hashes))

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        held = {r.request_id for r in self.scheduler.running} | {
            r.request_id for r in self.scheduler.waiting
        }
        if held != set(self._live):
            raise IntegrityError(f"scheduler holds {held}, engine tracks {set(self._live)}")
