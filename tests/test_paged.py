"""paged=True: blocks on demand, preemption by recompute when the pool runs dry.

Greedy outputs must not depend on how the KV memory is handed out, on the batch, or on
preemption: every setting is compared token for token with one request at a time.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import SamplingParams
from minillm.engine.block_manager import BlockManager

from conftest import assert_engine_idle

PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time, in a small village by the sea, there lived",
    "List three colours:",
    "2, 4, 8, 16,",
    "Water boils at",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Explain what a KV cache is in one sentence.",
    "Bonjour, je m'appelle",
    "import numpy as np\n",
    "Q: What is 7 times 6?\nA:",
    "A haiku about the moon:",
]
MAX_TOKENS = [6, 12, 4, 9, 12, 5, 8, 12, 7, 10, 3, 11]


def params():
    return [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


@pytest.fixture(scope="module")
def single_request_tokens(default_llm):
    one = default_llm.with_levers(max_num_seqs=1)
    return [o.outputs[0].token_ids for o in one.generate(PROMPTS, params())]


@pytest.mark.parametrize("levers", [
    dict(paged=True),
    dict(paged=True, block_size=4),
    dict(paged=True, batching="static", max_num_seqs=5),
    dict(paged=False, batching="static", max_num_seqs=5),
    dict(paged=False, block_size=32),
])
def test_greedy_tokens_do_not_depend_on_memory_layout_or_batching(default_llm, single_request_tokens, levers):
    llm = default_llm.with_levers(**levers)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params())]
    for i, (g, want) in enumerate(zip(got, single_request_tokens)):
        assert g == want, f"prompt {i} differs under {levers}: {g} vs {want}"
    assert_engine_idle(llm)


def test_a_pool_that_holds_a_few_requests_serves_them_all_with_preemption(default_llm, single_request_tokens):
    # 24 blocks of 4 tokens = 96 slots; each request needs up to ~30, so only a few fit at once.
    block_bytes = default_llm.kv_bytes_per_token * 4
    tight = default_llm.with_levers(paged=True, block_size=4, kv_cache_bytes=24 * block_bytes)
    assert tight.engine.block_manager.num_blocks == 24
    prompts, sampling = PROMPTS * 2, params() * 2
    outs = tight.generate(prompts, sampling)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(prompts)
    assert [o.outputs[0].token_ids for o in outs] == single_request_tokens * 2
    assert tight.stats.num_preemptions > 0, "the pool was meant to run dry and force preemption"
    assert_engine_idle(tight)


def test_paged_reserves_less_than_contiguous_and_fits_more(default_llm):
    # Short chat answers in a pool of 2.5 contexts: contiguous reserves max_model_len slots per
    # request up front, so two run at once; paged holds only the blocks the tokens fill, so all three.
    questions = ["What is 2 + 2?", "Say hello.", "Name a colour."]
    prompts = [{"prompt_token_ids": default_llm.chat_token_ids([{"role": "user", "content": q}])} for q in questions]
    room = SamplingParams(max_tokens=200)
    per_token, context = default_llm.kv_bytes_per_token, 512
    budget = dict(max_model_len=context, kv_cache_bytes=int(2.5 * context * per_token))
    contiguous = default_llm.with_levers(paged=False, **budget)
    paged = default_llm.with_levers(paged=True, **budget)
    a = contiguous.generate(prompts, room)
    b = paged.generate(prompts, room)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(o.outputs[0].finish_reason == "stop" and len(o.outputs[0].token_ids) < 60 for o in b)
    assert (contiguous.stats.peak_running, paged.stats.peak_running) == (2, 3)
    assert contiguous.stats.peak_kv_reserved_bytes == 2 * context * per_token
    assert paged.stats.peak_kv_reserved_bytes <= paged.stats.peak_kv_bytes + 3 * 15 * per_token  # < 1 block each
    # The fraction of reserved memory holding real tokens: a few percent contiguous, most of it paged.
    assert contiguous.stats.kv_utilization < 0.1 < 0.7 < paged.stats.kv_utilization
    assert_engine_idle(contiguous)
    assert_engine_idle(paged)


def test_block_usage_while_running(default_llm):
    llm = default_llm.with_levers(paged=True, block_size=16)
    engine = llm.engine
    seq = engine.add_request(list(range(1, 21)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()                                   # prefill: 20 tokens in 2 blocks
    usage = engine.block_usage()
    assert (usage.used_blocks, usage.real_tokens, usage.unused_reserved_slots) == (2, 20, 12)
    while engine.has_unfinished():
        engine.step()
    assert seq.finish_reason == "length" and engine.block_usage().used_blocks == 0


# --------------------------------------------------------------------- block manager, paged
@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "finish"]), st.integers(1, 40), st.integers(0, 7)),
                max_size=60))
def test_paged_block_manager_random_admit_grow_finish(ops):
    bm = BlockManager(num_blocks=16, block_size=4, contiguous=False)
    tables: list[tuple[list[int], int]] = []   # (block table, tokens held)
    for op, tokens, pick in ops:
        if op == "admit":
            if bm.can_allocate(tokens):
                tables.append((bm.allocate(tokens), tokens))
        elif op == "grow" and tables:
            table, held = tables[pick % len(tables)]
            new = held + tokens
            if bm.can_grow(table, new):
                bm.grow(table, new)
                tables[pick % len(tables)] = (table, new)
            else:
                before = list(table)
                with pytest.raises(MemoryError):
                    bm.grow(table, new)
                assert table == before, "a failed grow must not change the table"
        elif op == "finish" and tables:
            table, _ = tables.pop(pick % len(tables))
            bm.free(table)
        owned = [b for table, _ in tables for b in table]
        assert len(owned) == len(set(owned)), "a block belongs to two sequences"
        assert all(len(table) == bm.blocks_for(held) for table, held in tables)
        assert bm.num_free_blocks == bm.num_blocks - len(owned)
        assert all(not bm.is_free[b] for b in owned)
    for table, _ in tables:
        bm.free(table)
    assert bm.num_free_blocks == bm.num_blocks and all(bm.is_free)


def test_two_hundred_requests_through_a_pool_that_holds_a_few(default_llm):
    # Issue 3's acceptance: every request completes, outputs identical to an unconstrained run.
    prompts = [f"Request {i}: the number after {i} is" for i in range(200)]
    sampling = [SamplingParams(max_tokens=2 + i % 3, ignore_eos=True) for i in range(200)]
    free = [o.outputs[0].token_ids for o in default_llm.with_levers(max_num_seqs=64).generate(prompts, sampling)]
    block_bytes = default_llm.kv_bytes_per_token * 4
    tight = default_llm.with_levers(paged=True, block_size=4, kv_cache_bytes=20 * block_bytes, max_num_seqs=64)
    outs = tight.generate(prompts, sampling)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 200
    assert [o.outputs[0].token_ids for o in outs] == free
    assert max(s.num_seqs for s in tight.stats.steps) < 10, "the pool was meant to hold only a few at once"
    assert_engine_idle(tight)
