"""Block manager and sequence-id pool: the ledger rules hold under any sequence of operations."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ferrum.engine.kv.ledger import BlockManager, IntegrityError, PageTable, SeqIdPool, blocks_for
from tests.profiles import examples


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_grow_allocates_only_what_is_missing():
    bm = BlockManager(4, 16)
    t = PageTable()
    assert bm.grow(t, 17)
    assert len(t.blocks) == 2 and bm.num_free == 2
    assert bm.grow(t, 32) and len(t.blocks) == 2
    assert not bm.grow(t, 100)  # would need 7 blocks: refused without partial allocation
    assert len(t.blocks) == 2 and bm.num_free == 2
    bm.check_integrity([t])


def test_shared_block_returns_to_free_list_only_at_ref_zero():
    bm = BlockManager(4, 16)
    a = PageTable()
    bm.grow(a, 40)  # 3 blocks
    b = bm.fork(a, 40)  # shares the 2 whole blocks holding positions 0..31
    assert b.blocks == a.blocks[:2]
    assert [bm.ref_count(x) for x in a.blocks] == [2, 2, 1]
    bm.check_integrity([a, b])
    bm.release(a)
    assert bm.num_free == 2  # the shared blocks stay: b still references them
    bm.check_integrity([b])
    bm.release(b)
    assert bm.num_free == 4
    bm.check_integrity([])


def test_copy_on_write_gives_the_writer_a_private_block():
    bm = BlockManager(4, 16)
    a = PageTable()
    bm.grow(a, 32)
    b = bm.fork(a, 32)
    old, new = bm.copy_on_write(b, 1)
    assert old == a.blocks[1] and b.blocks[1] == new != old
    assert bm.ref_count(old) == 1 and bm.ref_count(new) == 1
    assert bm.copy_on_write(b, 1) is None  # already private
    bm.check_integrity([a, b])


def test_double_free_and_bad_retain_are_caught():
    bm = BlockManager(2, 16)
    (x,) = bm.allocate(1)
    bm.free([x])
    with pytest.raises(IntegrityError):
        bm.free([x])
    with pytest.raises(IntegrityError):
        bm.retain_block(x)


def test_integrity_check_detects_a_lost_block():
    bm = BlockManager(2, 16)
    t = PageTable()
    bm.grow(t, 16)
    with pytest.raises(IntegrityError):
        bm.check_integrity([])  # the table that owns the block was forgotten


def test_seq_id_pool_one_owner_each():
    pool = SeqIdPool(2)
    a, b = pool.acquire(), pool.acquire()
    assert {a, b} == {0, 1} and pool.acquire() is None
    pool.check_integrity([a, b])
    pool.release(a)
    with pytest.raises(IntegrityError):
        pool.release(a)
    pool.check_integrity([b])


class LedgerMachine(RuleBasedStateMachine):
    """Random grow / fork / copy-on-write / release: rules 1-3 of kv/ledger.py always hold."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(24, 4)
        self.tables: list[tuple[PageTable, int]] = []  # (table, tokens it holds)

    @rule(n=st.integers(1, 40))
    def new_table(self, n: int) -> None:
        t = PageTable()
        if self.bm.grow(t, n):
            self.tables.append((t, n))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100), extra=st.integers(1, 12))
    def grow(self, i: int, extra: int) -> None:
        t, n = self.tables[i % len(self.tables)]
        if self.bm.grow(t, n + extra):
            self.tables[i % len(self.tables)] = (t, n + extra)

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100), frac=st.floats(0, 1))
    def fork(self, i: int, frac: float) -> None:
        t, n = self.tables[i % len(self.tables)]
        keep = int(n * frac)
        child = self.bm.fork(t, keep)
        self.tables.append((child, len(child.blocks) * self.bm.block_size))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100), j=st.integers(0, 100))
    def write(self, i: int, j: int) -> None:
        t, _ = self.tables[i % len(self.tables)]
        if t.blocks and self.bm.num_free:
            self.bm.copy_on_write(t, j % len(t.blocks))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        t, _ = self.tables.pop(i % len(self.tables))
        self.bm.release(t)

    @invariant()
    def ledger_is_consistent(self) -> None:
        self.bm.check_integrity(t for t, _ in self.tables)

    def teardown(self) -> None:
        for t, _ in self.tables:
            self.bm.release(t)
        assert self.bm.num_free == self.bm.num_blocks


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)
