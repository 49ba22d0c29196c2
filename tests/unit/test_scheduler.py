"""Scheduler: budgets, decode-first ordering, FIFO admission, preemption."""

from __future__ import annotations

from ferrum.engine.kv import BlockManager
from ferrum.engine.kv_manager import KVManager
from ferrum.engine.request import FinishReason, Request, RequestStatus
from ferrum.engine.scheduler import Scheduler
from tests.factories import sampling


class _NoKv:
    def clear_sequence(self, seq_id: int) -> None:
        pass

    def copy_sequence(self, src: int, dst: int, length: int) -> None:
        raise AssertionError("no reuse without a prefix cache")

    def holds_window(self, seq_id: int, length: int) -> bool:
        raise AssertionError("no reuse without a prefix cache")


def _sched(num_blocks: int, block_size: int, max_running: int, budget: int, **kw) -> Scheduler:
    kv = KVManager(BlockManager(num_blocks, block_size), _NoKv(), max_running, prefix_cache=False)
    return Scheduler(kv, max_running=max_running, token_budget=budget, **kw)


def _req(rid: str, n_prompt: int) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), sampling())


def _advance(sched_out, token: int = 5) -> None:
    """Pretends the runner decoded the step: counters move, sampled chunks get a token."""
    for c in sched_out.chunks:
        samples = c.samples
        c.request.num_computed_tokens = c.start + c.length
        if samples:
            c.request.append_output(token)


def test_step_never_exceeds_the_token_budget_and_prefill_is_chunked():
    s = _sched(64, 16, 4, 32)
    s.add(_req("a", 100))
    out = s.schedule()
    assert [(c.start, c.length) for c in out.chunks] == [(0, 32)]
    _advance(out)
    starts = []
    while s.running[0].num_output_tokens == 0:
        out = s.schedule()
        assert out.num_tokens <= 32
        starts.append(out.chunks[0].start)
        _advance(out)
    assert starts == [32, 64, 96]


def test_decodes_go_first_and_new_requests_join_at_step_boundaries():
    s = _sched(64, 16, 4, 16)
    s.add(_req("a", 4))
    _advance(s.schedule())  # a prefilled, has its first token
    s.add(_req("long", 40))
    out = s.schedule()
    assert [(c.request.request_id, c.length) for c in out.chunks] == [("a", 1), ("long", 15)]
    _advance(out)
    out = s.schedule()
    # a keeps decoding while long is still prefilling
    assert [(c.request.request_id, c.length) for c in out.chunks] == [("a", 1), ("long", 15)]


def test_admission_is_fifo_and_bounded_by_max_running():
    s = _sched(64, 16, 2, 100)
    for rid in "abc":
        s.add(_req(rid, 4))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]
    s.finish(s.running[0], FinishReason.STOP)
    out = s.schedule()
    assert "c" in [c.request.request_id for c in out.chunks]
    assert s.running[-1].seq_id == 0  # a's id, cleared when a finished, now c's
    s.check_integrity()


def test_a_request_that_does_not_fit_waits_and_blocks_those_behind_it():
    s = _sched(8, 16, 4, 512)
    s.add(_req("a", 60))  # 4 blocks (+1 headroom)
    s.add(_req("big", 70))  # needs 5 + 1: does not fit next to a
    s.add(_req("small", 4))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a"]
    assert [r.request_id for r in s.waiting] == ["big", "small"]
    s.check_integrity()


def test_decode_without_free_blocks_preempts_the_newest_request():
    s = _sched(4, 4, 4, 64, watermark=0)
    a, b, c = _req("a", 8), _req("b", 3), _req("c", 3)
    for r in (a, b, c):
        s.add(r)
    _advance(s.schedule())  # a holds 2 blocks, b and c one each: none free
    assert s.blocks.num_free == 0
    out = s.schedule()  # a needs a 3rd block for position 8: c, the newest, goes
    assert out.preempted == [c]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0
    assert c.output_token_ids == [5]  # output kept: recomputed later, not lost
    assert [ch.request.request_id for ch in out.chunks] == ["a", "b"]
    assert s.waiting[0] is c
    s.check_integrity()


def test_finish_of_a_waiting_request_frees_nothing_it_did_not_hold():
    s = _sched(4, 16, 1, 64)
    a, b = _req("a", 4), _req("b", 4)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b, FinishReason.ABORT)
    assert b.status is RequestStatus.FINISHED and not s.waiting
    s.check_integrity()
