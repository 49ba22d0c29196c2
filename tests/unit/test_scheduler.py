"""Scheduler: budgets, decode-first ordering, FIFO admission, preemption."""

from __future__ import annotations

from ferrum.engine.kv.ledger import BlockManager
from ferrum.engine.kv.residency import KVManager
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


# -- fair shares of the slots ----------------------------------------------------------------


def _tenant_req(rid: str, tenant: str, n_prompt: int = 4, max_tokens: int = 100) -> Request:
    params = sampling(tenant=tenant, max_tokens=max_tokens)
    return Request(rid, list(range(1, n_prompt + 1)), params)


def _ids(out) -> list[str]:
    return [c.request.request_id for c in out.chunks]


def test_admission_takes_the_tenant_holding_fewest_slots_first_fifo_within_a_tenant():
    s = _sched(64, 16, 2, 100)
    for r in (_tenant_req("a1", "A"), _tenant_req("a2", "A"), _tenant_req("b1", "B")):
        s.add(r)
    out = s.schedule()
    assert _ids(out) == ["a1", "b1"]  # FIFO would run a1 and a2, and b1 would wait
    s.finish(s.running[0], FinishReason.STOP)
    assert "a2" in _ids(s.schedule())
    s.check_integrity()


def test_a_tenant_alone_may_hold_every_slot_in_fifo_order_and_is_never_preempted():
    s = _sched(64, 16, 4, 100)
    flood = [_tenant_req(f"a{i}", "A") for i in range(6)]
    for r in flood:
        s.add(r)
    assert _ids(s.schedule()) == ["a0", "a1", "a2", "a3"]
    for _ in range(10):
        out = s.schedule()
        assert not out.preempted
        _advance(out)
    assert [r.request_id for r in s.waiting] == ["a4", "a5"]


def test_a_newcomer_gets_a_slot_from_a_tenant_holding_every_slot_within_a_few_steps():
    s = _sched(256, 4, 8, 512)
    for i in range(8):  # one request with n=8: eight choices, one tenant
        s.add(_tenant_req(f"flood-{i}", "A"))
    for _ in range(6):
        _advance(s.schedule())
    chat = _tenant_req("chat", "B", max_tokens=2)
    s.add(chat)
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["flood-7"]  # A's newest
    assert "chat" in _ids(out) and chat.status is RequestStatus.RUNNING
    victim = out.preempted[0]
    assert victim.output_token_ids == [5] * 6  # output kept: it resumes, nothing is lost
    assert s.waiting[0] is victim
    s.check_integrity()


def test_a_request_preempted_for_fairness_is_not_preempted_again_right_after_it_resumes():
    s = _sched(256, 4, 2, 512)
    a1, a2 = _tenant_req("a1", "A"), _tenant_req("a2", "A")
    s.add(a1)
    s.add(a2)
    for _ in range(6):
        _advance(s.schedule())
    s.add(_tenant_req("b1", "B"))
    out = s.schedule()
    assert out.preempted == [a2]
    _advance(out)
    s.finish(s.running[-1], FinishReason.STOP)  # b1 done: a2 resumes in its slot
    _advance(s.schedule())
    assert a2.status is RequestStatus.RUNNING
    s.add(_tenant_req("b2", "B"))
    out = s.schedule()
    # b2 is owed a slot, but a2 has run no token since it resumed: a1 goes instead.
    assert out.preempted == [a1]
    s.check_integrity()


def test_a_request_that_just_started_is_preempted_only_once_it_has_made_a_few_tokens():
    s = _sched(256, 4, 2, 512)
    s.add(_tenant_req("a1", "A"))
    s.add(_tenant_req("a2", "A"))
    _advance(s.schedule())  # each has its first token: 1 of the 4 needed
    s.add(_tenant_req("b", "B"))
    waits = 0
    while not (out := s.schedule()).preempted:
        waits += 1
        _advance(out)
    assert waits == 3 and [r.request_id for r in out.preempted] == ["a2"]
    assert _ids(out) == ["a1", "b"]


def test_a_request_preempted_for_fairness_resumes_its_parked_sequence_with_the_same_output():
    from tests.factories import FakeRunner, fake_engine, model_info, run_to_completion
    from tests.unit.test_engine_state_machine import expected_tokens

    runner = FakeRunner(info=model_info(n_seq_max=4))  # 2 running, 2 parked
    engine = fake_engine(runner, block_size=4)
    prompts = {"a0": list(b"one user's first prompt"), "a1": list(b"and their second one")}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, sampling(tenant="A", max_tokens=30))
    for _ in range(8):
        engine.step()
    victim = engine.scheduler.running[-1]
    engine.add_request("b", list(b"hi"), sampling(tenant="B", max_tokens=2))
    engine.step()
    assert victim.status is RequestStatus.WAITING
    [parked] = engine.kv_manager.parked
    assert parked.all_token_ids == victim.all_token_ids[:-1]  # all it had computed
    cleared = len(runner.cleared)
    while victim.status is not RequestStatus.RUNNING:
        engine.step()
    # It continues its own sequence: nothing cleared, nothing recomputed.
    assert victim.seq_id == parked.seq_id and parked.seq_id not in runner.cleared[cleared:]
    assert victim.num_cached_tokens == 0  # its own KV taken back is no cache hit
    results = run_to_completion(engine)
    for rid in prompts:
        assert results[rid]["final"].finish_reason == "length"
    assert victim.output_token_ids == expected_tokens(prompts[victim.request_id], 30)


