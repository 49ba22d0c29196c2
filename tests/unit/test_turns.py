"""Turns at the cores (`ferrum.engine.turns`) and an embedding decode's cost model.

Oracles: turns are entered in the order they were asked for, one at a time; a waiter that
gives up never blocks those behind it; a party's budget is a share of the shortest mean turn
of the others busy now, and None when it is alone; the cost fit recovers a known fixed and
per-token cost.
"""

from __future__ import annotations

import threading
import time

import pytest

from ferrum.engine import turns as turns_module
from ferrum.engine.turns import DecodeCost, Turns


def _wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_turns_are_entered_one_at_a_time_in_the_order_asked():
    turns = Turns()
    holder, *waiters = [turns.join(f"p{i}") for i in range(4)]
    entered: list[str] = []
    inside = 0
    most_inside = 0
    lock = threading.Lock()

    def take(party) -> None:
        nonlocal inside, most_inside
        with party.turn():
            with lock:
                inside += 1
                most_inside = max(most_inside, inside)
            entered.append(party.name)
            time.sleep(0.005)
            with lock:
                inside -= 1

    release = threading.Event()
    with_turn = threading.Event()

    def hold() -> None:
        with holder.turn():
            with_turn.set()
            release.wait(5)

    threads = [threading.Thread(target=hold)]
    threads[0].start()
    with_turn.wait(5)
    for party in waiters:  # each asks only once the one before it is waiting
        t = threading.Thread(target=take, args=(party,))
        t.start()
        threads.append(t)
        _wait_until(lambda p=party: p.waiting)
    release.set()
    for t in threads:
        t.join(5)
    assert entered == ["p1", "p2", "p3"]
    assert most_inside == 1
    assert [p.turns_taken for p in (holder, *waiters)] == [1, 1, 1, 1]


def test_a_waiter_that_gives_up_does_not_block_those_behind_it():
    turns = Turns()
    holder, quitter, patient = (turns.join(n) for n in ("holder", "quitter", "patient"))
    plain_wait = turns.cond.wait

    def wait(timeout=None):
        if threading.current_thread().name == "quitter":
            raise KeyboardInterrupt  # what a signal delivered while waiting looks like
        return plain_wait(timeout)

    turns.cond.wait = wait  # type: ignore[method-assign]
    release = threading.Event()
    failed: list[BaseException] = []
    got_turn = threading.Event()

    def hold() -> None:
        with holder.turn():
            release.wait(5)

    def quit_waiting() -> None:
        try:
            with quitter.turn():
                pass
        except KeyboardInterrupt as exc:
            failed.append(exc)

    def wait_patiently() -> None:
        with patient.turn():
            got_turn.set()

    h = threading.Thread(target=hold)
    h.start()
    _wait_until(lambda: holder.turns_taken == 0 and turns.next_ticket == 1)
    q = threading.Thread(target=quit_waiting, name="quitter")
    q.start()
    q.join(5)
    p = threading.Thread(target=wait_patiently)
    p.start()
    release.set()
    assert got_turn.wait(5), "the ticket given up blocked the next waiter"
    assert failed and not quitter.waiting
    for t in (h, p):
        t.join(5)


def test_a_budget_is_a_share_of_the_shortest_busy_turn_and_none_alone(monkeypatch):
    turns = Turns()
    embed, chat, other = turns.join("embed"), turns.join("chat"), turns.join("other")
    assert embed.budget_s(0.5) is None  # nobody has taken a turn
    with chat.turn():
        time.sleep(0.02)
    assert embed.budget_s(0.5) == pytest.approx(0.5 * chat.mean_turn_s)
    assert 0.009 < embed.budget_s(0.5) < 0.5
    with other.turn():
        pass  # a much shorter turn: it sets the budget
    assert embed.budget_s(0.5) == pytest.approx(0.5 * other.mean_turn_s)
    other.leave()
    assert embed.budget_s(0.5) == pytest.approx(0.5 * chat.mean_turn_s)
    monkeypatch.setattr(turns_module, "_ACTIVE_S", 0.0)  # the chat engine went quiet
    assert embed.budget_s(0.5) is None
    chat.waiting = True  # ... unless it is waiting for a turn now
    assert embed.budget_s(0.5) == pytest.approx(0.5 * chat.mean_turn_s)


def test_mean_turn_follows_recent_turns():
    turns = Turns()
    party = turns.join("p")
    for _ in range(3):
        with party.turn():
            time.sleep(0.03)
    slow = party.mean_turn_s
    for _ in range(15):
        with party.turn():
            pass
    assert party.mean_turn_s < slow / 10


def test_the_decode_cost_fit_recovers_fixed_and_per_token_costs():
    cost = DecodeCost()
    assert cost.tokens_within(0.01) == DecodeCost.UNMEASURED_TOKENS
    for tokens in (4, 16, 64, 8, 32, 128):
        cost.add(tokens, 0.002 + 0.0005 * tokens)
    fixed, per_token = cost.fit()
    assert fixed == pytest.approx(0.002)
    assert per_token == pytest.approx(0.0005)
    assert cost.tokens_within(0.00705) == 10
    assert cost.tokens_within(0.001) == 1  # under the fixed cost: one input still goes
    one_size = DecodeCost()
    one_size.add(10, 0.01)
    assert one_size.fit() == (0.0, pytest.approx(0.001))


def test_a_party_that_does_not_pace_leaves_the_others_budgets_alone():
    turns = Turns()
    embed, prep = turns.join("embed"), turns.join("preparation", paces=False)
    with prep.turn():
        pass
    assert embed.budget_s(0.5) is None  # only a non-pacing party was busy
    chat = turns.join("chat")
    with chat.turn():
        time.sleep(0.01)
    assert embed.budget_s(0.5) == pytest.approx(0.5 * chat.mean_turn_s)


def test_a_turn_without_waiting_is_had_only_when_nobody_holds_or_wants_one():
    turns = Turns()
    engine, other = turns.join("engine"), turns.join("other")
    with engine.turn(wait=False) as held:
        assert held  # free: taken at once
        with other.turn(wait=False) as also:
            assert not also  # held by the engine: refused, not queued
    assert turns.next_ticket == turns.serving == 1  # the refusal left no ticket behind
    inside = threading.Event()
    release = threading.Event()

    def wait_for_one() -> None:
        with other.turn():
            inside.set()
            release.wait(5)

    with engine.turn():
        t = threading.Thread(target=wait_for_one)
        t.start()
        _wait_until(lambda: other.waiting)
        with engine.turn(wait=False) as held:
            assert not held  # another party waits (behind the engine's own turn)
    assert inside.wait(5)
    with engine.turn(wait=False) as held:
        assert not held
    release.set()
    t.join(5)


def test_laps_keep_a_turn_while_nobody_waits_and_count_as_turns():
    turns = Turns()
    engine, other = turns.join("engine"), turns.join("other")
    entered = threading.Event()
    with engine.turn() as held:
        assert held
        for _ in range(3):
            time.sleep(0.01)
            assert engine.lap()  # nobody else wants the cores: keep them
        assert engine.turns_taken == 3 and 0.009 < engine.mean_turn_s < 0.1

        def wait_for_one() -> None:
            with other.turn():
                entered.set()

        t = threading.Thread(target=wait_for_one)
        t.start()
        _wait_until(lambda: other.waiting)
        assert not engine.lap()  # someone waits: the holder must end its turn
        assert not entered.is_set()  # ... which it still holds until it does
    assert entered.wait(5)
    t.join(5)
    assert engine.turns_taken == 5  # three laps, the one that found a waiter, the end
