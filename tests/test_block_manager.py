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


# ----------------------------------------------------------------- reference counts and usage
def test_share_counts_owners_and_frees_on_the_last():
    bm = BlockManager(6, 4, contiguous=False)
    a = bm.allocate(9)                       # 3 blocks at count 1
    b = bm.share(a[:2])                      # a second owner of the first two (a shared prefix)
    assert [bm.ref_count[x] for x in a] == [2, 2, 1]
    bm.free(a)                               # the first owner leaves: only its own last block returns
    assert bm.num_free_blocks == 4 and [bm.ref_count[x] for x in a] == [1, 1, 0]
    bm.check()
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.ref_count == [0] * 6
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(b)
    with pytest.raises(RuntimeError, match="is free and cannot be shared"):
        bm.share(b)
    bm.check()


def test_a_failed_free_changes_nothing():
    bm = BlockManager(4, 2, contiguous=False)
    a = bm.allocate(4)
    with pytest.raises(RuntimeError, match="block 3 freed twice"):
        bm.free(a + [3])
    assert bm.num_free_blocks == 2 and [bm.ref_count[x] for x in a] == [1, 1]
    bm.check()


def test_usage_reports_reserved_unused_and_utilization():
    bm = BlockManager(10, 16)               # contiguous: a request reserves its whole future
    bm.allocate(64)                          # 4 blocks reserved, say 10 tokens written
    bm.allocate(32)                          # 2 blocks, 20 tokens written
    u = bm.usage(real_tokens=30)
    assert (u.used_blocks, u.free_blocks, u.reserved_slots) == (6, 4, 96)
    assert u.unused_reserved_slots == 66
    assert u.utilization == pytest.approx(30 / 96)
    assert bm.usage(0).utilization == 0.0
    assert BlockManager(3, 4).usage(0).utilization == 1.0   # nothing reserved, nothing wasted


# ----------------------------------------------------------------- the scheduler drives the pool
def _scheduler(num_blocks, block_size, paged, chunked, max_num_seqs=4):
    from minillm.config import EngineConfig
    from minillm.engine.scheduler import Scheduler

    cfg = EngineConfig(paged=paged, block_size=block_size, max_num_seqs=max_num_seqs, chunked_prefill=chunked,
                       max_num_batched_tokens=12 if chunked else 64)
    max_model_len = num_blocks * block_size if paged else 3 * block_size
    return Scheduler(cfg, BlockManager(num_blocks, block_size, contiguous=not paged), max_model_len)


def _check_scheduler(sched, forks):
    bm = sched.block_manager
    bm.check()
    owners = [0] * bm.num_blocks
    for seq in sched.running:
        assert len(seq.block_table) >= bm.blocks_for(seq.num_cached_tokens), "cached tokens without blocks"
        for b in seq.block_table:
            owners[b] += 1
    for table in forks:
        for b in table:
            owners[b] += 1
    for seq in sched.waiting:
        assert seq.block_table == [], "a waiting sequence holds blocks"
    assert owners == bm.ref_count, "reference counts disagree with the block tables that hold them"


op = st.tuples(st.sampled_from(["add", "step", "step", "step", "finish", "preempt", "fork", "drop_fork"]),
               st.integers(1, 20), st.integers(0, 99))


@settings(max_examples=150, deadline=None, database=None)
@given(paged=st.booleans(), chunked=st.booleans(), block_size=st.sampled_from([1, 2, 4]),
       ops=st.lists(op, max_size=80))
def test_random_admit_step_finish_preempt_fork_never_leaks(paged, chunked, block_size, ops):
    """Issue 3: random admit / append / finish / preempt (and forks sharing blocks): no leak,
    no double free, reference counts equal the tables that hold each block, all back at the end."""
    from minillm.engine.sequence import Sequence
    from minillm.sampling import SamplingParams

    sched = _scheduler(num_blocks=12, block_size=block_size, paged=paged, chunked=chunked)
    bm = sched.block_manager
    forks: list[list[int]] = []
    limit = sched.max_model_len
    for kind, n, pick in ops:
        if kind == "add":
            prompt = list(range(min(n, limit - 2)))
            sched.add(Sequence(prompt, SamplingParams(max_tokens=min(1 + pick % 6, limit - len(prompt)))))
        elif kind == "step":
            seqs, _ = sched.schedule()
            if not seqs and sched.has_unfinished():
                seqs, _ = sched.schedule()
            done = [s.num_cached_tokens + s.num_scheduled_tokens >= len(s) for s in seqs]
            tokens = [7 if d else None for d in done]
            sched.postprocess(seqs, tokens, lambda s: "length" if s.num_output_tokens >= s.params.max_tokens
                              or len(s) >= limit else None)
        elif kind in ("finish", "preempt") and sched.running:
            seq = sched.running[pick % len(sched.running)]
            if kind == "finish":
                sched.finish(seq, "abort")
            else:
                sched.preempt(seq)
        elif kind == "fork" and sched.running:
            seq = sched.running[pick % len(sched.running)]
            if seq.block_table:
                forks.append(bm.share(seq.block_table))
        elif kind == "drop_fork" and forks:
            bm.free(forks.pop(pick % len(forks)))
        _check_scheduler(sched, forks)
    # Drain: everything admitted finishes (no request is lost), then every block is back.
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        seqs, _ = sched.schedule()
        if not seqs and sched.has_unfinished():
            seqs, _ = sched.schedule()
        if not seqs:   # only forks pin the pool: release them and go on
            assert forks, "nothing runs, nothing is pinned, yet requests wait"
            bm.free(forks.pop())
            continue
        done = [s.num_cached_tokens + s.num_scheduled_tokens >= len(s) for s in seqs]
        sched.postprocess(seqs, [7 if d else None for d in done],
                          lambda s: "length" if s.num_output_tokens >= s.params.max_tokens or len(s) >= limit else None)
        _check_scheduler(sched, forks)
    assert not sched.has_unfinished()
    for table in forks:
        bm.free(table)
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks and bm.ref_count == [0] * bm.num_blocks