def test_a_newcomers_first_step_leaves_out_the_tenants_above_their_share_for_one_step():
    s = _sched(256, 4, 8, 512)
    for i in range(6):  # A: one request with n=6 (one tenant) ...
        s.add(_tenant_req(f"flood-{i}", "A"))
    s.add(_tenant_req("c", "C"))  # ... and C, one request: both already decoding
    for _ in range(6):
        _advance(s.schedule())
    s.add(_tenant_req("chat", "B", max_tokens=2))
    out = s.schedule()
    # A holds 6 of 8 slots (share 8 // 3 = 2): it sits out the chat's first step; C (at its
    # share) decodes beside it. Without the lane the chat's step would decode all seven.
    assert _ids(out) == ["c", "chat"] and not out.preempted
    _advance(out)
    assert set(_ids(s.schedule())) == {f"flood-{i}" for i in range(6)} | {"c", "chat"}
    s.check_integrity()


def test_a_tenant_that_sat_out_a_step_decodes_in_the_next_whatever_arrives():
    s = _sched(256, 4, 8, 512)
    for i in range(6):
        s.add(_tenant_req(f"flood-{i}", "A"))
    for _ in range(6):
        _advance(s.schedule())
    flood = {f"flood-{i}" for i in range(6)}
    seen = []
    for k in range(3):  # a new chat of a new tenant before every step
        s.add(_tenant_req(f"chat-{k}", f"B{k}", max_tokens=50))
        out = s.schedule()
        seen.append(flood <= set(_ids(out)))
        _advance(out)
    assert seen == [False, True, False]  # every other step at worst
    s.check_integrity()


def test_a_newcomer_that_does_not_fit_makes_nobody_sit_out():
    s = _sched(12, 4, 8, 512)  # 12 blocks of 4: the flood holds most of them
    for i in range(4):
        s.add(_tenant_req(f"flood-{i}", "A", n_prompt=6))
    for _ in range(2):
        _advance(s.schedule())
    s.add(_tenant_req("chat", "B", n_prompt=40))  # needs 11 blocks: waits
    out = s.schedule()
    assert {f"flood-{i}" for i in range(4)} <= set(_ids(out)) and "chat" not in _ids(out)
    s.check_integrity()


def _adapter_req(rid: str, n_prompt: int, adapters: tuple) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), sampling(max_tokens=100, adapters=adapters))


def test_each_step_decodes_one_adapter_set_and_a_minority_set_waits_at_most_a_turn():
    s = _sched(256, 16, 8, 64)
    sets = [(), ((0, 1.0),), ((1, 0.5),)]
    # A majority on the base, one request on each adapter, the minority arriving last.
    reqs = [_adapter_req(f"base{i}", 4, ()) for i in range(6)]
    reqs += [_adapter_req("a", 4, sets[1]), _adapter_req("b", 4, sets[2])]
    for r in reqs:
        s.add(r)
    last_step: dict[str, int] = {}
    longest_wait = 0
    for step in range(30):
        out = s.schedule()
        assert len({c.request.adapters for c in out.chunks}) == 1  # one set per decode
        for c in out.chunks:
            rid = c.request.request_id
            longest_wait = max(longest_wait, step - last_step.get(rid, step))
            last_step[rid] = step
        _advance(out)
    assert set(last_step) == {r.request_id for r in reqs}  # nobody starved
    assert longest_wait <= len(sets)  # between two turns of its set: the other sets' turns
    assert s.turns.switches >= 20


def test_a_set_without_room_passes_its_turn_within_the_step():
    s = _sched(256, 16, 1, 64)  # one slot: the adapter request waits for it
    s.add(_adapter_req("base", 4, ()))
    _advance(s.schedule())
    s.add(_adapter_req("a", 4, ((0, 1.0),)))
    for _ in range(3):
        out = s.schedule()
        assert [c.request.request_id for c in out.chunks] == ["base"]
        _advance(out)


def test_decode_every_lets_streams_decode_in_every_nth_step_of_a_prefill():
    s = _sched(64, 16, 4, 16, decode_every=3)
    s.add(_req("a", 4))
    _advance(s.schedule())  # a prefilled, has its first token: a stream
    long = _req("long", 100)
    s.add(long)
    decoded = []
    while long.num_output_tokens == 0:
        out = s.schedule()
        assert out.num_tokens <= 16 and out.has_prefill  # the prompt moves every step
        decoded.append(any(c.request.request_id == "a" for c in out.chunks))
        _advance(out)
    # Admitted beside the decodes; from then on, while its prompt runs, every third step.
    assert decoded == [i % 3 == 0 for i in range(len(decoded))] and len(decoded) >= 6
    out = s.schedule()  # no prompt left: the streams decode every step again
    assert {c.request.request_id for c in out.chunks} == {"a", "long"}


def test_decode_every_never_stalls_when_no_prompt_chunk_can_go():
    """A prompt that cannot be admitted (no sequence id) is no reason to sit out."""
    s = _sched(64, 16, 1, 16, decode_every=3)
    s.add(_req("a", 4))
    _advance(s.schedule())
    s.add(_req("waiting", 40))  # max_running 1: it waits for a
    for _ in range(3):
        out = s.schedule()
        assert [c.request.request_id for c in out.chunks] == ["a"]
        _advance(out)
