"""Scheduler: decides, each step, which tokens of which requests go into one llama_decode.

One step's batch, under a token budget that never exceeds llama's n_batch (going over it aborts
the process inside llama.cpp):

    [ decode A | decode B | decode C | prefill chunk D (≤ rest) | first chunk of E (≤ rest) ]
      running requests, oldest first,   running prefills        newly admitted (fair)
      one token each                    continue

Decodes go first so a long prompt never stalls running streams; prefills take what is left,
or at most `prefill_cap` positions while streams decode in the step (`--prefill-cap`): a step
costs about its positions, so the cap bounds how far a burst of long prompts or images
stretches the streams' inter-token gaps, and the prompts' first tokens come later for it.
The other way round (`--decode-every N`): while a running prompt is being computed, the
streams decode in every N-th step only, since a decode call costs about a pass over the
weights however few rows it holds.

Images (`Request.images`): a chunk may end inside an image whose rows attend to each other
in one direction (each row sees those before it, in this step or an earlier one). Where they
attend both ways (Gemma 3's projector: `whole_images`), a chunk ends before the image
instead and the image goes whole into a later step, past the cap if it is that step's first
prompt chunk; `image_room` bounds an image so it always fits a step beside the decodes.

Memory (through `KVManager`): admission reserves KV blocks for everything the request has so
far, minus what it reuses from a resident prefix; each decode grows its page table on demand.
When a decode finds no free block, parked sequences are evicted first; then the newest running
request is preempted: its blocks and sequence id are released and it returns to the head of the
queue, to be recomputed later with its output kept. The oldest request therefore always
progresses, and nothing is ever asked of llama.cpp that the ledger has not granted.

Speculation (`speculation/`): a decode may carry a draft after its token, within the step's
budget and `batch_max`, on blocks that are free without evicting anything; the engine moves
progress past the draft tokens the runner accepted (`computed`).

Admission shares the running slots out fairly among tenants (`fairness.FairShare`): the oldest
waiting request of the tenant holding the fewest slots goes next, so a single tenant is served
FIFO. One exception: a request whose prefix is being computed right now by a running donor
steps aside (without blocking those behind it) until the donor is done with it. While a
waiting tenant holds less than its share of full slots, the tenant most above its share gives
up its newest request that has generated `min_tokens` since its admission (anti-thrashing):
that one's sequence is parked, not cleared, so its re-admission takes it over through the
prefix index and continues where it stopped instead of recomputing it (its output is kept
either way; without a prefix cache it is recomputed like a preemption for memory). A fresh
request of a tenant below its share is admitted before the step's decodes, and the tenants
above their share sit that one step out (`FairShare.fast_lane`): its first token does not
wait for theirs.

LoRA adapters (`adapter_turns.py`): every step decodes one adapter set, its requests only;
the sets with work take turns, so each rule above applies within the set whose turn it is.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ferrum.engine.adapter_turns import AdapterTurns
from ferrum.engine.fairness import FairShare
from ferrum.engine.kv.ledger import IntegrityError
from ferrum.engine.kv.plan import Reuse
from ferrum.engine.kv.residency import KVManager
from ferrum.engine.request import AdapterSet, FinishReason, Request, RequestStatus
from ferrum.engine.speculation.speculator import Speculator


@dataclass(slots=True)
class ScheduledChunk:
    """Positions [start, start + length) of `request.all_token_ids` go into this step."""

    request: Request
    start: int
    length: int
    draft: tuple[int, ...] = ()  # tokens guessed to follow, verified in the same decode

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the known tokens: its last logits are sampled."""
        return self.start + self.length == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.length + len(c.draft) for c in self.chunks)

    @property
    def has_prefill(self) -> bool:
        """Whether a chunk computes several positions of a prompt (or a recomputation)."""
        return any(c.length > 1 for c in self.chunks)


