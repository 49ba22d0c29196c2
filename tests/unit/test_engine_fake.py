"""The engine on the fake runner: batching, stops, lengths, aborts, faults, preemption."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrum.engine.engine import LLMEngine
from ferrum.errors import ContextLengthExceeded, InvalidRequest
from tests.factories import (
    EOS,
    FakeRunner,
    byte_tokenize,
    fake_engine,
    model_info,
    run_to_completion,
    sampling,
)
from tests.profiles import examples

PROMPTS = ["hello", "a much longer prompt that needs several chunks " * 3, "x", "ünïcødé ✓"]


def _alone(prompt: str, **params) -> str:
    engine = fake_engine()
    engine.add_request("r", byte_tokenize(prompt), sampling(**params))
    return run_to_completion(engine)["r"]["content"]


def test_batched_output_equals_output_alone():
    engine = fake_engine()
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", byte_tokenize(p), sampling(max_tokens=12))
    results = run_to_completion(engine)
    for i, p in enumerate(PROMPTS):
        assert results[f"r{i}"]["content"] == _alone(p, max_tokens=12)
    assert max(engine.runner.batch_sizes) > 1


def test_requests_decode_together_in_one_call():
    runner = FakeRunner()
    engine = fake_engine(runner)
    for i in range(4):
        engine.add_request(f"r{i}", byte_tokenize(f"p{i}"), sampling(max_tokens=20))
    run_to_completion(engine)
    assert runner.batch_sizes.count(4) >= 15  # 4 sequences × 1 token per decode step


def test_max_tokens_gives_finish_reason_length_and_usage():
    engine = fake_engine()
    engine.add_request("r", byte_tokenize("hi"), sampling(max_tokens=5))
    final = run_to_completion(engine)["r"]["final"]
    assert final.finish_reason == "length"
    assert (final.prompt_tokens, final.completion_tokens) == (3, 5)


def test_eog_token_stops_unless_ignore_eos():
    script = lambda hist: EOS if len(hist) >= 6 else ord("z")  # noqa: E731
    engine = fake_engine(FakeRunner(next_token=script))
    engine.add_request("r", byte_tokenize("abc"), sampling(max_tokens=10))
    engine.add_request("i", byte_tokenize("abc"), sampling(max_tokens=10, ignore_eos=True))
    res = run_to_completion(engine)
    assert res["r"]["final"].finish_reason == "stop"
    assert res["r"]["content"] == "zz"  # the EOS itself is never text
    assert res["i"]["final"].finish_reason == "length"
    assert res["i"]["final"].completion_tokens == 10


def test_stop_string_across_tokens_is_not_emitted():
    text = iter("say STOP now")
    engine = fake_engine(FakeRunner(next_token=lambda hist: ord(next(text))))
    engine.add_request("r", byte_tokenize("q"), sampling(max_tokens=20, stop=("STOP",)))
    res = run_to_completion(engine)["r"]
    assert res["content"] == "say "
    assert res["final"].finish_reason == "stop"


def test_think_block_goes_to_reasoning():
    text = iter("<think>hmm</think>\n\nanswer" + "!" * 20)
    engine = fake_engine(FakeRunner(next_token=lambda hist: ord(next(text))))
    engine.add_request("r", byte_tokenize("q"), sampling(max_tokens=30))
    res = run_to_completion(engine)["r"]
    assert (res["reasoning"], res["content"][:6]) == ("hmm", "answer")


def test_abort_frees_everything_and_other_requests_continue():
    runner = FakeRunner()
    engine = fake_engine(runner)
    engine.add_request("a", byte_tokenize("aaa"), sampling(max_tokens=50))
    engine.add_request("b", byte_tokenize("bbb"), sampling(max_tokens=5))
    engine.step()
    out = engine.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert engine.abort("a") is None  # idempotent
    res = run_to_completion(engine)
    assert res["b"]["final"].finish_reason == "length"
    engine.kv_manager.drop_parked()
    assert engine.kv_manager.blocks.num_free == engine.kv_manager.blocks.num_blocks
    assert not runner.samplers and runner.closed_samplers  # every sampler freed


def test_a_decode_fault_fails_only_its_request_and_the_sequence_is_cleared():
    runner = FakeRunner()
    engine = fake_engine(runner)
    engine.add_request("a", byte_tokenize("aaa"), sampling(max_tokens=6))
    engine.add_request("b", byte_tokenize("bbb"), sampling(max_tokens=6))
    first = {o.request_id: o.content for o in engine.step()}
    runner.fail_seqs.add(0)
    res = run_to_completion(engine)
    assert res["a"]["final"].finish_reason == "error"
    assert res["b"]["final"].finish_reason == "length"
    assert first["b"] + res["b"]["content"] == _alone("bbb", max_tokens=6)
    engine.add_request("c", byte_tokenize("ccc"), sampling(max_tokens=6))  # reuses seq 0
    assert run_to_completion(engine)["c"]["content"] == _alone("ccc", max_tokens=6)


def test_preempted_requests_produce_the_same_output():
    # 6 blocks of 4 tokens: three requests growing to 18 positions cannot all stay resident.
    runner = FakeRunner(info=model_info(n_ctx=24, n_batch=16))
    engine = fake_engine(runner, block_size=4)
    preemptions = []
    engine.observer.on_step = lambda stats: preemptions.append(stats.preemptions)
    prompts = ["abc", "defg", "hi"]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", byte_tokenize(p), sampling(max_tokens=14))
    res = run_to_completion(engine)
    assert sum(preemptions) > 0
    for i, p in enumerate(prompts):
        assert res[f"r{i}"]["content"] == _alone(p, max_tokens=14)
        assert res[f"r{i}"]["final"].completion_tokens == 14


def test_context_rules():
    engine = fake_engine(FakeRunner(info=model_info(n_ctx=64)))
    with pytest.raises(ContextLengthExceeded):
        engine.clamp_max_tokens(64, 1)
    with pytest.raises(InvalidRequest):
        engine.clamp_max_tokens(0, 1)
    assert engine.clamp_max_tokens(60, 100) == 4  # clamped to the room left
    assert engine.clamp_max_tokens(60, None) == 4
    assert engine.clamp_max_tokens(10, 3) == 3


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "abort", "step", "fault"]),
            st.integers(1, 40),
            st.integers(1, 20),
        ),
        max_size=60,
    )
)
def test_random_workloads_never_leak_blocks_or_sequence_ids(ops):
    runner = FakeRunner(info=model_info(n_ctx=128, n_batch=32, n_seq_max=6))
    engine = fake_engine(runner, block_size=8)
    added: list[str] = []
    for i, (op, a, b) in enumerate(ops):
        if op == "add":
            rid = f"r{i}"
            n_prompt = min(a, 100)
            engine.add_request(rid, [65] * n_prompt, sampling(max_tokens=b))
            added.append(rid)
        elif op == "abort" and added:
            engine.abort(added[a % len(added)])
        elif op == "fault":
            runner.fail_seqs.add(a % 6)
        elif engine.has_work:
            engine.step()
        engine.check_integrity()
    runner.fail_seqs.clear()
    run_to_completion(engine)
    engine.kv_manager.drop_parked()
    engine.check_integrity()
    assert engine.kv_manager.blocks.num_free == engine.kv_manager.blocks.num_blocks
    assert engine.kv_manager.seq_ids.num_free == 6


def test_a_parked_sequence_holding_every_block_never_blocks_admission():
    # Found by the API fuzzer: a request that ran to the end of the context parks a sequence
    # holding every block. The same prompt again matched it as a donor that admission would not
    # evict, so it waited forever, and every request behind it too.
    engine = fake_engine(FakeRunner(info=model_info(n_ctx=64)), block_size=8)
    prompt = byte_tokenize("a prompt of two blocks")
    whole_context = engine.clamp_max_tokens(len(prompt), None)
    contents = []
    for rid in ("first", "again"):
        engine.add_request(rid, prompt, sampling(max_tokens=whole_context))
        res = run_to_completion(engine, max_steps=500)
        assert res[rid]["final"].finish_reason == "length"
        contents.append(res[rid]["content"])
    assert contents[0] == contents[1]


def test_a_request_that_cannot_fit_evicts_no_parked_sequence():
    """A large request waiting for running ones to finish must not empty the prefix cache:
    eviction starts only when evicting would make room."""
    runner = FakeRunner(info=model_info(n_ctx=256, n_batch=64, n_seq_max=8))
    engine = fake_engine(runner)  # 16 blocks of 16
    for i in range(2):  # two parked sequences of 3 blocks each
        engine.add_request(f"p{i}", byte_tokenize(f"{i} parked " * 4), sampling(max_tokens=4))
    run_to_completion(engine)
    parked = {p.seq_id for p in engine.kv_manager.parked}
    assert len(parked) == 2
    engine.add_request("long", byte_tokenize("x" * 60), sampling(max_tokens=30))  # 4-6 blocks
    for _ in range(3):
        engine.step()
    # 13 blocks: more than the free ones (6) and the parked ones (6) while "long" runs.
    engine.add_request("big", byte_tokenize("y" * 200), sampling(max_tokens=2))
    engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == ["big"]
    assert {p.seq_id for p in engine.kv_manager.parked} == parked  # nothing evicted in vain
    assert engine.kv_manager.evictions == 0
    res = run_to_completion(engine)
    assert res["big"]["final"].finish_reason == "length"


def test_a_failed_admission_keeps_no_sequence_id_or_block():
    runner = FakeRunner()
    engine = fake_engine(runner)
    prompt = byte_tokenize("the same long enough prompt, twice over")
    engine.add_request("a", prompt, sampling())
    run_to_completion(engine)

    def broken_copy(src: int, dst: int, length: int) -> None:
        raise RuntimeError("llama.cpp refused the copy")

    runner.copy_sequence = broken_copy  # type: ignore[method-assign]
    engine.add_request("b", prompt + byte_tokenize(" more", add_special=False), sampling())
    with pytest.raises(RuntimeError, match="refused the copy"):
        engine.step()
    engine.fail_all("engine fault")
    engine.check_integrity()
    kv = engine.kv_manager
    assert kv.seq_ids.num_free == kv.seq_ids.size - len(kv.parked)


def test_an_idle_engine_gathers_a_burst_into_its_first_step():
    """Requests sent together reach the engine a few milliseconds apart; an idle engine that
    stepped on the first would make the others wait a whole step for their prefill."""
    import asyncio

    from ferrum.engine.async_engine import AsyncEngine

    async def burst(gather: tuple[float, float], gap_s: float) -> list[int]:
        runner = FakeRunner()
        front = AsyncEngine(fake_engine(runner), gather=gather)
        front.start()
        try:
            streams = []
            for i in range(4):
                prompt = byte_tokenize(f"request {i}")
                streams.append(front.submit(f"r{i}", prompt, sampling(max_tokens=2), True))
                await asyncio.sleep(gap_s)
            for s in streams:
                async for _ in s:
                    pass
        finally:
            await front.stop()
        return runner.batch_sizes

    prompt_tokens = len(byte_tokenize("request 0"))
    gathered = asyncio.run(burst((0.2, 2.0), 0.01))  # a quiet window wider than the gaps
    assert gathered[0] == 4 * prompt_tokens
    alone = asyncio.run(burst((0.0, 0.0), 0.05))  # no gathering: the first steps alone
    assert alone[0] == prompt_tokens


def test_a_parked_donor_holding_the_only_sequence_id_gives_way():
    """One sequence id, prefix reuse on: the next request with the same prompt matches the
    parked sequence but cannot copy from it (no second id); it must be prefilled afresh, not
    wait forever for a donor nothing will ever free."""
    runner = FakeRunner(info=model_info(n_ctx=512, n_batch=64, n_seq_max=1))
    engine = LLMEngine(runner, block_size=8, max_running=1, prefix_cache=True)
    prompt = [256, *b"the same prompt, twice"]
    outputs = []
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, sampling(max_tokens=10))
        outputs.append(run_to_completion(engine, max_steps=100)[rid]["tokens"])
        assert not engine.has_work
        engine.check_integrity()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 10


def test_a_request_answered_whole_crosses_to_the_event_loop_once():
    """A non-streamed answer reads only the finished output: the engine thread merges the
    deltas itself and posts one output, the same text and tokens as the streamed request's
    many; an abort still ends it with what it had."""
    import asyncio

    from ferrum.engine.async_engine import AsyncEngine

    async def run() -> None:
        front = AsyncEngine(fake_engine(FakeRunner(step_delay_s=0.002)))
        front.start()
        try:
            prompt = byte_tokenize("the same prompt")
            streamed = front.submit("s", prompt, sampling(max_tokens=12), True)
            whole = front.submit("w", prompt, sampling(max_tokens=12), True, whole=True)
            while front._streams:  # both finished and posted
                await asyncio.sleep(0.01)
            outs = {rid: [s._queue.get_nowait() for _ in range(s._queue.qsize())]
                    for rid, s in (("s", streamed), ("w", whole))}  # fmt: skip
            assert len(outs["s"]) > 1 and len(outs["w"]) == 1
            (answer,) = outs["w"]
            assert answer.finished and answer.finish_reason == "length"
            assert answer.token_ids == [t for o in outs["s"] for t in o.token_ids]
            assert answer.content == "".join(o.content for o in outs["s"])
            assert len(answer.token_ids) == answer.completion_tokens == 12

            cut = front.submit("c", prompt, sampling(max_tokens=10_000), True, whole=True)
            await asyncio.sleep(0.05)  # some tokens, held on the engine thread
            front.abort("c")
            await asyncio.sleep(0.05)
            assert cut._queue.empty()  # its client left: nothing is sent
            await asyncio.sleep(0.05)
            assert not front._held
        finally:
            await front.stop()

    asyncio.run(run())


class _ThreadRecordingRunner(FakeRunner):
    """Notes which thread runs each decode."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.threads: list[str] = []

    def execute(self, items):
        import threading

        self.threads.append(threading.current_thread().name)
        return super().execute(items)


