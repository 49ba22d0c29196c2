"""The Responses store under random traffic, against a plain LRU model of it: the same
entries survive, bounds always hold, and a conversation reads back whole or not at all."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ferrum.api.responses_api.bodies import size_of
from ferrum.api.responses_api.store import ResponseStore
from ferrum.errors import NotFound

MAX_BYTES = 2000
MAX_ENTRIES = 6


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = ResponseStore(MAX_BYTES, MAX_ENTRIES)
        self.model: OrderedDict[str, tuple[int, str | None, list]] = OrderedDict()
        self.count = 0

    def _touch(self, rid: str) -> None:
        self.model.move_to_end(rid)

    @rule(text=st.text(max_size=400), parent=st.integers(0, 20), root=st.booleans())
    def put(self, text: str, parent: int, root: bool) -> None:
        rid = f"resp_{self.count}"
        self.count += 1
        parents = list(self.model)
        parent_id = None if root or not parents else parents[parent % len(parents)]
        response = {"id": rid, "output_text": text}
        messages = [{"role": "user", "content": text}]
        self.store.put(response, messages, parent_id)
        size = size_of(response) + size_of(messages)
        if size > MAX_BYTES:
            return
        self.model[rid] = (size, parent_id, messages)
        while (
            sum(s for s, _, _ in self.model.values()) > MAX_BYTES or len(self.model) > MAX_ENTRIES
        ):
            self.model.popitem(last=False)

    @precondition(lambda self: self.count > 0)
    @rule(pick=st.integers(0, 40))
    def get(self, pick: int) -> None:
        rid = f"resp_{pick % self.count}"
        if rid in self.model:
            assert self.store.get(rid).response["id"] == rid
            self._touch(rid)
        else:
            with pytest.raises(NotFound):
                self.store.get(rid)

    @precondition(lambda self: self.count > 0)
    @rule(pick=st.integers(0, 40))
    def conversation(self, pick: int) -> None:
        rid = f"resp_{pick % self.count}"
        chain, at = [], rid
        while at is not None and at in self.model:
            chain.append(at)
            at = self.model[at][1]
        if at is not None or rid not in self.model:  # a missing turn: refused whole
            with pytest.raises(NotFound):
                self.store.conversation(rid)
            for touched in chain:  # the turns read before the gap were touched
                self._touch(touched)
            return
        expected = [m for turn in reversed(chain) for m in self.model[turn][2]]
        assert self.store.conversation(rid) == expected
        for touched in chain:
            self._touch(touched)

    @precondition(lambda self: self.count > 0)
    @rule(pick=st.integers(0, 40))
    def delete(self, pick: int) -> None:
        rid = f"resp_{pick % self.count}"
        assert self.store.delete(rid) == (self.model.pop(rid, None) is not None)

    @invariant()
    def same_entries_within_bounds(self) -> None:
        assert len(self.store) == len(self.model) <= MAX_ENTRIES
        assert self.store.bytes == sum(s for s, _, _ in self.model.values()) <= MAX_BYTES
        for rid in self.model:
            assert rid in self.store._entries
        assert list(self.store._entries) == list(self.model)  # the same LRU order


TestResponseStore = StoreMachine.TestCase
TestResponseStore.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
