"""Request preparation in turns with the engines (`ferrum.api.prompting.preparation`).

Oracles: every preparation runs on the one preparation thread and hands back its result or
its exception; none runs while an engine holds a turn; what waited while an engine stepped is
prepared in one turn when the engines leave room for it, and one at a time when a step is
short; a caller that went away before its turn costs no preparation; the thread ends when
idle and comes back with the next request.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from ferrum.api.prompting import preparation as preparation_module
from ferrum.api.prompting.preparation import Preparer
from ferrum.engine.turns import Turns


class _Stepper:
    """A fake engine thread: takes turns of `step_s` back to back until stopped."""

    def __init__(self, turns: Turns, step_s: float):
        self.party = turns.join("engine")
        self.step_s = step_s
        self.inside = threading.Event()  # set while it holds a turn
        self.turns_taken = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> _Stepper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.party.turn():
                self.inside.set()
                time.sleep(self.step_s)
                self.inside.clear()
                self.turns_taken += 1


def test_preparations_run_on_one_thread_and_return_results_and_errors():
    async def main():
        preparer = Preparer(None)
        names = await asyncio.gather(
            *(preparer.run(lambda: threading.current_thread().name) for _ in range(5))
        )
        assert set(names) == {"ferrum-prepare"}

        def bad() -> None:
            raise ValueError("no such schema")

        with pytest.raises(ValueError, match="no such schema"):
            await preparer.run(bad)
        assert await preparer.run(lambda: 7) == 7  # the thread survived the error

    asyncio.run(main())


def test_no_preparation_runs_inside_an_engine_step():
    turns = Turns()
    preparer = Preparer(turns)
    seen_inside: list[bool] = []

    def prepare() -> int:
        seen_inside.append(stepper.inside.is_set())
        time.sleep(0.001)
        return 1

    async def main():
        for _ in range(4):
            assert sum(await asyncio.gather(*(preparer.run(prepare) for _ in range(8)))) == 8
            await asyncio.sleep(0.003)

    with _Stepper(turns, step_s=0.004) as stepper:
        asyncio.run(main())
    assert len(seen_inside) == 32 and not any(seen_inside)


def _burst_turns(step_s: float) -> int:
    """How many preparation turns 8 preparations of 2 ms each, queued during an engine step,
    took."""
    turns = Turns()
    preparer = Preparer(turns)
    party = preparer._party
    assert party is not None

    async def main():
        while stepper.turns_taken < 3:  # the engine's mean step is known
            await asyncio.sleep(0.001)
        before = party.turns_taken
        await asyncio.gather(*(preparer.run(lambda: time.sleep(0.002)) for _ in range(8)))
        return party.turns_taken - before

    with _Stepper(turns, step_s=step_s) as stepper:
        return asyncio.run(main())


def test_a_burst_is_prepared_in_turns_that_fit_a_share_of_the_engine_step():
    assert _burst_turns(step_s=0.2) <= 2  # 16 ms of preparation fit in half of 200 ms
    assert _burst_turns(step_s=0.004) >= 4  # 2 ms steps: about one preparation per turn


def test_a_caller_gone_before_its_turn_costs_no_preparation():
    turns = Turns()
    preparer = Preparer(turns)
    ran: list[int] = []
    holder = turns.join("engine")

    async def main():
        entered, release = threading.Event(), threading.Event()

        def hold() -> None:
            with holder.turn():
                entered.set()
                release.wait(5)

        t = threading.Thread(target=hold)
        t.start()
        entered.wait(5)
        waiting = asyncio.ensure_future(preparer.run(lambda: ran.append(1)))
        await asyncio.sleep(0.05)  # queued behind the engine's turn
        waiting.cancel()
        await asyncio.sleep(0.01)
        release.set()
        t.join(5)
        assert await asyncio.wait_for(preparer.run(lambda: 2), 5) == 2  # the thread lives on
        assert ran == []

    asyncio.run(main())


def test_the_thread_ends_when_idle_and_comes_back(monkeypatch):
    monkeypatch.setattr(preparation_module, "_IDLE_S", 0.02)
    preparer = Preparer(None)

    async def main():
        assert await preparer.run(lambda: 1) == 1
        deadline = time.monotonic() + 5
        while preparer._thread is not None:
            assert time.monotonic() < deadline, "the idle thread did not end"
            await asyncio.sleep(0.01)
        assert await preparer.run(lambda: 2) == 2

    asyncio.run(main())


def _held_turn(turns: Turns) -> tuple[threading.Event, threading.Event, threading.Thread]:
    """An engine that holds the cores until released: (entered, release, its thread)."""
    holder = turns.join("engine")
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with holder.turn():
            entered.set()
            release.wait(5)

    thread = threading.Thread(target=hold)
    thread.start()
    entered.wait(5)
    return entered, release, thread


def test_a_light_preparation_does_not_wait_for_the_step_in_flight():
    turns = Turns()
    preparer = Preparer(turns)
    _, release, thread = _held_turn(turns)

    async def main():
        light = await asyncio.wait_for(preparer.run(lambda: "light", light=True), 2)
        heavy = asyncio.ensure_future(preparer.run(lambda: "heavy"))
        await asyncio.sleep(0.05)
        assert not heavy.done()  # an ordinary one still waits for its turn
        release.set()
        return light, await asyncio.wait_for(heavy, 5)

    try:
        assert asyncio.run(main()) == ("light", "heavy")
    finally:
        release.set()
        thread.join(5)


def test_light_preparations_outside_turns_stay_within_their_allowance():
    """20 light preparations of 2 ms during one long step: the allowance (10 ms) lets a few
    run beside it, the rest wait for the step to end."""
    turns = Turns()
    preparer = Preparer(turns)
    _, release, thread = _held_turn(turns)
    ended_at: list[float] = []

    def prepare() -> None:
        time.sleep(0.002)
        ended_at.append(time.monotonic())

    async def main():
        jobs = [asyncio.ensure_future(preparer.run(prepare, light=True)) for _ in range(20)]
        await asyncio.sleep(0.3)
        released = time.monotonic()
        release.set()
        await asyncio.wait_for(asyncio.gather(*jobs), 5)
        return released

    try:
        released = asyncio.run(main())
    finally:
        release.set()
        thread.join(5)
    beside = sum(t < released for t in ended_at)
    assert 1 <= beside <= 7, beside
    assert len(ended_at) == 20
