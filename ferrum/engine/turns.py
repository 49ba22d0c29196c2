"""Turns: the engines of one server take turns at the cores.

Every model a server runs has an engine thread of its own (`AsyncEngine` for chat,
`EmbeddingEngine` for embeddings), and each of their decodes wants every core. Run side by
side on a CPU, two decodes split the cores and both take about twice as long, so a flood of
embeddings doubles the gaps between a chat stream's tokens. With `Turns`, a decode (a chat
step, an embedding batch) runs only in its engine's turn, and turns are granted in the order
they were asked for: an engine that wants the cores waits at most for the turns asked before
it, and then the others wait for it. Nobody starves.

That alone bounds a chat stream's gap by its own step plus one turn of each other busy engine.
To keep that small, an engine whose work can be cut finer (embedding inputs are independent)
asks `budget_s()` how long its next turn may last while others are busy: a share of the
shortest turn among the other engines that took one lately, turned into work by its
`DecodeCost`. Chat steps are not cut: their size is what their streams need.

Uncontended, a turn costs one lock round trip (microseconds against milliseconds of decode).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

# Another engine counts as busy while it waits for a turn or ended one within this window.
_ACTIVE_S = 0.25
# Smoothing of each party's mean turn length (the weight of the newest turn).
_SMOOTHING = 0.2


class Party:
    """One thread's seat at the turns (an engine's, or request preparation's,
    `ferrum.api.preparation`); used by one thread at a time."""

    def __init__(self, turns: Turns, name: str, paces: bool = True):
        self._turns = turns
        self.name = name
        self.paces = paces  # whether its turns bound the length of the others' (budget_s)
        self.mean_turn_s = 0.0  # smoothed length of this party's turns (0: none yet)
        self.last_end = float("-inf")  # monotonic time its last turn ended
        self.waiting = False
        # Running totals for the metrics (read from other threads: plain numbers, no lock).
        self.turns_taken = 0
        self.held_s = 0.0  # seconds holding the cores
        self.waited_s = 0.0  # seconds waiting for a turn while another party held them
        self._lap_start = 0.0  # monotonic time the turn held now (or its last lap) began

    @contextmanager
    def turn(self, wait: bool = True) -> Iterator[bool]:
        """Holds the cores for the body; returns once every earlier request has had its turn.
        `wait=False`: only a turn nobody holds or waits for, at once; the body is told whether
        it has one (True) or not (False, and it must not touch the cores)."""
        turns = self._turns
        if not self._wait_for_turn(wait):
            yield False
            return
        self._lap_start = time.monotonic()
        try:
            yield True
        finally:
            end = time.monotonic()
            with turns.cond:
                turns.serving += 1
                turns.skip_abandoned()
                self._count_turn(end)

    def lap(self) -> bool:
        """Within a turn: the work since it began (or since the last lap) counts as a turn of
        its own in the others' budgets, and the cores stay held while nobody else waits for
        them. False: someone does; the holder ends its turn now. Cheaper than a turn a step
        (no lock: a waiter that arrives meanwhile is seen at the next lap)."""
        self._count_turn(time.monotonic())
        turns = self._turns
        return turns.next_ticket == turns.serving + 1

    def _count_turn(self, end: float) -> None:
        took = end - self._lap_start
        if self.turns_taken == 0:
            self.mean_turn_s = took
        else:
            self.mean_turn_s += _SMOOTHING * (took - self.mean_turn_s)
        self.last_end = end
        self.turns_taken += 1
        self.held_s += took
        self._lap_start = end

    def _wait_for_turn(self, wait: bool) -> bool:
        """Takes a ticket and waits until it is served; False: not waiting, and one was out."""
        turns = self._turns
        with turns.cond:
            if not wait and turns.serving != turns.next_ticket:
                return False
            ticket = turns.next_ticket
            turns.next_ticket += 1
            self.waiting = True
            asked = time.monotonic() if turns.serving != ticket else None
            try:
                while turns.serving != ticket:
                    turns.cond.wait()
                if asked is not None:  # uncontended: no clock read, one lock round trip
                    self.waited_s += time.monotonic() - asked
            except BaseException:  # never leave a ticket behind that nobody will serve
                turns.abandoned.add(ticket)
                turns.skip_abandoned()
                raise
            finally:
                self.waiting = False
        return True

    def budget_s(self, share: float) -> float | None:
        """How long this party's next turn should last: `share` of the shortest mean turn of
        the other parties busy now, or None when none is (the turn may be as long as it
        likes)."""
        now = time.monotonic()
        with self._turns.cond:
            others = [
                p.mean_turn_s
                for p in self._turns.parties
                if p is not self
                and p.paces
                and p.turns_taken
                and (p.waiting or now - p.last_end < _ACTIVE_S)
            ]
        return share * min(others) if others else None

    def leave(self) -> None:
        """The engine stopped: its turns no longer count for the others' budgets."""
        with self._turns.cond:
            if self in self._turns.parties:
                self._turns.parties.remove(self)


class Turns:
    """First asked, first served turns at the cores, shared by the engines of one server."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.next_ticket = 0
        self.serving = 0
        self.parties: list[Party] = []
        self.abandoned: set[int] = set()  # tickets whose holders gave up waiting

    def join(self, name: str, paces: bool = True) -> Party:
        """A seat for `name`; paces=False: its turns do not shorten the others' budgets (a
        request's preparation is short, and cannot be cut; an engine's work can)."""
        party = Party(self, name, paces)
        with self.cond:
            self.parties.append(party)
        return party

    def skip_abandoned(self) -> None:
        """Under `cond`: moves past tickets nobody waits on and wakes the waiters."""
        while self.serving in self.abandoned:
            self.abandoned.remove(self.serving)
            self.serving += 1
        self.cond.notify_all()


class DecodeCost:
    """A decode's seconds as fixed + per-token cost, fitted to the recent decodes (least
    squares), so a turn's budget can be turned into tokens."""

    WINDOW = 32
    UNMEASURED_TOKENS = 64  # the limit before any decode was timed

    def __init__(self) -> None:
        self._points: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)

    def add(self, tokens: int, seconds: float) -> None:
        self._points.append((tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before any decode."""
        if not self._points:
            return None
        xs = np.array([t for t, _ in self._points], dtype=np.float64)
        ys = np.array([s for _, s in self._points], dtype=np.float64)
        spread = xs - xs.mean()
        var = float(spread @ spread)
        if var > 0:
            per_token = float(spread @ (ys - ys.mean())) / var
            if per_token > 0:
                return max(0.0, float(ys.mean() - per_token * xs.mean())), per_token
        return 0.0, float(ys.sum() / xs.sum())  # one size only: all of it per token

    def tokens_within(self, seconds: float) -> int:
        """Most tokens a decode may hold to last about `seconds` (at least 1)."""
        fit = self.fit()
        if fit is None:
            return self.UNMEASURED_TOKENS
        fixed, per_token = fit
        return max(1, int((seconds - fixed) / per_token)) if per_token > 0 else 1 << 30
