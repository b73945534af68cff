"""BlockManager: allocation, freeing, contiguous runs, stats — examples and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engine.block_manager import BlockManager


def test_construction_and_sizes():
    bm = BlockManager(10, 16)
    assert bm.num_blocks == 10 and bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    assert bm.capacity_tokens == 160
    assert [bm.blocks_for(n) for n in (1, 15, 16, 17, 32, 33, 160)] == [1, 1, 1, 2, 2, 3, 10]
    assert bm.blocks_for(0) == 0
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(0, 16)


def test_allocate_gives_a_contiguous_run_and_updates_stats():
    bm = BlockManager(8, 4)
    a = bm.allocate(9)            # 3 blocks
    assert a == [0, 1, 2]
    b = bm.allocate(4)            # 1 block
    assert b == [3]
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 4
    assert bm.num_reserved_tokens == 16
    assert bm.peak_used_blocks == 4
    bm.free(a)
    assert bm.num_free_blocks == 7 and bm.num_reserved_tokens == 4
    assert bm.peak_used_blocks == 4   # the peak stays
    # the hole at 0..2 is first fit for a 2-block request
    assert bm.allocate(5) == [0, 1]


def test_contiguous_needs_a_run_not_just_enough_free_blocks():
    bm = BlockManager(6, 1)
    tables = [bm.allocate(1) for _ in range(6)]
    bm.free(tables[1])
    bm.free(tables[3])
    bm.free(tables[5])
    assert bm.num_free_blocks == 3
    assert not bm.can_allocate(2)          # 3 free blocks but no two adjacent
    with pytest.raises(MemoryError, match="no run of 2 free blocks"):
        bm.allocate(2)
    assert bm.num_free_blocks == 3         # a refused allocation changes nothing
    assert bm.can_allocate(1)
    bm.free(tables[4])
    assert bm.can_allocate(3) and bm.allocate(3) == [3, 4, 5]


def test_non_contiguous_uses_any_free_blocks():
    bm = BlockManager(6, 1, contiguous=False)
    tables = [bm.allocate(1) for _ in range(6)]
    for i in (1, 3, 5):
        bm.free(tables[i])
    assert bm.can_allocate(3)
    assert bm.allocate(3) == [1, 3, 5]
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(1)
    with pytest.raises(MemoryError, match="1 blocks needed, 0 free"):
        bm.allocate(1)


def test_full_pool_refuses():
    bm = BlockManager(4, 8)
    assert bm.can_allocate(32) and not bm.can_allocate(33)
    with pytest.raises(MemoryError):
        bm.allocate(33)
    bm.allocate(32)
    assert bm.num_free_blocks == 0 and not bm.can_allocate(1)


def test_double_free_raises():
    bm = BlockManager(4, 8)
    t = bm.allocate(10)
    bm.free(t)
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(t)
    assert bm.num_free_blocks == 4   # state is still consistent


def test_slot_mapping():
    bm = BlockManager(8, 4)
    table = [5, 2, 7]
    assert [bm.slot(table, p) for p in range(12)] == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31]


# ------------------------------------------------------------------------------- properties

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(min_value=1, max_value=70)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=1000)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None, database=None)
@given(num_blocks=st.integers(1, 24), block_size=st.integers(1, 8), contiguous=st.booleans(), ops=ops)
def test_random_allocate_free_keeps_the_pool_consistent(num_blocks, block_size, contiguous, ops):
    bm = BlockManager(num_blocks, block_size, contiguous=contiguous)
    live: list[list[int]] = []
    peak = 0
    for op, arg in ops:
        if op == "alloc":
            need = bm.blocks_for(arg)
            before = bm.num_free_blocks
            expected_ok = bm.can_allocate(arg)
            try:
                table = bm.allocate(arg)
            except MemoryError:
                assert not expected_ok
                assert bm.num_free_blocks == before
                continue
            assert expected_ok
            assert len(table) == need and len(table) * block_size >= arg
            if contiguous:
                assert table == list(range(table[0], table[0] + need))
            live.append(table)
        elif live:
            bm.free(live.pop(arg % len(live)))
        used = [b for t in live for b in t]
        assert len(used) == len(set(used)), "two sequences share a block"
        assert all(0 <= b < num_blocks for b in used)
        assert bm.num_free_blocks == num_blocks - len(used)
        assert sum(bm.is_free) == bm.num_free_blocks
        assert all(not bm.is_free[b] for b in used)
        assert bm.num_reserved_tokens == len(used) * block_size
        peak = max(peak, len(used))
        assert bm.peak_used_blocks == peak
    for t in live:
        bm.free(t)
    assert bm.num_free_blocks == num_blocks and bm.num_reserved_tokens == 0


@settings(max_examples=200, deadline=None, database=None)
@given(num_blocks=st.integers(1, 30), sizes=st.lists(st.integers(1, 5), max_size=30))
def test_contiguous_allocation_succeeds_whenever_a_free_run_exists(num_blocks, sizes):
    """can_allocate agrees with a brute-force search for a run of free blocks."""
    bm = BlockManager(num_blocks, 1)
    for i, n in enumerate(sizes):
        free = bytes(bm.is_free)
        has_run = b"\x01" * n in free
        assert bm.can_allocate(n) == has_run
        if has_run:
            table = bm.allocate(n)
            assert table[0] == free.find(b"\x01" * n)   # first fit
            if i % 3 == 0:
                bm.free(table)