def test_a_busy_engine_steps_on_the_compute_thread_and_yields_the_cores_within_a_step():
    """Alone, an engine's steps run back to back on the compute thread (no hand-off between
    threads, no turn of their own); another party asking for a turn, or another compute job,
    gets the cores after the step under way, and the engine then goes on."""
    import asyncio
    import time

    from ferrum.engine.async_engine import AsyncEngine
    from ferrum.engine.compute import compute
    from ferrum.engine.turns import Turns

    step_s = 0.005
    turns = Turns()
    runner = _ThreadRecordingRunner(step_delay_s=step_s)

    def waits_for_the_cores(other) -> list[float]:
        waits = []
        for i in range(6):
            start = time.monotonic()
            if i % 2:
                compute().run(lambda: None)
            else:
                with other.turn():
                    pass
            waits.append(time.monotonic() - start)
            time.sleep(2 * step_s)  # the engine takes the cores back meanwhile
        return waits

    async def run() -> None:
        front = AsyncEngine(fake_engine(runner), turns=turns.join("engine"))
        front.start()
        try:
            prompt = byte_tokenize("a long answer")
            front.submit("r", prompt, sampling(max_tokens=400), True)
            while len(runner.threads) < 20:
                await asyncio.sleep(step_s)
            assert set(runner.threads) == {"ferrum-compute"}
            waits = await asyncio.to_thread(waits_for_the_cores, turns.join("other"))
            # A step or so each (the request alone would hold the cores for 2 s).
            assert max(waits) < 20 * step_s, waits
            steps = len(runner.threads)
            await asyncio.sleep(10 * step_s)
            assert len(runner.threads) > steps + 3  # the engine went on
            front.abort("r")
        finally:
            await front.stop()

    asyncio.run(run())