# ----------------------------------------------------------------- prefix caching: cached blocks
def _prefix_scheduler(num_blocks, block_size, chunked, hash_fn=None):
    from minillm.config import EngineConfig
    from minillm.engine.scheduler import Scheduler

    cfg = EngineConfig(paged=True, block_size=block_size, max_num_seqs=4, chunked_prefill=chunked,
                       max_num_batched_tokens=12 if chunked else 64, prefix_caching=True)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, contiguous=False, hash_fn=hash_fn),
                     num_blocks * block_size)


def _collide(parent, tokens, salt):
    """A deliberately bad hash: every block at the same depth (and salt) gets the same key."""
    return (parent, salt)


_TEXTS = [[0] * 20, [0] * 6 + [1] * 14, [0, 0, 0, 0, 0, 0, 1, 2] * 3, [0] * 5 + [2] * 15]
prefix_op = st.tuples(st.sampled_from(["add", "step", "step", "step", "step", "finish", "preempt", "evict_all"]),
                      st.integers(1, 20), st.integers(0, 99))


@settings(max_examples=150, deadline=None, database=None)
@given(chunked=st.booleans(), block_size=st.sampled_from([1, 2, 4]), collide=st.booleans(),
       ops=st.lists(prefix_op, max_size=80))
def test_random_admit_step_finish_preempt_with_cached_blocks(chunked, block_size, collide, ops):
    """Prefix caching under random admit / step / finish / preempt: a shadow KV pool records which
    token each slot holds. Every token a sequence reads from its blocks is its own (no stale reuse,
    also under a colliding hash), no step writes into a cached or shared block, reference counts
    equal the tables that hold each block, no leak, and everything returns to the pool."""
    from minillm.engine.sequence import Sequence
    from minillm.sampling import SamplingParams

    sched = _prefix_scheduler(num_blocks=12, block_size=block_size, chunked=chunked,
                              hash_fn=_collide if collide else None)
    bm = sched.block_manager
    limit = sched.max_model_len
    shadow: dict[int, int] = {}   # pool slot -> the token whose K/V it holds
    hits = 0

    def step():
        nonlocal hits
        seqs, _ = sched.schedule()
        if not seqs and sched.has_unfinished():
            seqs, _ = sched.schedule()
        for seq in seqs:
            table, start = seq.block_table, seq.num_cached_tokens
            assert len(table) * block_size >= start + seq.num_scheduled_tokens
            for pos in range(start):   # what attention reads: it must be this sequence's own tokens
                assert shadow.get(bm.slot(table, pos)) == seq.token_ids[pos], "stale K/V reused"
            for pos in range(start, start + seq.num_scheduled_tokens):
                block = table[pos // block_size]
                assert bm.ref_count[block] == 1 and bm.block_key[block] is None, \
                    "a step writes into a cached or shared block"
                shadow[bm.slot(table, pos)] = seq.token_ids[pos]
        done = [s.num_cached_tokens + s.num_scheduled_tokens >= len(s) for s in seqs]
        # Generated tokens come from the sequence's own content, so identical requests stay identical.
        tokens = [(sum(s.token_ids) * 7 + len(s)) % 5 if d else None for s, d in zip(seqs, done)]
        sched.postprocess(seqs, tokens, lambda s: "length" if s.num_output_tokens >= s.params.max_tokens
                          or len(s) >= limit else None)
        for block, key in enumerate(bm.block_key):   # a cached block's record is the content it holds
            if key is not None:
                got = tuple(shadow.get(block * block_size + o) for o in range(block_size))
                assert got == bm.block_tokens[block], "a cached block's tokens are not what it holds"
        return seqs

    for kind, n, pick in ops:
        if kind == "add":
            # Prefixes of four texts that share their starts (shared blocks, identical prompts, divergence), or
            # one of many small-alphabet prompts (collisions under the colliding hash).
            length = min(n, limit - 2)
            prompt = _TEXTS[pick % 5][:length] if pick % 5 < 4 else [(pick // (1 + i // 3)) % 3 for i in range(length)]
            salt = "b" if pick % 7 == 0 else None
            sched.add(Sequence(prompt, SamplingParams(max_tokens=min(1 + pick % 6, limit - len(prompt))),
                               cache_salt=salt))
        elif kind == "step":
            step()
        elif kind in ("finish", "preempt") and sched.running:
            seq = sched.running[pick % len(sched.running)]
            if kind == "finish":
                sched.finish(seq, "abort")
            else:
                sched.preempt(seq)
        elif kind == "evict_all":
            bm.reset_prefix_cache()
        _check_scheduler(sched, [])
        # Shared blocks count once: the pool never holds more real tokens than its used blocks' slots.
        assert sched.kv_tokens() <= bm.num_used_blocks * block_size
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        assert step(), "nothing runs, yet requests wait"
        _check_scheduler(sched, [])
    assert not sched.has_unfinished()
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks and bm.ref_count == [0] * bm.num_blocks
    assert sched.prefix_hits <= sched.prefix_queries
