"""A read-only picture of what one engine is doing now: its requests (ids, lengths, state)
and its KV blocks, for llama-server's /slots and /props and ferrum's dashboard.

Counts and states only, never token ids or text: whoever reads a picture learns how long
the requests are, not what they say. `engine_view` reads the scheduler and the KV ledger,
which only the engine thread may touch: call it through `AsyncEngine.on_engine_thread`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferrum.engine.engine import LLMEngine
from ferrum.engine.request import Request


@dataclass(frozen=True)
class SlotView:
    """One request the engine holds."""

    request_id: str
    tenant: str  # whose it is (a key's digest): the API shows the id to its owner only
    state: str  # "waiting" (not admitted), "prefill" or "decoding"
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int  # positions whose KV is resident
    cached_tokens: int  # prompt positions reused instead of computed
    max_tokens: int
    temperature: float


@dataclass(frozen=True)
class EngineView:
    """The engine's requests and blocks at one step boundary."""

    slots: tuple[SlotView, ...]  # running first (admission order), then waiting (FIFO)
    max_running: int  # --parallel: how many run at once
    n_ctx: int
    block_size: int
    blocks_total: int
    blocks_free: int
    blocks_parked: int  # held by finished sequences kept for reuse
    speculative: bool


def _slot(req: Request, state: str) -> SlotView:
    return SlotView(
        request_id=req.request_id,
        tenant=req.params.tenant,
        state=state,
        prompt_tokens=req.num_prompt_tokens,
        output_tokens=req.num_output_tokens,
        computed_tokens=req.num_computed_tokens,
        cached_tokens=req.num_cached_tokens,
        max_tokens=req.params.max_tokens,
        temperature=req.params.temperature,
    )


def engine_view(engine: LLMEngine) -> EngineView:
    """The picture (engine thread only: `AsyncEngine.on_engine_thread`)."""
    sched = engine.scheduler
    blocks = sched.blocks
    running = [
        _slot(r, "decoding" if r.num_tokens - r.num_computed_tokens <= 1 else "prefill")
        for r in sched.running
    ]
    waiting = [_slot(r, "waiting") for r in sched.waiting]
    return EngineView(
        slots=tuple(running + waiting),
        max_running=sched.max_running,
        n_ctx=engine.info.n_ctx,
        block_size=blocks.block_size,
        blocks_total=blocks.num_blocks,
        blocks_free=blocks.num_free,
        blocks_parked=engine.kv_manager.parked.num_blocks,
        speculative=engine.speculator is not None,
    )