@dataclass(slots=True)
class _Budget:
    """Positions a step has left: `total` under n_batch, `prefill` of them for prompts (the
    cap while streams decode, else all of `total`)."""

    total: int
    prefill: int
    taken: int = 0  # prompt positions given out so far

    def take(self, n: int) -> None:
        self.total -= n
        self.prefill = max(0, self.prefill - n)
        self.taken += n


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        max_running: int,
        token_budget: int,
        watermark: float = 0.01,
        speculator: Speculator | None = None,
        fairness: FairShare | None = None,
        prefill_cap: int = 0,
        whole_images: bool = False,
        decode_every: int = 1,
    ):
        if max_running <= 0 or token_budget <= 0 or prefill_cap < 0 or decode_every < 1:
            raise ValueError(
                "max_running, token_budget and decode_every must be positive, prefill_cap ≥ 0"
            )
        self.kv = kv
        self.speculator = speculator
        self.fairness = fairness or FairShare()
        self.blocks = kv.blocks
        self.max_running = max_running
        self.token_budget = token_budget
        self.prefill_cap = prefill_cap  # prompt positions a step takes beside decodes (0: all)
        self.whole_images = whole_images  # an image's rows go into one step, never split
        self.decode_every = decode_every  # streams decode in every N-th step of a prefill
        self._prefill_steps = 0  # steps so far that computed part of a running prompt
        self._watermark = int(kv.blocks.num_blocks * watermark)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._sat_out: frozenset[str] = frozenset()  # tenants that sat out the last step
        self.turns = AdapterTurns()

    # -- commands ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def image_room(self) -> int | None:
        """The most positions an image may take where images go whole: a step's budget less
        a decode for every other slot and the drafts (so it always fits a step in time);
        None where images may be split."""
        if not self.whole_images:
            return None
        drafts = self.speculator.config.batch_max if self.speculator is not None else 0
        return self.token_budget - (self.max_running - 1) - drafts

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request wherever it is; its KV is parked for reuse unless it failed."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv.release(request, park=reason is not FinishReason.ERROR)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def computed(self, chunk: ScheduledChunk, accepted: int = 0) -> None:
        """The runner computed the chunk's positions and the first `accepted` of its draft:
        the one place progress moves forward."""
        req = chunk.request
        req.num_computed_tokens = chunk.start + chunk.length + accepted
        if chunk.start < req.num_prompt_tokens:
            self.kv.computed(req, chunk.start, req.num_computed_tokens)

    def append_token(self, request: Request, token: int) -> None:
        request.append_output(token)
        self.kv.on_tokens_appended(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._share_out(out)
        for turn in self.turns.order(self.running, self.waiting):
            self._schedule_set(out, turn)
            if out.chunks:  # else the turn passes to the next set within this step
                self.turns.decoded(turn)
                self.kv.bound_parked(self.running)
                break
        return out

    def _schedule_set(self, out: SchedulerOutput, turn: AdapterSet) -> None:
        """The step for the requests of one adapter set (`turn`)."""
        sitting_out = self._fast_lane(turn)
        if self._decodes_wait(turn):
            budget = _Budget(self.token_budget, self.token_budget)
            self._schedule_running_prefills(out, budget, sitting_out, turn)
            self._admit(out, budget, turn)
            if out.chunks:
                return  # the prompts alone this step; else the streams decode after all
        left = self._schedule_decodes(out, self.token_budget, sitting_out, turn)
        capped = self.prefill_cap > 0 and bool(out.chunks)  # streams decode in this step
        budget = _Budget(left, min(left, self.prefill_cap) if capped else left)
        self._schedule_running_prefills(out, budget, sitting_out, turn)
        self._admit(out, budget, turn)

    def _decodes_wait(self, turn: AdapterSet) -> bool:
        """Whether the streams sit this step out (`decode_every`): a running prompt of the
        turn is being computed and this is not its every-N-th step. A decode call costs about
        a pass over the weights however few rows it has, so beside a long prompt fewer,
        fuller ones finish the work sooner; the streams' gaps grow by up to N steps."""
        if self.decode_every == 1:
            return False
        prefilling = any(
            r.adapters == turn and r.num_tokens - r.num_computed_tokens > 1 for r in self.running
        )
        if not prefilling:
            return False
        self._prefill_steps += 1
        return self._prefill_steps % self.decode_every != 0

    def _fast_lane(self, turn: AdapterSet) -> frozenset[str]:
        """Admits a newcomer of a tenant below its share ahead of the decodes (its chunk is
        scheduled with the running prefills); the tenants that sit this step out."""
        waiting = [r for r in self.waiting if r.adapters == turn]
        lane = self.fairness.fast_lane(waiting, self.running, self.max_running, self._sat_out)
        self._sat_out = frozenset()
        if lane is None:
            return frozenset()
        req, over = lane
        reuse = self.kv.plan(req)
        if reuse is None or not self._admit_one(req, reuse):
            return frozenset()  # not admitted: nobody sits out for it
        self._sat_out = over
        return over

    def _schedule_decodes(
        self, out: SchedulerOutput, budget: int, sitting_out: frozenset[str], turn: AdapterSet
    ) -> int:
        decoding = [
            r for r in self.running
            if r.num_tokens - r.num_computed_tokens == 1 and r.params.tenant not in sitting_out
            and r.adapters == turn
        ]  # fmt: skip
        chunks = []
        for req in decoding:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            if not self._grow_or_preempt(req, out):
                continue  # req itself was preempted
            chunk = ScheduledChunk(req, req.num_computed_tokens, 1)
            out.chunks.append(chunk)
            chunks.append(chunk)
            budget -= 1
        return budget - self._draft(chunks, budget)

    def _draft(self, chunks: list[ScheduledChunk], budget: int) -> int:
        """Drafts for the step's decodes, within batch_max and `budget` for all of them and on
        blocks already free (a guess never evicts or preempts anything); the tokens placed."""
        spec = self.speculator
        if spec is None or not chunks or budget <= 0:
            return 0
        if self.kv.streams and len(chunks) > 1:
            # With a stream per sequence llama.cpp puts only rows of equal length in one
            # micro-batch: one drafting request among others costs a pass of the weights.
            return 0
        share = spec.config.batch_max // len(chunks)
        drafts = spec.plan([c.request for c in chunks], share, limit=budget)
        placed = 0
        for c, draft in zip(chunks, drafts, strict=True):
            req = c.request
            if draft and self.blocks.grow(req.page_table, req.num_tokens + len(draft)):
                c.draft = tuple(draft)
                placed += len(draft)
        return placed

    def _schedule_running_prefills(
        self, out: SchedulerOutput, budget: _Budget, sitting_out: frozenset[str], turn: AdapterSet
    ) -> None:
        for req in self.running:
            remaining = req.num_tokens - req.num_computed_tokens
            if budget.prefill == 0:
                break
            if remaining <= 1 or req.params.tenant in sitting_out or req.adapters != turn:
                continue
            self._prefill_chunk(out, req, budget)

    def _prefill_chunk(self, out: SchedulerOutput, req: Request, budget: _Budget) -> None:
        """The step's chunk of req's prompt: what `budget.prefill` allows, cut back to an
        image's start rather than inside it where images go whole. An image that alone passes
        the cap still goes, whole, as a step's first prompt chunk (else it would never go).
        Where window checkpoints are kept, a chunk also ends at req's next one: there the
        window is whole after the step (`kv/checkpoints.py`)."""
        start = req.num_computed_tokens
        n = min(req.num_tokens - start, budget.prefill)
        if self.whole_images:
            span = next((s for s in req.images if s.start < start + n < s.end), None)
            if span is not None:
                fits = span.start == start and span.end - start <= budget.total
                n = span.end - start if fits and not budget.taken else span.start - start
        if self.kv.checkpoints is not None:
            n = next((p - start for p in req.checkpoints if start < p < start + n), n)
        if n > 0:
            out.chunks.append(ScheduledChunk(req, start, n))
            budget.take(n)

    def _share_out(self, out: SchedulerOutput) -> None:
        """Slots for waiting tenants below their fair share, taken from those above it."""
        for victim in self.fairness.victims(self.waiting, self.running, self.max_running):
            self._preempt(victim, out, park=True)

    def _admit(self, out: SchedulerOutput, budget: _Budget, turn: AdapterSet) -> None:
        passed: set[int] = set()  # ids of requests whose donor is computing their prefix
        while budget.prefill > 0 and len(self.running) < self.max_running:
            candidates = [r for r in self.waiting if id(r) not in passed and r.adapters == turn]
            if not candidates:
                break
            req = self.fairness.pick(candidates, self.running)
            reuse = self.kv.plan(req)
            if reuse is None:
                passed.add(id(req))  # its donor is computing the shared prefix: others first
                continue
            if not self._admit_one(req, reuse):
                break  # in order: later requests wait behind one that does not fit
            self._prefill_chunk(out, req, budget)

    def _admit_one(self, req: Request, reuse: Reuse) -> bool:
        """Moves `req` from waiting to running on the blocks `reuse` planned; False when they
        do not fit."""
        keep_free = self._watermark if self.running else 0
        reused = self.kv.admit(req, reuse, keep_free)
        if reused is None:
            return False
        if not req.admitted:
            req.num_cached_tokens, req.admitted = reused, True
        req.num_computed_tokens = reused
        req.output_at_admission = req.num_output_tokens
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def _grow_or_preempt(self, req: Request, out: SchedulerOutput) -> bool:
        """Room for req's next position, preempting newer requests; False if req itself went."""
        while not self.kv.grow(req, req.num_computed_tokens + 1):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput, park: bool = False) -> None:
        """Back to the head of the queue, output kept; `park`: its KV stays for it to resume
        (a preemption for memory clears it: its blocks are what is needed)."""
        self.running.remove(req)
        self.kv.release(req, park=park)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        out.preempted.append(req)

    # -- checks -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """No block or sequence id lost or double-owned; waiting requests hold nothing."""
        self.kv.check_integrity(self.running)
        for r in self.waiting:
            if r.page_table.blocks or r.seq_id is not None:
                raise IntegrityError(f"waiting request {r.request_id} holds KV resources")
