"""The Responses store under random traffic of two keys, against a model of it (LRU within the
key holding the most bytes): the same entries survive, bounds always hold, a conversation reads
back whole or not at all, and one key never reads, continues or deletes the other's responses
(they do not exist for it)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ferrum.api.responses.bodies import size_of
from ferrum.api.responses.store import ResponseStore
from ferrum.errors import NotFound
from tests.profiles import examples

MAX_BYTES = 2000
MAX_ENTRIES = 6
OWNERS = st.sampled_from(["key:a", "key:b"])


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = ResponseStore(MAX_BYTES, MAX_ENTRIES)
        self.model: OrderedDict[str, tuple[int, str | None, list, str]] = OrderedDict()
        self.count = 0

    def _touch(self, rid: str) -> None:
        self.model.move_to_end(rid)

    @rule(text=st.text(max_size=400), parent=st.integers(0, 20), root=st.booleans(), owner=OWNERS)
    def put(self, text: str, parent: int, root: bool, owner: str) -> None:
        rid = f"resp_{self.count}"
        self.count += 1
        # A continuation's parent is the same key's (the route reads it as that key first).
        parents = [r for r, entry in self.model.items() if entry[3] == owner]
        parent_id = None if root or not parents else parents[parent % len(parents)]
        response = {"id": rid, "output_text": text}
        messages = [{"role": "user", "content": text}]
        self.store.put(response, messages, parent_id, owner)
        size = size_of(response) + size_of(messages)
        if size > MAX_BYTES:
            return
        self.model[rid] = (size, parent_id, messages, owner)
        while sum(e[0] for e in self.model.values()) > MAX_BYTES or len(self.model) > MAX_ENTRIES:
            held: dict[str, int] = {}
            for size_, _, _, who in self.model.values():
                held[who] = held.get(who, 0) + size_
            heaviest = {who for who, n in held.items() if n == max(held.values())}
            del self.model[next(r for r, e in self.model.items() if e[3] in heaviest)]

    @precondition(lambda self: self.count > 0)
    @rule(pick=st.integers(0, 40), owner=OWNERS)
    def get(self, pick: int, owner: str) -> None:
        rid = f"resp_{pick % self.count}"
        if self._owns(rid, owner):
            assert self.store.get(rid, owner).response["id"] == rid
            self._touch(rid)
        else:
            with pytest.raises(NotFound):
                self.store.get(rid, owner)

    @precondition(lambda self: self.count > 0)
    @rule(pick=st.integers(0, 40), owner=OWNERS)
    def conversation(self, pick: int, owner: str) -> None:
        rid = f"resp_{pick % self.count}"
        chain, at = [], rid
        while at is not None and self._owns(at, owner):
            chain.append(at)
            at = self.model[at][1]
        if at is not None or not self._owns(rid, owner):  # a missing turn: refused whole
            with pytest.raises(NotFound):
                self.store.conversation(rid, owner)
            for touched in chain:  # the turns read before the gap were touched
                self._touch(touched)
            return
        expected = [m for turn in reversed(chain) for m in self.model[turn][2]]
        assert self.store.conversation(rid, owner) == expected
        for touched in chain:
            self._touch(touched)

    @precondition(lambda self: self.count > 0)
    @rule(pick=st.integers(0, 40), owner=OWNERS)
    def delete(self, pick: int, owner: str) -> None:
        rid = f"resp_{pick % self.count}"
        owned = self._owns(rid, owner)
        assert self.store.delete(rid, owner) == owned
        if owned:
            del self.model[rid]

    def _owns(self, rid: str, owner: str) -> bool:
        return rid in self.model and self.model[rid][3] == owner

    @invariant()
    def same_entries_within_bounds(self) -> None:
        assert len(self.store) == len(self.model) <= MAX_ENTRIES
        assert self.store.bytes == sum(e[0] for e in self.model.values()) <= MAX_BYTES
        for rid in self.model:
            assert rid in self.store._entries
        assert list(self.store._entries) == list(self.model)  # the same LRU order


TestResponseStore = StoreMachine.TestCase
TestResponseStore.settings = settings(
    max_examples=examples(200), stateful_step_count=40, deadline=None
)


def test_one_key_flooding_the_store_evicts_its_own_responses_first():
    store = ResponseStore(max_bytes=4000, max_entries=100)
    mine = {"id": "resp_b", "output_text": "a short answer"}
    store.put(mine, [{"role": "user", "content": "q"}], None, "key:b")
    for i in range(200):  # key a stores far more than the store holds
        store.put({"id": f"resp_a{i}", "output_text": "x" * 100}, [], None, "key:a")
    assert store.get("resp_b", "key:b").response == mine
    assert store.bytes <= 4000
